"""The train step at scale: the precision policy of every shipped config, and gradient accumulation equal to
the whole batch at a fraction of its memory."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diffusiongemma as dg
from diffusiongemma.build import models
from diffusiongemma.build import tasks
from diffusiongemma.build.config import load_config_file
from diffusiongemma.model import flops
from diffusiongemma.training import optim
from diffusiongemma.training import state as state_lib
from diffusiongemma.training import step as step_lib

ROOT = pathlib.Path(__file__).parent.parent


def _dtypes(tree, name):
  """The dtypes of the leaves of `tree` whose key path holds `name`."""
  return {str(leaf.dtype) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
          if any(getattr(k, "name", getattr(k, "key", None)) == name for k in path)}


@pytest.mark.parametrize("name", ["tiny", "small", "small_ar", "diffusiongemma_26b_a4b"])
def test_every_config_trains_float32_master_weights_and_moments(name):
  """What training keeps, per the policy: master weights and both Adam moments float32, computing in the
  config's dtype (the released config: bfloat16, though its inference weights are bfloat16); with
  `mu_dtype='bfloat16'` the first moment alone in bfloat16. Abstract states only (no memory)."""
  config = load_config_file(ROOT / "configs" / f"{name}.py")
  for mu_dtype in ("", "bfloat16"):
    config.train.mu_dtype = mu_dtype
    model_cfg = tasks.training_model_config(config)
    state = state_lib.abstract_train_state(dg.DiffusionGemma(model_cfg), optim.make_optimizer(
        optim.OptimizerSettings.from_mapping(config.train)), seed=0)
    assert {str(x.dtype) for x in jax.tree.leaves(state.params)} == {"float32"}
    assert _dtypes(state.opt_state, "mu") == {mu_dtype or "float32"}
    assert _dtypes(state.opt_state, "nu") == {"float32"}
    assert model_cfg.dtype == config.train.compute_dtype
  assert models.model_config(config).param_dtype == config.model.get("param_dtype", "float32")  # inference


def _setup(accum, optimizer=None, batch_size=8, vocab=512, canvas=8):
  cfg = dg.ModelConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                       num_full_kv_heads=1, full_head_dim=16, sliding_window=16, intermediate_size=32,
                       num_experts=2, top_k=1, moe_intermediate_size=16, canvas_length=canvas, max_positions=64,
                       moe_impl="dense")
  model = dg.DiffusionGemma(cfg)
  loss = dg.diffusion.loss.LossConfig(noise=dg.diffusion.UniformNoise(vocab), self_conditioning_prob=0.5)
  optimizer = optimizer or optim.make_optimizer(optim.OptimizerSettings(learning_rate=1e-2, warmup_steps=0,
                                                                        num_steps=10))
  step = step_lib.make_train_step(model, optimizer, loss, num_canvases=2, grad_accum_steps=accum)
  state = state_lib.create_train_state(model, optimizer, seed=0)
  rng = np.random.default_rng(0)
  batch = {"tokens": jnp.asarray(rng.integers(3, vocab, (batch_size, 6 + 2 * canvas)), jnp.int32),
           "prompt_length": jnp.asarray(rng.integers(2, 7, batch_size), jnp.int32),
           "num_canvases": jnp.asarray(rng.integers(1, 3, batch_size), jnp.int32)}
  return step, state, batch


def _recording(lr):
  """SGD that keeps the last gradients in its state (so that a test reads them exactly)."""
  record = optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda grads, state, params=None: (grads, grads))
  return optax.chain(record, optax.sgd(lr))


@pytest.fixture(scope="module")
def accumulated():
  """The same step compiled for the whole batch and for 4 micro-batches (one compile each), run once."""
  out = {}
  for accum in (1, 4):
    step, state, batch = _setup(accum, optimizer=_recording(0.1))
    compiled = step.lower(state, batch).compile()
    out[accum] = (compiled.memory_analysis().temp_size_in_bytes, *compiled(state, batch))
  return out


def test_gradient_accumulation_is_the_whole_batch_update(accumulated):
  """4 micro-batches == the whole batch (rows of different prompt lengths and canvas counts, with
  self-conditioning): loss, its parts and the updated parameters within 1e-6 relative (each tensor in norm), the
  gradients within float32 rounding (5e-6 of their norm)."""
  (_, whole, whole_metrics), (_, micro, micro_metrics) = accumulated[1], accumulated[4]
  for key in ("loss", "diffusion_loss", "ar_loss", "grad_norm", "corrupted_accuracy", "corrupted_fraction"):
    np.testing.assert_allclose(micro_metrics[key], whole_metrics[key], rtol=1e-6, err_msg=key)
  flat = lambda s: np.concatenate([np.asarray(g).ravel() for g in jax.tree.leaves(s.opt_state[0])])
  # float32 sums in another order: 1.5e-6 relative here
  assert np.linalg.norm(flat(micro) - flat(whole)) <= 5e-6 * np.linalg.norm(flat(whole))
  for a, b in zip(jax.tree.leaves(micro.params), jax.tree.leaves(whole.params), strict=True):  # per tensor
    assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 1e-6 * np.linalg.norm(np.asarray(b))
  with pytest.raises(ValueError, match="batch of 8 rows does not split into .*grad_accum_steps=3"):
    step_lib._micro_batches(jnp.zeros((8, 2)), 3)  # pylint: disable=protected-access


def test_gradient_accumulation_needs_a_fraction_of_the_memory(accumulated):
  """XLA's compiled temporary memory of the step at 4 micro-batches is at most 0.4x the whole batch's (the
  activations, dominated by [rows, positions, vocab] logits, of a quarter of the rows at a time): 0.27x."""
  assert accumulated[4][0] <= 0.4 * accumulated[1][0], (accumulated[4][0], accumulated[1][0])


@pytest.mark.parametrize("self_conditioning,all_canvases", [(0.5, False), (0.0, True)])
def test_the_analytic_flops_of_a_step_are_what_xla_counts(self_conditioning, all_canvases):
  """`model.flops.train_step_flops` (the loop's perf/model_tflops_per_step and MFU) within 10% of XLA's cost
  analysis of the compiled step (lowered from shapes alone; nothing runs), with and without the
  self-conditioning pass, grading one canvas or all; top_k = num_experts, so the dense MoE computes only chosen
  experts, and matmuls dominate (hidden 256)."""
  cfg = dg.ModelConfig(vocab_size=2048, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                       num_full_kv_heads=1, full_head_dim=64, sliding_window=32, intermediate_size=512,
                       num_experts=2, top_k=2, moe_intermediate_size=256, canvas_length=16, max_positions=128,
                       moe_impl="dense")
  model = dg.DiffusionGemma(cfg)
  loss = dg.diffusion.loss.LossConfig(noise=dg.diffusion.UniformNoise(cfg.vocab_size),
                                      self_conditioning_prob=self_conditioning, all_canvases=all_canvases)
  optimizer = optim.make_optimizer(optim.OptimizerSettings(learning_rate=1e-2, warmup_steps=0, num_steps=10))
  step = step_lib.make_train_step(model, optimizer, loss, num_canvases=2)
  batch, prompt = 4, 32
  shapes = {"tokens": jax.ShapeDtypeStruct((batch, prompt + 2 * cfg.canvas_length), jnp.int32),
            "prompt_length": jax.ShapeDtypeStruct((batch,), jnp.int32)}
  analysis = step.lower(state_lib.abstract_train_state(model, optimizer, seed=0), shapes).compile().cost_analysis()
  xla = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
  ours = flops.train_step_flops(cfg, batch, prompt, 2, self_conditioning=self_conditioning > 0,
                                all_canvases=all_canvases)
  assert ours == pytest.approx(xla, rel=0.10)

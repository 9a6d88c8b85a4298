"""The model's properties on tiny random configs, and the released config's size via eval_shape."""

import functools
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma.build.config import load_config_file
from diffusiongemma.model import moe
from diffusiongemma.model.config import default_moe_impl

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"

TINY = dg.ModelConfig(
    vocab_size=61, hidden_size=40, num_layers=4, layer_types=("sliding", "full", "sliding", "full"),
    num_heads=4, num_kv_heads=2, head_dim=10, num_full_kv_heads=1, full_head_dim=14, sliding_window=4,
    intermediate_size=36, num_experts=5, top_k=2, moe_intermediate_size=20, canvas_length=6,
    max_positions=256)


def _random_params(config, seed=0):
  """Random parameters of the model's shapes, drawn in numpy: compiling `init` costs ~20 s here."""
  model = dg.DiffusionGemma(config)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 3), jnp.int32),
                          jnp.zeros((1, config.canvas_length), jnp.int32))
  rng = np.random.default_rng(seed)

  def draw(x):
    if x.ndim < 2:  # norm scales and per-layer scalars sit around one
      return jnp.asarray(1 + 0.1 * rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(x.shape[-2]), x.dtype)

  return jax.tree.map(draw, nn.unbox(shapes)["params"])


@pytest.fixture(scope="module")
def params():
  return _random_params(TINY)


def _tokens(seed, shape, vocab=TINY.vocab_size):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


# Jitted: op-by-op dispatch of a whole model costs seconds per call on 2 CPU cores.
@functools.partial(jax.jit, static_argnames=("config",))
def _encode(params, tokens, cache=None, config=TINY, num_tokens=None):
  model = dg.DiffusionGemma(config)
  return model.apply({"params": params}, tokens, cache, num_tokens=num_tokens, method=model.encode)


@functools.partial(jax.jit, static_argnames=("config", "block_length"))
def _denoise(params, canvas, cache, sc=None, config=TINY, self_conditioning_mask=None, block_length=None):
  model = dg.DiffusionGemma(config)
  return model.apply({"params": params}, canvas, cache, sc, self_conditioning_mask,
                     block_length=block_length, method=model.denoise)


def test_released_config_size():
  cfg = dg.ModelConfig.from_dict(load_config_file(CONFIGS / "diffusiongemma_26b_a4b.py").model)
  counts = dg.model.count_parameters(cfg)
  print(f"26B-A4B: total {counts['total'] / 1e9:.3f}B, active per token {counts['active'] / 1e9:.3f}B")
  assert abs(counts["total"] / 25.2e9 - 1) <= 0.02
  assert abs(counts["active"] / 3.8e9 - 1) <= 0.05


@pytest.mark.parametrize("name", ["tiny", "small", "diffusiongemma_26b_a4b"])
def test_config_files_build(name):
  config = load_config_file(CONFIGS / f"{name}.py")
  cfg = dg.ModelConfig.from_dict(config.model)
  assert cfg.layer_types[-1] == dg.model.FULL
  assert config.data.vocab_size == cfg.vocab_size


def test_encoder_is_causal(params):
  tokens = _tokens(0, (2, 9))
  changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % TINY.vocab_size)
  a, _ = _encode(params, tokens)
  b, _ = _encode(params, changed)
  np.testing.assert_array_equal(a[:, :6], b[:, :6])
  assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3


def test_final_logits_are_softcapped(params):
  """The logits are softcap * tanh(raw / softcap) of the same model without the cap (softcap 30), checked
  where it matters: an embedding table scaled so that the raw logits reach far past the cap."""
  big = {**params, "embedder": {**params["embedder"], "input_embedding": params["embedder"]["input_embedding"] * 30}}
  tokens = _tokens(8, (1, 7))
  capped, _ = _encode(big, tokens)
  raw, _ = _encode(big, tokens, config=TINY.replace(final_logit_softcap=None))
  raw = np.asarray(raw)
  assert np.abs(raw).max() > 2 * TINY.final_logit_softcap
  np.testing.assert_allclose(capped, TINY.final_logit_softcap * np.tanh(raw / TINY.final_logit_softcap), rtol=1e-5,
                             atol=1e-4)


def test_every_canvas_position_sees_every_other(params):
  _, cache = _encode(params, _tokens(1, (1, 7)))
  canvas = _tokens(2, (1, TINY.canvas_length))
  base = _denoise(params, canvas, cache)
  for j in range(TINY.canvas_length):
    changed = _denoise(params, canvas.at[0, j].set((canvas[0, j] + 1) % TINY.vocab_size), cache)
    moved = np.abs(changed - base).max(axis=-1)[0]  # [C]
    assert (moved > 1e-6).all(), f"changing canvas position {j} left positions {np.where(moved <= 1e-6)} unchanged"


def test_encode_in_pieces_equals_encode_at_once(params):
  tokens = _tokens(3, (2, 11))  # longer than the window, split across it
  whole, whole_cache = _encode(params, tokens)
  cache = dg.KVCache.empty(TINY, 2, 11)
  first, cache = _encode(params, tokens[:, :5], cache)
  second, cache = _encode(params, tokens[:, 5:], cache)
  np.testing.assert_allclose(np.concatenate([first, second], 1), whole, atol=1e-5)
  np.testing.assert_array_equal(cache.length, [11, 11])
  for a, b in zip(cache.keys + cache.values, whole_cache.keys + whole_cache.values):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_padded_rows_equal_unpadded(params):
  """Prompts of different lengths in one batch (right padding + num_tokens) equal each row alone."""
  tokens = _tokens(4, (2, 8))
  lengths = jnp.asarray([8, 5])
  logits, cache = _encode(params, tokens, dg.KVCache.empty(TINY, 2, 20), num_tokens=lengths)
  canvas = _tokens(5, (2, TINY.canvas_length))
  denoised = _denoise(params, canvas, cache)
  for row, n in enumerate([8, 5]):
    alone_logits, alone_cache = _encode(params, tokens[row:row + 1, :n])
    np.testing.assert_allclose(logits[row, :n], alone_logits[0], atol=1e-5)
    np.testing.assert_allclose(denoised[row], _denoise(params, canvas[row:row + 1], alone_cache)[0], atol=1e-5)


def test_training_cache_prefix_equals_prompt_cache(params):
  """The clean full-sequence cache seen up to a canvas start equals encoding only that prefix."""
  sequence = _tokens(6, (2, 4 + 2 * TINY.canvas_length))
  _, full = _encode(params, sequence)
  canvas = _tokens(7, (2, TINY.canvas_length))
  start = 4 + TINY.canvas_length
  _, prefix = _encode(params, sequence[:, :start])
  np.testing.assert_allclose(_denoise(params, canvas, full.with_length(start)),
                             _denoise(params, canvas, prefix), atol=1e-5)


def test_block_causal_multi_canvas_equals_one_at_a_time(params):
  c = TINY.canvas_length
  sequence = _tokens(8, (2, 5 + 3 * c))
  _, cache = _encode(params, sequence)
  noisy = _tokens(9, (2, 3 * c))
  together = _denoise(params, noisy, cache.with_length(5), block_length=c)
  for i in range(3):
    alone = _denoise(params, noisy[:, i * c:(i + 1) * c], cache.with_length(5 + i * c))
    np.testing.assert_allclose(together[:, i * c:(i + 1) * c], alone, atol=1e-5)


def test_encode_denoise_is_encode_then_denoise(params):
  """One pass over [committed ; canvas] gives the canvas's hidden states and the cache of `encode` followed
  by `denoise`: each half with its own layer scalar, the sliding window narrower than the context, rows
  with caches of different lengths, per-row self-conditioning."""
  model = dg.DiffusionGemma(TINY)
  c = TINY.canvas_length
  cache = dg.KVCache.empty(TINY, 2, 24)
  _, cache = _encode(params, _tokens(1, (2, 7)), cache, num_tokens=jnp.asarray([7, 4]))
  committed, canvas = _tokens(2, (2, c)), _tokens(3, (2, c))
  signal = jnp.asarray(np.random.default_rng(4).standard_normal((2, c, TINY.hidden_size)), jnp.float32)
  mask, skip = jnp.asarray([True, False]), jnp.asarray([False, True])
  variables = {"params": params}

  @jax.jit
  def both(committed, canvas, cache):
    _, encoded = model.apply(variables, committed, cache, method=model.encode)
    hidden = model.apply(variables, canvas, encoded, None, mask, return_hidden=True,
                         self_conditioning_embedding=signal, method=model.denoise)
    fused = model.apply(variables, committed, canvas, cache, self_conditioning_embedding=signal,
                        self_conditioning_mask=mask, skip_rows=skip, method=model.encode_denoise)
    return (hidden, encoded), fused

  (hidden, encoded), (fused_hidden, fused_cache, _) = both(committed, canvas, cache)
  np.testing.assert_allclose(fused_hidden[0], hidden[0], atol=2e-5)  # row 1 is skipped: its output unused
  np.testing.assert_array_equal(fused_cache.length, encoded.length)
  for x, y in zip(fused_cache.keys + fused_cache.values, encoded.keys + encoded.values):
    np.testing.assert_allclose(x, y, atol=2e-5)


def test_self_conditioning(params):
  _, cache = _encode(params, _tokens(10, (2, 5)))
  canvas = _tokens(11, (2, TINY.canvas_length))
  sc = jax.random.normal(jax.random.key(1), (2, TINY.canvas_length, TINY.vocab_size))
  none = _denoise(params, canvas, cache)
  with_sc = _denoise(params, canvas, cache, sc)
  masked = _denoise(params, canvas, cache, sc, self_conditioning_mask=jnp.asarray([True, False]))
  assert np.abs(with_sc - none).max() > 1e-3
  np.testing.assert_allclose(masked[0], with_sc[0], atol=2e-5)
  np.testing.assert_allclose(masked[1], none[1], atol=2e-5)
  # zero logits are a uniform signal (the mean embedding), not "no signal"
  assert np.abs(_denoise(params, canvas, cache, jnp.zeros_like(sc)) - none).max() > 1e-3


def _routing(seed, num_tokens, skew, num_experts=TINY.num_experts):
  rng = np.random.default_rng(seed)
  if skew:  # every token on experts 0 and 1: the most unbalanced groups possible
    experts = np.tile([0, 1], (num_tokens, 1))
  else:
    experts = np.stack([rng.permutation(num_experts)[:TINY.top_k] for _ in range(num_tokens)])
  weights = rng.uniform(0.1, 1.0, experts.shape)
  return jnp.asarray(weights, jnp.float32), jnp.asarray(experts, jnp.int32)


MANY = TINY.replace(num_experts=16)  # enough experts that `grouped` runs its slab and tiles


@pytest.mark.parametrize("impl", ["grouped", "ragged"])
@pytest.mark.parametrize("cfg,num_tokens,skew,plan", [(TINY, 1, False, "gathered"), (TINY, 13, False, "dense"),
                                                      (MANY, 64, False, "slab"), (MANY, 64, True, "slab")])
def test_sparse_experts_equal_dense(impl, cfg, num_tokens, skew, plan):
  assert moe.grouped_plan(num_tokens, cfg.top_k, cfg.num_experts) == plan
  x = jax.random.normal(jax.random.key(2), (num_tokens, cfg.hidden_size))
  weights, experts = _routing(num_tokens, num_tokens, skew, cfg.num_experts)
  dense = moe.Experts(cfg.replace(moe_impl="dense"))
  variables = dense.init(jax.random.key(3), x, weights, experts)
  want = jax.jit(dense.apply)(variables, x, weights, experts)
  got = jax.jit(moe.Experts(cfg.replace(moe_impl=impl)).apply)(variables, x, weights, experts)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_grouped_plan_runs_every_expert_only_when_that_is_no_more_rows():
  """Few tokens: each assignment's own weights (T*k <= E), then every expert while T*E rows are at most
  the slab's E*S plus the tiles' rows (measured: docs/moe.md), then the slab and tiles."""
  assert [moe.grouped_plan(t, 2, 8) for t in (4, 5, 16, 32, 64)] == ["gathered", "dense", "dense", "dense", "slab"]
  assert [moe.grouped_plan(t, 2, 16) for t in (8, 16, 32, 256)] == ["gathered", "dense", "slab", "slab"]
  assert moe.grouped_plan(2048, 8, 128) == "slab" and moe.grouped_plan(3, 1, 1) == "dense"


def test_moe_impl_auto_is_chosen_by_the_backend_once_and_overridable(monkeypatch):
  """"auto" (the default) becomes `ragged` on GPU/TPU and `grouped` on CPU when the config is built (one
  backend query), and the config keeps the concrete choice (replace, to_dict, the sampler's settings); an
  explicit choice is never changed. The backend is faked: no GPU needed."""
  queries = []
  for backend, want in (("cpu", "grouped"), ("gpu", "ragged"), ("tpu", "ragged")):
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: queries.append(b) or b)
    config = dg.ModelConfig(**{**TINY.to_dict(), "moe_impl": "auto"})
    assert config.moe_impl == want and queries[-1:] == [backend]
    assert dg.ModelConfig(**{k: v for k, v in TINY.to_dict().items() if k != "moe_impl"}).moe_impl == want
    count = len(queries)
    assert config.replace(top_k=1).moe_impl == want and config.to_dict()["moe_impl"] == want
    assert TINY.replace(moe_impl="dense").moe_impl == "dense"
    assert len(queries) == count  # a built config is never resolved again
    assert dg.Sampler(dg.DiffusionGemma(config), dg.SamplerConfig()).settings()["moe_impl"] == want
  assert default_moe_impl("cuda") == "ragged" and default_moe_impl("METAL") == "grouped"


@pytest.mark.parametrize("cfg,plan", [(MANY, "slab"), (TINY, "dense")])
def test_grouped_experts_skip_tokens_and_leave_the_others_unchanged(cfg, plan):
  assert moe.grouped_plan(40, cfg.top_k, cfg.num_experts) == plan
  x = jax.random.normal(jax.random.key(6), (40, cfg.hidden_size))
  weights, experts = _routing(1, 40, False, cfg.num_experts)
  module = moe.Experts(cfg.replace(moe_impl="grouped"))
  variables = module.init(jax.random.key(7), x, weights, experts)
  apply = jax.jit(module.apply)
  full = np.asarray(apply(variables, x, weights, experts))
  skip = np.arange(40) % 3 == 0
  part = np.asarray(apply(variables, x, weights, experts, jnp.asarray(skip)))
  np.testing.assert_array_equal(part[~skip], full[~skip])  # bit for bit: tiles keep their shape
  assert (part[skip] == 0).all()


def test_sparse_experts_gradients_equal_dense():
  assert moe.grouped_plan(24, MANY.top_k, MANY.num_experts) == "slab"
  x = jax.random.normal(jax.random.key(4), (24, MANY.hidden_size))
  weights, experts = _routing(0, 24, False, MANY.num_experts)
  variables = moe.Experts(MANY).init(jax.random.key(5), x, weights, experts)

  def grads(impl):
    module = moe.Experts(MANY.replace(moe_impl=impl))
    return jax.jit(jax.grad(lambda v, x: module.apply(v, x, weights, experts).sum(),
                            argnums=(0, 1)))(variables, x)

  for got, want in zip(jax.tree.leaves(grads("grouped")), jax.tree.leaves(grads("dense"))):
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_remat_and_bfloat16():
  config = TINY.replace(num_layers=2, layer_types=("sliding", "full"))
  params = _random_params(config, seed=1)
  prompt, canvas = _tokens(12, (2, 5)), _tokens(13, (2, TINY.canvas_length))

  @functools.partial(jax.jit, static_argnames="config")
  @functools.partial(jax.grad)
  def grad(p, config):
    return dg.DiffusionGemma(config).apply({"params": p}, prompt, canvas).mean()

  want = grad(params, config)
  got = grad(params, config.replace(remat=True))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  apply = jax.jit(lambda p, config: dg.DiffusionGemma(config).apply({"params": p}, prompt, canvas),
                  static_argnames="config")
  bf16, full = apply(params, config.replace(dtype="bfloat16")), apply(params, config)
  assert bf16.dtype == jnp.float32 and np.abs(bf16 - full).max() < 0.1


def test_parameters_carry_logical_axes():
  model = dg.DiffusionGemma(TINY)
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32),
                                            jnp.zeros((1, 6), jnp.int32)))["params"]
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert leaves and all(isinstance(x, nn.Partitioned) for x in leaves)
  for leaf in leaves:
    assert len(leaf.names) == len(leaf.value.shape)
  assert boxed["layer_1"]["experts"]["gating_einsum"].names == ("experts", None, "expert_mlp", "embed")


BAD_CONFIGS = [
    (dict(top_k=6), "top_k=6"),
    (dict(num_kv_heads=3), "num_kv_heads=3"),
    (dict(num_full_kv_heads=3), "num_full_kv_heads=3"),
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(layer_types=("full", "sliding", "full", "sliding")), "last layer"),
    (dict(layer_types=("sliding", "full")), "one entry per layer"),
    (dict(layer_types=("sliding", "local", "sliding", "full")), "'local'"),
    (dict(hidden_size=-4), "hidden_size=-4"),
    (dict(head_dim=11), "head_dim=11"),
    (dict(num_experts=2.5), "num_experts=2.5"),
    (dict(full_partial_rotary_factor=1.5), "full_partial_rotary_factor=1.5"),
    (dict(dtype="float8"), "dtype='float8'"),
    (dict(moe_impl="megablocks"), "moe_impl='megablocks'"),
    (dict(canvas_length=1000), "canvas_length=1000"),
    (dict(eos_id=61), "eos_id=61"),
    (dict(final_logit_softcap=0.0), "final_logit_softcap=0.0"),
]


@pytest.mark.parametrize("changes,message", BAD_CONFIGS)
def test_bad_config_is_rejected_clearly(changes, message):
  with pytest.raises(ValueError, match=f"ModelConfig.*{__import__('re').escape(message)}"):
    TINY.replace(**changes)


def test_unknown_config_field_is_named():
  with pytest.raises(ValueError, match="num_expert"):
    dg.ModelConfig.from_dict({**TINY.to_dict(), "num_expert": 4})
  assert dg.ModelConfig.from_dict(TINY.to_dict()) == TINY

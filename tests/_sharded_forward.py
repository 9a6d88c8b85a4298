"""Run by test_parallel.py in a fresh process with 8 simulated CPU devices: sharded == one device.

`python _sharded_forward.py` checks sharded init and forward on three meshes; with a transformers
checkpoint folder as argument it checks the streaming sharded load instead; with `train`, one train step
of configs/tiny.py on two meshes against one device; `memory [OUT.json]` measures the training plan against
XLA's allocation (docs/scale.md).
"""

import json
import os
import pathlib
import sys
import tempfile
import tracemalloc

import device_env  # pylint: disable=wrong-import-position  (tests/, this script's folder)

os.environ.update(device_env.with_devices(8))  # with the suite's -O0 (tests/conftest.py) when a test runs it

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np

import diffusiongemma as dg
from diffusiongemma import parallel
from diffusiongemma import timing
from diffusiongemma import training
from diffusiongemma.build import plan as plan_lib
from diffusiongemma.build.config import load_config_file, to_json
from diffusiongemma.training import checkpoint as ckpt_lib
from diffusiongemma.training import loop
from diffusiongemma.training import state as state_lib

ROOT = pathlib.Path(__file__).parent.parent
TRAIN_MESHES = [dict(data=2, fsdp=2, expert=2, tensor=1), dict(data=1, fsdp=2, expert=4, tensor=1)]

CONFIG = dg.ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, layer_types=("sliding", "full"), num_heads=4,
    num_kv_heads=2, head_dim=8, num_full_kv_heads=1, full_head_dim=16, sliding_window=4,
    intermediate_size=32, num_experts=4, top_k=2, moe_intermediate_size=16, canvas_length=8,
    max_positions=128)
MESHES = [dict(data=2, fsdp=2, expert=2, tensor=1), dict(data=1, fsdp=2, expert=4, tensor=1),
          dict(data=1, fsdp=2, expert=1, tensor=4)]


def main():
  assert jax.device_count() == 8, jax.devices()
  model = dg.DiffusionGemma(CONFIG)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, 64, (8, 5)), jnp.int32)
  canvas = jnp.asarray(rng.integers(0, 64, (8, 8)), jnp.int32)
  forward = lambda p, a, b: model.apply({"params": p}, a, b)
  one = parallel.make_mesh({"data": 1}, jax.devices()[:1])
  want_params, _ = parallel.init_params(model, jax.random.key(0), one, prompt[:1], canvas[:1])
  want = np.asarray(jax.jit(forward)(want_params, prompt, canvas))
  for sizes in MESHES:
    mesh = parallel.make_mesh(sizes)
    params, shardings = parallel.init_params(model, jax.random.key(0), mesh, prompt[:1], canvas[:1])
    experts = params["layer_0"]["experts"]["gating_einsum"]
    assert experts.addressable_shards[0].data.shape[0] == CONFIG.num_experts // sizes["expert"]
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    batch = parallel.batch_sharding(mesh)
    sharded_forward = jax.jit(forward, in_shardings=(shardings, batch, batch))
    got = sharded_forward(params, prompt, canvas)  # GSPMD alone: expert weights are gathered
    with jax.set_mesh(mesh):  # the mesh in context: the MoE runs expert-parallel (shard_map)
      got_ep = sharded_forward(params, prompt, canvas)
    for name, out in (("gspmd", got), ("mesh in context", got_ep)):
      np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
      print(f"mesh {sizes}, {name}: max |sharded - one device| = {np.abs(np.asarray(out) - want).max():.2e}")
    sampler = dg.Sampler(model, dg.SamplerConfig(max_denoising_steps=6, prompt_bucket=8))
    single = sampler.generate(want_params, prompt, jax.random.key(3), max_new_tokens=16)
    with jax.set_mesh(mesh):
      sharded = sampler.generate(params, prompt, jax.random.key(3), max_new_tokens=16)
    np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(single.tokens))
  print("OK")


def load(path):
  """Streams a sharded checkpoint onto a (1, 2, 4, 1) mesh; host staging stays below the checkpoint size."""
  mesh = parallel.make_mesh(dict(data=1, fsdp=2, expert=4, tensor=1))

  cfg = dg.convert.config_from_hf(json.loads((pathlib.Path(path) / "config.json").read_text()))
  model = dg.DiffusionGemma(cfg)
  boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32),
                         jnp.zeros((1, cfg.canvas_length), jnp.int32))["params"]
  shardings = parallel.param_shardings(boxed, mesh)
  dg.convert.load_hf(path, shardings=shardings)  # warm up jax's own caches, which are not staging

  checkpoint_bytes = sum(f.stat().st_size for f in pathlib.Path(path).glob("*.safetensors"))
  tracemalloc.start()
  cfg, params = dg.convert.load_hf(path, shardings=shardings)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  experts = params["layer_0"]["experts"]["gating_einsum"]
  assert len(experts.sharding.device_set) == 8 and experts.addressable_shards[0].data.shape[0] < cfg.num_experts
  _, host = dg.convert.load_hf(path)
  model = dg.DiffusionGemma(cfg)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 7)), jnp.int32)
  canvas = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, cfg.canvas_length)), jnp.int32)
  forward = jax.jit(lambda p, a, b: model.apply({"params": p}, a, b))
  np.testing.assert_allclose(np.asarray(forward(params, prompt, canvas)),
                             np.asarray(forward(jax.device_put(host, jax.devices()[0]), prompt, canvas)), atol=1e-4)
  print(f"peak host staging {peak} bytes for a {checkpoint_bytes}-byte checkpoint")
  assert peak < checkpoint_bytes / 2, (peak, checkpoint_bytes)
  print("OK")


def _one_train_step(config, devices):
  """(state before, state after, metrics) of one step of the training library's own step on `devices`."""
  mesh = parallel.make_mesh(dict(config.mesh), devices)
  model_cfg = dg.build.model_config(config)
  loss_cfg = dg.build.loss(config)
  model = dg.DiffusionGemma(model_cfg)
  optimizer = training.make_optimizer(config.train)
  shardings = training.state_shardings(model, optimizer, mesh, seed=config.train.seed)
  state = state_lib.make_init_fn(model, optimizer, seed=config.train.seed, sharding=shardings)()
  before = jax.device_get(state)
  rng = np.random.default_rng(0)
  length = config.data.prompt_length + config.data.num_canvases * model_cfg.canvas_length
  batch = {"tokens": rng.integers(0, model_cfg.vocab_size, (config.train.batch_size, length), np.int32),
           "prompt_length": np.full((config.train.batch_size,), config.data.prompt_length, np.int32)}
  step = training.make_train_step(model, optimizer, loss_cfg, num_canvases=config.data.num_canvases,
                                  state_sharding=shardings, batch_sharding=parallel.batch_sharding(mesh, ndim=1))
  state, metrics = step(state, loop.to_global(batch, parallel.batch_sharding(mesh, ndim=1)))
  experts = state.params["params"]["layer_0"]["experts"]["gating_einsum"]
  moment = state.opt_state[1][0].mu["params"]["layer_0"]["experts"]["gating_einsum"]
  assert experts.sharding == moment.sharding, (experts.sharding, moment.sharding)
  assert experts.addressable_shards[0].data.shape[0] == model_cfg.num_experts // mesh.shape["expert"]
  _check_sharded_restore(state, shardings)
  return before, jax.device_get(state), jax.device_get(metrics)


def _check_sharded_restore(state, shardings):
  """A checkpoint of the sharded state restores equal, straight into the same shardings."""
  with tempfile.TemporaryDirectory() as workdir:
    checkpointer = training.Checkpointer(workdir, async_save=False)
    checkpointer.save(1, state, {}, {})
    abstract = parallel.abstract_with_sharding(jax.eval_shape(lambda: state).to_dict(), shardings.to_dict())
    restored, _, _ = checkpointer.restore(1, abstract)
    checkpointer.close()
  for got, want, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(state.to_dict()),
                                 jax.tree.leaves(shardings.to_dict()), strict=True):
    assert got.sharding == sharding, (got.sharding, sharding)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def train():
  """One train step of configs/tiny.py (2 layers, batch 8) on the (2,2,2,1) and (1,2,4,1) meshes == one device.

  Loss, gradient norm and the (clipped) gradients, read as Adam's first moment (1 - b1) g after one step,
  agree within 1e-5 everywhere; so do the updated parameters wherever Adam's first update
  lr g / (|g| + eps) is well conditioned (|g| >= 1e-5): where |g| is near eps = 1e-8 that update turns
  a 1e-9 difference in g (summation order) into up to 2 lr. Warmup is off, so the step moves parameters.
  """
  assert jax.device_count() == 8, jax.devices()
  config = load_config_file(ROOT / "configs" / "tiny.py")
  config.model.num_layers = 2  # one sliding-window and one full-attention layer: each kind, half the compile
  config.train.batch_size = 8
  config.train.warmup_steps = 0
  config.mesh.data = 1
  want_before, want, want_metrics = _one_train_step(config, jax.devices()[:1])
  b1 = config.train.adam_b1
  grads = lambda s: [m / (1 - b1) for m in jax.tree.leaves(s.opt_state[1][0].mu)]
  conditioned = [np.abs(g) >= 1e-5 for g in grads(want)]
  moved = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(want.params),
                                                   jax.tree.leaves(want_before.params), strict=True))
  for sizes in TRAIN_MESHES:
    config.mesh.update(sizes)
    before, got, metrics = _one_train_step(config, jax.devices())
    for a, b in zip(jax.tree.leaves(before.params), jax.tree.leaves(want_before.params), strict=True):
      np.testing.assert_array_equal(a, b)
    for key in ("loss", "diffusion_loss", "ar_loss", "grad_norm"):
      np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=1e-5, atol=1e-5, err_msg=key)
    grad_diff = max(np.abs(a - b).max() for a, b in zip(grads(got), grads(want), strict=True))
    param_diffs = [np.abs(a - b) for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params),
                                                 strict=True)]
    param_diff = max(np.where(m, d, 0).max() for m, d in zip(conditioned, param_diffs, strict=True))
    print(f"train mesh {sizes}: loss {metrics['loss']:.6f} (one device {want_metrics['loss']:.6f}), "
          f"max |grad diff| {grad_diff:.2e}, max |param diff| {param_diff:.2e} where |g| >= 1e-5 "
          f"({sum(m.sum() for m in conditioned)} of {sum(m.size for m in conditioned)} entries; "
          f"{max(d.max() for d in param_diffs):.2e} over all), the step moved params by up to {moved:.2e}")
    assert grad_diff < 1e-5 and param_diff < 1e-5 and moved > 1e-3, (grad_diff, param_diff, moved)
  print("OK")


# The scaled-down configs the training plan is measured on: 8 devices (fsdp=4, expert=2), 4 layers, batch 16, a
# 64-token prompt and two 16-token canvases; float32 with remat, and bfloat16 compute and first moment without
# remat over 2 micro-batches.
MEMORY_CONFIGS = {
    "float32, remat": {"model.remat": True},
    "bfloat16 compute and mu, no remat, 2 micro-batches": {
        "model.remat": False, "train.compute_dtype": "bfloat16", "train.mu_dtype": "bfloat16",
        "train.grad_accum_steps": 2},
}


def memory(out: str | None = None):
  """A measurement (docs/scale.md), not a check: the training plan of `build.plan.config_plan` against what XLA
  allocates per device for the trainer's own compiled step (lowered from shapes; nothing runs): arguments +
  outputs - donated aliases + temporaries. Prints one JSON line per config and writes them to `out`."""
  assert jax.device_count() == 8, jax.devices()
  rows = []
  for name, overrides in MEMORY_CONFIGS.items():
    config = load_config_file(ROOT / "configs" / "tiny.py")
    config.model.update(num_layers=4, hidden_size=128, vocab_size=2048, num_experts=8, top_k=2, canvas_length=16,
                        intermediate_size=256, moe_intermediate_size=128)
    config.data.update(prompt_length=64, num_canvases=2)
    config.train.batch_size = 16
    config.mesh.update(data=1, fsdp=4, expert=2, tensor=1)
    for key, value in overrides.items():
      section, field = key.split(".")
      config[section][field] = value
    with tempfile.TemporaryDirectory() as workdir:
      setup = loop._Setup(dg.build.train_task(config, workdir), workdir)  # pylint: disable=protected-access
    programs = setup.programs
    state = parallel.abstract_with_sharding(programs.abstract_state, programs.state_shardings)
    length = config.data.prompt_length + config.data.num_canvases * config.model.canvas_length
    shaped = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=setup.batch_sharding)
    batch = {"tokens": shaped(config.train.batch_size, length), "prompt_length": shaped(config.train.batch_size)}
    with jax.set_mesh(setup.mesh):
      stats = programs.train_step.jitted.lower(state, batch).compile().memory_analysis()
    xla = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
           + stats.temp_size_in_bytes)
    planned = plan_lib.config_plan(config, parallel.mesh_shape(config.mesh, 8), training=True)
    rows.append({"config": name, "overrides": overrides, "settings": to_json(config),
                 "plan_bytes": planned["total"], "xla_bytes": xla, "plan_over_xla": planned["total"] / xla,
                 "plan": planned, "xla": {k: getattr(stats, k) for k in dir(stats) if k.endswith("_in_bytes")}})
    print(json.dumps({k: rows[-1][k] for k in ("config", "plan_bytes", "xla_bytes", "plan_over_xla", "plan", "xla")}))
  if out:
    pathlib.Path(out).write_text(json.dumps({"command": f"python tests/_sharded_forward.py memory {out}",
                                             "xla_flags": os.environ["XLA_FLAGS"], **timing.provenance(ROOT),
                                             "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
  if sys.argv[1:] == ["train"]:
    train()
  elif sys.argv[1:2] == ["memory"]:
    memory(*sys.argv[2:3])
  elif len(sys.argv) > 1:
    load(sys.argv[1])
  else:
    main()

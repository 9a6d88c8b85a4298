"""Run by test_parallel.py in a fresh process with 8 simulated CPU devices: sharded == one device.

`python _sharded_forward.py` checks sharded init and forward on three meshes; with a transformers
checkpoint folder as argument it checks the streaming sharded load instead.
"""

import json
import os
import pathlib
import sys
import tracemalloc

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np

import diffusiongemma as dg
from diffusiongemma import parallel

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
    got = jax.jit(forward, in_shardings=(shardings, batch, batch))(params, prompt, canvas)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    print(f"mesh {sizes}: max |sharded - one device| = {np.abs(np.asarray(got) - want).max():.2e}")
    sampler = dg.Sampler(model, dg.SamplerConfig(max_denoising_steps=6, prompt_bucket=8))
    sharded = sampler.generate(params, prompt, jax.random.key(3), max_new_tokens=16)
    single = sampler.generate(want_params, prompt, jax.random.key(3), max_new_tokens=16)
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


if __name__ == "__main__":
  if len(sys.argv) > 1:
    load(sys.argv[1])
  else:
    main()

"""`load_hf(path, dtype=bfloat16, shardings=mesh_shardings())`: a sharded safetensors checkpoint of ~60 MB
(float32) streamed onto 8 simulated devices, each tensor read once, cast and placed in its sharding.

The check runs this file as a script in a fresh process (the device-count flag must be set before jax is
imported). Host staging is measured with tracemalloc, which sees numpy's buffers and the bytes safetensors
reads but not XLA's device buffers (on CPU those are host memory too, but they are the devices' share,
not staging): its peak must stay below the largest shard file plus a 4 MiB margin (Python and jax
bookkeeping), i.e. the load never holds more than about one shard's worth of tensors on the host.
"""

import pathlib
import subprocess
import sys

import device_env

MARGIN = 4 * 2**20


def test_bf16_sharded_load_onto_8_devices(tmp_path):
  env = device_env.with_devices(8)
  result = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, check=False, env=env)
  print(result.stdout)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "OK" in result.stdout


def _main(folder: pathlib.Path):
  import tracemalloc  # pylint: disable=import-outside-toplevel

  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import diffusiongemma as dg  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == 8, jax.devices()
  cfg = dg.ModelConfig(
      vocab_size=4096, hidden_size=256, num_layers=4, layer_types=("sliding", "full", "sliding", "full"),
      num_heads=8, num_kv_heads=4, head_dim=32, num_full_kv_heads=2, full_head_dim=64, sliding_window=16,
      intermediate_size=512, num_experts=16, top_k=2, moe_intermediate_size=256, canvas_length=16,
      max_positions=512)
  model = dg.DiffusionGemma(cfg)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 2), jnp.int32),
                          jax.ShapeDtypeStruct((1, cfg.canvas_length), jnp.int32))["params"]
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), nn.unbox(shapes))
  dg.convert.save_hf(cfg, params, folder, max_shard_bytes=16 * 2**20)
  shards = sorted(folder.glob("*.safetensors"))
  largest_shard = max(f.stat().st_size for f in shards)
  total = sum(f.stat().st_size for f in shards)
  largest_tensor = max(x.nbytes for x in jax.tree.leaves(params))
  assert len(shards) >= 3, shards

  shardings = dg.convert.mesh_shardings()
  dg.convert.load_hf(folder, dtype=jnp.bfloat16, shardings=shardings)  # warm jax's caches (not staging)
  tracemalloc.start()
  loaded_cfg, loaded = dg.convert.load_hf(folder, dtype=jnp.bfloat16, shardings=shardings)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()

  assert loaded_cfg == cfg
  want = shardings(cfg)
  for path, got in jax.tree_util.tree_leaves_with_path(loaded):
    sharding = want
    for key in path:
      sharding = sharding[key.key]
    assert got.dtype == jnp.bfloat16, (path, got.dtype)
    assert got.sharding == sharding, (path, got.sharding, sharding)
  experts = loaded["layer_0"]["experts"]["gating_einsum"]  # [E, 2, F, D]: F split 8 ways (tensor axis)
  assert experts.addressable_shards[0].data.shape == (16, 2, 256 // 8, 256), experts.addressable_shards[0]
  np.testing.assert_array_equal(np.asarray(experts, np.float32),
                                params["layer_0"]["experts"]["gating_einsum"].astype(jnp.bfloat16))
  print(f"{len(shards)} shards, {total / 2**20:.1f} MiB float32 in all, largest shard "
        f"{largest_shard / 2**20:.1f} MiB, largest tensor {largest_tensor / 2**20:.1f} MiB; bf16 load onto 8 "
        f"devices: peak host staging {peak / 2**20:.1f} MiB (bound: largest shard + {MARGIN / 2**20:.0f} MiB)")
  assert peak < largest_shard + MARGIN, (peak, largest_shard)
  print("OK")


if __name__ == "__main__":
  _main(pathlib.Path(sys.argv[1]))

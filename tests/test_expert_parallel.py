"""Expert parallelism (moe.py): under a mesh with an `expert` axis the experts run in `shard_map`, tokens
travel (all-gather + reduce-scatter) and the weights stay put; results and gradients equal one device's.

The multi-device checks run this file as a script in a fresh process with 8 simulated CPU devices (the
flag must be set before jax is imported), so the module imports nothing heavy at the top.
"""

import contextlib
import functools
import os
import pathlib
import re
import subprocess
import sys

import device_env

MESHES = [dict(data=1, fsdp=1, expert=8, tensor=1), dict(data=2, fsdp=1, expert=4, tensor=1),
          dict(data=1, fsdp=2, expert=2, tensor=2)]
_COLLECTIVE = re.compile(r"= (\(.*?\)|\S+) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
                         r"(?:-start)?\(")
_SHAPE = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")


def collectives(hlo: str) -> list[tuple[str, str, tuple[int, ...], int]]:
  """(op, dtype, shape, bytes) of every collective's result in compiled HLO text, leaving out those over
  one-device groups (`replica_groups={{0},{1},...}`), which move nothing."""
  found = []
  for line in hlo.splitlines():
    match = _COLLECTIVE.search(line)
    if not match or re.search(r"replica_groups=\{\{\d+\}(,\{\d+\})*\}", line):
      continue
    types, op = match.groups()
    for dtype, dims in _SHAPE.findall(types):
      shape = tuple(int(d) for d in dims.split(",") if d)
      size = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype)) // 8
      count = 1
      for d in shape:
        count *= d
      found.append((op, dtype, shape, count * size))
  return found


def test_local_grouped_worst_case_routing_equals_dense():
  """One device's share of the experts when every gathered token picks them (the buffer's worst case)
  and when none does: the chunks that hold rows run, the rest are skipped, nothing is dropped."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from diffusiongemma.model import moe  # pylint: disable=import-outside-toplevel

  rows, top_k, num_local, dim, ffn = 32, 2, 3, 8, 4
  x = jax.random.normal(jax.random.key(0), (rows, dim))
  gating = jax.random.normal(jax.random.key(1), (num_local, 2, ffn, dim))
  linear = jax.random.normal(jax.random.key(2), (num_local, ffn, dim))
  weights = jax.random.uniform(jax.random.key(3), (rows, top_k))
  rng = np.random.default_rng(0)
  for experts in (np.tile([0, 2], (rows, 1)),  # all local
                  rng.integers(-6, 9, (rows, top_k)),  # mostly other devices' (out of [0, 3))
                  np.full((rows, top_k), 5)):  # none local
    experts = jnp.asarray(experts, jnp.int32)
    want = moe._local_dense(x, weights, experts, gating, linear)  # pylint: disable=protected-access
    grouped = functools.partial(moe._local_grouped, tokens=rows // 4)  # pylint: disable=protected-access
    for local in (grouped, moe._local_ragged):  # pylint: disable=protected-access
      got = jax.jit(local)(x, weights, experts, gating, linear)
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_expert_parallel_on_8_devices():
  # Compiling is most of the time here: skip LLVM's costlier passes (the programs are tiny); no result changes.
  env = device_env.with_devices(8, "--xla_llvm_disable_expensive_passes=true")
  result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300,
                          check=False, env=env, cwd=pathlib.Path(__file__).parent.parent)
  assert result.returncode == 0, result.stderr[-4000:]
  assert "OK" in result.stdout, result.stdout
  print(result.stdout)


def _main():
  """The 8-device checks (run as a script)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import diffusiongemma as dg  # pylint: disable=import-outside-toplevel
  from diffusiongemma import parallel  # pylint: disable=import-outside-toplevel
  from diffusiongemma.model import moe  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == 8, jax.devices()
  config = dg.ModelConfig(
      vocab_size=64, hidden_size=32, num_layers=1, layer_types=("full",), num_heads=4,
      num_kv_heads=2, head_dim=8, num_full_kv_heads=1, full_head_dim=16, sliding_window=4,
      intermediate_size=32, num_experts=8, top_k=2, moe_intermediate_size=16, canvas_length=8,
      max_positions=128)
  close = lambda got, want: np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5,
                                                       rtol=1e-5)

  # The layer alone. The first 96 tokens are routed at random, the last 96 all to experts 0 and 1: the
  # devices holding those tokens send every assignment to one expert device, the buffer's worst case.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(192, config.hidden_size)), jnp.float32)
  weights = jnp.asarray(rng.uniform(0.1, 1, (192, 2)), jnp.float32)
  experts = jnp.asarray(np.concatenate([np.stack([rng.permutation(8)[:2] for _ in range(96)]),
                                        np.tile([0, 1], (96, 1))]), jnp.int32)
  args = (x, weights, experts)
  boxed = jax.eval_shape(moe.Experts(config).init, jax.random.key(0), *args)["params"]
  shapes = _unbox(boxed)
  keys = dict(zip(shapes, jax.random.split(jax.random.key(1), len(shapes))))
  params = {name: 0.2 * jax.random.normal(keys[name], s.shape) for name, s in shapes.items()}

  def layer(impl):
    module = moe.Experts(config.replace(moe_impl=impl))

    def run(p, x, w, e):  # the output, and the gradients of a loss on it in the params, x and weights
      def loss(p, x, w):
        out = module.apply({"params": p}, x, w, e)
        return jnp.sum(jnp.sin(out)), out

      (_, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(p, x, w)
      return out, grads

    return run

  want = {impl: jax.jit(layer(impl))(params, *args) for impl in ("grouped", "ragged", "dense")}
  for sizes in MESHES:
    mesh = parallel.make_mesh(sizes)
    specs = (parallel.param_shardings(boxed, mesh),) + (parallel.batch_sharding(mesh),) * 3
    for impl in ("grouped", "ragged", "dense") if sizes["expert"] == 8 else ("grouped",):
      with jax.set_mesh(mesh):
        compiled = jax.jit(layer(impl), in_shardings=specs).lower(params, *args).compile()
      for got, ref in zip(jax.tree.leaves(compiled(params, *args)), jax.tree.leaves(want[impl])):
        close(got, ref)
      if sizes["expert"] == 8 and impl == "grouped":  # the program keeps expert weights, moves tokens
        ops = collectives(compiled.as_text())
        weight_like = [o for o in ops if o[2][-2:] == (config.moe_intermediate_size, config.hidden_size)]
        assert not weight_like, weight_like
        assert ("all-gather", "f32", (192, config.hidden_size), 192 * config.hidden_size * 4) in ops, ops
        assert any(op == "reduce-scatter" and shape == (24, config.hidden_size) for op, _, shape, _ in ops), ops
        gspmd = jax.jit(layer(impl), in_shardings=specs).lower(params, *args).compile()
        gspmd_ops = collectives(gspmd.as_text())
        expert_bytes = 4 * params["gating_einsum"].size
        assert max(b for *_, b in gspmd_ops) >= expert_bytes, gspmd_ops  # GSPMD moves whole weights
        print(f"layer, collective bytes: expert-parallel {sum(b for *_, b in ops)}, "
              f"GSPMD default {sum(b for *_, b in gspmd_ops)}")
    print(f"layer on mesh {sizes}: forward and gradients equal one device's")

  # The whole model on each mesh; its gradients on the mesh with fsdp and tensor (compiling a model's
  # backward pass is the slow part of this test).
  model = dg.DiffusionGemma(config)
  prompt = jnp.asarray(rng.integers(0, 64, (8, 5)), jnp.int32)
  canvas = jnp.asarray(rng.integers(0, 64, (8, 8)), jnp.int32)
  forward = lambda p, a, b: model.apply({"params": p}, a, b)
  grad = jax.grad(lambda p, a, b: jnp.mean(jax.nn.log_softmax(forward(p, a, b))[..., 3]))
  one = parallel.make_mesh({"data": 1}, jax.devices()[:1])
  want_params, _ = parallel.init_params(model, jax.random.key(0), one, prompt[:1], canvas[:1])
  want = jax.jit(forward)(want_params, prompt, canvas)
  for sizes in MESHES:
    mesh = parallel.make_mesh(sizes)
    model_params, shardings = parallel.init_params(model, jax.random.key(0), mesh, prompt[:1], canvas[:1])
    batch = parallel.batch_sharding(mesh)
    with jax.set_mesh(mesh):
      got = jax.jit(forward, in_shardings=(shardings, batch, batch))(model_params, prompt, canvas)
      if sizes["tensor"] > 1:
        got_grad = jax.jit(grad, in_shardings=(shardings, batch, batch))(model_params, prompt, canvas)
    close(got, want)
    message = f"model on mesh {sizes}: max |sharded - one device| = {np.abs(np.asarray(got) - want).max():.1e}"
    if sizes["tensor"] > 1:
      for g, ref in zip(jax.tree.leaves(got_grad), jax.tree.leaves(jax.jit(grad)(want_params, prompt, canvas))):
        close(g, ref)
      message += ", gradients equal too"
    print(message)

  # Experts that the expert axis does not divide are refused, naming both numbers.
  bad = moe.Experts(config.replace(num_experts=12))
  try:
    with jax.set_mesh(parallel.make_mesh(MESHES[0])):
      jax.eval_shape(bad.init, jax.random.key(0), *args)
  except ValueError as error:
    assert "num_experts=12" in str(error) and "size 8" in str(error), error
  else:
    raise AssertionError("12 experts on an expert axis of 8 were accepted")

  print("OK")


def _measure(tokens_per_device: int = 256, impl: str = "grouped"):
  """Compiled collective bytes and memory of one 26B-A4B expert layer (bf16; forward, and forward plus
  backward), expert-parallel vs the GSPMD default, on a (1, 1, 8, 1) mesh. Compiles only, runs nothing:
  `python tests/test_expert_parallel.py --measure [tokens per device] [grouped|ragged|dense]`."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import diffusiongemma as dg  # pylint: disable=import-outside-toplevel
  from diffusiongemma import parallel  # pylint: disable=import-outside-toplevel
  from diffusiongemma.model import moe  # pylint: disable=import-outside-toplevel

  config = dg.ModelConfig(dtype="bfloat16", param_dtype="bfloat16", moe_impl=impl)  # released dimensions
  mesh = parallel.make_mesh(dict(data=1, fsdp=1, expert=8, tensor=1))
  num_tokens = 8 * tokens_per_device
  args = (jax.ShapeDtypeStruct((num_tokens, config.hidden_size), jnp.bfloat16),
          jax.ShapeDtypeStruct((num_tokens, config.top_k), jnp.float32),
          jax.ShapeDtypeStruct((num_tokens, config.top_k), jnp.int32))
  module = moe.Experts(config)
  boxed = jax.eval_shape(module.init, jax.random.key(0), *args)["params"]
  specs = (parallel.param_shardings(boxed, mesh),) + (parallel.batch_sharding(mesh),) * 3
  forward = lambda p, x, w, e: module.apply({"params": p}, x, w, e)
  loss = lambda p, x, w, e: jnp.sum(jnp.square(forward(p, x, w, e).astype(jnp.float32)))
  grad = jax.grad(loss, argnums=(0, 1))
  for name, fn in (("forward", forward), ("forward+backward", grad)):
    for kind in ("expert-parallel", "GSPMD default"):
      with jax.set_mesh(mesh) if kind == "expert-parallel" else contextlib.nullcontext():
        compiled = jax.jit(fn, in_shardings=specs).lower(_unbox(boxed), *args).compile()
      ops = collectives(compiled.as_text())
      moved = sum(b for *_, b in ops)
      if "-v" in sys.argv:
        print(ops)
      memory = compiled.memory_analysis()
      print(f"{impl} {name:16s} {kind:16s} T={tokens_per_device}/device: collective results "
            f"{moved / 2**20:8.1f} MiB, temp {memory.temp_size_in_bytes / 2**20:8.1f} MiB, arguments "
            f"{memory.argument_size_in_bytes / 2**20:7.1f} MiB per device")


def _unbox(tree):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  return nn.unbox(tree)


if __name__ == "__main__":
  if "--measure" in sys.argv:
    # 8 simulated CPU devices unless the caller chose otherwise (before jax is first imported, in _measure).
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    _measure(*[int(a) if a.isdigit() else a for a in sys.argv[sys.argv.index("--measure") + 1:] if a != "-v"])
  else:
    _main()

"""Measuring helpers shared by the benchmark scripts: timing, machine peaks, XLA cost analysis.

Every figure is measured in the same process as what it is compared with; a "fraction of peak" uses a
peak measured here too (a float32 matmul for FLOP/s, a matrix-vector product for bandwidth), not a datasheet.
A peak is the fastest of its runs, not the median: on a machine shared with other work the median
catches busy moments and understates the peak, which inflates every fraction of it (above 1).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from diffusiongemma import training
from diffusiongemma.diffusion import loss as loss_lib
from diffusiongemma.model import DiffusionGemma, ModelConfig


def median_seconds(fn: Callable, *args, repeats: int = 3, reduce: Callable = statistics.median) -> float:
  """Median (or `reduce`) wall time of `fn(*args)` (blocked until ready), after one untimed warm-up."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return reduce(times)


def first_call_seconds(fn: Callable, *args) -> tuple[float, object]:
  """(seconds, result) of one call, blocked until ready: compile time plus one run for a fresh jit."""
  start = time.perf_counter()
  result = jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, result


def matmul_peak_flops(size: int = 2048, repeats: int = 3) -> float:
  """Best FLOP/s of a jitted float32 [size, size] @ [size, size] matmul on the default device."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
  return 2 * size**3 / median_seconds(jax.jit(jnp.matmul), a, b, repeats=repeats, reduce=min)


def read_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 3) -> float:
  """Best bytes/s read by a jitted float32 matrix-vector product over a matrix of `num_bytes`.

  A matrix-vector product reads every weight once and does 2 FLOPs per 4 bytes, the access pattern of
  an autoregressive step; on CPU it runs on every core, where an elementwise copy runs on one and
  understates what decoding can reach.
  """
  rows = 4096
  matrix = jnp.ones((rows, num_bytes // 4 // rows), jnp.float32)
  vector = jnp.ones((matrix.shape[1],), jnp.float32)
  return matrix.nbytes / median_seconds(jax.jit(jnp.matmul), matrix, vector, repeats=repeats, reduce=min)


def cost(fn: Callable, *args) -> dict[str, float]:
  """XLA's cost analysis of `jax.jit(fn)(*args)`: {'flops', 'bytes accessed'} (0 where unknown)."""
  return compiled_cost(jax.jit(fn).lower(*args).compile())


def compiled_cost(compiled) -> dict[str, float]:
  """{'flops', 'bytes accessed'} of an already compiled program (0 where XLA does not know)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, list):  # older jax: one dict per computation
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  return {"flops": float(analysis.get("flops", 0.0)),
          "bytes accessed": float(analysis.get("bytes accessed", 0.0))}


def benchmark_train_step(config, repeats: int = 3, batch_size: int | None = None) -> dict[str, float]:
  """Throughput of the jitted train step of `config` on random tokens, compile time apart.

  Built from the training library's public pieces (optimizer, state, step) exactly as training runs
  them, with the state donated; the step is lowered and compiled once, and XLA's cost analysis of that
  compiled program gives the FLOPs per step (forward, backward and optimizer update). The tokens counted
  are the training sequences' tokens (batch x (prompt + canvases)), the convention of LM throughput;
  the denoiser's canvas passes are extra work inside the same step. MFU is left to the caller, who
  measures the peak it is a fraction of.
  """
  cfg = ModelConfig.from_dict(config.model).replace(dtype=config.train.compute_dtype)
  model = DiffusionGemma(cfg)
  loss_config = loss_lib.LossConfig.from_dict(config.diffusion)
  optimizer = training.make_optimizer(config.train)
  prompt_length, num_canvases = config.data.prompt_length, config.data.num_canvases
  batch_size = batch_size or config.train.batch_size
  length = prompt_length + num_canvases * cfg.canvas_length
  tokens = jax.random.randint(jax.random.key(0), (batch_size, length), 0, cfg.vocab_size, jnp.int32)
  batch = {"tokens": tokens, "prompt_length": jnp.full((batch_size,), prompt_length, jnp.int32)}
  state = training.create_train_state(model, optimizer, seed=config.train.seed, prompt_length=prompt_length)
  step = training.make_train_step(model, optimizer, loss_config, num_canvases=num_canvases)

  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_seconds = time.perf_counter() - start
  flops = compiled_cost(compiled)["flops"]

  state, metrics = jax.block_until_ready(compiled(state, batch))  # warm-up
  times = []
  for _ in range(repeats):
    begin = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, batch))
    times.append(time.perf_counter() - begin)
  seconds = statistics.median(times)
  return {"batch_size": batch_size, "sequence_length": length, "tokens_per_step": batch_size * length,
          "seconds_per_step": seconds, "compile_seconds": compile_seconds,
          "tokens_per_second": batch_size * length / seconds, "flops_per_step": flops,
          "achieved_gflops": flops / seconds / 1e9,
          "parameters": sum(x.size for x in jax.tree.leaves(state.params)),
          "final_loss": float(metrics["loss"])}

"""Measuring helpers shared by the benchmark scripts: timing, machine peaks, XLA cost analysis.

Every figure is measured in the same process as what it is compared with; a "fraction of peak" uses a
peak measured here too (a float32 matmul for FLOP/s, an array copy for bandwidth), not a datasheet.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def median_seconds(fn: Callable, *args, repeats: int = 3) -> float:
  """Median wall time of `fn(*args)` (blocked until ready), after one untimed warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def first_call_seconds(fn: Callable, *args) -> tuple[float, object]:
  """(seconds, result) of one call, blocked until ready: compile time plus one run for a fresh jit."""
  start = time.perf_counter()
  result = jax.block_until_ready(fn(*args))
  return time.perf_counter() - start, result


def matmul_peak_flops(size: int = 2048, repeats: int = 3) -> float:
  """FLOP/s of a jitted float32 [size, size] @ [size, size] matmul on the default device."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
  return 2 * size**3 / median_seconds(jax.jit(jnp.matmul), a, b, repeats=repeats)


def copy_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 3) -> float:
  """Bytes/s read plus written by a jitted elementwise copy of a float32 array of `num_bytes`."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  return 2 * num_bytes / median_seconds(jax.jit(lambda v: v * 1.0001), x, repeats=repeats)


def cost(fn: Callable, *args) -> dict[str, float]:
  """XLA's cost analysis of `jax.jit(fn)(*args)`: {'flops', 'bytes accessed'} (0 where unknown)."""
  analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(analysis, list):  # older jax: one dict per computation
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  return {"flops": float(analysis.get("flops", 0.0)),
          "bytes accessed": float(analysis.get("bytes accessed", 0.0))}

"""Measuring helpers for anything that reports a measured number (benchmarks, projects, scripts): one timer,
the machine's in-run peaks, and what a result file needs to be read later.

Every figure is measured in the same process as what it is compared with; a "fraction of peak" uses a peak
measured here too (a float32 matmul for FLOP/s, a matrix-vector product for bandwidth), not a datasheet. A
peak is the fastest of its runs (`Timing.best`), not the median: on a machine shared with other work the
median catches busy moments and understates the peak, which inflates every fraction of it. A throughput is
the median of its runs (`Timing.median`), with the first call's compile time apart.

It sits at the bottom of the package (it imports JAX only), so `projects/` and `benchmarks/` both build on
it and neither imports the other for it; `benchmarks.measure` adds the model-specific measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class Timing:
  """Wall times of one function: a first call (compile + run) and `repeats` more, each blocked until ready."""

  output: Any  # of the last call
  first: float
  runs: list[float]

  @property
  def median(self) -> float:
    return statistics.median(self.runs)

  @property
  def best(self) -> float:
    return min(self.runs)

  @property
  def compile_seconds(self) -> float:
    """The first call minus a typical run: trace, compile and transfer time."""
    return max(self.first - self.median, 0.0)


def time_call(fn: Callable, *args, repeats: int = 1, **kwargs) -> Timing:
  """Times `fn(*args, **kwargs)`: one first call (it compiles a fresh jit) then `repeats` timed calls."""
  if repeats < 1:
    raise ValueError(f"repeats={repeats} must be >= 1.")
  start = time.perf_counter()
  output = jax.block_until_ready(fn(*args, **kwargs))
  first = time.perf_counter() - start
  runs = []
  for _ in range(repeats):
    start = time.perf_counter()
    output = jax.block_until_ready(fn(*args, **kwargs))
    runs.append(time.perf_counter() - start)
  return Timing(output, first, runs)


def alternate(ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int) -> tuple[Timing, Timing]:
  """Times two competitors in turns, so that a change in the machine's load hits both alike: one first call
  of each (compiling, warming up), then ours, theirs, ours, theirs, ... `repeats` times each."""
  timings = alternate_all({"ours": ours, "theirs": theirs}, repeats)
  return timings["ours"], timings["theirs"]


def alternate_all(calls: dict[Any, Callable[[], Any]], repeats: int) -> dict[Any, Timing]:
  """`alternate` of any number of calls: one first call of each, then each in turn, `repeats` times."""
  if repeats < 1:
    raise ValueError(f"repeats={repeats} must be >= 1.")
  firsts, runs, outputs = {}, {name: [] for name in calls}, {}
  for name, fn in calls.items():
    start = time.perf_counter()
    outputs[name] = jax.block_until_ready(fn())
    firsts[name] = time.perf_counter() - start
  for _ in range(repeats):
    for name, fn in calls.items():
      start = time.perf_counter()
      outputs[name] = jax.block_until_ready(fn())
      runs[name].append(time.perf_counter() - start)
  return {name: Timing(outputs[name], firsts[name], runs[name]) for name in calls}


def loaded_machine(machine: dict[str, Any], max_load: float, allow: bool) -> list[str]:
  """The warnings a timing run writes into its JSON: none on a quiet machine (1-minute load average of
  `provenance` at most `max_load`); above it, SystemExit unless `allow`, then one loud warning."""
  load = machine["load_average"][0]
  if load <= max_load:
    return []
  message = (f"LOADED MACHINE: 1-minute load average {load:.2f} > {max_load} before the start; "
             "timings and their ratio are not results.")
  if not allow:
    raise SystemExit(f"Refusing to time. {message} Wait for a quiet machine, or pass --allow_load.")
  print(f"WARNING: {message}", flush=True)
  return [message]


# Dense bf16 peak TFLOP/s by device kind (datasheets; the first name contained in `device_kind` wins).
PEAKS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
         ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("TPU v6 lite", 918.0), ("TPU v5 lite", 197.0),
         ("TPU v5", 459.0), ("TPU v4", 275.0))


def datasheet_peak_flops(device=None) -> float | None:
  """The dense bf16 FLOP/s of `device`'s kind (default: the first device) from `PEAKS`; None if not listed."""
  kind = (device or jax.devices()[0]).device_kind
  return next((tflops * 1e12 for name, tflops in PEAKS if name in kind), None)


@functools.cache
def peak_flops_per_device(dtype: str = "bfloat16") -> tuple[float, str]:
  """(FLOP/s, 'datasheet' or 'measured'): the device kind's datasheet peak, else (a CPU, a kind not listed)
  a `dtype` matmul's measured here (1024^3 on a CPU, a fraction of a second; once per process)."""
  table = datasheet_peak_flops()
  if table is not None:
    return table, "datasheet"
  return matmul_peak_flops(1024 if jax.default_backend() == "cpu" else 8192, dtype=dtype), "measured"


def matmul_peak_flops(size: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
  """Best FLOP/s of a jitted [size, size] @ [size, size] matmul on the default device: float32, or for
  "bfloat16" bf16 inputs accumulated in float32 (what a bf16 model's matmuls do)."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32).astype(dtype)
  matmul = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
  return 2 * size**3 / time_call(matmul, a, b, repeats=repeats).best


def provenance(root: pathlib.Path) -> dict[str, Any]:
  """What a result file needs to be read later: the devices, the machine's 1/5/15-minute load averages
  now, and the git commit of `root` (None outside a git checkout; `dirty` when files differ from it)."""
  def git(*args):
    try:
      result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
      return None
    return result.stdout.strip()

  device = jax.devices()[0]
  status = git("status", "--porcelain", "--untracked-files=no")
  return {"backend": jax.default_backend(), "device": getattr(device, "device_kind", str(device)),
          "devices": jax.device_count(), "processor": platform.processor() or platform.machine(),
          "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()), "jax": jax.__version__,
          "git_commit": git("rev-parse", "HEAD"), "git_dirty": None if status is None else bool(status)}


def read_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
  """Best bytes/s read by a jitted float32 matrix-vector product over a matrix of `num_bytes`.

  A matrix-vector product reads every weight once and does 2 FLOPs per 4 bytes, the access pattern of
  an autoregressive step; on CPU it runs on every core, where an elementwise copy runs on one and
  understates what decoding can reach.
  """
  rows = 4096
  matrix = jnp.ones((rows, num_bytes // 4 // rows), jnp.float32)
  vector = jnp.ones((matrix.shape[1],), jnp.float32)
  return matrix.nbytes / time_call(jax.jit(jnp.matmul), matrix, vector, repeats=repeats).best

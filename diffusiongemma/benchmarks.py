"""Measuring helpers shared by the benchmark scripts: one timer, machine peaks, XLA cost analysis, and
the measurements more than one script reports (the train step, the MoE layer against a dense MLP).

Every figure is measured in the same process as what it is compared with; a "fraction of peak" uses a
peak measured here too (a float32 matmul for FLOP/s, a matrix-vector product for bandwidth), not a
datasheet. A peak is the fastest of its runs (`Timing.best`), not the median: on a machine shared with other
work the median catches busy moments and understates the peak, which inflates every fraction of it. A
throughput is the median of its runs (`Timing.median`), with the first call's compile time apart.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from diffusiongemma import build
from diffusiongemma import training
from diffusiongemma.model import DiffusionGemma, ModelConfig
from diffusiongemma.model import layers
from diffusiongemma.model import moe


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


def matmul_peak_flops(size: int = 2048, repeats: int = 5) -> float:
  """Best FLOP/s of a jitted float32 [size, size] @ [size, size] matmul on the default device."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.float32)
  return 2 * size**3 / time_call(jax.jit(jnp.matmul), a, b, repeats=repeats).best


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
  them (the model and objective from `build`), with the state donated; the step is lowered and compiled
  once, and XLA's cost analysis of that compiled program gives the FLOPs per step (forward, backward and
  optimizer update). The tokens counted are the training sequences' tokens (batch x (prompt +
  canvases)), the convention of LM throughput; the denoiser's canvas passes are extra work inside the same
  step. MFU is left to the caller, who measures the peak it is a fraction of.
  """
  cfg = build.model_config(config)
  model = DiffusionGemma(cfg)
  optimizer = training.make_optimizer(config.train)
  prompt_length, num_canvases = config.data.prompt_length, config.data.num_canvases
  batch_size = batch_size or config.train.batch_size
  length = prompt_length + num_canvases * cfg.canvas_length
  tokens = jax.random.randint(jax.random.key(0), (batch_size, length), 0, cfg.vocab_size, jnp.int32)
  batch = {"tokens": tokens, "prompt_length": jnp.full((batch_size,), prompt_length, jnp.int32)}
  state = training.create_train_state(model, optimizer, seed=config.train.seed, prompt_length=prompt_length)
  step = training.make_train_step(model, optimizer, build.loss(config), num_canvases=num_canvases)

  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_seconds = time.perf_counter() - start
  flops = compiled_cost(compiled)["flops"]
  holder = {"state": state}

  def run():  # the state is donated: every call continues from the previous one's
    holder["state"], metrics = compiled(holder["state"], batch)
    return metrics

  timing = time_call(run, repeats=repeats)
  seconds = timing.median
  return {"batch_size": batch_size, "sequence_length": length, "tokens_per_step": batch_size * length,
          "seconds_per_step": seconds, "compile_seconds": compile_seconds,
          "tokens_per_second": batch_size * length / seconds, "flops_per_step": flops,
          "achieved_gflops": flops / seconds / 1e9,
          "parameters": sum(x.size for x in jax.tree.leaves(holder["state"].params)),
          "final_loss": float(timing.output["loss"])}


def moe_against_dense(cfg: ModelConfig, tokens: int, repeats: int = 3, seed: int = 0) -> dict[str, float]:
  """Median seconds of the model's MoE layer (router + experts of `cfg.moe_impl`) against a dense GeGLU
  MLP with the same active parameters (width top_k x expert width), on `tokens` random tokens; the
  routing is the model's, from a random router (realistic, unbalanced groups)."""
  x = jax.random.normal(jax.random.key(seed), (tokens, cfg.hidden_size))
  router, experts = moe.Router(cfg), moe.Experts(cfg)
  router_vars = router.init(jax.random.key(seed + 1), x)
  weights, chosen = router.apply(router_vars, x)
  expert_vars = experts.init(jax.random.key(seed + 2), x, weights, chosen)
  layer = jax.jit(lambda rv, ev, h: experts.apply(ev, h, *router.apply(rv, h)))
  mlp = layers.FeedForward(cfg.hidden_size, cfg.top_k * cfg.moe_intermediate_size, jnp.float32, jnp.float32)
  mlp_vars = mlp.init(jax.random.key(seed + 3), x[None])
  moe_s = time_call(layer, router_vars, expert_vars, x, repeats=repeats).median
  dense_s = time_call(jax.jit(mlp.apply), mlp_vars, x[None], repeats=repeats).median
  return {"tokens": tokens, "moe_seconds": moe_s, "dense_same_active_seconds": dense_s,
          "moe_over_dense": moe_s / dense_s, "impl": cfg.moe_impl, "experts": cfg.num_experts,
          "top_k": cfg.top_k}

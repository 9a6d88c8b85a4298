"""Measuring helpers shared by the benchmark scripts: XLA cost analysis, the matmuls of a step one at a time,
and the measurements more than one script reports (the train step, the MoE layer against a dense MLP, a
denoising step taken apart, ours against transformers' `generate` on one random model, batching's runs), with
the useful FLOPs of a pass, a generation and a train step counted from the model's shapes. The timer, the
in-run machine peaks and a result's provenance are `diffusiongemma.timing` (shared with `projects/`),
re-exported here under their old names.
"""

from __future__ import annotations

import math
import pathlib
import time
from collections.abc import Callable

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np

from diffusiongemma import build
from diffusiongemma import timing
from diffusiongemma import training
from diffusiongemma.model import DiffusionGemma, ModelConfig
from diffusiongemma.model import layers
from diffusiongemma.model import moe
from diffusiongemma.model.flops import denoiser_flops, encoder_flops, generation_flops, train_step_flops  # noqa: F401 (re-exported)
from diffusiongemma.timing import Timing, alternate, matmul_peak_flops, provenance, read_bandwidth, time_call  # noqa: F401 (re-exported)


def matmuls_alone(fn: Callable, *args, repeats: int = 5) -> dict[str, float]:
  """The matmuls of `fn(*args)` run one at a time: every `dot_general` of its jaxpr (inside nested calls
  too; inside a `scan`, once per iteration) jitted by itself on random operands of the same shapes and
  dtypes, the fastest of `repeats` runs, summed: what `fn` would take under XLA's kernels at these shapes
  if everything but its matmuls were free and no two ran at once. Dots under a `cond` or a `while` run a
  number of times known only at run time: left out, counted in `conditional_dots`.

  Returns {seconds, flops, dots, distinct (each timed once), conditional_dots}.
  """
  counts: dict[tuple, int] = {}
  conditional, flops = 0, 0.0

  def walk(jaxpr, times: int, known: bool):
    nonlocal conditional, flops
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        if known:
          p, (lhs, _) = eqn.params, eqn.invars
          key = (tuple((tuple(v.aval.shape), v.aval.dtype) for v in eqn.invars), p["dimension_numbers"],
                 p.get("precision"), p.get("preferred_element_type"))
          counts[key] = counts.get(key, 0) + times
          contracted = math.prod(lhs.aval.shape[d] for d in p["dimension_numbers"][0][0])
          flops += times * 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted
        else:
          conditional += times
      inner = times * eqn.params["length"] if eqn.primitive.name == "scan" else times
      inner_known = known and eqn.primitive.name not in ("cond", "while")
      for sub in jax_core.jaxprs_in_params(eqn.params):
        walk(sub, inner, inner_known)

  walk(jax.make_jaxpr(fn)(*args).jaxpr, 1, True)
  seconds = 0.0
  for (operands, dims, precision, out_dtype), n in counts.items():
    (lhs_shape, lhs_dtype), (rhs_shape, rhs_dtype) = operands
    lhs = jax.random.normal(jax.random.key(0), lhs_shape).astype(lhs_dtype)
    rhs = jax.random.normal(jax.random.key(1), rhs_shape).astype(rhs_dtype)
    dot = jax.jit(lambda a, b, dims=dims, precision=precision, out_dtype=out_dtype: jax.lax.dot_general(
        a, b, dims, precision=precision, preferred_element_type=out_dtype))
    seconds += n * time_call(dot, lhs, rhs, repeats=repeats).best
  return {"seconds": seconds, "flops": flops, "dots": float(sum(counts.values())),
          "distinct": float(len(counts)), "conditional_dots": float(conditional)}


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


def step_breakdown(sampler, params, prompts, repeats: int = 3, matmuls: bool = True) -> dict[str, float]:
  """Seconds of the parts of one denoising step of `sampler` at this batch, each jitted alone on the
  state after a first step (so that self-conditioning is on): `denoiser` the pass from canvas to final
  hidden states; `head` the vocabulary head (LM head, soft embedding, statistics, streamed);
  `step` the whole `steps.denoise_step` (those, the draw, acceptance, re-noising, stopping). Also, for
  comparison, the bare LM head (logits and softcap, no statistics) and the head's two matmuls bare (those
  logits, then weighted by themselves into embedding rows: the soft embedding's matmul), the step's matmuls
  run one at a time (`matmuls_alone`: `step_matmuls_alone_seconds`, their FLOPs, how many, and how many
  under a `cond` left out; skipped when not `matmuls`), and XLA's FLOPs of denoiser + head."""
  from diffusiongemma.sampling import prompts as prompts_lib  # pylint: disable=g-import-not-at-top
  from diffusiongemma.sampling import steps, vocab  # pylint: disable=g-import-not-at-top
  model, rules = sampler.model, sampler.rules
  cfg = model.config
  variables = prompts_lib.variables(params)
  b, c = prompts.shape[0], cfg.canvas_length
  prompts = jnp.asarray(prompts, jnp.int32)
  cache = jax.jit(lambda v, p: sampler.encode(v, p, model.init_cache(b, p.shape[1])))(variables, prompts)
  keys = jax.random.split(jax.random.key(0), b)
  start, step_keys = sampler.start_canvas(keys, 0)
  state = steps.init_state(rules, start, jnp.zeros((b,), bool), cfg.hidden_size, cfg.param_dtype)
  step = jax.jit(lambda v, cc, s: steps.denoise_step(rules, sampler.denoiser(v, cc), s, step_keys))
  state = jax.block_until_ready(step(variables, cache, state))
  temperature = steps.temperature(rules, rules.max_denoising_steps - 1)
  uniforms = vocab.uniforms(step_keys, c)
  body = jax.jit(lambda v, cc, s: sampler.denoiser(v, cc).hidden(s.canvas, s.sc_embedding, s.has_sc,
                                                                 s.done))
  hidden = body(variables, cache, state)
  head = jax.jit(lambda v, h: sampler.head(model.apply(v, method=model.embedding_table), h, temperature,
                                           uniforms))
  table = lambda v: model.apply(v, method=model.embedding_table)
  logits = lambda v, h: layers.head_logits(h, table(v), jnp.dtype(cfg.dtype), cfg.final_logit_softcap)
  bare = jax.jit(logits)
  pair = jax.jit(lambda v, h: layers.weighted_rows(logits(v, h), table(v)))  # both matmuls, no statistics
  out = {}
  for name, fn, args in (("denoiser", body, (variables, cache, state)), ("head", head, (variables, hidden)),
                         ("bare_lm_head", bare, (variables, hidden)), ("bare_head_matmuls", pair, (variables, hidden)),
                         ("step", step, (variables, cache, state))):
    out[f"{name}_seconds"] = time_call(fn, *args, repeats=repeats).best
  if matmuls:
    alone = matmuls_alone(step, variables, cache, state)
    out.update(step_matmuls_alone_seconds=alone["seconds"], step_matmul_flops=alone["flops"],
               step_dots=alone["dots"], step_conditional_dots=alone["conditional_dots"])
  out["xla_flops"] = cost(body, variables, cache, state)["flops"] + cost(head, variables, hidden)["flops"]
  out["useful_flops"] = denoiser_flops(cfg, b, int(prompts.shape[1]))
  return out


# The random DiffusionGemma sizes of the side-by-side runs (`vs_transformers`, `accelerator`): transformers
# config fields, then (prompt length, new tokens).
_COMMON = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
               num_global_key_value_heads=1)
SIZES = {
    "tiny": (dict(hidden_size=64, num_hidden_layers=2, **{**_COMMON, "head_dim": 16, "global_head_dim": 32},
                  sliding_window=16, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                  top_k_experts=2, vocab_size=512, canvas_length=32), (16, 64)),
    "small": (dict(hidden_size=256, num_hidden_layers=6, **_COMMON, sliding_window=128, intermediate_size=512,
                   moe_intermediate_size=256, num_experts=16, top_k_experts=2, vocab_size=8192,
                   canvas_length=256), (64, 256)),
    "realistic": (dict(hidden_size=1536, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=256, global_head_dim=512, num_global_key_value_heads=2, sliding_window=1024,
                       intermediate_size=1536, moe_intermediate_size=384, num_experts=32, top_k_experts=4,
                       vocab_size=262_144, canvas_length=256), (64, 256)),
}


def transformers_model(folder: pathlib.Path, fields: dict, dtype: str, threads: int = 2,
                       released_layers: bool = False):
  """(hf_reference, the random transformers DiffusionGemma of `fields` on its device in `dtype`, the torch
  device name): built and saved into `folder` (`hf_reference.make_tiny_hf`; with `released_layers`, the
  released layer pattern), or loaded when `folder` already holds one. CUDA when torch has it, else the CPU
  with `threads` threads."""
  import torch  # pylint: disable=g-import-not-at-top  (the `hf` extra)
  from benchmarks import hf_reference  # pylint: disable=g-import-not-at-top
  if (folder / "config.json").exists():
    model = hf_reference.load_hf(folder, attn_implementation="sdpa")
  else:
    layer_types = hf_reference.released_layer_types(fields["num_hidden_layers"]) if released_layers else None
    model = hf_reference.make_tiny_hf(folder, seed=0, attn_implementation="sdpa", layer_types=layer_types,
                                      **fields)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  if device == "cpu":
    torch.set_num_threads(threads)
  return hf_reference, model.to(device=device, dtype=getattr(torch, dtype)), device


def passes_per_canvas(out) -> float:
  """Mean denoiser passes over the canvases a generation ran (`SampleOutput.canvas_passes` > 0)."""
  passes = np.asarray(out.canvas_passes)
  return float(passes[passes > 0].mean())


def side_by_side(sampler, params, hf_reference, hf_model, prompts, hf_kwargs, new_tokens, repeats) -> dict:
  """One figure: ours and transformers' generate alternated (`alternate`) on the same prompts: seconds
  (median; `_best_seconds` the fastest), every run, compile seconds, tokens/s of each (median and best), passes
  per canvas, and `ratio` (ours / transformers tokens/s, medians; `best_ratio` of the fastest runs)."""
  ours = lambda: sampler.generate(params, prompts, jax.random.key(1), new_tokens)
  theirs = lambda: hf_reference.generate(hf_model, prompts, **hf_kwargs)
  timings = dict(zip(("ours", "hf"), alternate(ours, theirs, repeats)))
  b = prompts.shape[0]
  row = {"batch_size": int(b), "vocab_chunk": sampler.head.chunk_for(b * sampler.model.config.canvas_length)}
  for name, t in timings.items():
    row.update({f"{name}_seconds": t.median, f"{name}_best_seconds": t.best, f"{name}_runs": t.runs,
                f"{name}_compile_seconds": t.compile_seconds, f"{name}_tokens_per_second": b * new_tokens / t.median,
                f"{name}_best_tokens_per_second": b * new_tokens / t.best})
  row["ours_passes_per_canvas"] = passes_per_canvas(timings["ours"].output)
  canvases = -(-new_tokens // sampler.model.config.canvas_length)  # every row runs them all: no stop tokens
  row["hf_passes_per_canvas"] = float(np.mean(new_tokens / timings["hf"].output[1])) / canvases
  row["ratio"] = row["ours_tokens_per_second"] / row["hf_tokens_per_second"]
  row["best_ratio"] = row["ours_best_tokens_per_second"] / row["hf_best_tokens_per_second"]
  row["ours_canvas_passes"] = np.asarray(timings["ours"].output.canvas_passes).max(0).tolist()
  return row


# benchmarks.batching's shapes: (prompt bucket, reply canvases) of the serving grid's programs.
SERVING_SHAPES = ((64, 2), (256, 8), (1024, 8), (1024, 64))


def _ignore(event) -> None:
  del event


def shape_call(sampler, variables, prompt: int, canvases: int, batch_size: int, rng: np.random.Generator):
  """One call of `shape_runs` (a function of nothing): `generate` on `batch_size` random prompts of the full
  bucket, no stop token, every pass streamed to a host listener that does nothing (as the server streams).
  Returns its tokens, each row's denoiser passes and each canvas's."""
  vocab = sampler.model.config.vocab_size
  tokens = rng.integers(vocab // 2, vocab, (batch_size, prompt)).astype(np.int32)

  def run():
    out = sampler.generate(variables, tokens, jax.random.key(0), canvases * sampler.canvas_length,
                           prompt_lengths=np.full((batch_size,), prompt, np.int32),
                           temperature_scale=np.ones((batch_size,), np.float32), on_pass=_ignore)
    return out.tokens, out.num_denoiser_passes, out.canvas_passes
  return run


def shape_runs(sampler, variables, prompt: int, canvases: int, batch_sizes, repeats: int) -> list[dict]:
  """`benchmarks.batching`'s rows at one shape, one per batch size: seconds of one `shape_call` (best of
  `repeats`, alternated), rows per second, that rate over batch 1's, the denoiser passes a row took, and the
  passes of each canvas (the batch's most)."""
  rng = np.random.default_rng(0)
  timings = timing.alternate_all({b: shape_call(sampler, variables, prompt, canvases, b, rng) for b in batch_sizes},
                                 repeats)
  one = timings[1].best
  return [{"prompt_bucket": prompt, "canvases": canvases, "batch_size": b, "seconds": t.best,
           "rows_per_second": b / t.best, "over_batch_1": b * one / t.best,
           "passes_per_row": float(np.mean(t.output[1])),
           "canvas_passes": np.asarray(t.output[2]).max(0).tolist()} for b, t in timings.items()]

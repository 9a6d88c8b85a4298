r"""What one pass costs at batch 1: the causal encoder (an AR step is one token of it, a speculative check a
block) and the denoiser, over N tokens after a prompt held in the KV cache, for each way of running the
experts, taken in turns and best of `--repeats`.

  python -m benchmarks.pass_cost --output=results/pass_cost_text.json      # the shipped text model
  python -m benchmarks.pass_cost --workdir=W --tokens=1,4,16 --output=O    # a training run

`--moe`: `grouped` (the CPU default, with `moe.grouped_plan` choosing gathered weights, every expert, or
the slab and tiles by the token count), `slab` (`grouped` always on its slab and tiles past T*k <= E: what
it ran before `moe.grouped_plan`), `dense` (every expert on every token). JSON: weights, settings, machine
(`measure.provenance`, matmul_peak_gflops, load_average_after), and `passes`: per way, per token count,
the plan, encode_ms and denoise_ms (best and median).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import statistics
import time
from unittest import mock

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from benchmarks import measure
from diffusiongemma.model import moe
from diffusiongemma.model.attention import KVCache
from projects.text import runs

_OUTPUT = flags.DEFINE_string("output", None, "Where the JSON goes.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir instead of the shipped text weights.")
_TOKENS = flags.DEFINE_list("tokens", ["1", "4", "8", "16", "32", "64"], "Tokens per pass.")
_MOE = flags.DEFINE_list("moe", ["grouped", "slab", "dense"], "Ways of running the experts.")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 64, "Tokens in the cache before the pass.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls of each (way, tokens, pass), in turns.")
_MAX_LOAD = flags.DEFINE_float("max_load", 0.5, "Refuse to time above this 1-minute load average.")
_ROOT = pathlib.Path(__file__).resolve().parent.parent
_MOE_IMPL = {"grouped": "grouped", "slab": "grouped", "dense": "dense"}


def _slab_plan(num_tokens, top_k, num_experts):
  return "gathered" if num_tokens * top_k <= num_experts else "slab"


def main(argv):
  del argv
  machine = measure.provenance(_ROOT)
  if machine["load_average"][0] > _MAX_LOAD.value:
    raise SystemExit(f"Refusing to time: 1-minute load average {machine['load_average'][0]:.2f} > "
                     f"{_MAX_LOAD.value}. Wait for a quiet machine.")
  unknown = sorted(set(_MOE.value) - set(_MOE_IMPL))
  if unknown:
    raise app.UsageError(f"--moe={','.join(unknown)} is unknown; expected some of {sorted(_MOE_IMPL)}.")
  run = runs.load(_WORKDIR.value)
  tokens = [int(n) for n in _TOKENS.value]
  cfg = run.model.config
  calls = {}
  for way in _MOE.value:
    model = run.model.clone(config=dataclasses.replace(cfg, moe_impl=_MOE_IMPL[way]))
    patch = mock.patch.object(moe, "grouped_plan", _slab_plan) if way == "slab" else contextlib.nullcontext()
    with patch:  # the plan is read while tracing: the first call of each program
      # The weights are arguments, as in the samplers: closed over, XLA folds them into the program as
      # constants laid out for each matmul, which a real generation does not get (~0.5-3 ms a pass here).
      encode = jax.jit(lambda v, t, c, model=model: model.apply(v, t, c, method=model.encode))
      denoise = jax.jit(lambda v, t, c, model=model: model.apply(v, t, c, method=model.denoise))
      prompt = jnp.full((1, _PROMPT.value), 5, jnp.int32)
      _, cache = encode(run.variables, prompt, KVCache.empty(cfg, 1, _PROMPT.value + max(tokens)))
      for n in tokens:
        block = jnp.full((1, n), 7, jnp.int32)
        for name, fn in (("encode", encode), ("denoise", denoise)):
          jax.block_until_ready(fn(run.variables, block, cache))  # compile
          calls[way, n, name] = (fn, block, cache)
  times = {key: [] for key in calls}
  for _ in range(_REPEATS.value):
    for key, (fn, block, cache) in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(run.variables, block, cache))
      times[key].append(time.perf_counter() - start)
  passes = {}
  for way in _MOE.value:
    plan = _slab_plan if way == "slab" else moe.grouped_plan
    passes[way] = {str(n): {"plan": plan(n, cfg.top_k, cfg.num_experts) if _MOE_IMPL[way] == "grouped" else "dense",
                            **{f"{name}_ms": 1e3 * min(times[way, n, name]) for name in ("encode", "denoise")},
                            **{f"{name}_ms_median": 1e3 * statistics.median(times[way, n, name])
                               for name in ("encode", "denoise")}}
                   for n in tokens}
  machine.update(matmul_peak_gflops=measure.matmul_peak_flops() / 1e9, load_average_after=list(os.getloadavg()))
  result = {"weights": run.source, "settings": {"tokens": tokens, "moe": _MOE.value, "prompt_tokens": _PROMPT.value,
                                                "repeats": _REPEATS.value, "batch_size": 1,
                                                "num_experts": cfg.num_experts, "top_k": cfg.top_k},
            "machine": machine, "passes": passes}
  out = pathlib.Path(_OUTPUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(f"{run.source}; batch 1, {_PROMPT.value} tokens in the cache; best of {_REPEATS.value}, ms")
  print("| tokens | " + " | ".join(f"{way} encode | {way} denoise" for way in _MOE.value) + " |")
  for n in tokens:
    print(f"| {n} | " + " | ".join(f"{passes[way][str(n)]['encode_ms']:.2f} | {passes[way][str(n)]['denoise_ms']:.2f}"
                                   for way in _MOE.value) + " |")
  print(f"wrote {out}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["output"])
  app.run(main)

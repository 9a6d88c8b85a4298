r"""Reusing settled positions (`SamplerConfig.reuse="settled"`) against exact decoding, on trained models.

- Sudoku (the shipped weights, held-out 36-40-clue puzzles of the validation stream, clues held): solve
  rate, passes per puzzle and puzzles/s of exact decoding and of reuse at each `--refresh` (0: only the
  first pass is whole) and `--delay` (passes computing a fixed position before it settles), at each of
  `--sudoku_batch_sizes`;
- text (the shipped text weights or `--text_workdir`, the prompts of `--prompts`, 128 new tokens): tokens
  per pass, judged perplexity (the same weights' AR mode) and tokens/s of exact decoding and of reuse at
  each refresh and delay, at each of `--text_batch_sizes`, and the canvas positions the passes computed
  (`SampleOutput.denoised_positions`: their share of the canvas, and exact's over the variant's, the
  speedup if a pass cost its positions alone);
- a pass's cost against how much of the canvas it recomputes: one pass at each width the sampler may take
  (`Sampler.reuse_widths`), timed alone, for both models at batch 1.
Exact and reuse runs are alternated `--repeats` times (best kept). The machine must be quiet (`--max_load`,
as `benchmarks.text_vs_ar`); the JSON records the load averages, a matmul peak and every setting.

  python -m benchmarks.reuse --output=results/reuse.json
"""

from __future__ import annotations

import json
import os
import pathlib

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma import build
from diffusiongemma import timing
from diffusiongemma.model.attention import KVCache
from projects.sudoku import data as sudoku
from projects.sudoku import solve
from projects.sudoku import weights as sudoku_weights
from projects.text import runs

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_OUTPUT = flags.DEFINE_string("output", None, "Where the JSON goes.")
_REFRESH = flags.DEFINE_list("refresh", ["0", "4"], "reuse_refresh values measured (0: no refresh).")
_DELAY = flags.DEFINE_list("delay", ["1", "2"], "reuse_delay values measured (each with each refresh).")
_PUZZLES = flags.DEFINE_integer("puzzles", 200, "Held-out Sudoku puzzles.")
_SUDOKU_BATCHES = flags.DEFINE_list("sudoku_batch_sizes", ["1", "16"], "Sudoku batch sizes.")
_PROMPTS = flags.DEFINE_string("prompts", str(runs.PROMPTS / "validation.jsonl"), "Text prompts (JSONL).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 32, "Text prompts used.")
_TEXT_WORKDIR = flags.DEFINE_string("text_workdir", None, "A text training workdir instead of the shipped one.")
_TEXT_BATCHES = flags.DEFINE_list("text_batch_sizes", ["1", "8"], "Text batch sizes.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs of each variant (alternated, best kept).")
_MAX_LOAD = flags.DEFINE_float("max_load", 0.5, "Refuse to time above this 1-minute load average.")
_ALLOW_LOAD = flags.DEFINE_bool("allow_load", False, "Time on a loaded machine anyway (warned in the JSON).")


def _variants(sampler) -> dict:
  out = {"exact": sampler}
  for d in map(int, _DELAY.value):
    for k in map(int, _REFRESH.value):
      name = f"reuse, refresh {k}" + (f", delay {d}" if d != 1 else "")
      out[name] = sampler.replace(config=sampler.config.replace(reuse="settled", reuse_refresh=k, reuse_delay=d))
  return out


def sudoku_runs(config, variables, provenance, batch_sizes, repeats) -> list[dict]:
  puzzles, _ = sudoku.generate_many(_PUZZLES.value, (36, 37, 38, 39, 40), seed=0, split="validation")
  out = []
  for b in batch_sizes:
    variants = _variants(build.sampler(config))
    calls = {name: (lambda s=s: solve.solve(s, variables, puzzles, batch_size=b).summary())
             for name, s in variants.items()}
    for name, t in timing.alternate_all(calls, repeats).items():
      seconds, summary = t.best, t.output
      out.append({"batch_size": b, "variant": name, "seconds": seconds, "puzzles_per_s": len(puzzles) / seconds,
                  **{k: summary[k] for k in ("solve_rate", "passes_per_puzzle", "tokens_per_forward")},
                  "sampler": variants[name].settings(), "weights": f"shipped Sudoku, step {provenance['step']}"})
  return out


def text_runs(run: runs.TextModel, batch_sizes, repeats) -> list[dict]:
  prompts = runs.read_prompts(_PROMPTS.value, run.tokenizer, limit=_NUM_PROMPTS.value)
  out = []
  for b in batch_sizes:
    variants = _variants(run.sampler())
    calls = {name: (lambda s=s: runs.diffusion(s, run.variables, prompts, 128, b)) for name, s in variants.items()}
    for name, t in timing.alternate_all(calls, repeats).items():
      seconds, (continuations, passes) = t.best, t.output
      q = runs.quality(run, prompts, continuations)
      positions = int(runs.denoised_positions(variants[name], run.variables, prompts, 128, b).sum())
      num_passes = max(int(passes.sum()), 1)
      out.append({"batch_size": b, "variant": name, "seconds": seconds, "tokens_per_second": q["new_tokens"] / seconds,
                  "tokens_per_pass": q["new_tokens"] / num_passes, **q, "denoised_positions": positions,
                  "recomputed_fraction": positions / num_passes / variants[name].canvas_length,
                  "sampler": variants[name].settings(), "weights": run.source})
  return out


def pass_cost(sampler, variables, prompt_length: int) -> list[dict]:
  """Seconds of one reusing pass at each width the sampler may take, batch 1 (prompt cache of
  `prompt_length` random tokens)."""
  model, mc = sampler.model, sampler.model.config
  c = mc.canvas_length
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, mc.vocab_size - 1, (1, prompt_length)), jnp.int32)
  cache = model.apply(variables, tokens, KVCache.empty(mc, 1, prompt_length), method=model.encode)[1]
  layers = [mc.layer_dims(i) for i in range(mc.num_layers)]
  canvas_kv = tuple(jnp.zeros((1, c, k, h), mc.dtype) for k, h in layers)
  out = []
  for width in sampler.reuse_widths:
    fn = jax.jit(lambda t, s, w=width: model.apply(
        variables, t[:, :w], s[:, :w], cache, canvas_kv, canvas_kv, method=model.denoise_subset)[0])
    slots = jnp.arange(c)[None]
    t = timing.time_call(fn, jnp.zeros((1, c), jnp.int32), slots, repeats=20)
    out.append({"width": width, "recomputed_fraction": width / c, "seconds": t.best})
  return out


def main(argv):
  del argv
  machine = timing.provenance(_ROOT)
  warnings = timing.loaded_machine(machine, _MAX_LOAD.value, _ALLOW_LOAD.value)
  repeats = _REPEATS.value
  sudoku_config, sudoku_variables, provenance = sudoku_weights.load(sudoku_weights.DIFFUSION)
  run = runs.load(_TEXT_WORKDIR.value)
  result = {"sudoku": sudoku_runs(sudoku_config, sudoku_variables, provenance,
                                  [int(b) for b in _SUDOKU_BATCHES.value], repeats),
            "text": text_runs(run, [int(b) for b in _TEXT_BATCHES.value], repeats)}
  result["pass_cost"] = {"sudoku": pass_cost(build.sampler(sudoku_config), sudoku_variables, 82),
                         "text": pass_cost(run.sampler(), run.variables, 64)}
  for name in ("sudoku", "text"):
    rows = result[name]
    for row in rows:
      exact = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["variant"] == "exact")
      row["speedup_over_exact"] = exact["seconds"] / row["seconds"]
      if "denoised_positions" in row:  # the speedup if a pass cost its positions alone
        row["positions_speedup"] = exact["denoised_positions"] / row["denoised_positions"]
  machine.update(matmul_peak_gflops=timing.matmul_peak_flops() / 1e9, load_average_after=list(os.getloadavg()),
                 warnings=warnings)
  result["machine"] = machine
  result["settings"] = {"refresh": [int(k) for k in _REFRESH.value], "delay": [int(d) for d in _DELAY.value],
                        "puzzles": _PUZZLES.value,
                        "prompts": _PROMPTS.value, "num_prompts": _NUM_PROMPTS.value, "repeats": repeats}
  out = pathlib.Path(_OUTPUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  for row in result["sudoku"]:
    print(f"sudoku b={row['batch_size']} {row['variant']}: solved {row['solve_rate']:.1%}, "
          f"{row['passes_per_puzzle']:.1f} passes, {row['puzzles_per_s']:.1f} puzzles/s, "
          f"{row['speedup_over_exact']:.2f}x exact")
  for row in result["text"]:
    print(f"text b={row['batch_size']} {row['variant']}: {row['tokens_per_pass']:.2f} tokens/pass, perplexity "
          f"{row['judged_perplexity']:.3f}, {row['tokens_per_second']:.0f} tok/s, {row['speedup_over_exact']:.2f}x exact")
  for name, rows in result["pass_cost"].items():
    print(name, ", ".join(f"width {r['width']}: {1000 * r['seconds']:.2f} ms" for r in rows))
  print(f"wrote {out}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["output"])
  app.run(main)

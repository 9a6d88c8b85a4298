r"""float32 against bfloat16 and int8 weights on a trained model: the Sudoku solver's solve rate, the share
of cells written as the float32 model writes them, the weights' bytes, and the time.

  python -m benchmarks.precision --output=results/precision_sudoku.json
  python -m benchmarks.precision --text_workdir=W --output=results/precision_text.json   # a text run

With `--text_workdir` (a training run of text, e.g. configs/small.py) the model continues validation
prompts instead (`build.generative_eval`'s), float32 against bfloat16 only: the share of new tokens written
as float32 writes them (same prompts, same sampling keys), of the first denoising step's argmax canvas,
what each wrote as judged by the float32 model's own encoder (perplexity, unigram entropy: a sample that
differs can still be as good), and the time at `--batch_size` and batch 1.

Every variant solves the same held-out puzzles with the same sampling keys (the randomness is common to
all, so a difference is the numerics'). Variants: `float32`; `bfloat16` (weights and compute);
`int8` (int8 matmul weights, float32 compute); `int8 bfloat16`. The timed solves alternate between the
variants, `--repeats` rounds, median reported; the JSON records the load average and a matmul peak.
"""

import json
import os
import pathlib
import statistics

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from benchmarks import measure
from diffusiongemma import build
from diffusiongemma import training
from diffusiongemma.evaluation import generative
from diffusiongemma.model import quantize
from diffusiongemma.sampling import stats
from projects.sudoku import runs as sudoku_runs
from projects.sudoku import solve
from projects.sudoku import weights as shipped

_WORKDIR = flags.DEFINE_string("workdir", None, "A Sudoku diffusion run (default: the shipped weights).")
_OUTPUT = flags.DEFINE_string("output", None, "The JSON to write (default: results/precision_sudoku.json, "
                              "or results/precision_text.json with --text_workdir).")
_PER_LEVEL = flags.DEFINE_integer("per_level", 40, "Held-out puzzles per clue count (36-40 clues).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Puzzles per sampler call.")
_BATCH1_PUZZLES = flags.DEFINE_integer("batch1_puzzles", 40, "Puzzles solved one at a time for the batch-1 time.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds over all variants (alternating).")
_SEED = flags.DEFINE_integer("seed", 0, "Puzzle stream and sampling seed.")
_TEXT_WORKDIR = flags.DEFINE_string("text_workdir", None, "A text training run: measure it instead.")
_TEXT_SAMPLES = flags.DEFINE_integer("text_samples", 32, "Validation prompts continued (--text_workdir).")

VARIANTS = {  # name: (compute and parameter dtype, quantize)
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    "int8 bfloat16": ("bfloat16", "int8"),
}


def variant(config: ml_collections.ConfigDict, params, dtype: str, quantize_name: str):
  """(sampler, variables) of the float32 `params` of `config` in `dtype`, quantised or not."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.train.compute_dtype = dtype
  config.model.param_dtype = dtype
  float_cfg = build.model_config(config)
  cast = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
  if quantize_name != "none":
    cast = quantize.quantize_params(cast, float_cfg)
  config.model.quantize = quantize_name
  return build.sampler(config), {"params": cast}


def _bytes(tree) -> int:
  return int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))


def _text(workdir: str) -> dict:
  """float32 against bfloat16 on a text run: tokens written alike, first-step argmax, the samples judged, time."""
  config = build.workdir_config(workdir)
  if config is None:
    raise app.UsageError(f"--text_workdir={workdir!r} has no config.json: not a training run's folder.")
  evaluation = build.generative_eval(config, workdir, num_samples=_TEXT_SAMPLES.value,
                                     batch_size=_BATCH_SIZE.value, seed=_SEED.value)
  params, prompts = evaluation.variables["params"], evaluation.prompts
  batch, new_tokens = min(_BATCH_SIZE.value, len(prompts)), evaluation.max_new_tokens
  names = ("float32", "bfloat16")
  runs = {name: variant(config, params, name, "none") for name in names}
  rows = {name: [] for name in runs}
  first_argmax = {}
  for name, (sampler, variables) in runs.items():
    for i, start in enumerate(range(0, len(prompts), batch)):
      out = sampler.generate(variables, prompts[start:start + batch], jax.random.key(_SEED.value + i),
                             new_tokens, return_trace=True)
      rows[name].append(np.asarray(out.tokens))
      first_argmax.setdefault(name, []).append(np.asarray(out.trace.argmax)[0, 0])
  tokens = {name: np.concatenate(r) for name, r in rows.items()}
  argmax = {name: np.concatenate(r) for name, r in first_argmax.items()}
  sampler = runs["float32"][0]
  written = {name: [stats.new_tokens(row, sampler.stop_tokens, sampler.model.config.pad_id) for row in t]
             for name, t in tokens.items()}
  judged = {name: generative.score(prompts, c, evaluation.judges) for name, c in written.items()}  # float32 judge
  call = lambda name, rows_: runs[name][0].generate(runs[name][1], rows_, jax.random.key(_SEED.value), new_tokens)
  timed = {key: dict(zip(names, measure.alternate(*(lambda n=n, p=p: call(n, p).tokens for n in names),
                                                  _REPEATS.value)))  # alternated; each compiled first
           for key, p in (("batch", prompts[:batch]), ("batch_1", prompts[:1]))}
  times = {name: {key: timed[key][name].runs for key in timed} for name in names}
  median = lambda name, key: statistics.median(times[name][key])
  return {
      "settings": {"workdir": workdir, "weights": evaluation.source, "prompts": int(len(prompts)),
                   "prompt_length": int(prompts.shape[1]), "max_new_tokens": new_tokens, "batch_size": batch,
                   "repeats": _REPEATS.value, "seed": _SEED.value, "sampler": runs["float32"][0].settings()},
      "new_tokens_equal_to_float32": float((tokens["bfloat16"] == tokens["float32"]).mean()),
      "rows_equal_to_float32": float((tokens["bfloat16"] == tokens["float32"]).all(axis=1).mean()),
      "first_step_argmax_equal": float((argmax["bfloat16"] == argmax["float32"]).mean()),
      "judged": judged,
      "seconds_batch": {name: median(name, "batch") for name in runs},
      "seconds_batch_1": {name: median(name, "batch_1") for name in runs},
      "speed_over_float32_batch": median("float32", "batch") / median("bfloat16", "batch"),
      "speed_over_float32_batch_1": median("float32", "batch_1") / median("bfloat16", "batch_1"),
      "runs_s": times,
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  load_before = list(os.getloadavg())
  if _TEXT_WORKDIR.value:
    report = _text(_TEXT_WORKDIR.value)
    report["machine"] = {"load_average_before": load_before,
                         "matmul_peak_gflops": measure.matmul_peak_flops(1024) / 1e9,
                         **measure.provenance(pathlib.Path(__file__).parent.parent),
                         "load_average_after": list(os.getloadavg())}
    _write(report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("settings", "machine", "runs_s")}, indent=1))
    return
  config, variables, source = sudoku_runs.load(_WORKDIR.value, shipped.DIFFUSION)
  puzzles = sudoku_runs.held_out_sets(_PER_LEVEL.value, _SEED.value)["36-40"]
  runs = {name: variant(config, variables["params"], dtype, q) for name, (dtype, q) in VARIANTS.items()}
  solve_all = lambda name, batch, rows: solve.solve(*runs[name], rows, batch_size=batch, seed=_SEED.value)
  results = {name: solve_all(name, _BATCH_SIZE.value, puzzles) for name in runs}
  times = {name: {"batch": [], "batch_1": []} for name in runs}
  for _ in range(_REPEATS.value):
    for name in runs:
      times[name]["batch"].append(solve_all(name, _BATCH_SIZE.value, puzzles).run_s)
      times[name]["batch_1"].append(solve_all(name, 1, puzzles[:_BATCH1_PUZZLES.value]).run_s)
  reference = results["float32"]
  blanks = puzzles == 0
  out = {}
  for name, result in results.items():
    same = result.solutions == reference.solutions
    out[name] = {
        "dtype": VARIANTS[name][0], "quantize": VARIANTS[name][1],
        "solve_rate": float(result.solved.mean()), "passes_per_puzzle": float(result.passes.mean()),
        "blank_cells_equal_to_float32": float(same[blanks].mean()),
        "puzzles_equal_to_float32": float(same.all(axis=1).mean()),
        "weight_bytes": _bytes(runs[name][1]),
        "seconds_batch": statistics.median(times[name]["batch"]),
        "seconds_batch_1_per_puzzle": statistics.median(times[name]["batch_1"]) / _BATCH1_PUZZLES.value,
        "runs_s": times[name],
    }
  for name in out:
    out[name]["speed_over_float32_batch"] = out["float32"]["seconds_batch"] / out[name]["seconds_batch"]
    out[name]["speed_over_float32_batch_1"] = (out["float32"]["seconds_batch_1_per_puzzle"] /
                                               out[name]["seconds_batch_1_per_puzzle"])
  report = {
      "settings": {"weights": source, "puzzles": len(puzzles), "clues": "36-40", "batch_size": _BATCH_SIZE.value,
                   "batch1_puzzles": _BATCH1_PUZZLES.value, "repeats": _REPEATS.value, "seed": _SEED.value,
                   "sampler": runs["float32"][0].settings()},
      "machine": {"load_average_before": load_before, "matmul_peak_gflops": measure.matmul_peak_flops(1024) / 1e9,
                  **measure.provenance(pathlib.Path(__file__).parent.parent)},
      "variants": out,
  }
  report["machine"]["load_average_after"] = list(os.getloadavg())
  output = _write(report)
  for name, row in out.items():
    print(f"{name:14s} solved {row['solve_rate']:.3f} | {row['passes_per_puzzle']:.1f} passes | blank cells as "
          f"float32 {row['blank_cells_equal_to_float32']:.4f} | {row['weight_bytes'] / 1e6:.2f} MB | "
          f"x{row['speed_over_float32_batch']:.2f} (batch {_BATCH_SIZE.value}), "
          f"x{row['speed_over_float32_batch_1']:.2f} (batch 1)")
  print(f"wrote {output}")


def _write(report: dict) -> pathlib.Path:
  default = "results/precision_text.json" if _TEXT_WORKDIR.value else "results/precision_sudoku.json"
  output = pathlib.Path(_OUTPUT.value or default)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(report, indent=1, default=str))
  return output


if __name__ == "__main__":
  app.run(main)

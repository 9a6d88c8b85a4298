r"""The Sudoku recipe measured, into one JSON (every setting it ran with) and one plot.

  python -m projects.sudoku.report --workdir=W --ar_workdir=W_AR --output=results/sudoku.json

Without --workdir / --ar_workdir the shipped weights are measured. Puzzles: `--per_level` held-out puzzles
at each of 36-40 clues from the generator's validation stream (the headline set), at 30-35 clues, and at
36-40 clues from the independent symmetric generator (`other_generator`). For each decoder (block
diffusion with the run's `config.sampler`; the AR model, greedy; AR decoding of the diffusion weights
when they were trained with an AR loss) the JSON holds `solve.SolveResult.summary()` at batch 1 and at
`--batch_size` (solve rate, passes and tokens per forward, seconds per solved puzzle, puzzles/s), with
the time per solved puzzle of AR over diffusion; `batch_sweep` the same at each of `--batch_sizes` (where
AR overtakes, if it does); `acceptance` the diffusion model under each acceptance rule and threshold, and
with the clues not held; `curve` the solve rate of every checkpoint against its training seconds (the
spread over training seeds: `projects.sudoku.seeds`). Timings are meaningful on a quiet machine only:
the JSON records the load average before and after and a matmul peak measured in the run.
"""

import json
import os
import pathlib

from absl import app
from absl import flags
from absl import logging
import numpy as np

from diffusiongemma import build
from diffusiongemma import timing
from diffusiongemma import training
from diffusiongemma.diffusion import acceptance
from projects.sudoku import runs
from projects.sudoku import solve
from projects.sudoku import weights as shipped

_WORKDIR = flags.DEFINE_string("workdir", None, "The block-diffusion run (default: the shipped weights).")
_AR_WORKDIR = flags.DEFINE_string("ar_workdir", None, "The AR run (default: the shipped AR weights).")
_OUTPUT = flags.DEFINE_string("output", "results/sudoku.json", "The JSON to write (and .png beside).")
_PER_LEVEL = flags.DEFINE_integer("per_level", 40, "Held-out puzzles per clue count.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Puzzles per sampler call for the solve rates.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "4", "16", "64"], "Batch sizes timed for the crossover.")
_MARGINS = flags.DEFINE_list("margins", ["0.9", "0.99", "0.999"], "Margin thresholds compared.")
_CONFIDENCES = flags.DEFINE_list("confidences", ["0.99", "0.999", "0.9999"], "Confidence thresholds compared.")
_ENTROPY_BOUNDS = flags.DEFINE_list("entropy_bounds", ["0.01"], "Entropy bounds compared.")
_CURVE = flags.DEFINE_bool("curve", True, "Solve checkpoints (the solve rate against training time).")
_CURVE_EVERY = flags.DEFINE_integer("curve_every", 500, "Solve the checkpoints at multiples of this step, and the last.")
_CURVE_PUZZLES = flags.DEFINE_integer("curve_puzzles", 100, "Puzzles of the 36-40 set each checkpoint solves.")
_SEED = flags.DEFINE_integer("seed", 0, "Puzzle stream (validation split) and sampling seed.")


def _curve(workdir, sampler, puzzles, batch_size, seed, every) -> list[dict]:
  seconds = runs.train_seconds(workdir)
  out = []
  saved = list(training.checkpoint.saved_steps(workdir))
  for step in [s for s in saved if s % every == 0 or s == saved[-1]]:  # and the last
    variables, _ = training.load_params(workdir, step=step)
    result = solve.solve(sampler, variables, puzzles, batch_size=batch_size, seed=seed)
    known = [s for s in seconds if s <= step]
    out.append({"step": step, "train_s": seconds[max(known)] if known else None, **runs.summary(result)})
    logging.info("%s step %d: %s", workdir, step, out[-1])
  return out


def _decoders(diffusion, ar, sets, batch_size, seed) -> dict:
  """Each decoder on each set at `batch_size`, and on the headline set at batch 1."""
  out = {}
  for name, (sampler, variables) in {"diffusion": diffusion, "ar_model": ar}.items():
    row = {"settings": sampler.settings() if name == "diffusion" else {"stop_tokens": list(sampler.stop_tokens)}}
    for set_name, puzzles in sets.items():
      result = solve.solve(sampler, variables, puzzles, batch_size=batch_size, seed=seed)
      row[set_name] = {**runs.summary(result), "by_clues": solve.by_clues(puzzles, result)}
    row["36-40 batch 1"] = runs.summary(solve.solve(sampler, variables, sets["36-40"], batch_size=1, seed=seed))
    out[name] = row
    logging.info("%s: %s", name, row["36-40"])
  d, a = out["diffusion"]["36-40 batch 1"], out["ar_model"]["36-40 batch 1"]
  if d["seconds_per_solved"] and a["seconds_per_solved"]:
    out["ar_over_diffusion_seconds_per_solved_batch_1"] = a["seconds_per_solved"] / d["seconds_per_solved"]
  return out


def _batch_sweep(diffusion, ar, puzzles, batch_sizes, seed) -> list[dict]:
  rows = []
  for b in batch_sizes:
    row = {"batch_size": b}
    for name, (sampler, variables) in {"diffusion": diffusion, "ar_model": ar}.items():
      row[name] = runs.summary(solve.solve(sampler, variables, puzzles, batch_size=b, seed=seed))
    rows.append(row)
    logging.info("batch %d: %s", b, row)
  return rows


def _acceptance(sampler, variables, puzzles, batch_size, seed) -> list[dict]:
  rules = ([acceptance.Margin(float(m)) for m in _MARGINS.value] +
           [acceptance.Confidence(float(c)) for c in _CONFIDENCES.value] +
           [acceptance.EntropyBound(float(e)) for e in _ENTROPY_BOUNDS.value])
  rows = []
  for rule in rules:
    result = solve.solve(sampler.replace(acceptance=rule), variables, puzzles, batch_size=batch_size, seed=seed)
    rows.append({"acceptance": repr(rule), "hold_clues": True, **runs.summary(result)})
  free = solve.solve(sampler, variables, puzzles, batch_size=batch_size, seed=seed, hold_clues=False)
  rows.append({"acceptance": repr(sampler.acceptance), "hold_clues": False, **runs.summary(free)})
  return rows


def _plot(report, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  points = [(p["train_s"] / 60, p["solve_rate"]) for p in report["curve"] if p["train_s"] is not None]
  if points:
    left.plot(*zip(*points), marker="o", label="block diffusion")
  left.set_xlabel("training minutes (this machine)")
  left.set_ylabel("solved (36-40 clues)")
  left.grid(alpha=0.3)
  sweep = report["batch_sweep"]
  finite = lambda x: x if x and np.isfinite(x) else np.nan  # nothing solved: no point
  for name in ("diffusion", "ar_model"):
    right.plot([r["batch_size"] for r in sweep], [finite(r[name]["seconds_per_solved"]) for r in sweep],
               marker="o", label=name)
  right.set_xscale("log")
  if any(np.isfinite(finite(r[n]["seconds_per_solved"])) for r in sweep for n in ("diffusion", "ar_model")):
    right.set_yscale("log")
  right.set_xlabel("batch size")
  right.set_ylabel("seconds per solved puzzle")
  right.legend()
  right.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  load_before = list(os.getloadavg())
  config, variables, source = runs.load(_WORKDIR.value, shipped.DIFFUSION)
  ar_config, ar_variables, ar_source = runs.load(_AR_WORKDIR.value, shipped.AUTOREGRESSIVE)
  sampler = build.sampler(config)
  diffusion, ar = (sampler, variables), (build.ar_sampler(ar_config), ar_variables)
  batch, seed = _BATCH_SIZE.value, _SEED.value
  sets = runs.held_out_sets(_PER_LEVEL.value, seed)
  report = {
      "settings": {"weights": source, "ar_weights": ar_source, "seed": seed, "batch_size": batch,
                   "per_level": _PER_LEVEL.value, "curve_every": _CURVE_EVERY.value,
                   "curve_puzzles": _CURVE_PUZZLES.value, "config": config.to_dict(), "ar_config": ar_config.to_dict()},
      "machine": {"load_average_before": load_before, "matmul_peak_gflops": timing.matmul_peak_flops(1024) / 1e9},
      "decoders": _decoders(diffusion, ar, sets, batch, seed),
      "batch_sweep": _batch_sweep(diffusion, ar, sets["36-40"][:64], [int(b) for b in _BATCH_SIZES.value], seed),
      "acceptance": _acceptance(sampler, variables, sets["36-40"], batch, seed),
      "curve": (_curve(_WORKDIR.value, sampler, sets["36-40"][:_CURVE_PUZZLES.value], batch, seed, _CURVE_EVERY.value)
                if _WORKDIR.value and _CURVE.value else []),
  }
  report["machine"]["load_average_after"] = list(os.getloadavg())
  output = pathlib.Path(_OUTPUT.value)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(report, indent=1, default=str))
  _plot(report, output.with_suffix(".png"))
  for name in ("diffusion", "ar_model"):
    d = report["decoders"][name]
    print(f"{name:10s} " + " | ".join(f"{k}: solved {d[k]['solve_rate']:.3f}, {d[k]['passes_per_puzzle']:.1f} passes"
                                       for k in sets))
  print(f"wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
  app.run(main)

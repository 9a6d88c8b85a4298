r"""The Sudoku recipe measured: three decoders, the solve rate against training time, clue levels, and
the entropy-bound x step-cap sweep, into one JSON (every setting it ran with) and one plot.

  python scripts/train.py --config=projects/sudoku/config.py --workdir=W
  python scripts/train.py --config=projects/sudoku/config.py:ar --workdir=W_AR
  python -m projects.sudoku.report --workdir=W --ar_workdir=W_AR --output=results/sudoku.json

Held-out puzzles come from the validation split (a random stream training never draws from):
`--per_level` puzzles at each of `--levels` (the issue's 36-40 clues) and of `--easy_levels`. For each
decoder (block diffusion with the workdir's `config.sampler`; greedy AR decoding of the same weights;
the AR model of `--ar_workdir`, greedy) the JSON holds `evaluation.sudoku`'s summary (solve rate,
denoiser or forward passes per puzzle, tokens per forward, seconds per solved puzzle, puzzles/s) over
the `--levels` puzzles and the solve rate per clue count over all of them; `curve` the solve rate of
both models' checkpoints on the `--levels` puzzles against their training seconds (`time/train_s`);
`sweep` the diffusion model at every (entropy_bound, max_denoising_steps). The plot (the `--output`
path with `.png`) shows the curve and the sweep's solve rate against passes per puzzle.
"""

import json
import pathlib

from absl import app
from absl import flags
from absl import logging
import numpy as np

from diffusiongemma import build
from diffusiongemma import parallel
from diffusiongemma import training
from projects.sudoku import data as sudoku
from projects.sudoku import solve as sudoku_eval

_WORKDIR = flags.DEFINE_string("workdir", None, "The block-diffusion run (projects/sudoku/config.py).")
_AR_WORKDIR = flags.DEFINE_string("ar_workdir", None, "The AR run (projects/sudoku/config.py:ar); optional.")
_OUTPUT = flags.DEFINE_string("output", "results/sudoku.json", "The JSON to write (and .png beside).")
_LEVELS = flags.DEFINE_list("levels", ["36", "37", "38", "39", "40"], "Clue counts of the headline set.")
_EASY = flags.DEFINE_list("easy_levels", ["45", "50", "55"], "Easier clue counts, reported per level.")
_PER_LEVEL = flags.DEFINE_integer("per_level", 40, "Held-out puzzles per clue count.")
_BOUNDS = flags.DEFINE_list("entropy_bounds", ["0.01", "0.03", "0.1", "0.3"], "Sweep: entropy bounds.")
_CAPS = flags.DEFINE_list("max_steps", ["8", "12", "24", "48"], "Sweep: step caps.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 100, "Puzzles per sampler call.")
_SEED = flags.DEFINE_integer("seed", 0, "Puzzle stream (validation split) and sampling seed.")
flags.mark_flags_as_required(["workdir"])

_KEYS = ("solve_rate", "passes_per_puzzle", "tokens_per_forward", "seconds_per_solved", "puzzles_per_s",
         "run_s", "compile_s")


def _puzzles(levels, per_level: int, seed: int, start: int) -> np.ndarray:
  puzzles, _ = sudoku.generate_many(per_level * len(levels), [int(k) for k in levels], seed,
                                    split="validation", start=start)
  return puzzles


def _train_seconds(workdir) -> dict[int, float]:
  """Step -> `time/train_s` (training seconds, compiling and evaluation excluded) from metrics.jsonl."""
  out = {}
  path = pathlib.Path(workdir) / "metrics.jsonl"
  for line in path.read_text().splitlines() if path.is_file() else ():
    row = json.loads(line)
    if "time/train_s" in row:
      out[int(row["step"])] = float(row["time/train_s"])
  return out


def _summary(result) -> dict:
  s = result.summary()
  return {k: (None if s[k] == float("inf") else s[k]) for k in _KEYS}


def _curve(workdir, sampler, puzzles, batch_size, seed) -> list[dict]:
  """The solve rate at every checkpoint of `workdir`, with its training seconds."""
  seconds = _train_seconds(workdir)
  out = []
  for step in training.checkpoint.saved_steps(workdir):
    variables, _ = training.load_params(workdir, step=step)
    result = sudoku_eval.solve(sampler, variables, puzzles, batch_size=batch_size, seed=seed)
    known = [s for s in seconds if s <= step]
    out.append({"step": step, "train_s": seconds[max(known)] if known else None, **_summary(result)})
    logging.info("%s step %d: %s", workdir, step, out[-1])
  return out


def _decoder(sampler, weights, headline, everything, batch_size, seed) -> dict:
  result = sudoku_eval.solve(sampler, weights.variables, headline, batch_size=batch_size, seed=seed)
  levels = sudoku_eval.solve(sampler, weights.variables, everything, batch_size=batch_size, seed=seed)
  return {"weights": weights.source, **_summary(result),
          "by_clues": sudoku_eval.by_clues(everything, levels)}


def _plot(report, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  for name, curve in report["curve"].items():
    points = [(p["train_s"] / 60, p["solve_rate"]) for p in curve if p["train_s"] is not None]
    if points:
      left.plot(*zip(*points), marker="o", label=name)
  left.set_xlabel("training minutes (this machine)")
  left.set_ylabel(f"solved ({report['puzzles']['levels']} clues)")
  left.legend()
  left.grid(alpha=0.3)
  for bound in report["settings"]["entropy_bounds"]:
    rows = [r for r in report["sweep"] if r["entropy_bound"] == bound]
    right.plot([r["passes_per_puzzle"] for r in rows], [r["solve_rate"] for r in rows], marker="o",
               label=f"entropy bound {bound}")
  for name in ("ar_same_weights", "ar_model"):
    if name in report["decoders"]:
      d = report["decoders"][name]
      right.scatter([d["passes_per_puzzle"]], [d["solve_rate"]], marker="x", s=60, label=name)
  right.set_xlabel("forward passes per puzzle")
  right.set_ylabel("solved")
  right.legend(fontsize=7)
  right.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  parallel.enable_compilation_cache(_WORKDIR.value)
  training.quiet_orbax_logs()
  config = build.workdir_config(_WORKDIR.value)
  if config is None:
    raise app.UsageError(f"--workdir={_WORKDIR.value!r} holds no training run (no config.json).")
  ar_config = build.workdir_config(_AR_WORKDIR.value) if _AR_WORKDIR.value else None
  if _AR_WORKDIR.value and ar_config is None:
    raise app.UsageError(f"--ar_workdir={_AR_WORKDIR.value!r} holds no training run (no config.json).")
  bounds, caps = [float(b) for b in _BOUNDS.value], [int(c) for c in _CAPS.value]
  batch, seed = _BATCH_SIZE.value, _SEED.value
  headline = _puzzles(_LEVELS.value, _PER_LEVEL.value, seed, start=0)
  easy = _puzzles(_EASY.value, _PER_LEVEL.value, seed, start=len(headline)) if _EASY.value else headline[:0]
  everything = np.concatenate([headline, easy])

  weights = build.load(config, workdir=_WORKDIR.value)
  sampler = build.sampler(config, weights.model_config)
  decoders = {"diffusion": {"sampler": sampler.settings(),
                            **_decoder(sampler, weights, headline, everything, batch, seed)},
              "ar_same_weights": _decoder(build.ar_sampler(config, weights.model_config), weights,
                                          headline, everything, batch, seed)}
  curve = {"diffusion": _curve(_WORKDIR.value, sampler, headline, batch, seed)}
  if ar_config is not None:
    ar_weights = build.load(ar_config, workdir=_AR_WORKDIR.value)
    ar_sampler = build.ar_sampler(ar_config, ar_weights.model_config)
    decoders["ar_model"] = _decoder(ar_sampler, ar_weights, headline, everything, batch, seed)
    curve["ar_model"] = _curve(_AR_WORKDIR.value, ar_sampler, headline, batch, seed)
  sweep = []
  for bound in bounds:
    for cap in caps:
      swept = build.sampler(config, weights.model_config, entropy_bound=bound, max_denoising_steps=cap)
      result = sudoku_eval.solve(swept, weights.variables, headline, batch_size=batch, seed=seed)
      sweep.append({"entropy_bound": bound, "max_denoising_steps": cap, **_summary(result)})
      logging.info("sweep %s", sweep[-1])

  report = {
      "settings": {"workdir": _WORKDIR.value, "ar_workdir": _AR_WORKDIR.value, "seed": seed,
                   "batch_size": batch, "entropy_bounds": bounds, "max_steps": caps,
                   "config": config.to_dict(), "ar_config": ar_config.to_dict() if ar_config else None},
      "puzzles": {"split": "validation", "levels": f"{_LEVELS.value[0]}-{_LEVELS.value[-1]}",
                  "per_level": _PER_LEVEL.value, "headline": len(headline), "easy_levels": _EASY.value},
      "train_seconds": {"diffusion": max(_train_seconds(_WORKDIR.value).values(), default=None),
                        "ar_model": (max(_train_seconds(_AR_WORKDIR.value).values(), default=None)
                                     if ar_config else None)},
      "decoders": decoders, "curve": curve, "sweep": sweep}
  output = pathlib.Path(_OUTPUT.value)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(report, indent=1, default=str))
  _plot(report, output.with_suffix(".png"))
  for name, d in decoders.items():
    print(f"{name:16s} solved {d['solve_rate']:.3f} | passes/puzzle {d['passes_per_puzzle']:.1f} | "
          f"tokens/forward {d['tokens_per_forward']:.2f} | s/solved {d['seconds_per_solved']} | "
          f"puzzles/s {d['puzzles_per_s']:.1f}")
  print(f"wrote {output} and {output.with_suffix('.png')}")


if __name__ == "__main__":
  app.run(main)

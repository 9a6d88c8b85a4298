"""Trained Sudoku runs and the held-out sets they are measured on (shared by the report, the seeds
summary and benchmarks.precision)."""

import json
import pathlib

import numpy as np

from diffusiongemma import build
from projects.sudoku import data as sudoku
from projects.sudoku import other_generator
from projects.sudoku import weights as shipped

_KEYS = ("solve_rate", "passes_per_puzzle", "tokens_per_forward", "seconds_per_solved", "puzzles_per_s",
         "run_s", "compile_s")


def summary(result) -> dict:
  """The headline fields of a `solve.SolveResult` (None where nothing was solved: no seconds per solve)."""
  s = result.summary()
  return {k: (None if s[k] == float("inf") else s[k]) for k in _KEYS}


def held_out_sets(per_level: int, seed: int) -> dict[str, np.ndarray]:
  """The held-out sets: 36-40 and 30-35 clues from the validation stream, 36-40 from the other generator."""
  headline, _ = sudoku.generate_many(5 * per_level, (36, 37, 38, 39, 40), seed, "validation")
  hard, _ = sudoku.generate_many(6 * per_level, (30, 31, 32, 33, 34, 35), seed, "validation", start=10**6)
  other, _ = other_generator.generate_many(5 * per_level, (36, 37, 38, 39, 40), seed)
  return {"36-40": headline, "30-35": hard, "symmetric 36-40": other}


def load(workdir, name):
  """(config, variables, source) of a workdir's latest checkpoint, or of the shipped weights `name`."""
  if workdir:
    config = build.workdir_config(workdir)
    if config is None:
      raise FileNotFoundError(f"{workdir!r} holds no training run (no config.json).")
    weights = build.load(config, workdir=workdir)
    return config, weights.variables, weights.source
  config, variables, provenance = shipped.load(name)
  return config, variables, f"shipped {name} weights (step {provenance['step']})"


def train_seconds(workdir) -> dict[int, float]:
  """Step -> `time/train_s` (compiling and evaluation excluded) from metrics.jsonl."""
  out = {}
  path = pathlib.Path(workdir) / "metrics.jsonl"
  for line in path.read_text().splitlines() if path.is_file() else ():
    row = json.loads(line)
    if "time/train_s" in row:
      out[int(row["step"])] = float(row["time/train_s"])
  return out

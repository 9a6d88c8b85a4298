r"""One recipe trained from several seeds: each run's solve rate on the held-out sets, and their spread.

  python -m projects.sudoku.seeds --workdirs=W0,W1 --output=results/sudoku_seeds.json

Each workdir's latest checkpoint decodes the report's held-out sets (`runs.held_out_sets`) with its own
run's config (block diffusion; greedy AR for a run trained with the AR loss only), at `--batch_size`.
"""

import json
import pathlib

from absl import app
from absl import flags
import numpy as np

from diffusiongemma import build
from diffusiongemma import timing
from diffusiongemma import training
from projects.sudoku import runs
from projects.sudoku import solve

_WORKDIRS = flags.DEFINE_list("workdirs", [], "Training runs of one recipe, from different seeds.")
_OUTPUT = flags.DEFINE_string("output", "results/sudoku_seeds.json", "The JSON to write.")
_PER_LEVEL = flags.DEFINE_integer("per_level", 40, "Held-out puzzles per clue count.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Puzzles per sampler call.")
_SEED = flags.DEFINE_integer("seed", 0, "Puzzle stream (validation split) and sampling seed.")


def run_row(workdir, sets, batch_size: int, seed: int) -> dict:
  """A run's seed, steps, training minutes and its summary on each set."""
  config, variables, _ = runs.load(workdir, None)
  is_ar = config.diffusion.get("diffusion_loss_weight", 1.0) == 0.0
  sampler = build.ar_sampler(config) if is_ar else build.sampler(config)
  seconds = runs.train_seconds(workdir)
  row = {"workdir": str(workdir), "decoder": "ar_model" if is_ar else "diffusion", "train_seed": config.train.seed,
         "step": training.latest_step(workdir), "train_minutes": max(seconds.values()) / 60 if seconds else None}
  for name, puzzles in sets.items():
    result = solve.solve(sampler, variables, puzzles, batch_size=batch_size, seed=seed)
    row[name] = runs.summary(result)
  return row


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not _WORKDIRS.value:
    raise app.UsageError("Pass --workdirs=W0,W1,... (runs of one recipe from different seeds).")
  training.quiet_orbax_logs()
  sets = runs.held_out_sets(_PER_LEVEL.value, _SEED.value)
  rows = [run_row(w, sets, _BATCH_SIZE.value, _SEED.value) for w in _WORKDIRS.value]
  spread = {name: {stat: float(fn([r[name]["solve_rate"] for r in rows]))
                   for stat, fn in (("min", np.min), ("max", np.max), ("mean", np.mean))} for name in sets}
  report = {"settings": {"per_level": _PER_LEVEL.value, "batch_size": _BATCH_SIZE.value, "seed": _SEED.value,
                         **timing.provenance(pathlib.Path(__file__).parent.parent.parent)},
            "runs": rows, "spread": spread}
  output = pathlib.Path(_OUTPUT.value)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(report, indent=1, default=str))
  for run in rows:
    print(f"seed {run['train_seed']} ({run['workdir']}, step {run['step']}): " +
          " | ".join(f"{name} solved {run[name]['solve_rate']:.3f} in {run[name]['passes_per_puzzle']:.1f} passes"
                     for name in sets))
  print(f"wrote {output}")


if __name__ == "__main__":
  app.run(main)

r"""The shipped Sudoku models on held-out puzzles: one canvas drawn filling in pass by pass, then the solve
rate, passes and wall-clock of block diffusion against the AR model, both at batch 1.

  python -m projects.sudoku.demo [--puzzles=100] [--clues=36,37,38,39,40] [--seed=0]

Puzzles come from the generator's validation stream (a random stream training never draws from). The last
lines print the command that retrains the weights.
"""

import sys
import time

from absl import app
from absl import flags
import numpy as np

from diffusiongemma import build
from diffusiongemma import training
from projects.sudoku import data as sudoku
from projects.sudoku import solve
from projects.sudoku import weights as shipped

_PUZZLES = flags.DEFINE_integer("puzzles", 100, "Held-out puzzles to solve.")
_CLUES = flags.DEFINE_list("clues", ["36", "37", "38", "39", "40"], "Clue counts, cycled over the puzzles.")
_SEED = flags.DEFINE_integer("seed", 0, "Puzzle stream (validation split) and sampling seed.")
_SHOW = flags.DEFINE_bool("show", True, "Draw the first puzzle's canvas after every denoiser pass.")

RETRAIN = ("python scripts/train.py --config=projects/sudoku/config.py --workdir=workdir/sudoku\n"
           "python scripts/train.py --config=projects/sudoku/config.py:ar --workdir=workdir/sudoku_ar\n"
           "python -m projects.sudoku.report --workdir=workdir/sudoku --ar_workdir=workdir/sudoku_ar")


def grid_text(cells: np.ndarray, puzzle: np.ndarray, new: np.ndarray | None = None) -> str:
  """The 9 x 9 grid: clues as digits, filled cells as digits (`*` after the ones this pass wrote), blanks `.`."""
  rows = []
  for r in range(9):
    parts = []
    for c in range(9):
      i = 9 * r + c
      mark = "*" if new is not None and new[i] else " "
      parts.append(("." if cells[i] == 0 else str(int(cells[i]))) + mark)
      if c in (2, 5):
        parts.append("| ")
    rows.append("".join(parts).rstrip())
    if r in (2, 5):
      rows.append("-" * 23)
  return "\n".join(rows)


def show_one(sampler, variables, puzzle: np.ndarray, seed: int) -> None:
  """Solves `puzzle` alone, printing the canvas after each pass."""
  masked = sampler.noise.never_token

  def on_pass(event):
    tokens = event.canvas[0]
    digits = np.where(tokens == masked, 0, sudoku.decode_solution(tokens))
    filled = int((digits != 0).sum() - (puzzle != 0).sum())
    print(f"\npass {event.step + 1}: {int(event.accepted[0].sum())} cells accepted, "
          f"{filled} of {int((puzzle == 0).sum())} blanks filled")
    print(grid_text(digits, puzzle, event.accepted[0]))

  print("puzzle:")
  print(grid_text(puzzle, puzzle))
  result = solve.solve(sampler, variables, puzzle[None], batch_size=1, seed=seed, on_pass=on_pass)
  print(f"\n{'solved' if result.solved[0] else 'NOT solved'} in {int(result.passes[0])} passes")


def _row(name: str, summary: dict) -> str:
  return (f"| {name} | {summary['solve_rate']:.1%} | {summary['passes_per_puzzle']:.1f} | "
          f"{summary['tokens_per_forward']:.2f} | {1000 * summary['run_s'] / summary['puzzles']:.1f} | "
          f"{summary['seconds_per_solved'] * 1000:.1f} |")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  puzzles, _ = sudoku.generate_many(_PUZZLES.value, [int(k) for k in _CLUES.value], _SEED.value, "validation")
  config, variables, provenance = shipped.load(shipped.DIFFUSION)
  sampler = build.sampler(config)
  if _SHOW.value:
    show_one(sampler, variables, puzzles[0], _SEED.value)
  rows = ["| decoder (batch 1) | solved | passes / puzzle | tokens / pass | ms / puzzle | ms / solved |",
          "|---|---|---|---|---|---|"]
  started = time.perf_counter()
  diffusion = solve.solve(sampler, variables, puzzles, batch_size=1, seed=_SEED.value).summary()
  rows.append(_row("block diffusion", diffusion))
  ar_config, ar_variables, _ = shipped.load(shipped.AUTOREGRESSIVE)
  ar = solve.solve(build.ar_sampler(ar_config), ar_variables, puzzles, batch_size=1, seed=_SEED.value).summary()
  rows.append(_row("AR model", ar))
  print(f"\n{len(puzzles)} held-out puzzles, {','.join(_CLUES.value)} clues; weights: step "
        f"{provenance['step']} ({provenance.get('train_minutes', '?')} min of training)")
  print("\n".join(rows))
  if not ar["solved"] or not diffusion["solved"]:
    print(f"wall-clock per solved puzzle: AR solved {ar['solved']}, block diffusion {diffusion['solved']} of "
          f"{len(puzzles)} ({time.perf_counter() - started:.0f} s for both)")
  else:
    speedup = ar["seconds_per_solved"] / diffusion["seconds_per_solved"]
    print(f"wall-clock per solved puzzle: block diffusion {speedup:.1f}x better than AR "
          f"({time.perf_counter() - started:.0f} s for both)")
  print(f"\nRetrain the shipped weights:\n{RETRAIN}")
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)

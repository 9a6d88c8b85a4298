"""A second, independent Sudoku generator, to check that solving does not depend on `data.generate`'s
quirks: newspaper-style puzzles with 180-degree rotationally symmetric clues.

Grids come from the classical pattern `(3 r + r // 3 + c) mod 9` under a random relabelling, row and
column shuffles within bands and stacks, band and stack shuffles and a transpose (not from backtracking);
clues are removed in symmetric pairs, in random order, while a plain backtracking counter (written here,
not `data.solve`) still finds exactly one solution.
"""

from __future__ import annotations

import random

import numpy as np

NUM_CELLS = 81
_PEERS = [sorted({9 * r + c2 for c2 in range(9)} | {9 * r2 + c for r2 in range(9)} |
                 {9 * (3 * (r // 3) + i) + 3 * (c // 3) + j for i in range(3) for j in range(3)} - {9 * r + c})
          for r in range(9) for c in range(9)]


def _count(grid: list[int], limit: int = 2) -> int:
  """Solutions of `grid` (0 blank), counting up to `limit`: the blank with the fewest options first."""
  best, options = -1, None
  for i in range(NUM_CELLS):
    if grid[i] == 0:
      used = {grid[p] for p in _PEERS[i]}
      free = [d for d in range(1, 10) if d not in used]
      if best < 0 or len(free) < len(options):
        best, options = i, free
        if not free:
          return 0
  if best < 0:
    return 1
  found = 0
  for d in options:
    grid[best] = d
    found += _count(grid, limit - found)
    grid[best] = 0
    if found >= limit:
      break
  return found


def _pattern_grid(rng: random.Random) -> list[int]:
  def lines():
    bands = rng.sample(range(3), 3)
    return [3 * b + i for b in bands for i in rng.sample(range(3), 3)]

  rows, cols, digits = lines(), lines(), rng.sample(range(1, 10), 9)
  grid = [[digits[(3 * r + r // 3 + c) % 9] for c in cols] for r in rows]
  if rng.random() < 0.5:
    grid = [list(col) for col in zip(*grid)]
  return [d for row in grid for d in row]


def generate(num_clues: int, seed: int, index: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(puzzle, solution) [81] int8 with `num_clues` clues in a symmetric layout and a unique solution."""
  if not 24 <= num_clues <= NUM_CELLS:
    raise ValueError(f"num_clues={num_clues} is outside what this generator reaches (24..81).")
  rng = random.Random(f"sudoku-symmetric/{seed}/{index}")
  for _ in range(200):
    solution = _pattern_grid(rng)
    puzzle = list(solution)
    pairs = sorted({(min(i, 80 - i), max(i, 80 - i)) for i in range(NUM_CELLS)})
    rng.shuffle(pairs)
    clues = NUM_CELLS
    for a, b in pairs:
      size = 1 if a == b else 2
      if clues - size < num_clues:
        continue
      kept = puzzle[a], puzzle[b]
      puzzle[a] = puzzle[b] = 0
      if _count(list(puzzle)) == 1:
        clues -= size
      else:
        puzzle[a], puzzle[b] = kept
      if clues == num_clues:
        return np.asarray(puzzle, np.int8), np.asarray(solution, np.int8)
  raise RuntimeError(f"No symmetric puzzle with {num_clues} clues (seed {seed}, index {index}).")


def generate_many(num_puzzles: int, clues, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(puzzles, solutions) [N, 81]; puzzle k has clues[k % len(clues)] clues."""
  clues = (clues,) if isinstance(clues, int) else tuple(clues)
  pairs = [generate(clues[k % len(clues)], seed, k) for k in range(num_puzzles)]
  return np.stack([p for p, _ in pairs]), np.stack([s for _, s in pairs])

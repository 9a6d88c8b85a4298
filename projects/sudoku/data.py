"""Sudoku as a supervised task: puzzles with a unique solution, their token encoding, and checking.

Puzzles and solutions are int arrays of 81 cells in row-major order, 0 for a blank. Everything here is
deterministic by seed:

- `generate(num_clues, seed, split)`: a uniformly random-looking solved grid (randomised backtracking,
  not a relabelled template, so no shortcut of one grid family exists), then clues removed in a random
  order as long as the solution stays unique, down to `num_clues`. Uniqueness is certain: a removed
  cell that the clues alone force (a naked or hidden single) keeps the solution unique at no cost; any other
  removal is checked by counting solutions (up to 2) with constraint propagation and backtracking.
  Train and validation puzzles come from disjoint seed streams (the split is part of the seed).
- `puzzle_pool(...)`: many puzzles at once, cached as `.npz` (generation costs ~5 ms per puzzle in
  pure Python; the training pipeline multiplies a pool by the 2 x 6^8 x 9! validity-preserving
  symmetries of `random_symmetry`, and reveals extra cells of the solution to set the clue count).
- The token encoding: pad/eos/bos are the project's ids 0/1/2, `BLANK` is 3 and digit d is 3 + d, in a
  vocabulary of `VOCAB_SIZE` = 16 (the last id, 15, is free for the mask token of masked noise). The
  prompt is BOS + the 81 cells (82 tokens); the response is the 81 solution digits: one canvas of 81,
  whose clue cells the solver holds (`encode_solution_canvas`).
- `check_solution`: a valid grid (every row, column and box a permutation of 1..9) that keeps every
  clue of the puzzle. A puzzle with a unique solution has exactly one such grid.
- Puzzle files: one puzzle per line, 81 characters, `0` or `.` for a blank (`read_puzzles`,
  `write_puzzles`).
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import random
from collections.abc import Iterable, Sequence

import numpy as np

PAD, EOS, BOS, BLANK = 0, 1, 2, 3
DIGIT_OFFSET = 3  # digit d (1..9) is token 3 + d
VOCAB_SIZE = 16
NUM_CELLS = 81
PROMPT_LENGTH = NUM_CELLS + 1  # BOS + cells
RESPONSE_LENGTH = NUM_CELLS
SPLITS = ("train", "validation")

_ALL = 0x1FF  # bit d-1 set: digit d possible
_BIT = tuple(0 if d == 0 else 1 << (d - 1) for d in range(10))
_DIGIT_OF_BIT = {1 << k: k + 1 for k in range(9)}
_UNITS = tuple([tuple(9 * r + c for c in range(9)) for r in range(9)] +
               [tuple(9 * r + c for r in range(9)) for c in range(9)] +
               [tuple(9 * (3 * br + r) + 3 * bc + c for r in range(3) for c in range(3))
                for br in range(3) for bc in range(3)])
_PEERS = tuple(tuple(sorted({p for u in _UNITS if i in u for p in u} - {i})) for i in range(NUM_CELLS))
_UNITS_OF = tuple(tuple(u for u in _UNITS if i in u) for i in range(NUM_CELLS))


# ------------------------------------------------------------------------------------------- solver
def _candidates(grid: Sequence[int]) -> list[int] | None:
  """Candidate bitmasks of every cell given the filled cells, or None if two clues clash."""
  cand = [_ALL] * NUM_CELLS
  for i, d in enumerate(grid):
    if d:
      if not cand[i] & _BIT[d]:
        return None
      cand[i] = _BIT[d]
      for p in _PEERS[i]:
        cand[p] &= ~_BIT[d]
  return cand


def _propagate(cand: list[int]) -> bool:
  """Naked and hidden singles until nothing changes; False on a contradiction (edits `cand`)."""
  queue = [i for i, m in enumerate(cand) if not m & (m - 1)]
  while True:
    while queue:
      i = queue.pop()
      m = cand[i]
      if not m:
        return False
      for p in _PEERS[i]:
        c = cand[p]
        if c & m:
          c &= ~m
          if not c:
            return False
          cand[p] = c
          if not c & (c - 1):
            queue.append(p)
    for unit in _UNITS:
      seen_once = seen_twice = 0
      for i in unit:
        m = cand[i]
        seen_twice |= seen_once & m
        seen_once |= m
      if seen_once != _ALL:
        return False
      hidden = seen_once & ~seen_twice
      while hidden:
        bit = hidden & -hidden
        hidden ^= bit
        for i in unit:
          if cand[i] & bit:
            if cand[i] != bit:
              cand[i] = bit
              queue.append(i)
            break
    if not queue:
      return True


def _forced(puzzle: list[int], i: int, d: int) -> bool:
  """Whether blank cell i of `puzzle` must hold d given the clues alone: d is the only digit its peers
  allow (naked single), or no other blank of one of its units allows d (hidden single)."""
  taken = 0
  for p in _PEERS[i]:
    taken |= _BIT[puzzle[p]]
  if (_ALL & ~taken) == _BIT[d]:
    return True
  for unit in _UNITS_OF[i]:
    if all(puzzle[j] or any(puzzle[p] == d for p in _PEERS[j]) for j in unit if j != i):
      return True
  return False


def _search(cand: list[int], limit: int, rng: random.Random | None, out: list) -> int:
  """Counts solutions up to `limit` (appending them to `out`), branching on the fewest candidates;
  `rng` shuffles the branch order (to draw random grids)."""
  if not _propagate(cand):
    return 0
  best, best_count = -1, 10
  for i, m in enumerate(cand):
    if m & (m - 1):
      count = bin(m).count("1")
      if count < best_count:
        best, best_count = i, count
        if count == 2:
          break
  if best < 0:
    out.append([_DIGIT_OF_BIT[m] for m in cand])
    return 1
  bits = [1 << k for k in range(9) if cand[best] >> k & 1]
  if rng is not None:
    rng.shuffle(bits)
  found = 0
  for bit in bits:
    branch = list(cand)
    branch[best] = bit
    found += _search(branch, limit - found, rng, out)
    if found >= limit:
      break
  return found


def solve(puzzle: Sequence[int], limit: int = 2) -> list[np.ndarray]:
  """Up to `limit` solutions of `puzzle` (81 ints, 0 blank); one element iff the solution is unique
  (when limit >= 2)."""
  cand = _candidates([int(d) for d in _as_grid(puzzle)])
  out: list = []
  if cand is not None:
    _search(cand, limit, None, out)
  return [np.asarray(s, np.int8) for s in out]


def count_solutions(puzzle: Sequence[int], limit: int = 2) -> int:
  """The number of solutions of `puzzle`, counting at most `limit`."""
  return len(solve(puzzle, limit))


def random_grid(rng: random.Random) -> list[int]:
  """A random solved grid: backtracking over an empty grid with shuffled branch order."""
  out: list = []
  _search([_ALL] * NUM_CELLS, 1, rng, out)
  return out[0]


def _remove_clues(grid: list[int], num_clues: int, rng: random.Random) -> list[int] | None:
  """`grid` with cells removed in a random order while the solution stays unique, down to
  `num_clues` clues; None if no order-compatible removal reaches it."""
  puzzle = list(grid)
  order = list(range(NUM_CELLS))
  rng.shuffle(order)
  clues = NUM_CELLS
  for i in order:
    if clues == num_clues:
      break
    d = puzzle[i]
    puzzle[i] = 0
    if not _forced(puzzle, i, d):  # forced cells keep the solution unique; count the others
      cand = _candidates(puzzle)
      if _search(cand, 2, None, []) != 1:
        puzzle[i] = d
        continue
    clues -= 1
  return puzzle if clues == num_clues else None


def _rng(split: str, seed: int, index: int) -> random.Random:
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")
  return random.Random(f"sudoku/{split}/{int(seed)}/{int(index)}")


def generate(num_clues: int, seed: int, split: str = "train", index: int = 0
             ) -> tuple[np.ndarray, np.ndarray]:
  """(puzzle, solution) [81] int8: the `index`-th puzzle of (`split`, `seed`), with `num_clues` clues
  and a unique solution. The same arguments always give the same puzzle; the two splits never share a
  random stream."""
  if not 17 <= num_clues <= NUM_CELLS:
    raise ValueError(f"num_clues={num_clues} is invalid: a unique solution needs 17 to 81 clues.")
  if num_clues < 22:
    raise ValueError(f"num_clues={num_clues} is too few for this generator (random removal rarely "
                     "gets below ~22 clues); use 22 or more.")
  rng = _rng(split, seed, index)
  for _ in range(1000):
    grid = random_grid(rng)
    puzzle = _remove_clues(grid, num_clues, rng)
    if puzzle is not None:
      return np.asarray(puzzle, np.int8), np.asarray(grid, np.int8)
  raise RuntimeError(f"No puzzle with {num_clues} clues after 1000 grids (split {split}, seed {seed}, "
                     f"index {index}).")


def generate_many(num_puzzles: int, clues: int | Sequence[int], seed: int, split: str = "train",
                  start: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(puzzles, solutions) [N, 81] int8; puzzle k is `generate(clues[k % len(clues)], seed, split,
  start + k)`."""
  clues = (clues,) if isinstance(clues, (int, np.integer)) else tuple(clues)
  pairs = [generate(clues[k % len(clues)], seed, split, start + k) for k in range(num_puzzles)]
  if not pairs:
    return np.zeros((0, NUM_CELLS), np.int8), np.zeros((0, NUM_CELLS), np.int8)
  puzzles, solutions = zip(*pairs)
  return np.stack(puzzles), np.stack(solutions)


def puzzle_pool(num_puzzles: int, num_clues: int, seed: int, split: str = "train",
                cache_dir: os.PathLike | str | None = None) -> tuple[np.ndarray, np.ndarray]:
  """`generate_many(num_puzzles, num_clues, seed, split)`, cached in `cache_dir` as `.npz`."""
  path = None
  if cache_dir is not None:
    key = f"v1-{split}-{seed}-{num_clues}-{num_puzzles}"
    path = pathlib.Path(cache_dir) / f"sudoku-{hashlib.sha256(key.encode()).hexdigest()[:12]}.npz"
    if path.is_file():
      with np.load(path) as saved:
        return saved["puzzles"], saved["solutions"]
  puzzles, solutions = generate_many(num_puzzles, num_clues, seed, split)
  if path is not None:
    buffer = io.BytesIO()
    np.savez(buffer, puzzles=puzzles, solutions=solutions)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
  return puzzles, solutions


# ------------------------------------------------------------------------------------- symmetries
def random_symmetry(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """(cell permutation [81], digit map [10]) of a random validity-preserving symmetry: bands, rows
  within bands, stacks, columns within stacks, a transpose, and a relabelling of the digits (0 stays 0).
  A grid g maps to `digit_map[g[cells]]`; uniqueness and difficulty are unchanged."""

  def lines():
    return (rng.permutation(3)[:, None] * 3 + np.stack([rng.permutation(3) for _ in range(3)])).ravel()

  rows, cols = lines(), lines()
  cells = (rows[:, None] * 9 + cols[None, :])
  if rng.random() < 0.5:
    cells = cells.T
  digit_map = np.concatenate([[0], rng.permutation(9) + 1]).astype(np.int8)
  return cells.ravel(), digit_map


def apply_symmetry(grids: np.ndarray, cells: np.ndarray, digit_map: np.ndarray) -> np.ndarray:
  """`grids` [..., 81] under the symmetry `(cells, digit_map)` of `random_symmetry`."""
  return digit_map[np.asarray(grids)[..., cells]]


def reveal(puzzle: np.ndarray, solution: np.ndarray, num_clues: int, rng: np.random.Generator
           ) -> np.ndarray:
  """`puzzle` with random blanks filled from `solution` until it has `num_clues` clues (at least its
  own): more clues keep the solution unique and make the puzzle easier."""
  puzzle = np.array(puzzle)
  blanks = np.flatnonzero(puzzle == 0)
  extra = max(0, min(num_clues - (NUM_CELLS - blanks.size), blanks.size))
  if extra:
    chosen = rng.choice(blanks, extra, replace=False)
    puzzle[chosen] = solution[chosen]
  return puzzle


# ----------------------------------------------------------------------------------------- tokens
def encode_puzzle(puzzle: np.ndarray) -> np.ndarray:
  """[..., 81] cells (0 blank) -> [..., 82] prompt tokens (BOS, then BLANK or 3 + digit)."""
  puzzle = np.asarray(puzzle)
  cells = np.where(puzzle == 0, BLANK, puzzle.astype(np.int32) + DIGIT_OFFSET)
  bos = np.full(puzzle.shape[:-1] + (1,), BOS, np.int32)
  return np.concatenate([bos, cells.astype(np.int32)], axis=-1)


def encode_solution(solution: np.ndarray) -> np.ndarray:
  """[..., 81] digits 1..9 -> [..., 81] response tokens."""
  solution = np.asarray(solution)
  if ((solution < 1) | (solution > 9)).any():
    raise ValueError("A solution must hold digits 1..9 in every cell.")
  return solution.astype(np.int32) + DIGIT_OFFSET


def encode_solution_canvas(puzzle: np.ndarray) -> np.ndarray:
  """[..., 81] cells (0 blank) -> [..., 81] a canvas holding the clues' digit tokens (BLANK elsewhere: those
  positions start from the noise when the clues are given to the sampler)."""
  puzzle = np.asarray(puzzle)
  return np.where(puzzle == 0, BLANK, puzzle.astype(np.int32) + DIGIT_OFFSET).astype(np.int32)


def decode_solution(tokens: np.ndarray) -> np.ndarray:
  """[..., 81] response tokens -> [..., 81] digits, 0 where a token is not a digit."""
  tokens = np.asarray(tokens).astype(np.int64)
  digits = tokens - DIGIT_OFFSET
  return np.where((digits >= 1) & (digits <= 9), digits, 0).astype(np.int8)


def decode_puzzle(tokens: np.ndarray) -> np.ndarray:
  """[..., 82] prompt tokens -> [..., 81] cells (0 blank): the inverse of `encode_puzzle`."""
  return decode_solution(np.asarray(tokens)[..., 1:])


def example_tokens(puzzle: np.ndarray, solution: np.ndarray) -> np.ndarray:
  """[..., 163] training sequences: the prompt then the response."""
  return np.concatenate([encode_puzzle(puzzle), encode_solution(solution)], axis=-1)


# ---------------------------------------------------------------------------------------- checking
def is_valid_grid(grid: np.ndarray) -> np.ndarray:
  """[..., 81] -> [...] bool: every row, column and box holds each digit 1..9 once."""
  grid = np.asarray(grid)
  units = grid[..., np.asarray(_UNITS)]  # [..., 27, 9]
  present = np.zeros(units.shape[:-1] + (10,), bool)
  np.put_along_axis(present, units.astype(np.int64), True, axis=-1)
  return present[..., 1:].all(axis=(-1, -2))


def check_solution(puzzle: np.ndarray, solution: np.ndarray) -> np.ndarray:
  """[..., 81] x [..., 81] -> [...] bool: `solution` is a valid grid that keeps every clue."""
  puzzle, solution = np.asarray(puzzle), np.asarray(solution)
  keeps = ((puzzle == 0) | (puzzle == solution)).all(axis=-1)
  return keeps & is_valid_grid(solution)


# ------------------------------------------------------------------------------------------ files
def parse_puzzle(line: str, where: str = "puzzle") -> np.ndarray:
  """81 characters, digits with `0` or `.` for a blank -> [81] int8."""
  text = line.strip()
  bad = sorted({ch for ch in text if ch not in "0123456789."})
  if len(text) != NUM_CELLS or bad:
    reason = f"characters {bad} are not allowed" if bad else f"{len(text)} characters"
    raise ValueError(f"{where}: expected 81 characters of 1-9 with 0 or . for a blank; {reason}: "
                     f"{text[:90]!r}.")
  return np.asarray([0 if ch == "." else int(ch) for ch in text], np.int8)


def clash(puzzle: np.ndarray) -> str | None:
  """A description of two clues that break a row, column or box rule, or None when the clues agree."""
  grid = np.asarray(puzzle).ravel()
  names = [f"row {r + 1}" for r in range(9)] + [f"column {c + 1}" for c in range(9)] + \
          [f"box {b + 1}" for b in range(9)]
  for name, unit in zip(names, _UNITS):
    digits = [int(grid[i]) for i in unit if grid[i]]
    repeated = sorted({d for d in digits if digits.count(d) > 1})
    if repeated:
      return f"the digit {repeated[0]} appears twice in {name}"
  return None


def read_puzzles(path: os.PathLike | str) -> np.ndarray:
  """[N, 81] int8 puzzles of a file with one per line (blank lines skipped). A line that is not 81
  characters of 0-9 and '.', or whose clues break a row, column or box rule, is an error naming it.
  (A legal puzzle with no solution is read: a solver reports it unsolved.)"""
  path = pathlib.Path(path)
  rows = []
  for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
    if not line.strip():
      continue
    puzzle = parse_puzzle(line, f"{path}:{n}")
    problem = clash(puzzle)
    if problem:
      raise ValueError(f"{path}:{n}: the clues break the rules: {problem}.")
    rows.append(puzzle)
  return np.stack(rows) if rows else np.zeros((0, NUM_CELLS), np.int8)


def format_grid(grid: Sequence[int], blank: str = "0") -> str:
  """81 cells as one 81-character line."""
  return "".join(blank if int(d) == 0 else str(int(d)) for d in np.asarray(grid).ravel())


def write_puzzles(path: os.PathLike | str, grids: Iterable[Sequence[int]], blank: str = "0") -> None:
  """One 81-character line per grid."""
  text = "".join(format_grid(g, blank) + "\n" for g in grids)
  pathlib.Path(path).write_text(text, encoding="utf-8")


def _as_grid(puzzle: Sequence[int]) -> np.ndarray:
  grid = np.asarray(puzzle).ravel()
  if grid.shape != (NUM_CELLS,) or ((grid < 0) | (grid > 9)).any():
    raise ValueError(f"A puzzle is 81 cells of 0..9, got shape {np.asarray(puzzle).shape}.")
  return grid

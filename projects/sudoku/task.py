"""Sudoku as a training task (`config.data.task = 'projects.sudoku.task'`): `TASK.dataset` gives grain batches
in the block-diffusion training layout.

An example is the prompt (BOS + the 81 cells, blank = `data.BLANK`) and one canvas of the 81 solution
digits. With `hold_clues` the canvas holds the clues as given positions (`given` in the batch: never
noised, never a target, as the sampler's `given=` holds them when solving), so every pass of the model is
spent on the blanks. Training draws a puzzle from a cached pool, applies a random validity-preserving
symmetry and reveals solution cells up to a clue count drawn per example, so the pool is never seen twice
the same way; validation is a fixed set of held-out puzzles from another seed stream.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from projects.sudoku import data as sudoku

_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)


def example(puzzle: np.ndarray, solution: np.ndarray, hold_clues: bool = True) -> dict[str, np.ndarray]:
  """One puzzle and its solution as a training example (prompt, one canvas of 81, the held clues)."""
  tokens = np.concatenate([sudoku.encode_puzzle(puzzle), sudoku.encode_solution(solution)]).astype(np.int32)
  given = np.zeros(tokens.shape, bool)
  if hold_clues:
    given[sudoku.PROMPT_LENGTH:] = np.asarray(puzzle) != 0
  return {"tokens": tokens, "prompt_length": np.int32(sudoku.PROMPT_LENGTH), "num_canvases": np.int32(1),
          "given": given}


class _Example:
  """Pool index -> training example, randomised by the example's global position (picklable)."""

  def __init__(self, puzzles, solutions, min_clues, max_clues, seeds, augment, hold_clues):
    self.puzzles, self.solutions = puzzles, solutions
    self.min_clues, self.max_clues = min_clues, max_clues
    self.seeds, self.augment, self.hold_clues = tuple(seeds), augment, hold_clues

  def __call__(self, position: int, index: int) -> dict[str, np.ndarray]:
    puzzle, solution = self.puzzles[index], self.solutions[index]
    if self.augment:
      rng = np.random.default_rng([*self.seeds, int(position)])
      cells, digits = sudoku.random_symmetry(rng)
      puzzle = sudoku.apply_symmetry(puzzle, cells, digits)
      solution = sudoku.apply_symmetry(solution, cells, digits)
      puzzle = sudoku.reveal(puzzle, solution, int(rng.integers(self.min_clues, self.max_clues + 1)), rng)
    return example(puzzle, solution, self.hold_clues)


def validation_puzzles(num_puzzles: int, clues: Sequence[int] = (36, 37, 38, 39, 40), seed: int = 0
                       ) -> tuple[np.ndarray, np.ndarray]:
  """The held-out puzzles of a run: `generate_many(num_puzzles, clues, seed, 'validation')`."""
  return sudoku.generate_many(num_puzzles, tuple(clues), seed, "validation")


def dataset(split: str, *, batch_size: int, seed: int, pool_size: int = 4096, pool_clues: int = 30,
            min_clues: int = 30, max_clues: int = 45, validation_size: int = 256,
            validation_clues: Sequence[int] = (36, 37, 38, 39, 40), hold_clues: bool = True,
            shard_index: int = 0, shard_count: int = 1, cache_dir: os.PathLike | str | None = None
            ) -> grain.IterDataset:
  """Sudoku batches of `split`: 'train' (the pool, augmented, shuffled, forever) or 'validation'."""
  if not 22 <= pool_clues <= min_clues <= max_clues <= sudoku.NUM_CELLS:
    raise ValueError(f"Sudoku clue counts must satisfy 22 <= pool_clues ({pool_clues}) <= min_clues "
                     f"({min_clues}) <= max_clues ({max_clues}) <= 81.")
  if split == "train":
    puzzles, solutions = sudoku.puzzle_pool(pool_size, pool_clues, seed, "train", cache_dir)
  elif split == "validation":
    puzzles, solutions = validation_puzzles(validation_size, validation_clues, seed)
  else:
    raise ValueError(f"Unknown split {split!r}; expected one of {sudoku.SPLITS}.")
  train = split == "train"
  per_shard = len(puzzles) // shard_count
  if per_shard < batch_size:
    raise ValueError(f"{len(puzzles)} Sudoku puzzles over {shard_count} shards: fewer than batch_size = "
                     f"{batch_size} per shard.")
  ds = grain.MapDataset.range(len(puzzles)).slice(slice(shard_index, per_shard * shard_count, shard_count))
  if train:
    ds = ds.shuffle(seed=seed).repeat(None)
  ds = ds.map_with_index(_Example(puzzles, solutions, min_clues, max_clues, (seed, shard_index), train,
                                  hold_clues))
  return ds.batch(batch_size, drop_remainder=True).to_iter_dataset(_READ_OPTIONS)


@dataclasses.dataclass(frozen=True)
class SudokuTask:
  """The task `build.tasks` finds by `config.data.task = 'projects.sudoku.task'`; its settings are
  `config.data.sudoku` (the keyword arguments of `dataset`)."""

  needs_tokenizer = False

  def dataset(self, data: Mapping[str, Any], split: str, *, tokenizer, canvas_length: int, batch_size: int,
              seed: int, shard_index: int, shard_count: int, cache_dir):
    del tokenizer
    if canvas_length != sudoku.NUM_CELLS:
      raise ValueError(f"The Sudoku task needs model.canvas_length = {sudoku.NUM_CELLS}, got {canvas_length}.")
    if data.get("prompt_length") != sudoku.PROMPT_LENGTH or data.get("num_canvases") != 1:
      raise ValueError(f"The Sudoku task needs data.prompt_length = {sudoku.PROMPT_LENGTH} and "
                       f"data.num_canvases = 1, got {data.get('prompt_length')} and {data.get('num_canvases')}.")
    settings = dict(data.get("sudoku") or {})
    if "validation_clues" in settings:
      settings["validation_clues"] = tuple(settings["validation_clues"])
    return dataset(split, batch_size=batch_size, seed=seed, shard_index=shard_index, shard_count=shard_count,
                   cache_dir=cache_dir, **settings)


TASK = SudokuTask()

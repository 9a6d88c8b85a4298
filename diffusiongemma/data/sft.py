"""Supervised fine-tuning data: (prompt, response) pairs in the block-diffusion training layout.

An example is a clean prompt, encoded causally and never noised, followed by its response as whole
canvases: the response, then EOS up to a multiple of the canvas length C (at least one EOS, as the
released model pads and supervises its responses), at most `num_canvases` (n) canvases. Batches have
the training layout of `diffusion.loss`:

  tokens         int32 [B, P + n * C]  row b: prompt (p_b tokens), k_b canvases, then pad
  prompt_length  int32 [B]             p_b: where the row's first canvas starts
  num_canvases   int32 [B]             k_b <= n: canvases that hold the response (the loss draws the
                                       noised canvas among these, and the AR loss stops at their end)

The diffusion loss only ever reads canvas positions (`prompt_length` onwards), so prompt tokens
contribute nothing to it; the AR loss covers the prompt too unless `config.diffusion.ar_loss_on_prompt`
is False.

Two sources:
- `jsonl_examples`: a JSONL file of `{"prompt": str, "response": str}` records through a tokenizer
  (BOS + prompt; response + EOS), split into train/validation by a seeded hash of each record.
- `sudoku_dataset`: puzzles from `data.sudoku` (prompt: BOS + 81 cells; response: the 81 digits).
  Training draws a puzzle of a cached pool, applies a random validity-preserving symmetry and reveals
  solution cells up to a clue count drawn per example, so the pool is never seen twice the same way;
  validation is a fixed set of held-out puzzles (another seed stream) at the evaluation clue counts.

`dataset_from_config(config, split, ...)` builds either from `config.data.task` ('sft' or 'sudoku').
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Sequence

from absl import logging
import grain
import numpy as np

from diffusiongemma.data import corpus
from diffusiongemma.data import sudoku
from diffusiongemma.data.tokenizer import Tokenizer

TASKS = ("lm", "sft", "sudoku")
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)


def pack_example(prompt: Sequence[int], response: Sequence[int], *, prompt_length: int,
                 canvas_length: int, num_canvases: int, eos_id: int, pad_id: int) -> dict[str, np.ndarray]:
  """One example in the layout above; `response` gets EOS up to a whole number of canvases (at least
  one EOS). Raises ValueError if the prompt exceeds `prompt_length` or the response (with its EOS)
  `num_canvases * canvas_length` tokens."""
  prompt, response = list(prompt), list(response)
  if not prompt:
    raise ValueError("An SFT example needs at least one prompt token (e.g. BOS).")
  if len(prompt) > prompt_length:
    raise ValueError(f"The prompt has {len(prompt)} tokens, more than prompt_length={prompt_length}.")
  canvases = max(1, math.ceil((len(response) + 1) / canvas_length))
  if canvases > num_canvases:
    raise ValueError(f"The response has {len(response)} tokens: with its EOS it needs {canvases} canvases "
                     f"of {canvas_length}, more than num_canvases={num_canvases}.")
  body = response + [eos_id] * (canvases * canvas_length - len(response))
  tokens = np.full(prompt_length + num_canvases * canvas_length, pad_id, np.int32)
  tokens[:len(prompt) + len(body)] = prompt + body
  return {"tokens": tokens, "prompt_length": np.int32(len(prompt)), "num_canvases": np.int32(canvases)}


def read_jsonl_pairs(path: os.PathLike | str, prompt_field: str = "prompt",
                     response_field: str = "response") -> list[tuple[str, str]]:
  """(prompt, response) texts of a JSONL file; blank lines are skipped, anything else malformed is an
  error naming the line."""
  if not pathlib.Path(path).is_file():
    raise ValueError(f"SFT data {str(path)!r} does not exist (config.data.corpus).")
  return corpus.read_jsonl_fields(path, (prompt_field, response_field))


def jsonl_examples(path: os.PathLike | str, tokenizer: Tokenizer, split: str, *, prompt_length: int,
                   canvas_length: int, num_canvases: int, validation_fraction: float = 0.02,
                   seed: int = 0) -> list[dict[str, np.ndarray]]:
  """The packed examples of `split` of a JSONL file of prompt/response pairs. Pairs too long for the
  layout are left out (with a warning that counts them); none fitting is an error."""
  pairs = read_jsonl_pairs(path)
  keys = [json.dumps(pair) for pair in pairs]
  train, validation = corpus._split(pairs, keys, validation_fraction, seed)  # pylint: disable=protected-access
  chosen = train if split == "train" else validation
  prompts = tokenizer.encode_batch([p for p, _ in chosen]) if chosen else []
  responses = tokenizer.encode_batch([r for _, r in chosen]) if chosen else []
  examples, dropped = [], 0
  for prompt, response in zip(prompts, responses):
    try:
      examples.append(pack_example([tokenizer.bos_id] + prompt, response, prompt_length=prompt_length,
                                   canvas_length=canvas_length, num_canvases=num_canvases,
                                   eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id))
    except ValueError:
      dropped += 1
  if dropped:
    logging.warning("%s (%s): left out %d of %d pairs longer than prompt_length=%d or num_canvases=%d "
                    "x canvas_length=%d.", path, split, dropped, len(chosen), prompt_length, num_canvases,
                    canvas_length)
  if not examples:
    raise ValueError(f"{path}: no {split} pair fits prompt_length={prompt_length} and num_canvases="
                     f"{num_canvases} x canvas_length={canvas_length} ({len(chosen)} pairs in the split).")
  return examples


def _batches(dataset: grain.MapDataset, *, batch_size: int, seed: int, train: bool, shard_index: int,
             shard_count: int, size: int) -> grain.MapDataset:
  per_shard = size // shard_count
  if per_shard < batch_size:
    raise ValueError(f"{size} examples, {per_shard} per shard over {shard_count} shards: fewer than "
                     f"batch_size = {batch_size}.")
  dataset = dataset.slice(slice(shard_index, per_shard * shard_count, shard_count))
  if train:
    dataset = dataset.shuffle(seed=seed).repeat(None)
  return dataset


def examples_dataset(examples: Sequence[dict[str, np.ndarray]], *, batch_size: int, seed: int,
                     train: bool, shard_index: int = 0, shard_count: int = 1) -> grain.IterDataset:
  """Batches of packed examples: shuffled and repeated forever if `train`, else one pass in order."""
  dataset = grain.MapDataset.source(list(examples))
  dataset = _batches(dataset, batch_size=batch_size, seed=seed, train=train, shard_index=shard_index,
                     shard_count=shard_count, size=len(examples))
  return dataset.batch(batch_size, drop_remainder=True).to_iter_dataset(_READ_OPTIONS)


class _SudokuExample:
  """Pool index -> training example, randomised by the example's global position (picklable).

  With a curriculum, the lowest clue count of example `position` falls linearly from `max_clues` to
  `min_clues` over the first `curriculum_examples` examples (easy puzzles first)."""

  def __init__(self, puzzles, solutions, min_clues, max_clues, canvas_length, seeds, augment,
               curriculum_examples=0):
    self.puzzles, self.solutions = puzzles, solutions
    self.min_clues, self.max_clues = min_clues, max_clues
    self.canvas_length, self.seeds, self.augment = canvas_length, tuple(seeds), augment
    self.curriculum_examples = curriculum_examples

  def lowest_clues(self, position: int) -> int:
    if position >= self.curriculum_examples:
      return self.min_clues
    return round(self.max_clues - (self.max_clues - self.min_clues) * position / self.curriculum_examples)

  def __call__(self, position: int, index: int) -> dict[str, np.ndarray]:
    puzzle, solution = self.puzzles[index], self.solutions[index]
    if self.augment:
      rng = np.random.default_rng([*self.seeds, int(position)])
      cells, digits = sudoku.random_symmetry(rng)
      puzzle = sudoku.apply_symmetry(puzzle, cells, digits)
      solution = sudoku.apply_symmetry(solution, cells, digits)
      clues = int(rng.integers(self.lowest_clues(int(position)), self.max_clues + 1))
      puzzle = sudoku.reveal(puzzle, solution, clues, rng)
    return sudoku_example(puzzle, solution, self.canvas_length)


def sudoku_example(puzzle: np.ndarray, solution: np.ndarray, canvas_length: int = sudoku.NUM_CELLS
                   ) -> dict[str, np.ndarray]:
  """A puzzle and its solution in the SFT layout (one canvas of `canvas_length` >= 81; EOS beyond 81)."""
  if canvas_length < sudoku.NUM_CELLS:
    raise ValueError(f"canvas_length={canvas_length} is too short for the 81 cells of a Sudoku.")
  response = sudoku.encode_solution(solution).tolist()
  if canvas_length == sudoku.NUM_CELLS:  # the canvas is exactly the grid: no EOS
    tokens = np.asarray(sudoku.encode_puzzle(puzzle).tolist() + response, np.int32)
    return {"tokens": tokens, "prompt_length": np.int32(sudoku.PROMPT_LENGTH), "num_canvases": np.int32(1)}
  return pack_example(sudoku.encode_puzzle(puzzle), response, prompt_length=sudoku.PROMPT_LENGTH,
                      canvas_length=canvas_length, num_canvases=1, eos_id=sudoku.EOS, pad_id=sudoku.PAD)


def sudoku_dataset(split: str, *, batch_size: int, seed: int, canvas_length: int = sudoku.NUM_CELLS,
                   pool_size: int = 4096, pool_clues: int = 30, min_clues: int = 36, max_clues: int = 40,
                   validation_size: int = 256, validation_clues: Sequence[int] = (36, 37, 38, 39, 40),
                   curriculum_steps: int = 0, shard_index: int = 0, shard_count: int = 1,
                   cache_dir: os.PathLike | str | None = None) -> grain.IterDataset:
  """Sudoku batches of `split`.

  train: `pool_size` puzzles with `pool_clues` clues (seed stream 'train'), each example under a random
  symmetry with solution cells revealed up to U{min_clues..max_clues} clues, shuffled, forever; with
  `curriculum_steps`, the lower end of that range starts at max_clues and reaches min_clues after that
  many batches.
  validation: `validation_size` held-out puzzles (seed stream 'validation') cycling through
  `validation_clues`, one pass, unchanged.
  """
  if not 22 <= pool_clues <= min_clues <= max_clues <= sudoku.NUM_CELLS:
    raise ValueError(f"Sudoku clue counts must satisfy 22 <= pool_clues ({pool_clues}) <= min_clues "
                     f"({min_clues}) <= max_clues ({max_clues}) <= 81.")
  if split == "train":
    puzzles, solutions = sudoku.puzzle_pool(pool_size, pool_clues, seed, "train", cache_dir)
    augment = True
  elif split == "validation":
    puzzles, solutions = validation_puzzles(validation_size, validation_clues, seed)
    augment = False
  else:
    raise ValueError(f"Unknown split {split!r}; expected one of {sudoku.SPLITS}.")
  dataset = grain.MapDataset.range(len(puzzles))
  dataset = _batches(dataset, batch_size=batch_size, seed=seed, train=split == "train",
                     shard_index=shard_index, shard_count=shard_count, size=len(puzzles))
  dataset = dataset.map_with_index(_SudokuExample(puzzles, solutions, min_clues, max_clues, canvas_length,
                                                  (seed, shard_index), augment,
                                                  curriculum_steps * batch_size))
  return dataset.batch(batch_size, drop_remainder=True).to_iter_dataset(_READ_OPTIONS)


def validation_puzzles(num_puzzles: int, clues: Sequence[int] = (36, 37, 38, 39, 40), seed: int = 0
                       ) -> tuple[np.ndarray, np.ndarray]:
  """The held-out puzzles of a run: `generate_many(num_puzzles, clues, seed, 'validation')`."""
  return sudoku.generate_many(num_puzzles, tuple(clues), seed, "validation")


def dataset_from_config(config, split: str, *, tokenizer: Tokenizer | None, canvas_length: int,
                        batch_size: int, shard_index: int = 0, shard_count: int = 1,
                        cache_dir: os.PathLike | str | None = None) -> grain.IterDataset:
  """The dataset of `config.data.task` ('sft': JSONL pairs at `config.data.corpus`; 'sudoku': the
  generator, with its settings in `config.data.sudoku`)."""
  data = config.data
  task = data.get("task", "lm")
  common = dict(batch_size=batch_size, shard_index=shard_index, shard_count=shard_count)
  if task == "sudoku":
    settings = dict(data.get("sudoku", {}))
    if "validation_clues" in settings:
      settings["validation_clues"] = tuple(settings["validation_clues"])
    return sudoku_dataset(split, seed=config.train.seed, canvas_length=canvas_length, cache_dir=cache_dir,
                          **settings, **common)
  if task == "sft":
    if tokenizer is None:
      raise ValueError("config.data.task='sft' needs a tokenizer (config.data.tokenizer_path).")
    examples = jsonl_examples(data.corpus, tokenizer, split, prompt_length=data.prompt_length,
                              canvas_length=canvas_length, num_canvases=data.num_canvases,
                              validation_fraction=data.validation_fraction, seed=config.train.seed)
    return examples_dataset(examples, seed=config.train.seed, train=split == "train", **common)
  raise ValueError(f"Unknown config.data.task {task!r} for SFT data; expected 'sft' or 'sudoku' "
                   f"(tasks: {TASKS}).")

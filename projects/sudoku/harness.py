"""Sudoku through lm-evaluation-harness: the `sudoku` adapter (a puzzle line -> the prompt tokens and the
held clues; the canvas -> the 81 digits) and the offline task `sudoku_solve` (exact match on the 81
digits, puzzles from the generator's validation stream).

  python scripts/lm_eval_harness.py --model diffusiongemma --model_args workdir=W \
      --include_path projects/sudoku/harness_task --tasks sudoku_solve --batch_size 16

Importing this module registers the adapter (`scripts/lm_eval_harness.py` imports it). `write_task`
regenerates the task's JSONL.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import numpy as np

from diffusiongemma.build import harness as build_harness
from projects.sudoku import data as sudoku

TASK_DIR = pathlib.Path(__file__).parent / "harness_task"


class SudokuAdapter:
  """A request's context is one puzzle line (81 characters, 0 or . blank); the clues are held in the
  canvas, the model fills the blanks; the answer is the 81 digits (0 where no digit was written)."""

  def prompt_tokens(self, context: str) -> Sequence[int]:
    return sudoku.encode_puzzle(sudoku.parse_puzzle(context)).tolist()

  def generate_kwargs(self, contexts: Sequence[str]) -> dict:
    puzzles = np.stack([sudoku.parse_puzzle(c) for c in contexts])
    return {"initial_canvas": sudoku.encode_solution_canvas(puzzles), "given": puzzles != 0}

  def answer(self, context: str, tokens: Sequence[int]) -> str:
    return sudoku.format_grid(sudoku.decode_solution(np.asarray(tokens[:sudoku.NUM_CELLS])))


build_harness.register_adapter("sudoku", lambda model, tokenizer: SudokuAdapter())


def write_task(num_puzzles: int = 100, seed: int = 0, folder: pathlib.Path = TASK_DIR) -> pathlib.Path:
  """The task's JSONL: `num_puzzles` held-out puzzles, 36-40 clues, with their (unique) solutions."""
  puzzles, solutions = sudoku.generate_many(num_puzzles, (36, 37, 38, 39, 40), seed, "validation")
  path = pathlib.Path(folder) / "sudoku_solve.jsonl"
  path.write_text("".join(json.dumps({"puzzle": sudoku.format_grid(p), "solution": sudoku.format_grid(s)}) + "\n"
                          for p, s in zip(puzzles, solutions)))
  return path


if __name__ == "__main__":
  print(write_task())

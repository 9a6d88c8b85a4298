"""Solving Sudoku with a trained model: block diffusion, AR decoding of the same weights, an AR model.

A puzzle counts as solved when the model's 81 digits form a valid grid that keeps every clue
(`projects.sudoku.data.check_solution`). For each decoder we report:

- `solve_rate`: solved / puzzles;
- `passes_per_puzzle`: forward passes of the model per puzzle after the prompt (diffusion: denoiser
  passes, at most `max_denoising_steps`; AR: one per generated token, 81);
- `tokens_per_forward`: new tokens (`sampling.stats`: non-pad tokens, up to and including a stop token;
  81 per puzzle when the model writes a whole grid) over all forward passes of the run (pooled);
- `seconds_per_solved`: wall-clock of the whole run (prompt encoding included, compilation excluded)
  divided by the puzzles solved (inf when none is); `puzzles_per_s`: puzzles / run seconds;
- `compile_s`: the first batch's extra time (tracing and compiling), reported apart.

Puzzles run in batches of `batch_size` (the last one padded by repeating puzzles, so every batch has
one shape and the program compiles once); a first warm-up batch is run and timed apart, streaming nowhere
(a stream draws each pass once: the warm-up's passes are not the run's).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import numpy as np

from diffusiongemma.sampling import stats
from diffusiongemma.sampling.autoregressive import ARSampler
from diffusiongemma.sampling.sampler import Sampler
from projects.sudoku import data as sudoku

@dataclasses.dataclass
class SolveResult:
  """Per-puzzle outputs of one decoder over a set of puzzles, and the run's timings."""

  solutions: np.ndarray  # [N, 81] int8 digits, 0 where the model wrote no digit
  solved: np.ndarray  # [N] bool
  passes: np.ndarray  # [N] int32 forward passes after the prompt
  new_tokens: np.ndarray  # [N] int32 tokens written before the output turned to pad (at most C)
  run_s: float  # wall-clock of all batches, compilation excluded
  cpu_s: float  # process CPU time of the same (all threads)
  compile_s: float

  def summary(self) -> dict[str, float]:
    n = len(self.solved)
    solved = int(self.solved.sum())
    return {
        "puzzles": n,
        "solved": solved,
        "solve_rate": solved / max(n, 1),
        "passes_per_puzzle": float(self.passes.mean()) if n else 0.0,
        "tokens_per_forward": int(self.new_tokens.sum()) / max(int(self.passes.sum()), 1),
        "seconds_per_solved": self.run_s / solved if solved else math.inf,
        "puzzles_per_s": n / self.run_s if self.run_s > 0 else math.inf,
        "run_s": self.run_s,
        "cpu_s": self.cpu_s,
        "compile_s": self.compile_s,
    }


def _batches(puzzles: np.ndarray, batch_size: int):
  """(puzzles [b, 81], number of real rows) per batch, the last padded with repeats of its puzzles."""
  for start in range(0, len(puzzles), batch_size):
    chunk = puzzles[start:start + batch_size]
    real = len(chunk)
    if real < batch_size:
      chunk = np.concatenate([chunk, np.resize(chunk, (batch_size - real, sudoku.NUM_CELLS))])
    yield chunk, real


def _run(decode: Callable, puzzles: np.ndarray, batch_size: int, pad_id: int, held: bool = False) -> SolveResult:
  """Runs `decode(puzzles [b, 81], batch_index, warm_up) -> (tokens [b, >=81], passes [b])` over every batch,
  after one warm-up call on the first batch (`warm_up=True`); `held`: the clues were given, not written by
  the model (they are not new tokens)."""
  puzzles = np.asarray(puzzles)
  if puzzles.ndim != 2 or puzzles.shape[1] != sudoku.NUM_CELLS:
    raise ValueError(f"puzzles must have shape [N, 81], got {puzzles.shape}.")
  if len(puzzles) == 0:
    raise ValueError("No puzzles to solve.")
  batch_size = max(1, min(int(batch_size), len(puzzles)))
  warm, _ = next(_batches(puzzles, batch_size))
  start = time.perf_counter()
  jax.block_until_ready(decode(warm, 0, True))
  first = time.perf_counter() - start
  outputs, passes, new = [], [], []
  start, cpu_start = time.perf_counter(), time.process_time()
  for i, (chunk, real) in enumerate(_batches(puzzles, batch_size)):
    tokens, counts = jax.device_get(decode(chunk, i, False))
    tokens = np.asarray(tokens)[:real]
    outputs.append(tokens[:, :sudoku.NUM_CELLS])
    written = stats.new_token_counts(tokens, pad_id)
    new.append(written - (chunk[:real] != 0).sum(-1) if held else written)
    passes.append(np.asarray(counts)[:real])
  run_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
  batches = math.ceil(len(puzzles) / batch_size)
  solutions = sudoku.decode_solution(np.concatenate(outputs))
  return SolveResult(solutions=solutions, solved=sudoku.check_solution(puzzles, solutions),
                     passes=np.concatenate(passes).astype(np.int32),
                     new_tokens=np.concatenate(new).astype(np.int32), run_s=run_s, cpu_s=cpu_s,
                     compile_s=max(first - run_s / batches, 0.0))


def _ignore(event) -> None:
  del event


def solve_diffusion(sampler: Sampler, params, puzzles: np.ndarray, *, batch_size: int = 64, seed: int = 0,
                    hold_clues: bool = True, on_pass=None) -> SolveResult:
  """Block-diffusion solving with `sampler.generate`: one canvas per puzzle; with `hold_clues` the clues
  are given positions of the canvas (held in every pass) and the model writes only the blanks.
  `on_pass`: `generate`'s per-pass stream (e.g. to draw the canvas filling in), called for the passes of
  the measured run only: the warm-up streams to a no-op (the same compiled program, nothing drawn)."""
  length = sampler.canvas_length
  if length != sudoku.NUM_CELLS:
    raise ValueError(f"The model's canvas_length={length} is not the 81 cells of a Sudoku.")

  def decode(chunk, i, warm_up):
    canvas = given = None
    if hold_clues:
      canvas, given = sudoku.encode_solution_canvas(chunk), chunk != 0
    stream = _ignore if warm_up and on_pass is not None else on_pass
    out = sampler.generate(params, sudoku.encode_puzzle(chunk), jax.random.fold_in(jax.random.key(seed), i),
                           max_new_tokens=length, initial_canvas=canvas, given=given, on_pass=stream)
    return out.tokens, out.num_denoiser_passes

  return _run(decode, puzzles, batch_size, sampler.model.config.pad_id, held=hold_clues)


def solve_autoregressive(sampler: ARSampler, params, puzzles: np.ndarray, *, batch_size: int = 64,
                         seed: int = 0) -> SolveResult:
  """Greedy token-by-token solving with an `ARSampler` (81 forward passes per puzzle)."""

  def decode(chunk, i, warm_up):
    del warm_up  # nothing streams
    out = sampler.generate(params, sudoku.encode_puzzle(chunk), jax.random.fold_in(jax.random.key(seed), i),
                           max_new_tokens=sudoku.NUM_CELLS)
    return out.tokens, out.num_forward_passes

  return _run(decode, puzzles, batch_size, sampler.model.config.pad_id)


def solve(sampler: Sampler | ARSampler, params, puzzles: np.ndarray, **kwargs) -> SolveResult:
  """`solve_diffusion` for a `Sampler`, `solve_autoregressive` for an `ARSampler`."""
  if isinstance(sampler, Sampler):
    return solve_diffusion(sampler, params, puzzles, **kwargs)
  if isinstance(sampler, ARSampler):
    return solve_autoregressive(sampler, params, puzzles, **kwargs)
  raise ValueError(f"solve needs a Sampler or an ARSampler, got {type(sampler).__name__}.")


def by_clues(puzzles: np.ndarray, result: SolveResult) -> dict[int, dict[str, float]]:
  """Solve rate and passes per puzzle for each clue count present in `puzzles`."""
  clues = (np.asarray(puzzles) != 0).sum(-1)
  out = {}
  for k in sorted(set(clues.tolist())):
    rows = clues == k
    out[int(k)] = {"puzzles": int(rows.sum()), "solve_rate": float(result.solved[rows].mean()),
                   "passes_per_puzzle": float(result.passes[rows].mean())}
  return out

"""The sampler's statistics, each defined once, and the display of a traced generation.

Definitions (the same in the sampler output, `scripts/sample.py`, the benchmark, the sweep, the
evaluations and the notebook):
- a row's **new tokens**: its non-pad output tokens, which run up to and including its first stop token
  (after it everything is pad), as transformers' `generate` counts them; when infilling, the given
  positions are not new;
- a row's **tokens per forward**: its new tokens / its denoiser passes (`SampleOutput.tokens_per_forward`;
  what transformers returns, one per row);
- a run's **pooled_tokens_per_forward**: all new tokens / all denoiser passes of every row;
- a run's **mean_tokens_per_forward**: the mean of the rows' tokens per forward (heavy-tailed when some
  rows stop after few passes; reported beside the pooled figure, never under its name);
- **steps_per_canvas**: the mean number of passes over the canvases that ran;
- **tokens_per_second**: all new tokens / the wall time of a call that did not compile (compile time is
  reported apart, `benchmarks.measure.time_call`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from diffusiongemma.sampling.sampler import SampleOutput


def new_token_counts(tokens, pad_id: int, given=None) -> np.ndarray:
  """New tokens per row [B] of output tokens [B, T] (non-pad); with `given` [B, t <= T] (infilling), the
  given positions are not new."""
  new = np.asarray(tokens) != pad_id
  if given is not None:
    given = np.asarray(given, bool).reshape(new.shape[0], -1)
    new[:, :given.shape[1]] &= ~given
  return np.sum(new, axis=-1)


def new_tokens(row, stop_tokens: Sequence[int], pad_id: int) -> list[int]:
  """A row's new tokens as a list: up to and including its first stop token, without pad."""
  out = []
  for t in np.asarray(row).tolist():
    if t in stop_tokens:
      return out + [t]
    if t != pad_id:
      out.append(t)
  return out


def summary(tokens, canvas_passes, pad_id: int, seconds: float | None = None, given=None) -> dict[str, float]:
  """Run-level statistics of one or several outputs' `tokens` [B, T] and `canvas_passes` [B, K] (rows
  concatenated); with `seconds`, the wall time they took, tokens_per_second too; `given`: see
  `new_token_counts`."""
  counts = new_token_counts(tokens, pad_id, given)
  passes = np.asarray(canvas_passes)
  per_row = passes.sum(-1)
  ran = passes[passes > 0]
  out = {"rows": int(counts.size), "new_tokens": int(counts.sum()), "denoiser_passes": int(per_row.sum()),
         "pooled_tokens_per_forward": float(counts.sum() / max(int(per_row.sum()), 1)),
         "mean_tokens_per_forward": float(np.mean(counts / np.maximum(per_row, 1))),
         "steps_per_canvas": float(ran.mean()) if ran.size else 0.0}
  if seconds is not None:
    out["seconds"] = float(seconds)
    out["tokens_per_second"] = counts.sum() / seconds if seconds > 0 else float("inf")
  return out


def describe(values) -> str:
  """`key value, ...` with floats to three significant digits."""
  return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


def format_steps(out: SampleOutput, decode: Callable, row: int = 0, hide_token: int | None = None) -> list[str]:
  """One line per denoising step of `row`: canvas, step, accepted count and the argmax canvas text
  (`hide_token`, e.g. the mask token, left out)."""
  if out.trace is None:
    raise ValueError("generate(..., return_trace=True) is needed to show the steps.")
  passes = np.asarray(out.canvas_passes)[row]
  argmax = np.asarray(out.trace.argmax)[:, :, row]  # [K, N, C]
  accepted = np.asarray(out.trace.accepted)[:, :, row].sum(-1)  # [K, N]
  lines = []
  for k in range(argmax.shape[0]):
    for n in range(int(passes[k])):
      ids = [int(t) for t in argmax[k, n] if t != hide_token]
      text = decode(ids).replace("\n", "\\n")
      lines.append(f"canvas {k} step {n + 1:2d} accepted {int(accepted[k, n]):3d} | {text}")
  return lines


def accepted_per_step(out: SampleOutput) -> np.ndarray:
  """Mean accepted tokens per step over the rows still running [K, N] (NaN where none ran)."""
  if out.trace is None:
    raise ValueError("generate(..., return_trace=True) is needed.")
  passes = np.asarray(out.canvas_passes)  # [B, K]
  accepted = np.asarray(out.trace.accepted).sum(-1).astype(float)  # [K, N, B]
  running = np.arange(accepted.shape[1])[None, :, None] < passes.T[:, None, :]  # [K, N, B]
  with np.errstate(invalid="ignore"):
    return np.where(running, accepted, 0).sum(-1) / running.sum(-1)

"""Infilling: a canvas whose given positions are held, built from text with `[MASK]` markers.

A canvas for infilling is `initial_canvas` plus `given` [T] bool: the positions whose tokens are part of
the request. How the sampler holds them (phase 2 of the constraints issue), for both noise processes:
- the first canvas is `where(given, tokens, noise)` (uniform: random tokens; masked: the mask token);
- every step's re-noising keeps given positions (`where(given, canvas, renoised)`), masked noise marks
  them fixed from the start (so they are never eligible for acceptance), and the argmax canvas that is
  committed is `where(given, tokens, argmax)`;
- with a constraint, `given` and `tokens` are the `given` / `given_tokens` of `dp.viterbi` and
  `dp.allowed_tokens`, so the constrained canvas goes through the given text.
The model still sees every position (given ones included), so a hole is filled in context on both sides.

Markers: each `[MASK]` is one position to fill; `[MASK:n]` is n positions. Text between markers is
tokenised piece by piece (a token never spans a hole).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np


@dataclasses.dataclass(frozen=True)
class InfillCanvas:
  tokens: np.ndarray  # [T] int32: given tokens; `fill_id` at the positions to fill
  given: np.ndarray  # [T] bool: positions held as given


def infill_canvas(text: str, tokenizer, *, marker: str = "[MASK]", length: int | None = None,
                  fill_id: int = 0, stop_id: int | None = None, pad_id: int = 0) -> InfillCanvas:
  """(tokens, given) for `text` whose markers mark the positions to fill.

  length: the canvas length T (e.g. canvases x canvas length); positions after the text are free
    (the model continues the text) unless `stop_id` is given, in which case the text is the whole
    answer: a given stop token follows it and given pad fills the rest. Default: the text's length
    (plus the stop token).
  tokenizer: anything with `encode(str) -> list[int]`.
  """
  if not marker:
    raise ValueError("The infill marker must be a non-empty string.")
  if marker.endswith("]"):
    pattern = re.compile(re.escape(marker[:-1]) + r"(?::(\d+))?" + re.escape("]"))
  else:
    pattern = re.compile(re.escape(marker) + r"()")
  tokens, given, pos, holes = [], [], 0, 0
  for match in pattern.finditer(text):
    piece = tokenizer.encode(text[pos:match.start()]) if match.start() > pos else []
    count = int(match.group(1)) if match.group(1) else 1
    if count < 1:
      raise ValueError(f"Infill marker {match.group(0)!r} asks for {count} positions; at least 1.")
    tokens += list(piece) + [fill_id] * count
    given += [True] * len(piece) + [False] * count
    pos, holes = match.end(), holes + 1
  if holes == 0:
    raise ValueError(f"The text has no infill marker {marker!r}: nothing to fill.")
  tail = tokenizer.encode(text[pos:]) if pos < len(text) else []
  tokens += list(tail)
  given += [True] * len(tail)
  if stop_id is not None:
    tokens.append(stop_id)
    given.append(True)
  length = len(tokens) if length is None else length
  if length < len(tokens):
    raise ValueError(f"The infill text needs {len(tokens)} positions but the canvas has {length}; "
                     f"raise max_new_tokens to at least {len(tokens)}.")
  extra = length - len(tokens)
  if stop_id is not None:
    tokens, given = tokens + [pad_id] * extra, given + [True] * extra
  else:
    tokens, given = tokens + [fill_id] * extra, given + [False] * extra
  return InfillCanvas(tokens=np.asarray(tokens, np.int32), given=np.asarray(given, bool))

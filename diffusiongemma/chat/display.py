"""Showing chat turns: a draft redrawn in place on a terminal while it denoises, then the reply as text.

`LiveDraft` is an `on_step` for `ChatSampler.send`: each denoiser pass it erases what it drew and writes
the reply so far (committed canvases and the current argmax canvas, already split into thought and answer
by `ReplyStream`, so no control token shows), cut to the rows that fit on the screen. `format_reply`
writes the prompt, the thought and the answer under their own headings and the statistics; with
`style=False` (stdout is not a terminal) it is plain text with no escape sequences and nothing redrawn.
"""

from __future__ import annotations

import shutil
import sys
import unicodedata
from typing import TextIO

from diffusiongemma.chat.format import ReplyParts
from diffusiongemma.chat.sampler import Draft, Reply

BOLD, DIM, RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"
_ERASE_UP = "\x1b[{}F\x1b[J"  # to the start of the line `n` rows up, then clear to the end of the screen


def printable(text: str) -> str:
  """`text` with control characters other than newline and tab shown as U+FFFD (a random or confused
  model may emit escape sequences that would drive the terminal)."""
  return "".join("\ufffd" if unicodedata.category(ch) == "Cc" and ch not in "\n\t" else ch for ch in text)


def _columns(line: str) -> int:
  """Terminal columns of a line without escape sequences (wide characters take two)."""
  return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in line)


def _line_rows(line: str, width: int) -> int:
  return max(1, -(-_columns(line) // width))


def _rows(text: str, width: int) -> int:
  """Terminal rows `text` (no escape sequences) takes at `width` columns."""
  return sum(_line_rows(line, width) for line in text.split("\n"))


def _last_rows(text: str, width: int, rows: int) -> str:
  """The end of `text` that fits in `rows` terminal rows."""
  kept, used = [], 0
  for line in reversed(text.split("\n")):
    need = _line_rows(line, width)
    if used + need > rows:
      room, start = (rows - used) * width, len(line)  # keep the end of the line that fits
      while start > 0 and _columns(line[start - 1]) <= room:
        room -= _columns(line[start - 1])
        start -= 1
      if start < len(line):
        kept.append(line[start:])
      break
    kept.append(line)
    used += need
  return "\n".join(reversed(kept))


class LiveDraft:
  """An `on_step` that redraws the draft in place on a terminal (`stream`, default stdout)."""

  def __init__(self, stream: TextIO | None = None):
    self.stream = stream or sys.stdout
    self._drawn = 0  # rows written by the last draw

  def __call__(self, draft: Draft) -> None:
    columns, lines = shutil.get_terminal_size()
    width, room = max(columns, 20), max(lines - 2, 3)
    header = f"canvas {draft.canvas + 1}, step {draft.step + 1}"
    body = _draft_text(draft.parts)
    body = _last_rows(body, width, room - 1)
    self.clear()
    self.stream.write(f"{DIM}{header}{RESET}\n{body}\n")
    self.stream.flush()
    self._drawn = 1 + _rows(body, width)

  def clear(self) -> None:
    """Erases the last draw."""
    if self._drawn:
      self.stream.write(_ERASE_UP.format(self._drawn))
      self.stream.flush()
      self._drawn = 0


def _draft_text(parts: ReplyParts) -> str:
  """The draft as plain text (no escape sequences, so that its rows can be counted)."""
  thought, text = printable(parts.thought), printable(parts.text)
  if thought:
    return f"(thinking) {thought}" + (f"\n{text}" if text else "")
  return text


def _heading(title: str, style: bool) -> str:
  return f"{BOLD}{title}{RESET}" if style else f"--- {title} ---"


def format_prompt(prompt: str, *, style: bool) -> str:
  """The rendered prompt under a heading, exactly as the model reads it (with `<bos>` and control tokens)."""
  return f"{_heading('prompt', style)}\n{printable(prompt) if style else prompt}"


def format_stats(stats) -> str:
  """tokens, tokens/s (marked when the call compiled), tokens per forward, and what was encoded."""
  speed = f"{stats['tokens_per_second']:.1f} tokens/s" + (" (includes compilation)" if stats.get("compiled") else "")
  return (f"{stats['new_tokens']} tokens in {stats['seconds']:.2f} s, {speed}, "
          f"{stats['pooled_tokens_per_forward']:.2f} tokens per forward ({stats['denoiser_passes']} denoiser "
          f"passes); prompt {stats['prompt_tokens']} tokens, {stats['encoded_tokens']} encoded, "
          f"{stats['reused_tokens']} from the cache")


def format_reply(reply: Reply, *, style: bool) -> str:
  """The thought (under its own heading, when there is one), the answer and the statistics."""
  clean = printable if style else (lambda s: s)
  parts = []
  if reply.thought:
    parts.append(f"{_heading('thought', style)}\n{DIM + clean(reply.thought) + RESET if style else reply.thought}")
  parts.append(f"{_heading('answer', style)}\n{clean(reply.text)}")
  stats = format_stats(reply.stats)
  parts.append(f"{DIM}{stats}{RESET}" if style else f"--- {stats}")
  return "\n".join(parts)

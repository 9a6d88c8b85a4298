"""One request's row of a batched generation: from the sampler's per-pass events to what its client sees.

A `Row` gets every `PassEvent` of the batch (its own row of it) while the compiled program runs:
- with `canvas_events`, after every pass an `("canvas", payload)` event: the argmax canvas (token ids and
  their pieces), the positions this pass accepted, the fixed ones, the pass number and the draft reply;
- when its canvas is complete (the row is done, or the step cap is reached), the argmax canvas is what the
  sampler commits: its tokens up to the first stop token, capped at `max_tokens`, are fed to the reply
  splitter (`chat.format.ReplyStream`: thought and answer apart, no control token in either), and the new
  text goes out as `("delta", {"content": ..., "reasoning_content": ...})`;
- the row is finished at a stop token, at `max_tokens` tokens, or when a `stop` string appears in the answer
  (the answer is cut before it): `("done", Result)`. It leaves then, even while the batch runs on.

Deltas never hold text that could still change: trailing whitespace (the final answer is stripped) and a
tail that could begin a stop string wait for the next canvas, so the concatenated deltas are exactly the
final answer. `completion_tokens` counts the row's own tokens: up to and including its stop token, or up
to the token that completed a stop string, never more than `max_tokens`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from diffusiongemma.chat import format as fmt


@dataclasses.dataclass(frozen=True)
class Result:
  """A finished row: the answer, the thought, why it ended ("stop" | "length"), its token ids, its
  completion token count, and the denoiser passes and canvases that counted for it."""

  content: str
  reasoning: str
  finish_reason: str
  tokens: tuple[int, ...]
  completion_tokens: int
  passes: int
  canvases: int


class PlainStream:
  """`ReplyStream`'s interface for a tokenizer without the Gemma 4 chat tokens (a training workdir's):
  the decoded text up to a stop id, no thought."""

  def __init__(self, tokenizer, stop_ids: Sequence[int]):
    self._decode, self._stops = tokenizer.decode, set(stop_ids)
    self.tokens: list[int] = []
    self.finished = False

  def feed(self, ids) -> fmt.ReplyParts:
    for token in ids:
      if self.finished:
        break
      self.tokens.append(int(token))
      self.finished = int(token) in self._stops
    return self.view()

  def _parts(self, ids, partial: bool) -> fmt.ReplyParts:
    ids = [t for t in ids if t not in self._stops]
    text = self._decode(ids)
    text = text.lstrip().rstrip("\ufffd") if partial else text.strip()
    return fmt.ReplyParts("", text, self.finished, False)

  def view(self, draft=()) -> fmt.ReplyParts:
    draft = [int(t) for t in draft]
    return self._parts(self.tokens + (draft if not self.finished else []), partial=True)

  def result(self) -> fmt.ReplyParts:
    return self._parts(self.tokens, partial=False)


def _stop_at(text: str, stops: Sequence[str]) -> int | None:
  hits = [i for i in (text.find(s) for s in stops) if i >= 0]
  return min(hits) if hits else None


def _safe_length(text: str, stops: Sequence[str]) -> int:
  """How much of `text` can be sent: not trailing whitespace, nor a tail that may begin a stop string."""
  keep = len(text)
  for stop in stops:
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
      if text.endswith(stop[:n]):
        keep = min(keep, len(text) - n)
        break
  return len(text[:keep].rstrip())


class Row:
  """The state of one request in a running batch (see the module docstring).

  stream: a `ReplyStream` (or `PlainStream`); stop_ids: the sampler's stop tokens; steps: its step cap;
  pieces: id -> text for canvas events (None: no canvas events); send: where events go.
  """

  def __init__(self, stream, *, stop_ids: Sequence[int], max_tokens: int, stop: Sequence[str], steps: int,
               send: Callable[[tuple], None], pieces: Callable[[int], str] | None = None):
    self.stream, self.stop_ids, self.max_tokens = stream, frozenset(int(t) for t in stop_ids), max_tokens
    self.stop, self.steps, self.send, self.pieces = tuple(stop), steps, send, pieces
    self.tokens: list[int] = []
    self.passes = 0
    self.canvases = 0
    self.result: Result | None = None
    self._sent = {"reasoning_content": "", "content": ""}

  @property
  def finished(self) -> bool:
    return self.result is not None

  def on_pass(self, canvas_index: int, step: int, argmax, accepted, fixed, active: bool, done: bool) -> None:
    """One pass of the batch, this row's slice of it."""
    if self.finished:
      return
    self.passes += int(active)
    complete = done or step + 1 >= self.steps
    if self.pieces is not None and active:
      self._canvas_event(canvas_index, step, argmax, accepted, fixed, complete)
    if complete and canvas_index == self.canvases:  # once: a row that is done sees the batch's later passes
      self.commit(argmax)

  def _own(self, canvas) -> tuple[list[int], bool]:
    """The canvas's tokens that belong to this row's output, and whether a stop token ends them."""
    tokens = []
    for token in canvas:
      tokens.append(int(token))
      if int(token) in self.stop_ids:
        break
    tokens = tokens[:self.max_tokens - len(self.tokens)]
    return tokens, bool(tokens) and tokens[-1] in self.stop_ids

  def _canvas_event(self, canvas_index, step, argmax, accepted, fixed, complete) -> None:
    ids = [int(t) for t in argmax]
    draft = self.stream.view(self._own(ids)[0])
    self.send(("canvas", {
        "canvas": canvas_index, "pass": step + 1, "tokens": ids, "pieces": [self.pieces(t) for t in ids],
        "accepted": [bool(a) for a in accepted], "fixed": [bool(f) for f in fixed], "complete": bool(complete),
        "committed_tokens": len(self.tokens),
        "draft": {"content": draft.text, "reasoning_content": draft.thought}}))

  def commit(self, canvas) -> None:
    """A committed canvas (argmax, before stop-token padding): append, stream, maybe finish."""
    if self.finished:
      return
    self.canvases += 1
    tokens, stopped = self._own(canvas)
    parts = self.stream.view(tokens)
    if _stop_at(parts.text, self.stop) is not None:
      # The answer holds a stop string: the row used the tokens up to the one that completed it.
      used = next(n for n in range(1, len(tokens) + 1)
                  if _stop_at(self.stream.view(tokens[:n]).text, self.stop) is not None)
      self.stream.feed(tokens[:used])
      self.tokens += tokens[:used]
      final = self.stream.result()
      cut = _stop_at(final.text, self.stop)  # None when stripping removed it (e.g. a trailing "\n")
      self._finish(final.text[:cut].rstrip(), final.thought, "stop")
      return
    self.stream.feed(tokens)
    self.tokens += tokens
    if stopped or len(self.tokens) >= self.max_tokens:
      final = self.stream.result()
      self._finish(final.text, final.thought, "stop" if stopped else "length")
      return
    self._deltas(parts, final=False)

  def _deltas(self, parts: fmt.ReplyParts, final: bool) -> None:
    delta = {}
    for field, text in (("reasoning_content", parts.thought), ("content", parts.text)):
      if not final:
        text = text[:_safe_length(text, self.stop if field == "content" else ())]
      sent = self._sent[field]
      if len(text) > len(sent) and text.startswith(sent):
        delta[field] = text[len(sent):]
        self._sent[field] = text
    if delta:
      self.send(("delta", delta))

  def _finish(self, content: str, reasoning: str, reason: str) -> None:
    self._deltas(fmt.ReplyParts(reasoning, content, True, False), final=True)
    self.result = Result(content, reasoning, reason, tuple(self.tokens), len(self.tokens), self.passes,
                         self.canvases)
    self.send(("done", self.result))

  def finish_unended(self) -> None:
    """The batch ended without this row finishing (its canvases ran out): what it has is the answer."""
    if not self.finished:
      final = self.stream.result()
      self._finish(final.text, final.thought, "length")

"""The Gemma 4 chat format: a conversation to its exact prompt (text and ids), a reply to thought + answer.

Prompt (Gemma 4's chat template, the `chat_template.jinja` its checkpoints ship, followed whitespace for
whitespace):

    <bos><|turn>system\n<|think|>\n{system}<turn|>\n<|turn>user\n{user}<turn|>\n<|turn>model\n{answer}<turn|>\n
    ...<|turn>user\n{user}<turn|>\n<|turn>model\n

- The system turn is written when the conversation starts with one or thinking is on (then it may be
  empty); `<|think|>\n` opens it when thinking is on. Every content is stripped of surrounding whitespace.
- Earlier model turns go back as their answer only: their thought, and any `<|channel>...<channel|>`
  left in their text, is dropped (the template's `strip_thinking`).
- The prompt ends with `<|turn>model\n`, which opens the reply. Gemma 4's larger checkpoints (12B, 26B,
  31B) prefill an empty, closed thought channel `<|channel>thought\n<channel|>` there when thinking is
  off (`empty_thought=True`; `template_prefills_empty_thought` reads it from a checkpoint's template).

Reply: `<|channel>thought\n{reasoning}<channel|>{answer}<turn|>`. The parsers here split it into
`thought` and `text`; `<turn|>`, eos and `<|turn>` (the model starting a turn of its own) end it; an
unterminated channel is all thought with an empty answer; any other control token (stray `<channel|>`,
`<|think|>`, image placeholders, pad, ...) is dropped, so no raw control token ever reaches `text`.
`ReplyStream` does this incrementally on token ids (committed tokens plus an optional provisional draft,
e.g. a canvas still being denoised); `split_reply_text(..., partial=True)` does it on decoded text and
holds back a trailing fragment that could still become a control token (e.g. `<|chan`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence

from diffusiongemma import _files

TURN_OPEN, TURN_CLOSE = "<|turn>", "<turn|>"
THINK = "<|think|>"
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
THOUGHT_CHANNEL = "thought"
EMPTY_THOUGHT = f"{CHANNEL_OPEN}{THOUGHT_CHANNEL}\n{CHANNEL_CLOSE}"
ROLES = ("system", "user", "model")
_ROLE_ALIASES = {"assistant": "model"}
# Ends a reply in text (token ids: `<turn|>`, `<|turn>`, the tokenizer's eos and any `stop_ids`).
TEXT_STOPS = (TURN_CLOSE, TURN_OPEN, "<eos>")
# Gemma's control-token spellings (`<|x>`, `<x|>`, `<|x|>`) and its named specials, for parsing text.
_CONTROL_RE = re.compile(r'(<\|[\w"]+\|?>|<[\w"]+\|>|<(?:bos|eos|pad|unk|mask)>)')
_PARTIAL_RE = re.compile(r'<\|?[\w"]*\|?$')  # a suffix that may still grow into a control token


Message = Mapping[str, str]


def _role(message: Message, index: int) -> str:
  if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
    raise ValueError(f"Message {index} must be a mapping with 'role' and 'content', got {message!r}.")
  role = _ROLE_ALIASES.get(message["role"], message["role"])
  if role not in ROLES:
    raise ValueError(f"Message {index} has role {message['role']!r}; allowed: {ROLES} ('assistant' = 'model').")
  if not isinstance(message["content"], str):
    raise ValueError(f"Message {index} ({role}) has content of type {type(message['content']).__name__}; "
                     "expected str.")
  if "thought" in message and role != "model":
    raise ValueError(f"Message {index} is a {role} turn with a 'thought'; only model turns have one.")
  if "media" in message and (role != "user" or not isinstance(message["media"], str)):
    raise ValueError(f"Message {index} is a {role} turn with 'media'; only user turns have it (a str).")
  return role


def strip_thought(text: str) -> str:
  """`text` without any `<|channel>...<channel|>` span (or an unterminated `<|channel>...` tail), stripped."""
  kept = []
  for part in text.split(CHANNEL_CLOSE):
    kept.append(part.split(CHANNEL_OPEN)[0] if CHANNEL_OPEN in part else part)
  return "".join(kept).strip()


class _Control(str):
  """A control token of the template itself (written by this module, never taken from message text)."""


def _trusted(text: str) -> list[str]:
  """Text this module or its caller's own code wrote (e.g. `media`: image placeholders, video
  timestamps), with its control tokens marked as such."""
  return [_Control(piece) if i % 2 else piece for i, piece in enumerate(_CONTROL_RE.split(text)) if piece]


def render_parts(messages: Sequence[Message], *, thinking: bool = False, add_generation_prompt: bool = True,
                 empty_thought: bool = False, bos_token: str = "<bos>") -> list[str]:
  """The prompt as a list of pieces: the template's control tokens (`_Control`) and text; message text is
  always text, whatever it spells (see `render_prompt`)."""
  if not messages and not thinking:
    raise ValueError("Cannot render an empty conversation (no messages and thinking off).")
  roles = [_role(m, i) for i, m in enumerate(messages)]
  for i, role in enumerate(roles[1:], 1):
    if role == "system":
      raise ValueError(f"Message {i} is a system turn; only the first message may be one.")
  parts: list[str] = [_Control(bos_token)] if bos_token else []
  turn = lambda role, *body: [_Control(TURN_OPEN), f"{role}\n", *body, _Control(TURN_CLOSE), "\n"]
  first = 0
  if (roles and roles[0] == "system") or thinking:
    system = messages[0]["content"].strip() if roles and roles[0] == "system" else ""
    first = 1 if roles and roles[0] == "system" else 0
    parts += turn("system", *([_Control(THINK), "\n"] if thinking else []), system)
  for message, role in zip(messages[first:], roles[first:]):
    content = strip_thought(message["content"]) if role == "model" else message["content"].strip()
    parts += turn(role, *_trusted(message.get("media", "")), content)
  if add_generation_prompt:
    parts += [_Control(TURN_OPEN), "model\n"]
    if empty_thought and not thinking:
      parts += [_Control(CHANNEL_OPEN), f"{THOUGHT_CHANNEL}\n", _Control(CHANNEL_CLOSE)]
  return [p for p in parts if p]


def render_prompt(messages: Sequence[Message], *, thinking: bool = False, add_generation_prompt: bool = True,
                  empty_thought: bool = False, bos_token: str = "<bos>") -> str:
  """The exact prompt text of a conversation (see the module docstring).

  messages: dicts with 'role' ('system' first only, 'user', 'model'), 'content' (str) and, on model
    turns, an optional 'thought' (never written back: earlier thoughts are dropped); on user turns an
    optional 'media': text the caller's code wrote before the content (image placeholders, video
    timestamps), whose control tokens count as such. Control-token spellings inside 'content' are
    text: `render_ids` encodes them as text, so a message cannot open or close a turn.
  thinking: `<|think|>` at the start of the system turn (one is created if there is none).
  add_generation_prompt: end with `<|turn>model\n`, where the reply starts.
  empty_thought: with thinking off, prefill `<|channel>thought\n<channel|>` after it.
  """
  return "".join(render_parts(messages, thinking=thinking, add_generation_prompt=add_generation_prompt,
                              empty_thought=empty_thought, bos_token=bos_token))


def render_ids(messages: Sequence[Message], tokenizer, **options) -> list[int]:
  """The prompt's token ids: bos, the template's control tokens by id, and the text between them encoded
  with special-token parsing off, so that `<turn|>` or `<|turn>system` written in a message stays text (a
  user cannot forge a turn).

  `tokenizer` must know the Gemma 4 control tokens (a `CheckpointTokenizer`); `options` as
  `render_prompt`.
  """
  control = getattr(tokenizer, "control_ids", {})
  missing = [t for t in (TURN_OPEN, TURN_CLOSE, THINK, CHANNEL_OPEN, CHANNEL_CLOSE) if t not in control]
  if missing:
    raise ValueError(f"The Gemma 4 chat format needs a tokenizer with its control tokens; {tokenizer!r} "
                     f"lacks {missing} (a training workdir's tokenizer has none).")
  ids, run = [tokenizer.bos_id], []
  for part in render_parts(messages, bos_token="", **options):
    if isinstance(part, _Control):
      ids += tokenizer.encode("".join(run), parse_special=False) if run else []
      ids.append(control[part] if part in control else tokenizer.token_id(part))
      run = []
    else:
      run.append(part)
  return ids + (tokenizer.encode("".join(run), parse_special=False) if run else [])


def template_prefills_empty_thought(folder: os.PathLike | str) -> bool:
  """Whether a checkpoint's chat template prefills `<|channel>thought\\n<channel|>` (thinking off).

  Reads `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`; False when there is none.
  """
  folder = pathlib.Path(folder)
  template = ""
  if _files.present(folder / "chat_template.jinja"):
    template = _files.read_text(folder / "chat_template.jinja")
  elif _files.present(folder / "tokenizer_config.json"):
    template = _files.read_json(folder / "tokenizer_config.json").get("chat_template") or ""
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
      template = " ".join(t.get("template", "") for t in template if isinstance(t, dict))
    if not isinstance(template, str):
      raise _files.BadFileError(f"{folder / 'tokenizer_config.json'}: chat_template is {template!r}; expected a "
                                "string or a list of {'name': ..., 'template': ...} objects.")
  return EMPTY_THOUGHT.replace("\n", "\\n") in template or EMPTY_THOUGHT in template


@dataclasses.dataclass(frozen=True)
class ReplyParts:
  """A reply split: `thought` (the thought channel), `text` (the answer, never holding a control token),
  `finished` (a stop token ended it), `in_thought` (it ends inside an open channel)."""

  thought: str
  text: str
  finished: bool
  in_thought: bool


class _Splitter:
  """The reply state machine over text pieces and control tokens (given by their text)."""

  def __init__(self, stops: frozenset[str], in_thought: bool):
    self.stops = stops
    self.state = "thought" if in_thought else "answer"  # | "header" (after <|channel>) | "done"
    self.header, self.thought, self.text = "", [], []

  def clone(self) -> _Splitter:
    other = _Splitter(self.stops, False)
    other.state, other.header = self.state, self.header
    other.thought, other.text = list(self.thought), list(self.text)
    return other

  def add_text(self, piece: str) -> None:
    if not piece or self.state == "done":
      return
    if self.state == "header":
      self.header += piece
      if "\n" in self.header:  # the channel's name ends at the first newline
        name, rest = self.header.split("\n", 1)
        self.header, self.state = "", "thought"
        self.thought.append(_header_as_thought(name) + rest)
    elif self.state == "thought":
      self.thought.append(piece)
    else:
      self.text.append(piece)

  def add_control(self, token: str) -> None:
    if self.state == "done":
      return
    if token in self.stops:
      self._close_header()
      self.state = "done"
    elif token == CHANNEL_OPEN and self.state == "answer":
      self.state, self.header = "header", ""
    elif token == CHANNEL_CLOSE and self.state in ("header", "thought"):
      self._close_header()
      self.state = "answer"
    # Anything else is a stray control token: dropped.

  def _close_header(self) -> None:
    if self.state == "header":
      self.thought.append(_header_as_thought(self.header))
      self.header = ""

  def parts(self, partial: bool) -> ReplyParts:
    """The split so far; `partial` keeps a still-open channel's name out and leaves trailing space."""
    thought, text = "".join(self.thought), "".join(self.text)
    if not partial and self.state == "header":
      thought += _header_as_thought(self.header)
    if partial:
      thought, text = thought.lstrip().rstrip("\ufffd"), text.lstrip().rstrip("\ufffd")
    else:
      thought, text = thought.strip(), text.strip()
    return ReplyParts(thought, text, self.state == "done", self.state in ("header", "thought"))


def _header_as_thought(header: str) -> str:
  """A channel header is its name (dropped) unless it cannot be the thought channel's (then it is thought)."""
  return "" if THOUGHT_CHANNEL.startswith(header.strip()) else header


def split_reply_text(text: str, *, in_thought: bool = False, partial: bool = False,
                     stop_tokens: Iterable[str] = ()) -> ReplyParts:
  """Splits a decoded reply (control tokens written as text) into thought and answer.

  in_thought: the prompt already opened the thought channel. partial: the text may still grow (a
  streamed draft): a trailing fragment that could become a control token is held back.
  stop_tokens: more texts that end the reply, besides `<turn|>`, `<|turn>` and `<eos>`.
  """
  splitter = _Splitter(frozenset(TEXT_STOPS) | frozenset(stop_tokens), in_thought)
  if partial:
    text = _PARTIAL_RE.sub("", text)
  for i, piece in enumerate(_CONTROL_RE.split(text)):
    if i % 2:
      splitter.add_control(piece)
    else:
      splitter.add_text(piece)
  return splitter.parts(partial)


class ReplyStream:
  """Splits a reply given as token ids, incrementally: `feed` appends committed tokens, `view` shows
  them followed by a provisional `draft` (e.g. the canvas being denoised) without keeping it.

  Control tokens are recognised by id (`tokenizer.special_tokens`, id -> text), so no partial control
  token can show; a trailing incomplete UTF-8 character (U+FFFD) is held back until it completes.
  `stop_ids`: more ids that end the reply (e.g. the checkpoint's eos ids), besides `<turn|>`, `<|turn>`
  and the tokenizer's eos.
  """

  def __init__(self, tokenizer, *, in_thought: bool = False, stop_ids: Iterable[int] = ()):
    special = getattr(tokenizer, "special_tokens", None)
    if not special or TURN_CLOSE not in special.values():
      raise ValueError(f"Splitting a Gemma 4 reply needs a tokenizer with its control tokens; {tokenizer!r} "
                       "has none (a training workdir's tokenizer has none).")
    self._special: Mapping[int, str] = special
    self._decode = tokenizer.decode
    stops = {TURN_CLOSE, TURN_OPEN, special.get(tokenizer.eos_id, "<eos>")}
    for i in stop_ids:
      if int(i) not in special:
        raise ValueError(f"Stop id {int(i)} is not a special token of {tokenizer!r}.")
      stops.add(special[int(i)])
    self._state = _Splitter(frozenset(stops), in_thought)
    self._pending: list[int] = []  # committed ordinary ids since the last control token, not yet decoded
    self.tokens: list[int] = []

  def _push(self, state: _Splitter, pending: list[int], token: int) -> None:
    if token in self._special:
      state.add_text(self._decode(pending))
      pending.clear()
      state.add_control(self._special[token])
    else:
      pending.append(token)

  def feed(self, ids: Iterable[int]) -> ReplyParts:
    """Appends committed token ids; returns the split so far (as `view()`)."""
    for token in ids:
      if self._state.state == "done":
        break
      self.tokens.append(int(token))
      self._push(self._state, self._pending, int(token))
    return self.view()

  def view(self, draft: Iterable[int] = ()) -> ReplyParts:
    """The split of the committed tokens followed by `draft`, for display (partial)."""
    state, pending = self._state.clone(), list(self._pending)
    for token in draft:
      self._push(state, pending, int(token))
    state.add_text(self._decode(pending))
    return state.parts(partial=True)

  @property
  def finished(self) -> bool:
    return self._state.state == "done"

  def result(self) -> ReplyParts:
    """The final split of the committed tokens (stripped; an unterminated channel is all thought)."""
    state = self._state.clone()
    state.add_text(self._decode(self._pending))
    return state.parts(partial=False)


def split_reply(ids: Iterable[int], tokenizer, *, in_thought: bool = False,
                stop_ids: Iterable[int] = ()) -> ReplyParts:
  """Splits a finished reply given as token ids (see `ReplyStream`)."""
  stream = ReplyStream(tokenizer, in_thought=in_thought, stop_ids=stop_ids)
  stream.feed(ids)
  return stream.result()

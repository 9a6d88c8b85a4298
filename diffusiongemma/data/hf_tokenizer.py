"""A transformers checkpoint's own tokenizer, and `load_tokenizer`: the right tokenizer for a folder.

A released checkpoint ships `tokenizer.json` (read with the `tokenizers` library) and/or `tokenizer.model`
(sentencepiece); `tokenizer_config.json` names its bos/eos/pad tokens. Gemma 4 marks its control tokens
(`<|turn>`, `<turn|>`, `<|think|>`, `<|channel>`, ...) as *special added tokens* in tokenizer.json, so a
control token written in text encodes to its single id, and decoding can keep or drop them. Both file
kinds are held to that here: a control token that the file only lists as an ordinary piece is registered
as a special token (same id), and the sentencepiece path splits text at control tokens before encoding.

`TokenizerLike` is the minimal interface callers rely on (encode, decode, bos/eos/pad ids, vocab size);
both this class and the project's sentencepiece `Tokenizer` (a training workdir's) satisfy it.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

from diffusiongemma import _files
from diffusiongemma.data import tokenizer as sp_tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"

# Gemma 4 control tokens the chat format and the image placeholders need.
REQUIRED_CONTROL_TOKENS = ("<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|image|>",
                           "<|image>", "<image|>")
# Looked up when the checkpoint has them (audio placeholders, tool-use tokens).
OPTIONAL_CONTROL_TOKENS = ("<|audio|>", "<|audio>", "<audio|>", "<|tool>", "<tool|>", "<|tool_call>",
                           "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>')
_DEFAULT_NAMED = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}


@runtime_checkable
class TokenizerLike(Protocol):
  """What sampling and chat code needs of a tokenizer, whichever kind it is."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def bos_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Iterable[int]) -> str: ...


def check_fits(tokenizer: TokenizerLike, vocab_size: int, source: str, hint: str = "") -> None:
  """Refuses a tokenizer with ids that a model of `vocab_size` tokens cannot read or write (it would sample
  empty or wrong text). `source` names where `vocab_size` comes from; `hint` ends the message."""
  if tokenizer.vocab_size > vocab_size:
    name = getattr(tokenizer, "path", None)
    raise ValueError(f"The tokenizer{f' {name}' if name else ''} has {tokenizer.vocab_size} tokens, more than the "
                     f"model's vocabulary of {vocab_size} ({source}){f': {hint}' if hint else ''}.")


class CheckpointTokenizer:
  """The tokenizer of a transformers checkpoint folder: `tokenizer.json`, else `tokenizer.model`.

  `encode(text)` adds no bos unless `add_bos=True`; control tokens written in the text become their ids,
  unless `parse_special=False` (then they are text like any other: untrusted text, e.g. a user's message).
  `decode(ids)` drops special tokens (bos, eos, pad, control tokens) unless `skip_special_tokens=False`.
  `control_ids` maps each Gemma 4 control token found to its id (all of `REQUIRED_CONTROL_TOKENS`, any
  of `OPTIONAL_CONTROL_TOKENS`; empty for a text tokenizer without them, which completes text but cannot
  chat); `special_tokens` maps every special id to its text. bos/eos/pad are the tokens
  tokenizer_config.json names, else Gemma's `<bos>`/`<eos>`/`<pad>`, else a sentencepiece model's own.
  """

  def __init__(self, folder: os.PathLike | str):
    self.folder = pathlib.Path(folder)
    if not self.folder.is_dir():
      raise FileNotFoundError(f"Tokenizer folder {str(self.folder)!r} does not exist.")
    json_file, model_file = self.folder / TOKENIZER_JSON, self.folder / TOKENIZER_MODEL
    if _files.present(json_file):
      self.path = json_file
      self._backend = _JsonBackend(json_file)
    elif _files.present(model_file):
      self.path = model_file
      self._backend = _SentencePieceBackend(model_file)
    else:
      raise FileNotFoundError(f"{self.folder} has no tokenizer: neither {TOKENIZER_JSON} nor {TOKENIZER_MODEL}.")
    configured = _named_tokens(self.folder / TOKENIZER_CONFIG)
    named = {**_DEFAULT_NAMED, **configured}
    self._named = {}
    for name, text in named.items():  # Gemma's spelling, unless tokenizer_config.json names another
      token_id = self._backend.token_to_id(text)
      if token_id is None and name not in configured and (own := self._backend.role_id(name)) is not None:
        token_id, named[name] = own, self._backend.id_to_token(own)  # e.g. this project's sentencepiece model
      self._named[name] = self._require(text, name) if token_id is None else token_id
    # The Gemma 4 control tokens: all of them (a chat model's tokenizer) or none (text completion only, e.g.
    # a model trained here on its own sentencepiece tokenizer); some but not all is a damaged tokenizer.
    found = [t for t in REQUIRED_CONTROL_TOKENS if self._backend.token_to_id(t) is not None]
    self.control_ids: dict[str, int] = {t: self._require(t, "control token") for t in REQUIRED_CONTROL_TOKENS
                                        if found}
    self.control_ids.update({t: i for t in OPTIONAL_CONTROL_TOKENS
                             if found and (i := self._backend.token_to_id(t)) is not None})
    self._backend.mark_special(list(named.values()) + list(self.control_ids))
    self.special_tokens: dict[int, str] = self._backend.special_tokens()
    for text in self.control_ids:  # e.g. a sentencepiece piece that its model does not treat as one
      if self.encode(text) != [self.control_ids[text]]:
        raise ValueError(f"Control token {text!r} of {self.path} does not encode to its single id "
                         f"{self.control_ids[text]} (got {self.encode(text)}).")

  def _require(self, text: str, what: str) -> int:
    token_id = self._backend.token_to_id(text)
    if token_id is None:
      raise ValueError(f"The tokenizer {self.path} has no {what} {text!r}; a Gemma 4 chat tokenizer has all of "
                       f"{list(REQUIRED_CONTROL_TOKENS)}, a text tokenizer none, and either has bos/eos/pad.")
    return token_id

  @property
  def vocab_size(self) -> int:
    return self._backend.vocab_size

  @property
  def bos_id(self) -> int:
    return self._named["bos_token"]

  @property
  def eos_id(self) -> int:
    return self._named["eos_token"]

  @property
  def pad_id(self) -> int:
    return self._named["pad_token"]

  def token_id(self, text: str) -> int:
    """The id of a single token given by its text (e.g. '<turn|>'); a ValueError if there is none."""
    token_id = self._backend.token_to_id(text)
    if token_id is None:
      raise ValueError(f"The tokenizer {self.path} has no token {text!r}.")
    return token_id

  def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = True) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"encode takes a str, got {type(text).__name__}.")
    ids = self._backend.encode(text) if parse_special else self._backend.encode_text(text)
    return [self.bos_id] + ids if add_bos else ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    return self._backend.decode([int(i) for i in ids], skip_special_tokens)

  def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
    """`encode` of each text (what the training pipelines call, as on the sentencepiece `Tokenizer`)."""
    return [self.encode(text) for text in texts]

  @property
  def serialized(self) -> bytes:
    """The tokenizer file's bytes: what identifies it (the pipelines' token caches are keyed by them)."""
    return _files.read_bytes(self.path, _files.TOKENIZER_MAX_BYTES)

  def __repr__(self):
    return f"CheckpointTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


class _JsonBackend:
  """`tokenizers.Tokenizer` from tokenizer.json; encoding adds nothing (no post-processor bos)."""

  def __init__(self, path: pathlib.Path):
    import tokenizers  # pylint: disable=import-outside-toplevel
    self._tokenizers = tokenizers
    text = _files.read_text(path, _files.TOKENIZER_MAX_BYTES)
    try:
      self._tok = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # pylint: disable=broad-except  (the library raises a bare Exception)
      raise _files.BadFileError(f"{path} is not a tokenizers tokenizer.json: {e}.") from None
    self._text = None  # the tokenizer for `encode_text`, made on first use

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, text: str) -> int | None:
    return self._tok.token_to_id(text)

  def id_to_token(self, token_id: int) -> str:
    return self._tok.id_to_token(token_id)

  def role_id(self, name: str) -> int | None:  # tokenizer.json has no bos/eos/pad of its own
    del name
    return None

  def mark_special(self, texts: list[str]) -> None:
    """Registers as special added tokens those of `texts` that are not already (their ids are kept)."""
    added = {t.content: t for t in self._tok.get_added_tokens_decoder().values()}
    missing = [t for t in texts if t not in added or not added[t].special]
    if missing:
      self._tok.add_special_tokens([self._tokenizers.AddedToken(t, special=True, normalized=False)
                                    for t in missing])

  def special_tokens(self) -> dict[int, str]:
    return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_text(self, text: str) -> list[int]:
    """`encode` with special tokens matched as ordinary text (a second tokenizer with the setting on, made
    once: the setting belongs to the tokenizer, so flipping it on a shared one would race)."""
    if self._text is None:
      text_tok = self._tokenizers.Tokenizer.from_str(self._tok.to_str())
      text_tok.encode_special_tokens = True
      self._text = text_tok
    return self._text.encode(text, add_special_tokens=False).ids

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _SentencePieceBackend:
  """A sentencepiece model; text is split at special tokens first, so that each becomes its one id."""

  def __init__(self, path: pathlib.Path):
    self._sp = sp_tokenizer.load_sentencepiece(_files.read_bytes(path, _files.TOKENIZER_MAX_BYTES), path)
    self._special: dict[str, int] = {}
    self._pattern = None

  @property
  def vocab_size(self) -> int:
    return self._sp.vocab_size()

  def token_to_id(self, text: str) -> int | None:
    token_id = self._sp.piece_to_id(text)
    return None if token_id == self._sp.unk_id() and text != self._sp.id_to_piece(token_id) else token_id

  def id_to_token(self, token_id: int) -> str:
    return self._sp.id_to_piece(token_id)

  def role_id(self, name: str) -> int | None:
    """The model's own id of 'bos_token', 'eos_token' or 'pad_token' (None where it has none)."""
    token_id = {"bos_token": self._sp.bos_id, "eos_token": self._sp.eos_id, "pad_token": self._sp.pad_id}[name]()
    return token_id if token_id >= 0 else None

  def mark_special(self, texts: list[str]) -> None:
    self._special.update({t: self._sp.piece_to_id(t) for t in texts})
    self._special.update({self._sp.id_to_piece(i): i for i in range(self._sp.vocab_size())
                          if self._sp.is_control(i)})
    longest_first = sorted(self._special, key=len, reverse=True)
    self._pattern = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

  def special_tokens(self) -> dict[int, str]:
    return {i: t for t, i in self._special.items()}

  def encode(self, text: str) -> list[int]:
    ids = []
    for i, part in enumerate(self._pattern.split(text)):
      if i % 2:
        ids.append(self._special[part])
      elif part:
        ids.extend(self._sp.encode(part))
    return ids

  def encode_text(self, text: str) -> list[int]:
    """`encode` with special-token spellings kept as text: each is encoded as its first character and the
    rest, which no special token matches (sentencepiece itself matches its user-defined pieces)."""
    ids = []
    for i, part in enumerate(self._pattern.split(text)):
      if i % 2:
        ids += self._sp.encode(part[:1]) + self._sp.encode(part[1:])
      elif part:
        ids += self._sp.encode(part)
    return ids

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    special = self.special_tokens()
    out, run = [], []
    for i in ids:
      if i in special:
        out.append(self._sp.decode(run))
        run = []
        if not skip_special_tokens:
          out.append(special[i])
      else:
        run.append(i)
    out.append(self._sp.decode(run))
    return "".join(out)


def _named_tokens(config_file: pathlib.Path) -> dict[str, str]:
  """The bos/eos/pad token texts tokenizer_config.json names (a string or an AddedToken dict)."""
  named = {}
  if _files.present(config_file):
    config = _files.read_json(config_file)
    for name in _DEFAULT_NAMED:
      value = config.get(name)
      if isinstance(value, Mapping):
        value = value.get("content")
      if isinstance(value, str):
        named[name] = value
  return named


def load_tokenizer(folder: os.PathLike | str) -> TokenizerLike:
  """The tokenizer for a model folder, whichever kind it is.

  A training workdir (its config.json, written by training, has `model` and `data` sections): the
  project's sentencepiece `Tokenizer`, from `config.data.tokenizer_path` or `workdir/tokenizer.model`.
  A transformers checkpoint folder (tokenizer.json, tokenizer_config.json, or a config.json that is not a
  training config): `CheckpointTokenizer`.
  """
  folder = pathlib.Path(folder)
  if not folder.is_dir():
    raise FileNotFoundError(f"{str(folder)!r} is not a folder (expected a checkpoint folder or a workdir).")
  config_file = folder / "config.json"
  config = _files.read_json(config_file) if _files.present(config_file) else {}
  if isinstance(config.get("model"), Mapping) and isinstance(config.get("data"), Mapping):
    data = _files.Fields(config["data"], config_file, "data.")
    path = pathlib.Path(data.string("tokenizer_path", "") or folder / TOKENIZER_MODEL)
    if not _files.present(path):
      raise FileNotFoundError(f"The training workdir {folder} has no tokenizer at {path}.")
    return sp_tokenizer.Tokenizer(path)
  if config or any(_files.present(folder / f) for f in (TOKENIZER_JSON, TOKENIZER_CONFIG)):
    return CheckpointTokenizer(folder)
  if _files.present(folder / TOKENIZER_MODEL):
    return sp_tokenizer.Tokenizer(folder / TOKENIZER_MODEL)
  raise FileNotFoundError(f"{folder} has no tokenizer: none of {TOKENIZER_JSON}, {TOKENIZER_MODEL}, or a "
                          "training config.json naming one.")

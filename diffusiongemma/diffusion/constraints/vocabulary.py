"""A tokenizer's vocabulary as the bytes each token id stands for (what a token automaton walks).

A constraint is a language over bytes (UTF-8 text); a token is allowed where its bytes continue a string
of the language. So every tokenizer is reduced to one plain mapping, `{token id: bytes}`, holding the
text tokens only: control tokens (pad, eos, bos, unk, turn markers) decode to nothing and are left out,
and stop tokens are handled by the automaton itself. Adapters here cover the project's sentencepiece
`diffusiongemma.data.Tokenizer` (and any sentencepiece model) and a `tokenizers` tokenizer (a
checkpoint's `tokenizer.json`); any other tokenizer can hand over such a mapping directly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

Vocabulary = Mapping[int, bytes]
_SPACE_SYMBOL = "\u2581"  # sentencepiece's stand-in for a space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def normalize(vocabulary: Mapping[int, bytes | str]) -> dict[int, bytes]:
  """`{id: bytes}` from ids mapped to bytes or text (encoded as UTF-8); rejects bad ids and values."""
  out = {}
  for token_id, value in vocabulary.items():
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
      raise ValueError(f"Vocabulary ids must be integers >= 0, got {token_id!r}.")
    if isinstance(value, str):
      value = value.encode("utf-8")
    if not isinstance(value, bytes):
      raise ValueError(f"Vocabulary entry {token_id} must be bytes or str, got {type(value).__name__}.")
    if value:  # An empty token would loop in place; it is never useful inside constrained text.
      out[int(token_id)] = value
  return out


def from_sentencepiece(tokenizer) -> dict[int, bytes]:
  """The text tokens of a sentencepiece model: a `data.Tokenizer`, a processor, or serialized bytes.

  Byte pieces `<0xAB>` are that byte; other pieces are their text with U+2581 as a space (the project's
  tokenizer adds no dummy prefix, so a piece's bytes are exactly what it decodes to in context).
  """
  import sentencepiece as spm  # pylint: disable=import-outside-toplevel
  if isinstance(tokenizer, spm.SentencePieceProcessor):
    sp = tokenizer
  else:
    proto = tokenizer if isinstance(tokenizer, bytes) else tokenizer.serialized
    sp = spm.SentencePieceProcessor(model_proto=proto)
  out = {}
  for i in range(sp.get_piece_size()):
    if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
      continue
    piece = sp.id_to_piece(i)
    if sp.is_byte(i):
      out[i] = bytes([int(_BYTE_PIECE.fullmatch(piece).group(1), 16)])
    else:
      out[i] = piece.replace(_SPACE_SYMBOL, " ").encode("utf-8")
  return normalize(out)


def _gpt2_byte_decoder() -> dict[str, int]:
  """The inverse of GPT-2's byte-to-printable-character map used by byte-level BPE."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
               + list(range(ord("\xae"), ord("\xff") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


def _decoder_types(decoder: dict | None) -> list[dict]:
  if decoder is None:
    return []
  if decoder.get("type") == "Sequence":
    return [d for sub in decoder.get("decoders", []) for d in _decoder_types(sub)]
  return [decoder]


def from_hf_tokenizer(tokenizer) -> dict[int, bytes]:
  """The text tokens of a `tokenizers.Tokenizer` (e.g. `Tokenizer.from_file('tokenizer.json')`).

  Supports the two byte-exact families: byte-level BPE (GPT-2 style, decoder `ByteLevel`) and
  sentencepiece-style models (Gemma: `Metaspace` or `Replace('\u2581', ' ')` with `ByteFallback`).
  Special added tokens are left out; other added tokens are their text.
  """
  spec = json.loads(tokenizer.to_str())
  decoders = _decoder_types(spec.get("decoder"))
  kinds = {d.get("type") for d in decoders}
  special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
  added = {t["id"]: t["content"] for t in spec.get("added_tokens", []) if not t.get("special")}
  if "ByteLevel" in kinds:
    table = _gpt2_byte_decoder()
    convert = lambda piece: bytes(table[c] for c in piece) if all(c in table for c in piece) else None
  elif kinds & {"Metaspace", "Replace", "ByteFallback"} or not decoders:
    byte_fallback = bool(spec.get("model", {}).get("byte_fallback")) or "ByteFallback" in kinds

    def convert(piece):
      match = _BYTE_PIECE.fullmatch(piece) if byte_fallback else None
      if match:
        return bytes([int(match.group(1), 16)])
      return piece.replace(_SPACE_SYMBOL, " ").encode("utf-8")
  else:
    raise ValueError(f"Unsupported tokenizer decoder {sorted(kinds)}: token bytes are only known for "
                     "ByteLevel, Metaspace/Replace and ByteFallback decoders; pass a {id: bytes} mapping.")
  out = {}
  for piece, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
    if token_id in special:
      continue
    value = added[token_id].encode("utf-8") if token_id in added else convert(piece)
    if value is not None:
      out[token_id] = value
  return normalize(out)


def from_tokenizer(tokenizer) -> dict[int, bytes]:
  """Dispatches on the tokenizer's kind: a mapping, a `tokenizers.Tokenizer`, or a sentencepiece one."""
  if isinstance(tokenizer, Mapping):
    return normalize(tokenizer)
  inner = getattr(tokenizer, "tokenizer", None)  # wrappers that hold a `tokenizers.Tokenizer`
  for candidate in (tokenizer, inner):
    if candidate is not None and type(candidate).__module__.startswith("tokenizers"):
      return from_hf_tokenizer(candidate)
  return from_sentencepiece(tokenizer)

"""A sentencepiece BPE tokenizer that is lossless on source code, with Gemma's special ids.

Ids follow Gemma: pad=0, eos=1, bos=2 (and unk=3). Training settings keep every byte of the input:
identity normalization, no whitespace collapsing or dummy prefix, whitespace-only pieces, newline and
tab as atomic symbols, and byte fallback for characters outside the vocabulary; a literal U+2581
(sentencepiece's space marker) is encoded as bytes. So `decode(encode(text)) == text` for any text.
"""

from __future__ import annotations

import os
import pathlib
import random
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence

from absl import logging
import sentencepiece as spm

from diffusiongemma import _files
from diffusiongemma.data import corpus

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
TOKENIZER_FILENAME = "tokenizer.model"
_SPACE_SYMBOL = "\u2581"  # sentencepiece's stand-in for a space.

_TRAINER_OPTIONS = dict(
    model_type="bpe",
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,
    byte_fallback=True,
    split_digits=True,
    user_defined_symbols=["\n", "\t"],
    pad_id=PAD_ID,
    eos_id=EOS_ID,
    bos_id=BOS_ID,
    unk_id=UNK_ID,
    hard_vocab_limit=False,  # A small corpus yields a smaller vocabulary instead of an error.
    minloglevel=2,
)


def load_sentencepiece(proto: bytes, source) -> spm.SentencePieceProcessor:
  """A sentencepiece processor of the model bytes `proto` read from `source` (named in the error when the
  bytes are not a sentencepiece model)."""
  try:
    processor = spm.SentencePieceProcessor(model_proto=proto)
  except RuntimeError as e:
    raise _files.BadFileError(f"{source} is not a sentencepiece model ({str(e).strip() or 'unparsable'}).") from None
  if processor.vocab_size() < 1:
    raise _files.BadFileError(f"{source} is not a sentencepiece model: it holds no pieces.")
  return processor


class Tokenizer:
  """Wraps a `sentencepiece` model; picklable (it carries the serialized model)."""

  def __init__(self, model: os.PathLike | str | bytes):
    """Loads a model from a file path, or from its serialized bytes."""
    if isinstance(model, bytes):
      proto, self.path = model, None
    else:
      self.path = _files.as_path(model, "the tokenizer")
      if not _files.present(self.path):
        raise ValueError(f"Tokenizer model {str(self.path)!r} does not exist.")
      proto = _files.read_bytes(self.path, _files.TOKENIZER_MAX_BYTES)
    self._sp = load_sentencepiece(proto, self.path or "the serialized model")

  @property
  def serialized(self) -> bytes:
    """The model file's bytes (identifies the tokenizer, e.g. for caching token streams)."""
    return self._sp.serialized_model_proto()

  @property
  def vocab_size(self) -> int:
    return self._sp.vocab_size()

  @property
  def pad_id(self) -> int:
    return self._sp.pad_id()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  def encode(self, text: str) -> list[int]:
    if _SPACE_SYMBOL in text:
      return self._encode_with_space_symbol(text)
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
    """Encodes many texts at once, in parallel (`num_threads=-1`: all cores)."""
    batch = self._sp.encode(list(texts), num_threads=num_threads)
    for i, text in enumerate(texts):
      if _SPACE_SYMBOL in text:
        batch[i] = self._encode_with_space_symbol(text)
    return batch

  def _encode_with_space_symbol(self, text: str) -> list[int]:
    """Encodes a literal U+2581 as its UTF-8 bytes: as a piece, sentencepiece decodes it to ' '."""
    symbol_ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE_SYMBOL.encode("utf-8")]
    parts = self._sp.encode(text.split(_SPACE_SYMBOL))
    ids = parts[0]
    for part in parts[1:]:
      ids += symbol_ids + part
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Decodes ids (a list or a 1-D array); pad/eos/bos decode to nothing."""
    return self._sp.decode([int(i) for i in ids])

  def __getstate__(self):
    return {"proto": self.serialized, "path": self.path}

  def __setstate__(self, state):
    self.path = state["path"]
    self._sp = spm.SentencePieceProcessor(model_proto=state["proto"])

  @classmethod
  def train(
      cls,
      texts: Sequence[str],
      path: os.PathLike | str,
      vocab_size: int = 4096,
      *,
      max_chars: int = 16_000_000,
      seed: int = 0,
  ) -> Tokenizer:
    """Trains a BPE model on a sample of `texts`, writes it to `path` and returns it.

    The sample is a seeded random choice of whole documents holding at most `max_chars` characters
    (the last one truncated), so training time is bounded whatever the corpus size. The vocabulary
    may come out smaller than `vocab_size` when the sample is too small to fill it.
    """
    sample = _sample_texts(texts, max_chars, seed)
    if not sample:
      raise ValueError("Cannot train a tokenizer on an empty corpus.")
    max_bytes = max(len(t.encode("utf-8")) for t in sample)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
      prefix = os.path.join(tmp, "sp")
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(sample),
          model_prefix=prefix,
          vocab_size=vocab_size,
          max_sentence_length=max_bytes + 1,
          num_threads=os.cpu_count() or 1,
          **_TRAINER_OPTIONS,
      )
      proto = pathlib.Path(prefix + ".model").read_bytes()
    _files.atomic_write(path, proto)
    logging.info("Trained a %d-piece BPE tokenizer on %d characters in %.1f s: %s", vocab_size,
                 sum(map(len, sample)), time.perf_counter() - start, path)
    return cls(path)


def get_tokenizer(
    workdir: os.PathLike | str,
    path: os.PathLike | str | None = None,
    corpus_texts_fn: Callable[[], Sequence[str]] | None = None,
    vocab_size: int = 4096,
    *,
    train_if_missing: bool = False,
) -> Tokenizer:
  """Loads `path` if given, else `workdir/tokenizer.model`; with `train_if_missing` (what training does on a
  fresh workdir) that is trained and saved if missing, otherwise its absence is an error that says how to
  make one: reading a workdir never writes into it.

  `corpus_texts_fn` returns the training texts and is only called when training is needed; it
  defaults to the train split of the standard-library corpus.
  """
  if path is not None:
    return Tokenizer(path)
  default_path = _files.as_path(workdir, "--workdir") / TOKENIZER_FILENAME
  if _files.present(default_path):
    tokenizer = Tokenizer(default_path)
    if tokenizer.vocab_size != vocab_size:
      logging.warning("%s has %d pieces, not the configured %d.", default_path,
                      tokenizer.vocab_size, vocab_size)
    return tokenizer
  if not train_if_missing:
    raise FileNotFoundError(
        f"{str(workdir)!r} has no {TOKENIZER_FILENAME}: a training run writes it there (scripts/train.py "
        f"--workdir={workdir} trains one on the corpus before its first step), or name a tokenizer with "
        "--config.data.tokenizer_path=FILE.")
  if corpus_texts_fn is None:
    corpus_texts_fn = lambda: corpus.load_corpus("stdlib", "train")
  return Tokenizer.train(corpus_texts_fn(), default_path, vocab_size)


def _sample_texts(texts: Sequence[str], max_chars: int, seed: int) -> list[str]:
  """A seeded random subset of whole texts with at most `max_chars` characters in all."""
  order = list(range(len(texts)))
  random.Random(seed).shuffle(order)
  sample, budget = [], max_chars
  for i in order:
    if budget <= 0:
      break
    if texts[i]:
      sample.append(texts[i][:budget])
      budget -= len(sample[-1])
  return sample


"""Packed block-diffusion training batches from a token stream (a prepared split, or documents in memory).

Every example has the same layout: a prompt of `prompt_length` (P) tokens followed by
`num_canvases` (n) canvases of `canvas_length` (C) tokens, L = P + n * C tokens in all. Documents are
tokenized, each followed by EOS, and concatenated into one token stream (packing) that is cut into
consecutive, non-overlapping windows of L tokens; the trailing partial window is dropped. The windows are
the items of `batching.GlobalBatches`: globally shuffled and repeated forever for training, or read once in
order for validation, each process reading its rows of every global batch; its iterators'
`get_state()` / `set_state()` checkpoint and restore the exact position.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
from collections.abc import Sequence

from absl import logging
import grain
import numpy as np

from diffusiongemma import _files
from diffusiongemma.data import batching
from diffusiongemma.data import prepared
from diffusiongemma.data.tokenizer import Tokenizer

_ENCODE_CHUNK = 256  # Documents per encode call: bounds the memory of Python id lists.


def tokenize_corpus(
    texts: Sequence[str],
    tokenizer: Tokenizer,
    cache_dir: os.PathLike | str | None = None,
) -> np.ndarray:
  """Tokenizes documents into one int32 stream, each document followed by EOS.

  With `cache_dir`, the stream is saved there as `.npy`, keyed by a hash of the tokenizer model and
  the texts, and later calls with the same inputs load it (memory-mapped) instead of re-tokenizing.
  """
  cache_path = None
  if cache_dir is not None:
    cache_path = pathlib.Path(cache_dir) / f"tokens-{_fingerprint(texts, tokenizer)}.npy"
    if cache_path.is_file():
      logging.info("Loading cached token stream %s", cache_path)
      return np.load(cache_path, mmap_mode="r")
  pieces = []
  for start in range(0, len(texts), _ENCODE_CHUNK):
    for ids in tokenizer.encode_batch(texts[start:start + _ENCODE_CHUNK]):
      pieces.append(np.asarray(ids + [tokenizer.eos_id], np.int32))
  tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
  logging.info("Tokenized %d documents into %d tokens.", len(texts), tokens.size)
  if cache_path is not None:
    buffer = io.BytesIO()
    np.save(buffer, tokens)
    _files.atomic_write(cache_path, buffer.getvalue())
  return tokens


def make_dataset(
    texts_or_tokens: Sequence[str] | np.ndarray | prepared.TokenStream,
    tokenizer: Tokenizer | None,
    *,
    prompt_length: int,
    canvas_length: int,
    num_canvases: int,
    batch_size: int,
    seed: int,
    train: bool,
    shard_index: int = 0,
    shard_count: int = 1,
    cache_dir: os.PathLike | str | None = None,
    read_options: grain.ReadOptions | None = None,
) -> batching.GlobalBatches:
  """This process's part of the global batches `{'tokens': int32 [B, P + n*C], 'prompt_length': int32 [B]}`.

  Args:
    texts_or_tokens: documents (strings), an already tokenized 1-D stream of ids, or the stream of a
      prepared split (`prepared.open_split`; then `tokenizer` may be None).
    tokenizer: encodes the documents; its EOS id ends each document.
    prompt_length: P, prompt tokens at the start of each example.
    canvas_length: C, tokens per canvas.
    num_canvases: n, canvases after the prompt.
    batch_size: examples per batch of this process (the global batch is `batch_size * shard_count`).
    seed: the shuffle seed (training only).
    train: a global shuffle repeated forever if True, else one pass in stream order.
    shard_index: this process, in [0, shard_count).
    shard_count: the number of processes.
    cache_dir: where to cache the token stream of `texts` (see `tokenize_corpus`).
    read_options: grain's reading threads and prefetch buffer.
  """
  for name, value in (("prompt_length", prompt_length), ("canvas_length", canvas_length),
                      ("num_canvases", num_canvases), ("batch_size", batch_size),
                      ("shard_count", shard_count)):
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}.")
  if not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}.")
  stream = _as_token_stream(texts_or_tokens, tokenizer, cache_dir)
  length = prompt_length + num_canvases * canvas_length
  num_windows = stream.num_tokens // length
  if num_windows < 1:
    raise ValueError(f"The corpus has {stream.num_tokens} tokens, fewer than one sequence of "
                     f"prompt_length + num_canvases * canvas_length = {prompt_length} + "
                     f"{num_canvases} * {canvas_length} = {length} tokens.")
  return batching.GlobalBatches(
      num_windows, Windows(stream, length, prompt_length), global_batch_size=batch_size * shard_count,
      process_index=shard_index, process_count=shard_count, seed=seed, train=train,
      read_options=read_options, what=f"sequences of {length} tokens")


class Windows:
  """Window indices -> a batch: window w is tokens [w*L, (w+1)*L) of the stream (a class, so it pickles)."""

  def __init__(self, stream, length: int, prompt_length: int):
    self.stream, self.length, self.prompt_length = stream, length, prompt_length

  def __call__(self, windows: np.ndarray) -> dict[str, np.ndarray]:
    rows = [self.stream.read(int(w) * self.length, (int(w) + 1) * self.length) for w in windows]
    return {"tokens": np.stack(rows).astype(np.int32),
            "prompt_length": np.full(len(rows), self.prompt_length, np.int32)}


class _ArrayStream:
  """An in-memory token stream with the reader interface of a prepared one."""

  def __init__(self, tokens: np.ndarray):
    self.tokens = tokens

  @property
  def num_tokens(self) -> int:
    return int(self.tokens.size)

  def read(self, start: int, stop: int) -> np.ndarray:
    return np.asarray(self.tokens[start:stop], np.int32)


def _as_token_stream(texts_or_tokens, tokenizer, cache_dir):
  """A token stream reader, tokenizing documents when given strings."""
  if isinstance(texts_or_tokens, prepared.TokenStream):
    return texts_or_tokens
  if isinstance(texts_or_tokens, np.ndarray):
    if texts_or_tokens.ndim != 1 or not np.issubdtype(texts_or_tokens.dtype, np.integer):
      raise ValueError("A token stream must be a 1-D integer array, got "
                       f"{texts_or_tokens.dtype} of shape {texts_or_tokens.shape}.")
    return _ArrayStream(texts_or_tokens)
  if isinstance(texts_or_tokens, str):
    raise ValueError("texts_or_tokens must be a sequence of documents, not a single string.")
  if tokenizer is None:
    raise ValueError("A tokenizer is needed to tokenize texts.")
  return _ArrayStream(tokenize_corpus(texts_or_tokens, tokenizer, cache_dir))


def _fingerprint(texts: Sequence[str], tokenizer: Tokenizer) -> str:
  """A hash of the tokenizer model and the documents (with their boundaries)."""
  digest = hashlib.sha256(tokenizer.serialized)
  for text in texts:
    data = text.encode("utf-8", "surrogatepass")
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)
  return digest.hexdigest()[:16]

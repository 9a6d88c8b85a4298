"""grain pipelines from documents to packed block-diffusion training batches.

Every example has the same layout: a prompt of `prompt_length` (P) tokens followed by
`num_canvases` (n) canvases of `canvas_length` (C) tokens, L = P + n * C tokens in all. Documents are
tokenized, each followed by EOS, and concatenated into one token stream (packing) that is cut into
consecutive, non-overlapping windows of L tokens; the trailing partial window is dropped. Windows are
dealt round-robin to `shard_count` shards (one per process), then shuffled and repeated forever for
training, or read once in order for validation. The returned `grain.IterDataset` gives iterators
whose `get_state()` / `set_state()` checkpoint and restore the exact position.
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
from diffusiongemma.data.tokenizer import Tokenizer

_ENCODE_CHUNK = 256  # Documents per encode call: bounds the memory of Python id lists.
_DEFAULT_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)


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
    texts_or_tokens: Sequence[str] | np.ndarray,
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
) -> grain.IterDataset:
  """A dataset of batches `{'tokens': int32 [B, P + n*C], 'prompt_length': int32 [B]}`.

  Args:
    texts_or_tokens: documents (strings), or an already tokenized 1-D stream of ids (then
      `tokenizer` may be None).
    tokenizer: encodes the documents; its EOS id ends each document.
    prompt_length: P, prompt tokens at the start of each example.
    canvas_length: C, tokens per canvas.
    num_canvases: n, canvases after the prompt.
    batch_size: examples per batch (per process); the last partial batch is dropped.
    seed: the shuffle seed (training only).
    train: shuffle and repeat forever if True, else one pass in stream order.
    shard_index: this process's shard, in [0, shard_count).
    shard_count: the number of shards; every shard gets the same number of windows.
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
  tokens = _as_token_stream(texts_or_tokens, tokenizer, cache_dir)
  length = prompt_length + num_canvases * canvas_length
  num_windows = tokens.size // length
  if num_windows < 1:
    raise ValueError(f"The corpus has {tokens.size} tokens, fewer than one sequence of "
                     f"prompt_length + num_canvases * canvas_length = {prompt_length} + "
                     f"{num_canvases} * {canvas_length} = {length} tokens.")
  per_shard = num_windows // shard_count
  if per_shard < batch_size:
    raise ValueError(f"The corpus has {num_windows} sequences of {length} tokens, {per_shard} per "
                     f"shard over {shard_count} shards: fewer than batch_size = {batch_size}.")

  dataset = grain.MapDataset.range(per_shard * shard_count)
  dataset = dataset.slice(slice(shard_index, None, shard_count))
  if train:
    dataset = dataset.shuffle(seed=seed).repeat(None)
  dataset = dataset.map(_Window(tokens, length, prompt_length))
  dataset = dataset.batch(batch_size, drop_remainder=True)
  return dataset.to_iter_dataset(read_options or _DEFAULT_READ_OPTIONS)


class _Window:
  """Maps a window index to its example; a class (not a closure) so that it pickles."""

  def __init__(self, tokens: np.ndarray, length: int, prompt_length: int):
    self.tokens, self.length, self.prompt_length = tokens, length, prompt_length

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    start = int(index) * self.length
    return {
        "tokens": np.array(self.tokens[start:start + self.length], np.int32),
        "prompt_length": np.array(self.prompt_length, np.int32),
    }


def _as_token_stream(texts_or_tokens, tokenizer, cache_dir) -> np.ndarray:
  """A 1-D integer token stream, tokenizing documents when given strings."""
  if isinstance(texts_or_tokens, np.ndarray):
    if texts_or_tokens.ndim != 1 or not np.issubdtype(texts_or_tokens.dtype, np.integer):
      raise ValueError("A token stream must be a 1-D integer array, got "
                       f"{texts_or_tokens.dtype} of shape {texts_or_tokens.shape}.")
    return texts_or_tokens
  if isinstance(texts_or_tokens, str):
    raise ValueError("texts_or_tokens must be a sequence of documents, not a single string.")
  if tokenizer is None:
    raise ValueError("A tokenizer is needed to tokenize texts.")
  return tokenize_corpus(texts_or_tokens, tokenizer, cache_dir)


def _fingerprint(texts: Sequence[str], tokenizer: Tokenizer) -> str:
  """A hash of the tokenizer model and the documents (with their boundaries)."""
  digest = hashlib.sha256(tokenizer.serialized)
  for text in texts:
    data = text.encode("utf-8", "surrogatepass")
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)
  return digest.hexdigest()[:16]

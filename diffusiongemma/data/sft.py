"""Supervised fine-tuning data: (prompt, response) pairs in the block-diffusion training layout.

An example is a clean prompt, encoded causally and never noised, followed by its response as whole
canvases: the response, then EOS up to a multiple of the canvas length C (at least one EOS, as the
released model pads and supervises its responses), at most `num_canvases` (n) canvases. Batches have
the training layout of `diffusion.loss`:

  tokens         int32 [B, P + n * C]  row b: prompt (p_b tokens), k_b canvases, then pad
  prompt_length  int32 [B]             p_b: where the row's first canvas starts
  num_canvases   int32 [B]             k_b <= n: canvases that hold the response (the loss draws the
                                       noised canvas among these, and the AR loss stops at their end)

The diffusion loss only ever reads canvas positions (`prompt_length` onwards), so prompt tokens
contribute nothing to it; the AR loss covers the prompt too unless `config.diffusion.ar_loss_on_prompt`
is False.

`pairs_dataset` batches the pairs of a prepared corpus (`prepared.prepare(kind='pairs')` of a JSONL file of
`{"prompt": str, "response": str}` records: BOS + prompt; response + EOS), `jsonl_examples` reads such a
file into memory, and `examples_dataset` batches packed examples held in memory.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Sequence

from absl import logging
import grain
import numpy as np

from diffusiongemma.data import batching
from diffusiongemma.data import corpus
from diffusiongemma.data import prepared
from diffusiongemma.data.tokenizer import Tokenizer

_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)


def pack_example(prompt: Sequence[int], response: Sequence[int], *, prompt_length: int,
                 canvas_length: int, num_canvases: int, eos_id: int, pad_id: int) -> dict[str, np.ndarray]:
  """One example in the layout above; `response` gets EOS up to a whole number of canvases (at least
  one EOS). Raises ValueError if the prompt exceeds `prompt_length` or the response (with its EOS)
  `num_canvases * canvas_length` tokens."""
  prompt, response = list(prompt), list(response)
  if not prompt:
    raise ValueError("An SFT example needs at least one prompt token (e.g. BOS).")
  if len(prompt) > prompt_length:
    raise ValueError(f"The prompt has {len(prompt)} tokens, more than prompt_length={prompt_length}.")
  canvases = max(1, math.ceil((len(response) + 1) / canvas_length))
  if canvases > num_canvases:
    raise ValueError(f"The response has {len(response)} tokens: with its EOS it needs {canvases} canvases "
                     f"of {canvas_length}, more than num_canvases={num_canvases}.")
  body = response + [eos_id] * (canvases * canvas_length - len(response))
  tokens = np.full(prompt_length + num_canvases * canvas_length, pad_id, np.int32)
  tokens[:len(prompt) + len(body)] = prompt + body
  return {"tokens": tokens, "prompt_length": np.int32(len(prompt)), "num_canvases": np.int32(canvases)}


def read_jsonl_pairs(path: os.PathLike | str, prompt_field: str = "prompt",
                     response_field: str = "response") -> list[tuple[str, str]]:
  """(prompt, response) texts of a JSONL file; blank lines are skipped, anything else malformed is an
  error naming the line."""
  if not pathlib.Path(path).is_file():
    raise ValueError(f"SFT data {str(path)!r} does not exist (config.data.corpus).")
  return corpus.read_jsonl_fields(path, (prompt_field, response_field))


def jsonl_examples(path: os.PathLike | str, tokenizer: Tokenizer, split: str, *, prompt_length: int,
                   canvas_length: int, num_canvases: int, validation_fraction: float = 0.02,
                   seed: int = 0) -> list[dict[str, np.ndarray]]:
  """The packed examples of `split` of a JSONL file of prompt/response pairs. Pairs too long for the
  layout are left out (with a warning that counts them); none fitting is an error."""
  pairs = read_jsonl_pairs(path)
  keys = [json.dumps(pair) for pair in pairs]
  train, validation = corpus._split(pairs, keys, validation_fraction, seed)  # pylint: disable=protected-access
  chosen = train if split == "train" else validation
  prompts = tokenizer.encode_batch([p for p, _ in chosen]) if chosen else []
  responses = tokenizer.encode_batch([r for _, r in chosen]) if chosen else []
  examples, dropped = [], 0
  for prompt, response in zip(prompts, responses):
    try:
      examples.append(pack_example([tokenizer.bos_id] + prompt, response, prompt_length=prompt_length,
                                   canvas_length=canvas_length, num_canvases=num_canvases,
                                   eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id))
    except ValueError:
      dropped += 1
  if dropped:
    logging.warning("%s (%s): left out %d of %d pairs longer than prompt_length=%d or num_canvases=%d "
                    "x canvas_length=%d.", path, split, dropped, len(chosen), prompt_length, num_canvases,
                    canvas_length)
  if not examples:
    raise ValueError(f"{path}: no {split} pair fits prompt_length={prompt_length} and num_canvases="
                     f"{num_canvases} x canvas_length={canvas_length} ({len(chosen)} pairs in the split).")
  return examples


def examples_dataset(examples: Sequence[dict[str, np.ndarray]], *, batch_size: int, seed: int,
                     train: bool, shard_index: int = 0, shard_count: int = 1) -> batching.GlobalBatches:
  """Batches of packed examples in memory (this process's `batch_size` rows of each global batch): globally
  shuffled and repeated forever if `train`, else one pass in order."""
  examples = list(examples)
  fetch = lambda items: {k: np.stack([examples[i][k] for i in items]) for k in examples[0]}
  return batching.GlobalBatches(len(examples), fetch, global_batch_size=batch_size * shard_count,
                                process_index=shard_index, process_count=shard_count, seed=seed, train=train,
                                read_options=_READ_OPTIONS, what="examples")


class PackPairs:
  """Pair indices -> a batch of packed examples (a class, so that it pickles)."""

  def __init__(self, pairs: prepared.Pairs, *, prompt_length: int, canvas_length: int, num_canvases: int,
               eos_id: int, pad_id: int):
    self.pairs = pairs
    self.layout = dict(prompt_length=prompt_length, canvas_length=canvas_length, num_canvases=num_canvases,
                       eos_id=eos_id, pad_id=pad_id)

  def __call__(self, items: np.ndarray) -> dict[str, np.ndarray]:
    rows = [pack_example(*self.pairs.pair(int(i)), **self.layout) for i in items]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def pairs_dataset(pairs: prepared.Pairs, *, prompt_length: int, canvas_length: int, num_canvases: int,
                  eos_id: int, pad_id: int, batch_size: int, seed: int, train: bool, shard_index: int = 0,
                  shard_count: int = 1, source: str = "") -> batching.GlobalBatches:
  """Batches of the prepared pairs that fit the layout (the others are left out with a warning counting
  them; none fitting is an error), as `examples_dataset`."""
  prompts, responses = pairs.lengths[:, 0], pairs.lengths[:, 1]
  fits = (prompts <= prompt_length) & (-(-(responses + 1) // canvas_length) <= num_canvases)
  items = np.flatnonzero(fits)
  layout = f"prompt_length={prompt_length} and num_canvases={num_canvases} x canvas_length={canvas_length}"
  if items.size < len(pairs):
    logging.warning("%s: left out %d of %d pairs longer than %s.", source, len(pairs) - items.size, len(pairs),
                    layout)
  if not items.size:
    raise ValueError(f"{source}: no pair fits {layout} ({len(pairs)} pairs in the split).")
  pack = PackPairs(pairs, prompt_length=prompt_length, canvas_length=canvas_length, num_canvases=num_canvases,
                   eos_id=eos_id, pad_id=pad_id)
  return batching.GlobalBatches(
      items.size, _Subset(items, pack), global_batch_size=batch_size * shard_count, process_index=shard_index,
      process_count=shard_count, seed=seed, train=train, read_options=_READ_OPTIONS,
      what=f"examples of {source} that fit {layout}")


class _Subset:
  def __init__(self, items: np.ndarray, fetch):
    self.items, self.fetch = items, fetch

  def __call__(self, positions: np.ndarray) -> dict[str, np.ndarray]:
    return self.fetch(self.items[positions])

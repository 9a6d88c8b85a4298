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

`jsonl_examples` reads a JSONL file of `{"prompt": str, "response": str}` records through a tokenizer
(BOS + prompt; response + EOS), split into train/validation by a seeded hash of each record;
`examples_dataset` batches packed examples (a project's own examples too, e.g. projects/sudoku).
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

from diffusiongemma.data import corpus
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


def _batches(dataset: grain.MapDataset, *, batch_size: int, seed: int, train: bool, shard_index: int,
             shard_count: int, size: int) -> grain.MapDataset:
  per_shard = size // shard_count
  if per_shard < batch_size:
    raise ValueError(f"{size} examples, {per_shard} per shard over {shard_count} shards: fewer than "
                     f"batch_size = {batch_size}.")
  dataset = dataset.slice(slice(shard_index, per_shard * shard_count, shard_count))
  if train:
    dataset = dataset.shuffle(seed=seed).repeat(None)
  return dataset


def examples_dataset(examples: Sequence[dict[str, np.ndarray]], *, batch_size: int, seed: int,
                     train: bool, shard_index: int = 0, shard_count: int = 1) -> grain.IterDataset:
  """Batches of packed examples: shuffled and repeated forever if `train`, else one pass in order."""
  dataset = grain.MapDataset.source(list(examples))
  dataset = _batches(dataset, batch_size=batch_size, seed=seed, train=train, shard_index=shard_index,
                     shard_count=shard_count, size=len(examples))
  return dataset.batch(batch_size, drop_remainder=True).to_iter_dataset(_READ_OPTIONS)

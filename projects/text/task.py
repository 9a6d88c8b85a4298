"""Distillation as a training task (`config.data.task = 'projects.text.task'`): the teacher's greedy
continuations mixed with windows of the corpus, in the block-diffusion training layout.

A teacher row is a corpus prompt of P tokens and the teacher's continuation of n canvases (`teacher.py`),
EOS after its stop token up to the end (the released model's padding, supervised); its AR targets are the
prompt's own tokens only, so the encoder keeps learning real text and stays an honest teacher and judge,
never its own output. A corpus row is a window of the corpus as in pretraining (both losses everywhere).
`config.data.distil`: `teacher` (the folder), `corpus_fraction` (the share of corpus rows).
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from diffusiongemma import data as data_lib
from projects.text import teacher as teacher_lib

_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)


def teacher_example(prompt: np.ndarray, continuation: np.ndarray, *, canvas_length: int,
                    eos_id: int) -> dict[str, np.ndarray]:
  """One teacher row: the prompt, then the continuation with EOS after its first EOS (where `ARSampler`
  wrote `pad_id`), the canvases that hold it, and AR targets on the prompt only."""
  continuation = np.array(continuation, np.int32)
  if continuation.size % canvas_length:
    raise ValueError(f"A continuation of {continuation.size} tokens is not whole canvases of {canvas_length}.")
  stops = np.flatnonzero(continuation == eos_id)
  used = continuation.size if stops.size == 0 else int(stops[0]) + 1
  continuation[used:] = eos_id
  tokens = np.concatenate([prompt, continuation]).astype(np.int32)
  ar_targets = np.zeros(tokens.shape, bool)
  ar_targets[:len(prompt)] = True
  return {"tokens": tokens, "prompt_length": np.int32(len(prompt)),
          "num_canvases": np.int32(-(-used // canvas_length)), "ar_targets": ar_targets}


class _TeacherRow:
  def __init__(self, prompts, continuations, canvas_length, eos_id):
    self.prompts, self.continuations = prompts, continuations
    self.kw = dict(canvas_length=canvas_length, eos_id=eos_id)

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    return teacher_example(self.prompts[index], self.continuations[index], **self.kw)


class _CorpusRow:
  def __init__(self, stream, length, prompt_length, num_canvases):
    self.stream, self.length, self.prompt_length, self.num_canvases = stream, length, prompt_length, num_canvases

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    start = int(index) * self.length
    tokens = np.array(self.stream[start:start + self.length], np.int32)
    return {"tokens": tokens, "prompt_length": np.int32(self.prompt_length),
            "num_canvases": np.int32(self.num_canvases), "ar_targets": np.ones(tokens.shape, bool)}


@dataclasses.dataclass(frozen=True)
class Distillation:
  """`TASK`: see the module docstring."""

  needs_tokenizer = True

  def dataset(self, data, split, *, tokenizer, canvas_length, batch_size, seed, shard_index, shard_count,
              cache_dir):
    distil = dict(data.get("distil") or {})
    folder, fraction = distil.get("teacher", ""), float(distil.get("corpus_fraction", 0.5))
    if not folder:
      raise ValueError("config.data.distil.teacher is empty: name a teacher folder (python -m "
                       "projects.text.teacher --workdir=W --output=DIR).")
    if not 0.0 <= fraction < 1.0:
      raise ValueError(f"config.data.distil.corpus_fraction={fraction} must lie in [0, 1).")
    p, n = int(data["prompt_length"]), int(data["num_canvases"])
    prompts, continuations = teacher_lib.load(folder, split)
    if prompts.shape[1] != p or continuations.shape[1] != n * canvas_length:
      raise ValueError(f"The teacher folder {folder} has prompts of {prompts.shape[1]} and continuations of "
                       f"{continuations.shape[1]} tokens; the config's layout is prompt_length={p} and "
                       f"num_canvases * canvas_length = {n * canvas_length}.")
    train = split == "train"
    rows = grain.MapDataset.range(len(prompts)).slice(slice(shard_index, None, shard_count))
    if train:
      rows = rows.shuffle(seed=seed).repeat(None)
    rows = rows.map(_TeacherRow(prompts, continuations, canvas_length, tokenizer.eos_id))
    if fraction > 0:
      texts = data_lib.load_corpus(data["corpus"], split, text_field=data["text_field"],
                                   validation_fraction=data["validation_fraction"])
      stream = data_lib.tokenize_corpus(texts, tokenizer, cache_dir)
      windows = grain.MapDataset.range(stream.size // (p + n * canvas_length))
      windows = windows.slice(slice(shard_index, None, shard_count))
      if train:
        windows = windows.shuffle(seed=seed + 1).repeat(None)
      windows = windows.map(_CorpusRow(stream, p + n * canvas_length, p, n))
      rows = grain.MapDataset.mix([rows, windows], [1.0 - fraction, fraction])
    return rows.batch(batch_size, drop_remainder=True).to_iter_dataset(_READ_OPTIONS)


TASK = Distillation()

"""Data: text corpora and their prepared token shards, tokenizers (ours and a checkpoint's), global batches
sliced by process, SFT pairs, images and video.

Names resolve on first use, so a tokenizing worker (`import diffusiongemma.data.prepared`) loads neither grain
nor JAX.
"""

import importlib

_SUBMODULES = ("batching", "corpus", "hf_tokenizer", "images", "peek", "pipeline", "prepared", "sft", "sources",
               "tokenizer")
_NAMES = {
    "CheckpointTokenizer": "hf_tokenizer",
    "TOKENIZER_FILENAME": "tokenizer",
    "Tokenizer": "tokenizer",
    "TokenizerLike": "hf_tokenizer",
    "get_tokenizer": "tokenizer",
    "load_corpus": "corpus",
    "load_tokenizer": "hf_tokenizer",
    "make_dataset": "pipeline",
    "read_text_files": "corpus",
    "split_files": "corpus",
    "stdlib_files": "corpus",
    "tokenize_corpus": "pipeline",
}

__all__ = sorted(_NAMES) + ["images", "prepared", "sft", "sources"]


def __getattr__(name):
  if name in _NAMES:
    value = getattr(importlib.import_module(f"diffusiongemma.data.{_NAMES[name]}"), name)
  elif name in _SUBMODULES:
    value = importlib.import_module(f"diffusiongemma.data.{name}")
  else:
    raise AttributeError(f"module 'diffusiongemma.data' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))

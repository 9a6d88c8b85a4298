"""Text corpora: the Python standard library, a folder of text files, or a JSONL file.

Every source is split into train/validation deterministically by hashing a per-document key (the
file's path relative to the corpus root, or a JSONL record's text), so the split does not depend on
listing order and adding documents never moves existing ones between splits.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sysconfig
from collections.abc import Sequence

from absl import logging

SPLITS = ("train", "validation")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files() -> list[pathlib.Path]:
  """Sorted `.py` files of this interpreter's standard library, without installed packages."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return sorted(p for p in walk(root) if p.suffix == ".py")


def read_text_files(paths: Sequence[os.PathLike | str]) -> tuple[list[str], int]:
  """Reads files as UTF-8 text; returns (texts, number skipped).

  A file is skipped (and counted) when it is not valid UTF-8, contains a NUL byte (binary data), or
  cannot be read.
  """
  texts, skipped = [], 0
  for path in paths:
    text = read_text(path)
    if text is None:
      skipped += 1
    else:
      texts.append(text)
  if skipped:
    logging.info("Skipped %d of %d files that are not UTF-8 text.", skipped, len(paths))
  return texts, skipped


def split_files(
    paths: Sequence[os.PathLike | str],
    validation_fraction: float = 0.02,
    seed: int = 0,
    root: os.PathLike | str | None = None,
) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
  """Splits files into (train, validation) by a hash of each path relative to `root`.

  `root` defaults to the paths' common directory. Outputs keep the input order.
  """
  paths = [pathlib.Path(p) for p in paths]
  if root is None:
    root = os.path.commonpath(paths) if paths else "."
    if len(paths) == 1:
      root = paths[0].parent
  keys = [p.relative_to(root).as_posix() for p in paths]
  return _split(paths, keys, validation_fraction, seed)


def load_corpus(
    source: str | os.PathLike = "stdlib",
    split: str = "train",
    *,
    text_field: str = "text",
    validation_fraction: float = 0.02,
    seed: int = 0,
) -> list[str]:
  """Returns the documents of `split` ('train' or 'validation') of a corpus.

  Args:
    source: 'stdlib' (the Python standard library's source), a directory (every file below it that
      decodes as UTF-8 text without NUL bytes; hidden files and folders are ignored), or a `.jsonl`
      file with one JSON object per line holding the document in `text_field`.
    split: 'train' or 'validation'.
    text_field: the JSONL field holding the text.
    validation_fraction: expected fraction of documents in the validation split.
    seed: changes which documents land in validation.
  """
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")
  if str(source) == "stdlib":
    return _load_files(stdlib_files(), sysconfig.get_paths()["stdlib"], split, validation_fraction,
                       seed, source)
  path = pathlib.Path(source)
  if not path.exists():
    raise ValueError(f"Corpus path {str(path)!r} does not exist.")
  if path.is_dir():
    return _load_files(sorted(walk(path)), path, split, validation_fraction, seed, source)
  if path.suffix == ".jsonl":
    texts = _read_jsonl(path, text_field)
    train, validation = _split(texts, texts, validation_fraction, seed)
    return train if split == "train" else validation
  raise ValueError(f"Unsupported corpus source {str(source)!r}: expected 'stdlib', a directory, or a "
                   "'.jsonl' file.")


def _load_files(paths, root, split, validation_fraction, seed, source) -> list[str]:
  """Splits files, then reads only the requested split; errors if it holds no readable text."""
  if not paths:
    raise ValueError(f"Corpus {str(source)!r} contains no files.")
  train, validation = split_files(paths, validation_fraction, seed, root=root)
  texts, _ = read_text_files(train if split == "train" else validation)
  if not texts:
    raise ValueError(f"Corpus {str(source)!r} has no readable UTF-8 text files in split {split!r} "
                     f"({len(paths)} files in all).")
  return texts


def walk(root: pathlib.Path):
  """Yields regular files below `root`, skipping hidden entries and package/cache folders."""
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("."))
    for name in sorted(filenames):
      path = pathlib.Path(dirpath, name)
      if not name.startswith(".") and path.is_file():
        yield path


def read_text(path) -> str | None:
  """The file's text, or None when it is not UTF-8 text."""
  try:
    data = pathlib.Path(path).read_bytes()
  except OSError as e:
    logging.warning("Cannot read %s: %s", path, e)
    return None
  if b"\0" in data:
    return None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


def _read_jsonl(path: pathlib.Path, text_field: str) -> list[str]:
  """Texts of a JSONL file; blank lines are ignored, anything else malformed is an error."""
  return [text for text, in read_jsonl_fields(path, (text_field,))]


def read_jsonl_fields(path: os.PathLike | str, fields: Sequence[str]) -> list[tuple[str, ...]]:
  """The string `fields` of every record of a JSONL file, as tuples; blank lines are ignored, a line
  that is not a JSON object with those string fields is an error naming it."""
  path = pathlib.Path(path)
  records = []
  with path.open(encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {lineno} is not valid JSON ({e.msg}).") from None
      if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in fields):
        names = " and ".join(repr(k) for k in fields)
        raise ValueError(f"{path}: line {lineno} has no string field{'s' if len(fields) > 1 else ''} "
                         f"{names}.")
      records.append(tuple(record[k] for k in fields))
  if not records:
    raise ValueError(f"{path}: no records found.")
  return records


def _split(items: list, keys: Sequence[str], validation_fraction: float, seed: int):
  """Splits `items` by a seeded hash of `keys` into (train, validation), keeping order.

  A document goes to validation when its hash, read as a number in [0, 1), is below
  `validation_fraction`. For small corpora where that leaves validation empty, the document with
  the smallest hash is moved there, so both splits are non-empty whenever there are >= 2 items.
  """
  if not 0.0 <= validation_fraction < 1.0:
    raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}.")
  scores = [split_score(key, seed) for key in keys]
  is_validation = [s < validation_fraction for s in scores]
  if validation_fraction > 0 and len(items) >= 2 and not any(is_validation):
    is_validation[min(range(len(items)), key=scores.__getitem__)] = True
  train = [x for x, v in zip(items, is_validation) if not v]
  validation = [x for x, v in zip(items, is_validation) if v]
  return train, validation


def split_score(key: str, seed: int = 0) -> float:
  """A document's seeded hash in [0, 1): it is in validation when this is below the validation fraction."""
  return _hash01(f"{seed}:{key}")


def _hash01(key: str) -> float:
  digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0**64


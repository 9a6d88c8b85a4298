"""Corpus sources cut into pieces that workers read independently: the standard library, a folder of text
files, a JSONL file, parquet files, and a folder written by `datasets.save_to_disk` (Arrow files).

A piece is a JSON-able description (a list of files, a byte range of a JSONL file, a row group of a parquet
file, an Arrow file) whose documents `read_piece` yields as `(key, value)`: `key` decides the document's
split (`corpus.split_of`), `value` is the text, or with `pairs` a (prompt, response) tuple. Pieces are listed
in a fixed order, so the concatenation of their documents is the same whatever reads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import random
import sysconfig
from collections.abc import Iterator

from diffusiongemma.data import corpus

KINDS = ("stdlib", "folder", "jsonl", "parquet", "arrow")
_MIN_PIECE_BYTES = 1 << 20
_MAX_PIECE_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class Source:
  """A corpus and how to read its documents.

  name: what the user passed ('stdlib' or a path), for messages.
  kind: one of `KINDS`.
  root: the folder keys of folder documents are relative to.
  files: the files it reads, sorted.
  text_field: the text column / JSONL field (text corpora).
  pairs: (prompt_field, response_field) for prompt/response corpora (SFT), else None.
  token_field: the field holding already tokenized documents (lists of ids), instead of `text_field`.
  """

  name: str
  kind: str
  root: str
  files: tuple[str, ...]
  text_field: str = "text"
  pairs: tuple[str, str] | None = None
  token_field: str = ""

  @property
  def fields(self) -> tuple[str, ...]:
    return self.pairs if self.pairs else (self.token_field or self.text_field,)

  def fingerprint(self) -> str:
    """A hash of what was read and how (every file's path, size and modification time; the fields): cheap,
    and it changes when a file does."""
    digest = hashlib.sha256(json.dumps([self.kind, self.fields], sort_keys=True).encode())
    for path in self.files:
      info = os.stat(path)
      digest.update(f"{os.path.relpath(path, self.root)}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]

  def total_bytes(self) -> int:
    return sum(os.path.getsize(p) for p in self.files)


def open_source(source: str | os.PathLike, *, text_field: str = "text",
                pairs: tuple[str, str] | None = None, token_field: str = "") -> Source:
  """The `Source` of `source`: 'stdlib', a folder of text files, a folder of parquet files or one written by
  `datasets.save_to_disk`, or a `.jsonl` / `.parquet` / `.arrow` file. Refused by name when it is none of
  these or holds nothing."""
  name = str(source)
  if token_field and pairs:
    raise ValueError("Prompt/response pairs are read as text: a token_field cannot be combined with them.")
  source = _open(name, text_field, pairs)
  if token_field and source.kind in ("stdlib", "folder"):
    raise ValueError(f"token_field={token_field!r}: already tokenized documents come from a JSONL, parquet or "
                     f"datasets source, not {name!r}.")
  return dataclasses.replace(source, token_field=token_field)


def _open(name: str, text_field: str, pairs) -> Source:
  if name == "stdlib":
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return Source(name, "stdlib", str(root), tuple(str(p) for p in corpus.stdlib_files()), text_field, pairs)
  path = pathlib.Path(name)
  if not path.exists():
    raise ValueError(f"Corpus source {name!r} does not exist.")
  if path.is_dir():
    if (path / "dataset_dict.json").is_file():
      splits = sorted(p.name for p in path.iterdir() if p.is_dir())
      raise ValueError(f"{name!r} is a datasets DatasetDict (splits {splits}): pass one split's folder, e.g. "
                       f"{str(path / (splits[0] if splits else 'train'))!r}.")
    arrow = sorted(path.glob("*.arrow"))
    if arrow and (path / "state.json").is_file():
      return Source(name, "arrow", str(path), tuple(map(str, arrow)), text_field, pairs)
    parquet = sorted(path.glob("*.parquet"))
    if parquet:
      return Source(name, "parquet", str(path), tuple(map(str, parquet)), text_field, pairs)
    files = tuple(str(p) for p in corpus.walk(path))
    if not files:
      raise ValueError(f"Corpus source {name!r} contains no files.")
    if pairs:
      raise ValueError(f"Prompt/response pairs come from a JSONL, parquet or datasets source, not a folder of "
                       f"text files ({name!r}).")
    return Source(name, "folder", str(path), files, text_field, pairs)
  kinds = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
  if path.suffix not in kinds:
    raise ValueError(f"Unsupported corpus source {name!r}: expected 'stdlib', a folder, or a .jsonl, .parquet or "
                     ".arrow file.")
  if path.stat().st_size == 0:
    raise ValueError(f"Corpus source {name!r} is empty (0 bytes).")
  return Source(name, kinds[path.suffix], str(path.parent), (str(path),), text_field, pairs)


def pieces(source: Source, workers: int = 1, piece_bytes: int = 0) -> list[dict]:
  """The pieces of `source` in reading order: of about `piece_bytes` of input each, by default about 8 per
  worker of 1-32 MB each (a parquet row group and an Arrow file are one piece each)."""
  target = piece_bytes or min(_MAX_PIECE_BYTES, max(_MIN_PIECE_BYTES, source.total_bytes() // (8 * max(1, workers))))
  if source.kind in ("stdlib", "folder"):
    out, group, size = [], [], 0
    for path in source.files:
      group.append(path)
      size += os.path.getsize(path)
      if size >= target:
        out.append({"files": group})
        group, size = [], 0
    return out + ([{"files": group}] if group else [])
  if source.kind == "jsonl":
    size = os.path.getsize(source.files[0])
    return [{"file": source.files[0], "start": s, "stop": min(size, s + target)} for s in range(0, size, target)]
  if source.kind == "parquet":
    pq = _pyarrow("parquet").parquet
    return [{"file": f, "row_group": g} for f in source.files for g in range(pq.ParquetFile(f).num_row_groups)]
  return [{"file": f} for f in source.files]


def read_piece(source: Source, piece: dict) -> Iterator[tuple[str, object]]:
  """The documents of `piece` as (split key, text or (prompt, response)); a file that is not UTF-8 text is
  skipped and yields `(path, None)` so that it can be counted."""
  if source.kind in ("stdlib", "folder"):
    for path in piece["files"]:
      key = pathlib.Path(path).relative_to(source.root).as_posix()
      yield key, corpus.read_text(path)
  elif source.kind == "jsonl":
    yield from _jsonl_range(source, piece["file"], piece["start"], piece["stop"])
  elif source.kind == "parquet":
    table = _pyarrow("parquet").parquet.ParquetFile(piece["file"]).read_row_group(
        piece["row_group"], columns=list(source.fields))
    yield from _records(source, table, piece["file"])
  else:
    pa = _pyarrow()
    with pa.memory_map(piece["file"]) as f:
      try:
        table = pa.ipc.open_stream(f).read_all()
      except pa.ArrowInvalid:
        f.seek(0)
        table = pa.ipc.open_file(f).read_all()
    yield from _records(source, table, piece["file"])


def _records(source: Source, table, where: str) -> Iterator[tuple[str, object]]:
  columns = []
  for field in source.fields:
    if field not in table.column_names:
      raise ValueError(f"{where}: no column {field!r} (it has {table.column_names}); set --text_field.")
    columns.append(table.column(field).to_pylist())
  for row, values in enumerate(zip(*columns)):
    if not _valid(values, source):
      raise ValueError(f"{where}: row {row} of column {source.fields} is not {_expected(source)}.")
    yield _keyed(values, source)


def _valid(values, source: Source) -> bool:
  if source.token_field:
    return isinstance(values[0], list) and all(isinstance(i, int) and not isinstance(i, bool) for i in values[0])
  return all(isinstance(v, str) for v in values)


def _expected(source: Source) -> str:
  return "a list of integer token ids" if source.token_field else "a string"


def _keyed(values: tuple, source: Source) -> tuple[str, object]:
  """(split key, document) of one record, keyed as `corpus.load_corpus` and `sft.jsonl_examples` key them."""
  if source.pairs:
    return json.dumps(list(values)), tuple(values)
  if source.token_field:
    return ",".join(map(str, values[0])), values[0]
  return values[0], values[0]


def _jsonl_range(source: Source, path: str, start: int, stop: int) -> Iterator[tuple[str, object]]:
  """Records of the lines that start in [start, stop) (a line belongs to the range holding its first byte)."""
  with open(path, "rb") as f:
    f.seek(start)
    if start:
      f.seek(start - 1)
      if f.read(1) != b"\n":
        f.readline()  # the rest of a line that began in the previous range
    while f.tell() < stop:
      offset = f.tell()
      line = f.readline()
      if not line:
        break
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: the line at byte {offset} is not valid JSON ({e}).") from None
      if not isinstance(record, dict) or not _valid(tuple(record.get(k) for k in source.fields), source):
        names = " and ".join(repr(k) for k in source.fields)
        raise ValueError(f"{path}: the line at byte {offset} is not a JSON object whose field(s) {names} hold "
                         f"{_expected(source)}.")
      yield _keyed(tuple(record[k] for k in source.fields), source)


def _pyarrow(module: str = ""):
  try:
    import pyarrow  # pylint: disable=import-outside-toplevel
    if module:
      __import__(f"pyarrow.{module}")
  except ImportError:
    raise ImportError("Reading parquet or datasets (Arrow) corpora needs pyarrow: pip install -e '.[data]'.") from None
  return pyarrow


def sample_documents(source: Source, max_chars: int = 16_000_000, *, seed: int = 0,
                     validation_fraction: float = 0.0) -> list[str]:
  """Texts of training documents of `source` from its pieces in a seeded order, about `max_chars` characters
  (whole pieces until the budget is reached; a pair counts as its prompt and its response): what a tokenizer
  is trained on, read without reading the whole corpus."""
  if source.token_field:
    raise ValueError(f"{source.name!r} holds token ids ({source.token_field!r}), not text to train a tokenizer on: "
                     "name the tokenizer they were made with.")
  order = list(range(len(work := pieces(source))))
  random.Random(seed).shuffle(order)
  texts, total = [], 0
  for i in order:
    for key, value in read_piece(source, work[i]):
      if value is None or corpus.split_score(key, seed) < validation_fraction:
        continue
      for text in (value if source.pairs else (value,)):
        texts.append(text)
        total += len(text)
    if total >= max_chars:
      break
  return texts

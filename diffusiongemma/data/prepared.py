"""Prepared corpora: a source tokenized once into token shards plus `manifest.json`, read in windows.

  DIR/manifest.json          format and version, the tokenizer's hash, the source's fingerprint, per split the
                             shards with their token and document counts and sha256, and a digest of it all
  DIR/tokenizer.model        the sentencepiece tokenizer it was made with (when it is one)
  DIR/{train,validation}/NNNNN.tokens    little-endian token ids (uint16 below 65,536 pieces, else int32):
                             text documents each followed by EOS (`kind='text'`), or prompt + response ids
                             of each pair (`kind='pairs'`) with
  DIR/{split}/NNNNN.lengths  int32 [examples, 2]: each pair's prompt (BOS included) and response lengths
  DIR/pieces/NNNNN.json      what one piece of the source produced: the marker that lets a re-run skip it

Raw token files are read by range (`pread` locally, seek and read elsewhere), so a window of a 500 GB
corpus costs its own bytes; a packed window cuts across documents, so records would only be overhead.
Every file is written under a temporary name and renamed, the manifest last: a folder without a manifest
is unfinished, and one whose shards disagree with it (missing, truncated, another tokenizer, an edited
manifest) is refused naming the file. Workers are processes, one piece of the source at a time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Sequence

from absl import logging
import numpy as np
import tqdm

from diffusiongemma import _files
from diffusiongemma.data import corpus
from diffusiongemma.data import sources as sources_lib
from diffusiongemma.data import tokenizer as sp_tokenizer

FORMAT, VERSION = "diffusiongemma.prepared", 1
MANIFEST = "manifest.json"
KINDS = ("text", "pairs")
_OPEN_FILES = 64  # local shard files a reader keeps open
_SPLITS = corpus.SPLITS


class PreparedDataError(ValueError):
  """A prepared folder that cannot be used; the message names the file."""


def tokenizer_hash(tok) -> str:
  """The identity of a tokenizer: a hash of its serialized model."""
  return hashlib.sha256(tok.serialized).hexdigest()[:16]


def is_prepared(path) -> bool:
  """Whether `path` (a local folder or a gs:// URI) is a prepared folder (it holds a manifest)."""
  return str(path) != "stdlib" and (_path(path) / MANIFEST).is_file()


def _path(value):
  """A local path or a gs:// URI as an `epath.Path` (`_files.as_path`)."""
  return _files.as_path(value, "a prepared corpus")


# ----------------------------------------------------------------------------------------------- writing


@dataclasses.dataclass(frozen=True)
class _Job:
  """What every worker needs (pickled once per worker process)."""

  source: sources_lib.Source
  output: str
  tokenizer: object
  kind: str
  dtype: str
  validation_fraction: float
  seed: int
  key: str  # changes whenever the pieces' outputs would
  threads: int


def prepare(source: str | sources_lib.Source, output, tokenizer, *, kind: str = "text", workers: int = 1,
            validation_fraction: float = 0.02, seed: int = 0, text_field: str = "text",
            pair_fields: tuple[str, str] = ("prompt", "response"), token_field: str = "", piece_bytes: int = 0,
            threads: int = 1, progress: bool = False) -> dict:
  """Tokenizes `source` into the prepared folder `output` and returns its manifest.

  A re-run keeps every piece already done with the same source, tokenizer and settings (a folder prepared
  before returns at once). `workers` processes tokenize one piece each at a time (1: this process), each
  with `threads` threads (-1: every core; for one process preparing alone, e.g. on a training's first run).
  Documents that are not UTF-8 text are skipped and counted (`skipped_documents`). `piece_bytes`: the input
  per piece (default: `sources.pieces`'s choice).
  """
  if kind not in KINDS:
    raise ValueError(f"Unknown kind {kind!r}; expected one of {KINDS}.")
  if not 0.0 <= validation_fraction < 1.0:
    raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}.")
  if not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers must be an integer >= 1, got {workers!r}.")
  if not isinstance(source, sources_lib.Source):
    source = sources_lib.open_source(source, text_field=text_field, token_field=token_field,
                                     pairs=tuple(pair_fields) if kind == "pairs" else None)
  output = _path(output)
  dtype = "uint16" if tokenizer.vocab_size <= 2**16 else "int32"
  settings = {"kind": kind, "dtype": dtype, "validation_fraction": validation_fraction, "seed": seed,
              "tokenizer": tokenizer_hash(tokenizer), "source": source.fingerprint(), "fields": source.fields}
  key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
  manifest_path = output / MANIFEST
  if manifest_path.is_file():
    try:
      manifest = _files.read_json(manifest_path)
      if manifest.get("key") == key:
        _check(output, manifest, tokenizer)
        return manifest
    except (PreparedDataError, _files.BadFileError) as e:
      logging.warning("Preparing %s again: %s", output, e)
    manifest_path.unlink()
  work = sources_lib.pieces(source, workers, piece_bytes)
  job = _Job(source, str(output), tokenizer, kind, dtype, validation_fraction, seed, key, threads)
  start = time.perf_counter()
  done = {i: m for i, m in enumerate(_markers(output, len(work), key)) if m is not None}
  todo = [i for i in range(len(work)) if i not in done]
  bar = tqdm.tqdm(total=len(work), initial=len(done), unit="piece", desc=f"preparing {source.name}",
                  disable=not progress)
  if workers == 1 or len(todo) <= 1:
    for i in todo:
      done[i] = _run_piece(job, i, work[i])
      bar.update()
  else:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)), mp_context=context,
                                                initializer=_init_worker, initargs=(job,)) as pool:
      futures = {pool.submit(_worker_piece, i, work[i]): i for i in todo}
      for future in concurrent.futures.as_completed(futures):
        done[futures[future]] = future.result()
        bar.update()
  bar.close()
  markers = [done[i] for i in range(len(work))]
  documents = sum(m["splits"][s]["documents"] for m in markers for s in _SPLITS)
  if documents == 0:
    raise ValueError(f"Corpus source {source.name!r} has no readable UTF-8 text: "
                     f"{sum(m['skipped'] for m in markers)} documents skipped as not UTF-8 text.")
  if validation_fraction > 0 and documents >= 2 and not any(m["splits"]["validation"]["documents"] for m in markers):
    # As `corpus.load_corpus`: a small corpus moves its lowest-scored document into validation.
    i = min(range(len(work)), key=lambda j: markers[j]["lowest"][0] if markers[j]["lowest"] else 2.0)
    markers[i] = _run_piece(job, i, work[i], force_validation=markers[i]["lowest"][1])
  manifest = _manifest(job, source, markers, tokenizer)
  _files.atomic_write(manifest_path, json.dumps(manifest, indent=1, sort_keys=True))
  elapsed = time.perf_counter() - start
  logging.info("Prepared %s into %s: %s tokens (%d pieces, %d workers, %.1f s).", source.name, output,
               f"{manifest['splits']['train']['tokens']:,}", len(work), workers, elapsed)
  return manifest


def _markers(output, count: int, key: str) -> list[dict | None]:
  """The marker of each piece done before with the same key whose shards are all there."""
  out = []
  for i in range(count):
    path = output / "pieces" / f"{i:05d}.json"
    try:
      marker = _files.read_json(path)
    except (FileNotFoundError, _files.BadFileError):
      out.append(None)
      continue
    ok = marker.get("key") == key and all(
        (output / f).is_file() and (output / f).stat().length == size
        for s in _SPLITS for f, size in marker["splits"][s].get("files", {}).items())
    out.append(marker if ok else None)
  return out


_JOB: _Job | None = None


def _init_worker(job: _Job) -> None:
  global _JOB  # pylint: disable=global-statement
  _JOB = job


def _worker_piece(index: int, piece: dict) -> dict:
  return _run_piece(_JOB, index, piece)


def _encode(tok, texts: list[str], threads: int) -> list[list[int]]:
  if not texts:
    return []
  if isinstance(tok, sp_tokenizer.Tokenizer):
    return tok.encode_batch(texts, num_threads=threads)
  return tok.encode_batch(texts)


def _token_ids(job: _Job, docs: list[list[int]], piece: dict) -> list[list[int]]:
  """Already tokenized documents, checked against the tokenizer's vocabulary."""
  vocab = job.tokenizer.vocab_size
  for ids in docs:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
      raise ValueError(f"{piece.get('file', job.source.name)}: token id {bad[0]} in {job.source.token_field!r} is "
                       f"outside the tokenizer's vocabulary [0, {vocab}).")
  return docs


def _run_piece(job: _Job, index: int, piece: dict, force_validation: int | None = None) -> dict:
  """Tokenizes one piece into its shard of each split; writes the marker last."""
  texts = {s: [] for s in _SPLITS}
  skipped, lowest = 0, None
  for position, (key, value) in enumerate(sources_lib.read_piece(job.source, piece)):
    if value is None:
      skipped += 1
      continue
    score = corpus.split_score(key, job.seed)
    if lowest is None or score < lowest[0]:
      lowest = (score, position)
    validation = score < job.validation_fraction or position == force_validation
    texts["validation" if validation else "train"].append(value)
  output = _path(job.output)
  marker = {"key": job.key, "piece": piece, "skipped": skipped, "lowest": lowest, "splits": {}}
  for split in _SPLITS:
    docs = texts[split]
    files = {}
    if job.kind == "text":
      ids = _token_ids(job, docs, piece) if job.source.token_field else _encode(job.tokenizer, docs, job.threads)
      eos = job.tokenizer.eos_id
      tokens = np.concatenate([np.asarray(x + [eos], job.dtype) for x in ids]) if ids else np.zeros(0, job.dtype)
      lengths = None
    else:
      prompts = _encode(job.tokenizer, [p for p, _ in docs], job.threads)
      responses = _encode(job.tokenizer, [r for _, r in docs], job.threads)
      bos = job.tokenizer.bos_id
      rows = [np.asarray([bos] + p + r, job.dtype) for p, r in zip(prompts, responses)]
      tokens = np.concatenate(rows) if rows else np.zeros(0, job.dtype)
      lengths = np.array([[len(p) + 1, len(r)] for p, r in zip(prompts, responses)], "<i4").reshape(-1, 2)
    entry = {"tokens": int(tokens.size), "documents": len(docs), "files": files}
    if docs:
      name = f"{split}/{index:05d}"
      data = tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes()
      _files.atomic_write(output / f"{name}.tokens", data)
      files[f"{name}.tokens"] = len(data)
      entry["sha256"] = hashlib.sha256(data).hexdigest()
      if lengths is not None:
        _files.atomic_write(output / f"{name}.lengths", lengths.tobytes())
        files[f"{name}.lengths"] = lengths.nbytes
    marker["splits"][split] = entry
  _files.atomic_write(output / "pieces" / f"{index:05d}.json", json.dumps(marker))
  return marker


def _manifest(job: _Job, source: sources_lib.Source, markers: Sequence[dict], tok) -> dict:
  splits = {}
  for split in _SPLITS:
    shards = []
    for m in markers:
      entry = m["splits"][split]
      if entry["documents"]:
        name = next(f for f in entry["files"] if f.endswith(".tokens"))
        shards.append({"file": name, "tokens": entry["tokens"], "documents": entry["documents"],
                       "sha256": entry["sha256"]})
    splits[split] = {"tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
                     "shards": shards}
  tokenizer = {"sha256": tokenizer_hash(tok), "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
               "eos_id": tok.eos_id, "pad_id": tok.pad_id}
  if isinstance(tok, sp_tokenizer.Tokenizer):
    _files.atomic_write(_path(job.output) / sp_tokenizer.TOKENIZER_FILENAME, tok.serialized)
    tokenizer["file"] = sp_tokenizer.TOKENIZER_FILENAME
  manifest = {"format": FORMAT, "version": VERSION, "kind": job.kind, "dtype": job.dtype, "key": job.key,
              "tokenizer": tokenizer, "source": {"name": source.name, "kind": source.kind,
                                                 "fingerprint": source.fingerprint(), "fields": list(source.fields)},
              "validation_fraction": job.validation_fraction, "seed": job.seed, "splits": splits,
              "skipped_documents": sum(m["skipped"] for m in markers)}
  manifest["digest"] = _digest(manifest)
  return manifest


def _digest(manifest: dict) -> str:
  body = {k: v for k, v in manifest.items() if k != "digest"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------- reading


def read_manifest(folder, tokenizer=None) -> dict:
  """The manifest of the prepared `folder`, after checking it and every shard it lists (present, of the
  size it says) and, given `tokenizer`, that the data was made with it. Errors name the file."""
  folder = _path(folder)
  path = folder / MANIFEST
  if not _files.present(path):
    raise PreparedDataError(f"{path} does not exist: {str(folder)!r} is not a prepared corpus (or its "
                            "preparation did not finish; run scripts/prepare_data.py again to resume it).")
  try:
    manifest = _files.read_json(path)
  except _files.BadFileError as e:
    raise PreparedDataError(str(e)) from None
  if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
    raise PreparedDataError(f"{path} is not a {FORMAT} manifest of version {VERSION} (format "
                            f"{manifest.get('format')!r}, version {manifest.get('version')!r}).")
  if manifest.get("digest") != _digest(manifest):
    raise PreparedDataError(f"{path} was edited after it was written (its digest does not match its contents): "
                            "prepare the corpus again.")
  _check(folder, manifest, tokenizer)
  return manifest


def _check(folder, manifest: dict, tokenizer) -> None:
  if tokenizer is not None and manifest["tokenizer"]["sha256"] != tokenizer_hash(tokenizer):
    raise PreparedDataError(
        f"{folder / MANIFEST} was made with another tokenizer (sha256 {manifest['tokenizer']['sha256']}, "
        f"{manifest['tokenizer']['vocab_size']} pieces) than this run's ({tokenizer_hash(tokenizer)}, "
        f"{tokenizer.vocab_size} pieces): prepare it with this tokenizer, or train with the one it was made "
        f"with (config.data.tokenizer_path).")
  itemsize = np.dtype(manifest["dtype"]).itemsize
  for split in _SPLITS:
    for shard in manifest["splits"][split]["shards"]:
      expected = {shard["file"]: shard["tokens"] * itemsize}
      if manifest["kind"] == "pairs":
        expected[shard["file"].replace(".tokens", ".lengths")] = shard["documents"] * 8
      for name, size in expected.items():
        path = folder / name
        if not path.is_file():
          raise PreparedDataError(f"{path} is missing: the prepared corpus {str(folder)!r} is incomplete "
                                  "(prepare it again).")
        if path.stat().length != size:
          raise PreparedDataError(f"{path} is {path.stat().length:,} bytes, not the {size:,} that {MANIFEST} "
                                  "records: it is truncated or damaged (prepare the corpus again).")


class _Shards:
  """Random access to the concatenation of a split's shards: each read fetches its own bytes (`pread` locally,
  a ranged read elsewhere), so memory holds what was read, not the files."""

  def __init__(self, folder, shards: Sequence[dict], dtype: str):
    self.paths = [folder / s["file"] for s in shards]
    self.dtype = np.dtype(dtype).newbyteorder("<")
    self.starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in shards], dtype=np.int64)])
    self._files: dict[int, int] = {}  # shard -> an open file descriptor (local shards), oldest first
    self._lock = threading.Lock()
    self.reads: list[tuple[int, int]] | None = None  # set to a list to record every range read

  @property
  def num_tokens(self) -> int:
    return int(self.starts[-1])

  def _tokens(self, i: int, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of shard i."""
    if not _files.is_local(self.paths[i]):
      with self.paths[i].open("rb") as f:
        f.seek(start * self.dtype.itemsize)
        return np.frombuffer(f.read((stop - start) * self.dtype.itemsize), self.dtype)
    # pread, not a memory map: a map's pages count as this process's memory, and its faults map whole folios
    # of a file in cache (a 20 MB shard resident for a few windows, measured). At most _OPEN_FILES stay open.
    with self._lock:
      if i not in self._files:
        if len(self._files) >= _OPEN_FILES:
          os.close(self._files.pop(next(iter(self._files))))
        self._files[i] = os.open(os.fspath(self.paths[i]), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
      size = self.dtype.itemsize
      return np.frombuffer(os.pread(self._files[i], (stop - start) * size, start * size), self.dtype)

  def read(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the split as int32."""
    if self.reads is not None:
      self.reads.append((start, stop))
    out, position = [], start
    shard = int(np.searchsorted(self.starts, start, side="right")) - 1
    while position < stop:
      base = int(self.starts[shard])
      end = min(stop, int(self.starts[shard + 1]))
      out.append(np.asarray(self._tokens(shard, position - base, end - base), np.int32))
      position, shard = end, shard + 1
    return np.concatenate(out) if len(out) != 1 else out[0]

  def __getstate__(self):  # grain may pickle the reader into its threads or processes: files are reopened
    return {k: v for k, v in self.__dict__.items() if k not in ("_files", "_lock")}

  def __setstate__(self, state):
    self.__dict__.update(state, _files={}, _lock=threading.Lock())


class TokenStream(_Shards):
  """The token stream of a text split."""


class Pairs(_Shards):
  """The (prompt, response) id pairs of a `kind='pairs'` split."""

  def __init__(self, folder, shards: Sequence[dict], dtype: str):
    super().__init__(folder, shards, dtype)
    lengths = [np.frombuffer((folder / s["file"].replace(".tokens", ".lengths")).read_bytes(), "<i4").reshape(-1, 2)
               for s in shards]
    self.lengths = np.concatenate(lengths) if lengths else np.zeros((0, 2), np.int32)
    self.offsets = np.concatenate([[0], np.cumsum(self.lengths.sum(1), dtype=np.int64)])

  def __len__(self) -> int:
    return len(self.lengths)

  def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
    ids = self.read(int(self.offsets[i]), int(self.offsets[i + 1]))
    return ids[:self.lengths[i, 0]], ids[self.lengths[i, 0]:]


def open_split(folder, split: str, tokenizer=None, *, manifest: dict | None = None) -> TokenStream | Pairs:
  """The reader of `split` of a prepared folder (checked first, see `read_manifest`)."""
  if split not in _SPLITS:
    raise ValueError(f"Unknown split {split!r}; expected one of {_SPLITS}.")
  folder = _path(folder)
  manifest = manifest or read_manifest(folder, tokenizer)
  shards = manifest["splits"][split]["shards"]
  if not shards:
    raise PreparedDataError(f"{folder / MANIFEST}: the {split} split holds no document.")
  cls = Pairs if manifest["kind"] == "pairs" else TokenStream
  return cls(folder, shards, manifest["dtype"])

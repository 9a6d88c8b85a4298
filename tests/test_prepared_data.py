"""Prepared corpora (data/prepared.py, data/sources.py, scripts/prepare_data.py, data/peek.py): every source kind
tokenized once into shards equal to reading it directly, resumable, refused by file name when damaged; the
windows each process reads, and nothing else."""

import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from diffusiongemma import data
from diffusiongemma.data import prepared
from diffusiongemma.data import sft
from diffusiongemma.data import sources

ROOT = pathlib.Path(__file__).parent.parent


def _documents(n=60):
  return [f"def f{i}(x):\n    return x * {i}  # caf\u00e9 {'#' * (i % 13)}\n" * (1 + i % 4) for i in range(n)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return data.Tokenizer.train(_documents(), tmp_path_factory.mktemp("tok") / "tokenizer.model", vocab_size=300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """60 text files and one that is not UTF-8."""
  root = tmp_path_factory.mktemp("folder")
  for i, text in enumerate(_documents()):
    (root / f"doc{i:02d}.py").write_text(text)
  (root / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
  return root


def _expected_stream(texts, tok):
  return np.concatenate([np.asarray(tok.encode(t) + [tok.eos_id]) for t in texts])


def test_every_source_kind_prepares_the_stream_that_reading_it_gives(tmp_path, folder, tok, monkeypatch):
  """A folder, JSONL (cut into byte ranges mid-line), parquet (row groups) and a datasets save_to_disk folder:
  the prepared train stream is the train split's documents, each followed by EOS, in source order; the
  validation split holds the rest; a file that is not UTF-8 is skipped and counted."""
  monkeypatch.setattr(sources, "_MIN_PIECE_BYTES", 700)  # many small pieces: ranges, groups, workers' order
  monkeypatch.setattr(sources, "_MAX_PIECE_BYTES", 700)
  monkeypatch.setattr(prepared, "_OPEN_FILES", 2)  # a reader across many shards closes the oldest
  texts = _documents()
  train_files = data.load_corpus(folder, "train", validation_fraction=0.2)
  manifest = prepared.prepare(folder, tmp_path / "folder", tok, validation_fraction=0.2)
  assert manifest["skipped_documents"] == 1 and len(manifest["splits"]["train"]["shards"]) > 3
  stream = prepared.open_split(tmp_path / "folder", "train", tok)
  np.testing.assert_array_equal(stream.read(0, stream.num_tokens), _expected_stream(train_files, tok))
  assert manifest["splits"]["validation"]["documents"] + len(train_files) == 60

  jsonl = tmp_path / "c.jsonl"
  jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" + ("\n" if i % 7 == 0 else "")
                           for i, t in enumerate(texts)))
  pq = pytest.importorskip("pyarrow.parquet")
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  pq.write_table(pa.table({"text": texts, "n": list(range(60))}), tmp_path / "c.parquet", row_group_size=7)
  datasets = pytest.importorskip("datasets")
  datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
  want = _expected_stream(data.load_corpus(jsonl, "train", validation_fraction=0.2), tok)
  for name, source in (("jsonl", jsonl), ("parquet", tmp_path / "c.parquet"), ("hf", tmp_path / "hf")):
    prepared.prepare(source, tmp_path / name, tok, validation_fraction=0.2)
    got = prepared.open_split(tmp_path / name, "train", tok)
    np.testing.assert_array_equal(got.read(0, got.num_tokens), want, err_msg=name)
    assert prepared.read_manifest(tmp_path / name)["splits"]["train"]["documents"] < 60


def test_already_tokenized_records_are_taken_as_they_are_and_checked(tmp_path, tok):
  pq = pytest.importorskip("pyarrow.parquet")
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  ids = [tok.encode(t) for t in _documents(20)]
  pq.write_table(pa.table({"input_ids": ids}), tmp_path / "ids.parquet", row_group_size=6)
  prepared.prepare(tmp_path / "ids.parquet", tmp_path / "p", tok, token_field="input_ids", validation_fraction=0.0)
  got = prepared.open_split(tmp_path / "p", "train", tok)
  np.testing.assert_array_equal(got.read(0, got.num_tokens), np.concatenate([x + [tok.eos_id] for x in ids]))
  pq.write_table(pa.table({"input_ids": [[5, 6], [7, tok.vocab_size]]}), tmp_path / "bad.parquet")
  with pytest.raises(ValueError, match=rf"bad.parquet: token id {tok.vocab_size} in 'input_ids' is outside"):
    prepared.prepare(tmp_path / "bad.parquet", tmp_path / "q", tok, token_field="input_ids")


def test_pairs_are_prepared_with_their_prompt_masking_and_batched_like_jsonl_examples(tmp_path, tok):
  path = tmp_path / "pairs.jsonl"
  path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": "x = 1\n" * (i % 5)}) + "\n" for i in range(40)))
  prepared.prepare(path, tmp_path / "p", tok, kind="pairs", validation_fraction=0.25)
  layout = dict(prompt_length=6, canvas_length=4, num_canvases=3)
  want = sft.jsonl_examples(path, tok, "train", **layout, validation_fraction=0.25)
  pairs = prepared.open_split(tmp_path / "p", "train", tok)
  batches = sft.pairs_dataset(pairs, **layout, eos_id=tok.eos_id, pad_id=tok.pad_id, batch_size=len(want),
                              seed=0, train=False)
  got = next(iter(batches))
  np.testing.assert_array_equal(got["tokens"], np.stack([e["tokens"] for e in want]))
  np.testing.assert_array_equal(got["prompt_length"], [e["prompt_length"] for e in want])
  np.testing.assert_array_equal(got["num_canvases"], [e["num_canvases"] for e in want])


def test_a_rerun_keeps_finished_pieces_and_redoes_a_lost_one(tmp_path, folder, tok, monkeypatch):
  monkeypatch.setattr(sources, "_MIN_PIECE_BYTES", 2000)
  monkeypatch.setattr(sources, "_MAX_PIECE_BYTES", 2000)
  out = tmp_path / "p"
  manifest = prepared.prepare(folder, out, tok, validation_fraction=0.2)
  shards = sorted((out / "train").glob("*.tokens"))
  (out / "manifest.json").unlink()  # an interrupted run: no manifest, one piece lost
  (out / "pieces" / "00001.json").unlink()
  before = {p: p.stat().st_mtime_ns for p in shards}
  time.sleep(0.01)
  assert prepared.prepare(folder, out, tok, validation_fraction=0.2) == manifest
  redone = [p.name for p in shards if p.stat().st_mtime_ns != before[p]]
  assert redone == ["00001.tokens"]


def test_damaged_or_foreign_preparations_are_refused_naming_the_file(tmp_path, folder, tok):
  out = tmp_path / "p"
  prepared.prepare(folder, out, tok, validation_fraction=0.2)
  other = data.Tokenizer.train(_documents()[:30], tmp_path / "other.model", vocab_size=320)
  with pytest.raises(ValueError, match=r"manifest.json was made with another tokenizer"):
    prepared.read_manifest(out, other)
  shard = sorted((out / "train").glob("*.tokens"))[0]
  original = shard.read_bytes()
  shard.write_bytes(original[:-2])
  with pytest.raises(ValueError, match=rf"{shard} is .* bytes, not the .* truncated"):
    prepared.open_split(out, "train", tok)
  shard.unlink()
  with pytest.raises(ValueError, match=rf"{shard} is missing"):
    prepared.read_manifest(out)
  shard.write_bytes(original)
  manifest = json.loads((out / "manifest.json").read_text())
  manifest["splits"]["train"]["tokens"] += 1
  (out / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(ValueError, match=r"manifest.json was edited after it was written"):
    prepared.read_manifest(out)
  with pytest.raises(ValueError, match=r"nowhere.manifest.json does not exist"):
    prepared.read_manifest(tmp_path / "nowhere")
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(ValueError, match=r"empty.jsonl' is empty"):
    prepared.prepare(empty, tmp_path / "e", tok)


def test_each_process_reads_only_the_tokens_of_its_own_windows(tmp_path, folder, tok):
  prepared.prepare(folder, tmp_path / "p", tok, validation_fraction=0.2)
  length, reads = 24, []
  for process in range(2):
    stream = prepared.open_split(tmp_path / "p", "train")
    stream.reads = []
    batches = data.make_dataset(stream, None, prompt_length=8, canvas_length=8, num_canvases=2, batch_size=3,
                                seed=0, train=True, shard_index=process, shard_count=2)
    iterator = iter(batches)
    for _ in range(4):
      next(iterator)
    horizon = 4 + 2 * 16  # grain reads ahead (its prefetch buffer), still this process's own rows
    mine = {int(w) for step in range(horizon) for w in batches.items(step)}
    read = {start // length for start, _ in stream.reads}
    assert read <= mine and {(w * length, (w + 1) * length) for w in read} == set(stream.reads)
    assert {int(w) for step in range(4) for w in batches.items(step)} <= read
    reads.append(read)
  assert not reads[0] & reads[1]


def test_prepare_data_and_peek_binaries(tmp_path, folder):
  """scripts/prepare_data.py (2 workers, tokenizer trained on a sample) writes what the library writes with one
  worker; peek's windows of process 1 of 2 are that process's rows and decode to the corpus's text."""
  out = tmp_path / "prepared"
  run = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), f"--source={folder}",
                        f"--output={out}", "--vocab_size=300", "--workers=2", "--piece_bytes=2000",
                        "--validation_fraction=0.2"],
                       capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "1 skipped (not UTF-8 text)" in run.stdout
  tok = data.Tokenizer(out / "tokenizer.model")
  manifest = prepared.prepare(folder, tmp_path / "one", tok, validation_fraction=0.2, piece_bytes=2000)
  assert prepared.read_manifest(out, tok)["splits"] == manifest["splits"] and len(list(out.glob("train/*"))) > 3
  peek = subprocess.run([sys.executable, "-m", "diffusiongemma.data.peek", f"--config={ROOT / 'configs' / 'tiny.py'}",
                         f"--config.data.corpus={out}", "--config.train.batch_size=4", "--process_index=1",
                         "--process_count=2", "--steps=2", f"--output={tmp_path / 'peek.json'}"],
                        capture_output=True, text=True, timeout=300, check=False)
  assert peek.returncode == 0, peek.stderr[-2000:]
  shown = json.loads((tmp_path / "peek.json").read_text())
  assert [len(s["windows"]) for s in shown["steps"]] == [2, 2]
  corpus_text = "".join(data.load_corpus(folder, "train", validation_fraction=0.2))
  for text in shown["steps"][0]["text"]:
    assert text[5:40] in corpus_text
  bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), f"--source={tmp_path / 'none'}",
                        f"--output={tmp_path / 'x'}"], capture_output=True, text=True, timeout=120, check=False)
  assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1].endswith("none' does not exist.")

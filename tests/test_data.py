"""Tests for diffusiongemma.data: corpora, the tokenizer, and the grain pipeline."""

import json
import pathlib
import pickle

import numpy as np
import pytest

from diffusiongemma import data
from diffusiongemma.data import corpus
from diffusiongemma.data import tokenizer as tokenizer_lib

TRICKY_CODE = (
    "def f(x):\n"
    "\tif x:  # tab-indented, two spaces before the comment\n"
    "\t\treturn 'caf\u00e9 e\u0301 \u4e2d\u6587 \U0001F600'\n"
    "    \n"
    "\n\n"
    "   leading and trailing spaces   \r\n"
    "n = 1234567890 + 0x1F\u2581 <s></s><pad><unk> \u2581\u2581\n"
    "\x01\x7f\u00a0\u200b end"
)


def _synthetic_texts(n=40):
  """Small Python-like documents with indentation, tabs, digits and unicode."""
  return [
      f"class C{i}:\n    def m{i}(self, x):\n\t\treturn x * {i} + {i * 37}  # \u00fcber {i}\n"
      f"    value_{i} = 'text {i}'\n"
      for i in range(n)
  ]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
  return data.Tokenizer.train(_synthetic_texts() + [TRICKY_CODE], path, vocab_size=400)


def _window_stream(tokens, length):
  return np.asarray(tokens[:tokens.size // length * length]).reshape(-1, length)


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def _make(tokens, *, train, batch_size=2, seed=0, **kwargs):
  layout = dict(prompt_length=3, canvas_length=4, num_canvases=2)  # length 11
  return data.make_dataset(tokens, None, **layout, batch_size=batch_size, seed=seed,
                           train=train, **kwargs)


# Corpus.


def test_stdlib_files():
  files = corpus.stdlib_files()
  assert files == sorted(files) and len(files) > 100
  assert all(f.suffix == ".py" for f in files)
  assert not any({"site-packages", "dist-packages"} & set(f.parts) for f in files)
  assert any(f.name == "os.py" for f in files)


def test_read_text_files_skips_binary_and_non_utf8(tmp_path):
  (tmp_path / "good.txt").write_text("h\u00e9llo\n", encoding="utf-8")
  (tmp_path / "latin1.txt").write_bytes("h\u00e9llo".encode("latin-1"))
  (tmp_path / "nul.bin").write_bytes(b"abc\0def")
  texts, skipped = data.read_text_files(sorted(tmp_path.iterdir()))
  assert texts == ["h\u00e9llo\n"] and skipped == 2


def test_split_is_deterministic_disjoint_and_order_independent():
  paths = [pathlib.Path(f"/root/pkg{i % 7}/mod{i}.py") for i in range(500)]
  train, validation = data.split_files(paths, validation_fraction=0.1, seed=3)
  assert not set(train) & set(validation)
  assert set(train) | set(validation) == set(paths)
  assert 20 <= len(validation) <= 80
  train2, validation2 = data.split_files(paths[::-1], validation_fraction=0.1, seed=3)
  assert set(train2) == set(train) and set(validation2) == set(validation)
  # Moving the corpus elsewhere keeps the split: it hashes relative paths.
  moved = [pathlib.Path("/elsewhere") / p.relative_to("/root") for p in paths]
  _, validation3 = data.split_files(moved, validation_fraction=0.1, seed=3)
  assert {p.relative_to("/elsewhere") for p in validation3} == {
      p.relative_to("/root") for p in validation}
  _, other_seed = data.split_files(paths, validation_fraction=0.1, seed=4)
  assert set(other_seed) != set(validation)


def test_split_of_a_small_corpus_has_both_splits():
  paths = [pathlib.Path(f"/c/{name}") for name in "abc"]
  train, validation = data.split_files(paths, validation_fraction=0.02)
  assert len(validation) == 1 and len(train) == 2


def test_folder_source(tmp_path):
  for i in range(6):
    sub = tmp_path / f"d{i % 2}"
    sub.mkdir(exist_ok=True)
    (sub / f"f{i}.{['py', 'md', 'txt'][i % 3]}").write_text(f"doc {i}\n")
  (tmp_path / "image.bin").write_bytes(b"\x89PNG\0\0")
  (tmp_path / ".hidden").write_text("hidden\n")
  train = data.load_corpus(tmp_path, "train")
  validation = data.load_corpus(str(tmp_path), "validation")
  assert sorted(train + validation) == [f"doc {i}\n" for i in range(6)]
  assert train and validation and not set(train) & set(validation)


def test_jsonl_source(tmp_path):
  path = tmp_path / "docs.jsonl"
  records = [{"content": f"document {i}", "id": i} for i in range(50)]
  path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
  train = data.load_corpus(path, "train", text_field="content")
  validation = data.load_corpus(path, "validation", text_field="content")
  assert sorted(train + validation) == sorted(r["content"] for r in records)
  assert validation and not set(train) & set(validation)


@pytest.mark.parametrize("contents, match", [
    ('{"text": "a"}\nnot json\n', "line 2 is not valid JSON"),
    ('{"text": "a"}\n{"body": "b"}\n', "line 2 has no string field 'text'"),
    ('{"text": 7}\n', "line 1 has no string field 'text'"),
    ("\n\n", "no records"),
])
def test_bad_jsonl(tmp_path, contents, match):
  path = tmp_path / "bad.jsonl"
  path.write_text(contents)
  with pytest.raises(ValueError, match=match):
    data.load_corpus(path)


def test_bad_sources(tmp_path):
  with pytest.raises(ValueError, match="'/no/such/corpus' does not exist"):
    data.load_corpus("/no/such/corpus")
  with pytest.raises(ValueError, match="contains no files"):
    data.load_corpus(tmp_path)
  (tmp_path / "a.bin").write_bytes(b"\0\1\2")
  with pytest.raises(ValueError, match="no readable UTF-8 text files in split 'train'"):
    data.load_corpus(tmp_path)
  with pytest.raises(ValueError, match="Unknown split 'test'"):
    data.load_corpus("stdlib", "test")
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="Unsupported corpus source .*x.csv"):
    data.load_corpus(tmp_path / "x.csv")


# Tokenizer.


def test_tokenizer_special_ids_and_vocab(tokenizer):
  assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id) == (0, 1, 2)
  assert 300 < tokenizer.vocab_size <= 400


@pytest.mark.parametrize("text", [
    TRICKY_CODE, "", " ", "\n", "\t\t", "  x", "x  ", "\u2581", "\U0001F9EC\u0000z"])
def test_tokenizer_is_lossless(tokenizer, text):
  assert tokenizer.decode(tokenizer.encode(text)) == text
  assert tokenizer.decode(np.asarray(tokenizer.encode(text))) == text


def test_tokenizer_encode_batch_matches_encode(tokenizer):
  texts = [TRICKY_CODE, "abc", "\u2581x"]
  assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]


def test_tokenizer_pickles(tokenizer):
  clone = pickle.loads(pickle.dumps(tokenizer))
  assert clone.encode(TRICKY_CODE) == tokenizer.encode(TRICKY_CODE)


def test_get_tokenizer_trains_once_then_loads(tmp_path):
  calls = []

  def texts_fn():
    calls.append(1)
    return _synthetic_texts()

  with pytest.raises(FileNotFoundError, match="has no tokenizer.model: a training run writes it there"):
    data.get_tokenizer(tmp_path, corpus_texts_fn=texts_fn, vocab_size=350)  # a read trains nothing
  assert not calls and not any(tmp_path.iterdir())
  first = data.get_tokenizer(tmp_path, corpus_texts_fn=texts_fn, vocab_size=350, train_if_missing=True)
  assert (tmp_path / "tokenizer.model").is_file()
  second = data.get_tokenizer(tmp_path, corpus_texts_fn=texts_fn, vocab_size=350, train_if_missing=True)
  assert len(calls) == 1 and second.serialized == first.serialized
  explicit = data.get_tokenizer(tmp_path / "other", path=tmp_path / "tokenizer.model")
  assert explicit.serialized == first.serialized
  with pytest.raises(ValueError, match="missing.model' does not exist"):
    data.get_tokenizer(tmp_path, path=tmp_path / "missing.model")


def test_tokenizer_on_a_slice_of_the_stdlib(tmp_path, monkeypatch):
  """Training time is bounded by what the trainer reads: a seeded sample of whole documents of exactly
  max_chars characters (the last one cut), whatever the corpus size; the tokenizer round-trips held-out
  files."""
  texts = data.load_corpus("stdlib", "train")[:200]
  assert sum(map(len, texts)) > 2_000_000
  trainer, samples = tokenizer_lib.spm.SentencePieceTrainer, []
  train = trainer.train

  def spy(*, sentence_iterator, **kwargs):
    samples.append(list(sentence_iterator))
    return train(sentence_iterator=iter(samples[-1]), **kwargs)

  monkeypatch.setattr(trainer, "train", spy)
  tok = data.Tokenizer.train(texts, tmp_path / "t.model", vocab_size=1024, max_chars=1_000_000)
  data.Tokenizer.train(texts, tmp_path / "again.model", vocab_size=1024, max_chars=1_000_000)
  sample = samples[0]
  assert sum(map(len, sample)) == 1_000_000 and samples[1] == sample  # seeded
  assert all(text in texts for text in sample[:-1]) and any(t.startswith(sample[-1]) for t in texts)
  assert len(set(sample[:-1])) == len(sample) - 1 > 10  # whole documents, each once, from across the corpus
  assert tok.vocab_size == 1024
  held_out = data.load_corpus("stdlib", "validation")[:20]
  for text in held_out:
    assert tok.decode(tok.encode(text)) == text


# Pipeline.


def test_tokenize_corpus_appends_eos_and_caches(tokenizer, tmp_path):
  texts = ["a b", "c\n", "\u00fc"]
  tokens = data.tokenize_corpus(texts, tokenizer, cache_dir=tmp_path)
  assert tokens.dtype == np.int32
  expected = sum((tokenizer.encode(t) + [tokenizer.eos_id] for t in texts), [])
  np.testing.assert_array_equal(tokens, expected)
  assert len(list(tmp_path.glob("tokens-*.npy"))) == 1
  cached = data.tokenize_corpus(texts, tokenizer, cache_dir=tmp_path)
  assert isinstance(cached, np.memmap)
  np.testing.assert_array_equal(cached, tokens)
  data.tokenize_corpus(texts[:2], tokenizer, cache_dir=tmp_path)
  assert len(list(tmp_path.glob("tokens-*.npy"))) == 2


def test_pipeline_from_texts_shapes_and_dtypes(tokenizer):
  texts = _synthetic_texts()
  dataset = data.make_dataset(texts, tokenizer, prompt_length=5, canvas_length=8, num_canvases=3,
                              batch_size=4, seed=0, train=True)
  batch = next(iter(dataset))
  assert batch["tokens"].shape == (4, 5 + 3 * 8) and batch["tokens"].dtype == np.int32
  assert batch["prompt_length"].shape == (4,) and batch["prompt_length"].dtype == np.int32
  assert (batch["prompt_length"] == 5).all()
  # Each row is one window of the documents' token stream (each document's ids, then EOS), distinct.
  windows = _window_stream(np.asarray(data.tokenize_corpus(texts, tokenizer)), 5 + 3 * 8)
  rows = [int(np.flatnonzero((windows == row).all(-1))[0]) for row in batch["tokens"]]
  assert len(set(rows)) == 4


def test_validation_pass_reproduces_the_stream():
  tokens = np.arange(1000, dtype=np.int32)
  batches = list(_make(tokens, train=False, batch_size=3))
  windows = np.concatenate([b["tokens"] for b in batches])
  assert len(batches) == (1000 // 11) // 3
  np.testing.assert_array_equal(windows.reshape(-1), tokens[:windows.size])


def test_training_is_seeded_shuffled_and_repeats():
  tokens = np.arange(1000, dtype=np.int32)
  windows = _window_stream(tokens, 11)  # 90 windows, 45 batches of 2 per epoch
  first = _take(iter(_make(tokens, train=True, seed=1)), 45)
  again = _take(iter(_make(tokens, train=True, seed=1)), 45)
  other = _take(iter(_make(tokens, train=True, seed=2)), 45)
  _assert_batches_equal(first, again)
  epoch = np.concatenate([b["tokens"] for b in first])
  assert not np.array_equal(epoch, windows)
  assert not np.array_equal(epoch, np.concatenate([b["tokens"] for b in other]))
  # One epoch holds every window exactly once: packing loses and duplicates nothing.
  np.testing.assert_array_equal(np.sort(epoch[:, 0]), windows[:, 0])
  np.testing.assert_array_equal(epoch, windows[epoch[:, 0] // 11])
  assert len(_take(iter(_make(tokens, train=True, seed=1)), 200)) == 200


def test_state_restore_gives_identical_batches():
  tokens = np.arange(1000, dtype=np.int32)
  iterator = iter(_make(tokens, train=True, seed=5))
  _take(iterator, 7)
  state = json.loads(json.dumps(iterator.get_state()))  # What a checkpoint would store.
  expected = _take(iterator, 50)  # Crosses an epoch boundary.
  restored = iter(_make(tokens, train=True, seed=5))
  restored.set_state(state)
  _assert_batches_equal(_take(restored, 50), expected)


def test_processes_read_their_rows_of_one_global_order():
  """Process i of n reads rows i*B/n.. of every global batch of the one-process order: together the processes
  read exactly the global batches (training and validation), each window once."""
  tokens = np.arange(1000, dtype=np.int32)  # 90 windows
  for train in (True, False):
    whole = _take(iter(_make(tokens, train=train, batch_size=6)), 15)
    parts = [_take(iter(_make(tokens, train=train, batch_size=2, shard_index=i, shard_count=3)), 15)
             for i in range(3)]
    for step, batch in enumerate(whole):
      np.testing.assert_array_equal(batch["tokens"], np.concatenate([p[step]["tokens"] for p in parts]))
    starts = np.concatenate([b["tokens"][:, 0] for b in whole])
    assert len(set(starts.tolist())) == 90  # 15 batches of 6: one epoch, no window twice


def test_a_global_shuffle_mixes_windows_from_all_over_the_corpus():
  """Rows of one global batch come from anywhere in the corpus: the share of rows whose window neighbours
  another row's window in the same batch is what a uniform draw gives (about 2B/N), not 1 (the old
  deal-then-shuffle gave runs of consecutive windows, one per process)."""
  tokens = np.arange(11 * 4096, dtype=np.int32)
  parts = [iter(_make(tokens, train=True, batch_size=8, shard_index=i, shard_count=4)) for i in range(4)]
  seen, adjacent, rows = set(), 0, 0
  for _ in range(50):
    windows = np.concatenate([next(p)["tokens"][:, 0] // 11 for p in parts])
    assert not seen & set(windows.tolist())  # no window twice in 50 global batches
    seen |= set(windows.tolist())
    present = set(windows.tolist())
    adjacent += sum((w - 1 in present) or (w + 1 in present) for w in windows.tolist())
    rows += windows.size
  assert adjacent / rows < 0.1, adjacent / rows  # uniform: ~2 * 31 / 4096 = 1.5%


def test_a_saved_position_resumes_with_another_process_count_or_is_refused():
  tokens = np.arange(1000, dtype=np.int32)
  two = iter(_make(tokens, train=True, batch_size=2, shard_index=1, shard_count=2))
  _take(two, 5)
  state = json.loads(json.dumps(two.get_state()))
  assert state["global_batch"] == 5 and state["process_count"] == 2
  one = iter(_make(tokens, train=True, batch_size=4))
  one.set_state(state)  # the same global batch 5, read by one process
  expected = _take(iter(_make(tokens, train=True, batch_size=4)), 6)[5]
  np.testing.assert_array_equal(next(one)["tokens"], expected["tokens"])
  with pytest.raises(ValueError, match="global_batch_size=4, this run's is 6"):
    iter(_make(tokens, train=True, batch_size=6)).set_state(state)
  with pytest.raises(ValueError, match="older data pipeline"):
    iter(_make(tokens, train=True, batch_size=4)).set_state({"next_index": 3})


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size must be >= 1, got 0"),
    (dict(prompt_length=0), "prompt_length must be >= 1, got 0"),
    (dict(canvas_length=0), "canvas_length must be >= 1, got 0"),
    (dict(num_canvases=0), "num_canvases must be >= 1, got 0"),
    (dict(shard_index=2, shard_count=2), r"shard_index must be in \[0, 2\), got 2"),
    (dict(prompt_length=40, canvas_length=16, num_canvases=4),
     r"100 tokens, fewer than one sequence of .* = 40 \+ 4 \* 16 = 104 tokens"),
    (dict(batch_size=11), r"The training split has 9 sequences of 11 tokens: fewer than one global batch of 11 "
                          r"\(config.train.batch_size\): lower it\.$"),
    (dict(batch_size=11, train=False), r"validation split has 9 .* lower it, or raise config.data.validation_fraction"),
])
def test_bad_pipeline_arguments(kwargs, match):
  args = dict(prompt_length=3, canvas_length=4, num_canvases=2, batch_size=2, seed=0, train=True)
  with pytest.raises(ValueError, match=match):
    data.make_dataset(np.arange(100, dtype=np.int32), None, **{**args, **kwargs})


def test_texts_need_a_tokenizer():
  with pytest.raises(ValueError, match="A tokenizer is needed"):
    _make(["some text"], train=True)

"""Broken copies of a checkpoint folder and of a training workdir (issue 42): each is refused in seconds, with
an error of a known type that names the file and the field or tensor; nothing is imported from the folder,
read outside it, or written into it.

The corpus is made here from one tiny, valid folder (random weights written by `convert.save_hf` in three
shards with an index, the chat fixtures' tokenizer and generation config; no torch), each case breaking one
thing in a copy. Every case runs under a 30 s limit: a FIFO that blocked the load, or a /dev/zero that was
read to the end, would fail it instead of hanging the suite.
"""

import json
import os
import pathlib
import shutil
import sys
import tracemalloc

import flax.linen
import jax
import ml_collections
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import chat_fixtures
import diffusiongemma as dg
from diffusiongemma import _files
from diffusiongemma.build import tasks
from diffusiongemma.build.config import load_config_file
from diffusiongemma.convert import hf
from diffusiongemma.model import transformer
from diffusiongemma.training import checkpoint

ROOT = pathlib.Path(__file__).parent.parent
CFG = dg.ModelConfig(vocab_size=chat_fixtures.VOCAB_SIZE, hidden_size=32, num_layers=2, layer_types=("sliding", "full"),
                     num_heads=2, num_kv_heads=1, head_dim=16, num_full_kv_heads=1, full_head_dim=32, sliding_window=8,
                     intermediate_size=64, num_experts=4, top_k=2, moe_intermediate_size=32, canvas_length=8,
                     max_positions=256)
Q_PROJ = "model.decoder.layers.0.self_attn.q_proj.weight"  # [N*H, D] = [32, 32]: square, so a transposed copy
# would fit and load (what a header shows, shape and dtype, is checked; a layout that fits cannot be told apart)
LIMIT = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  """The valid folder every case copies: it loads (checked once here)."""
  folder = tmp_path_factory.mktemp("good_checkpoint")
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(np.float32),
                        transformer.abstract_params(CFG))
  dg.convert.save_hf(CFG, params, folder, max_shard_bytes=60_000)
  chat_fixtures.write_tokenizer(folder)
  chat_fixtures.write_generation_config(folder)
  assert len(list(folder.glob("*.safetensors"))) >= 3
  loaded = dg.build.pretrained(folder, dtype=None, shardings=None)
  np.testing.assert_array_equal(loaded.weights.variables["params"]["layer_0"]["attn"]["q_einsum"],
                                params["layer_0"]["attn"]["q_einsum"])
  return folder


# --- ways to break a folder ------------------------------------------------------------------------------

def _write(name, data):
  def apply(folder):
    path = folder / name
    path.unlink()
    if isinstance(data, str):
      path.write_text(data)
    else:
      path.write_bytes(data)
  return apply


def _fifo(name):
  def apply(folder):
    (folder / name).unlink()
    os.mkfifo(folder / name)
  return apply


def _symlink(name, target):
  def apply(folder):
    (folder / name).unlink()
    (folder / name).symlink_to(target)
  return apply


def _sparse(name, size):
  """A file of `size` bytes that takes no disk (and, read whole, `size` bytes of memory)."""
  def apply(folder):
    with open(folder / name, "wb") as f:
      f.truncate(size)
  return apply


def _edit_json(name, change):
  def apply(folder):
    values = json.loads((folder / name).read_text())
    change(values)
    (folder / name).write_text(json.dumps(values))
  return apply


def _text_config(**fields):
  return _edit_json("config.json", lambda values: values["text_config"].update(fields))


def _index(change):
  return _edit_json("model.safetensors.index.json", lambda values: change(values["weight_map"]))


def _shard_of(folder, key):
  return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]


def _first_shard(action):
  """`action(name)` applied to the shard that holds q_proj."""
  return lambda folder: action(_shard_of(folder, Q_PROJ))(folder)


def _tensor(key, change):
  """Rewrites the shard of tensor `key` with `change(value)` in its place (or without it, if None)."""
  def apply(folder):
    path = folder / _shard_of(folder, key)
    tensors = load_file(path)
    value = change(tensors.pop(key))
    save_file(tensors if value is None else {**tensors, key: value}, path, metadata={"format": "pt"})
  return apply


def _with_nan(value):
  value = value.copy()
  value[3, 5] = np.nan
  return value


def _snapshot(folder):
  """Each entry's name, size and modification time (of the entry itself, not what a symlink points to)."""
  return {p.name: (os.lstat(p).st_size, os.lstat(p).st_mtime_ns) for p in folder.iterdir()}


def _fail(folder):
  return dg.build.pretrained(folder)


BAD = _files.BadFileError
CASES = {
    # config.json: a file that is not one, bytes that are not JSON, fields of the wrong type or size.
    "config is not JSON": (_write("config.json", '{"text_config": {"vocab_size": 3,,'), BAD,
                           r"config\.json is not valid JSON: Expecting property name .* at line 1 column 34"),
    "config is a FIFO": (_fifo("config.json"), BAD, r"config\.json is a FIFO, not a regular file"),
    "config is a symlink to /dev/zero": (_symlink("config.json", "/dev/zero"), BAD,
                                         r"config\.json is a character device \(a symlink to '/dev/zero'\)"),
    "config is a broken symlink": (_symlink("config.json", "nowhere.json"), BAD,
                                   r"config\.json is a broken symlink \(to 'nowhere\.json'\)"),
    "config is a sparse 8 MiB": (_sparse("config.json", _files.JSON_MAX_BYTES + 1), BAD,
                                 r"config\.json is 8,388,609 bytes, more than the 8,388,608"),
    "config nested 100,000 deep": (_write("config.json", "[" * 100_000), BAD,
                                   r"config\.json is not JSON this reader accepts: maximum recursion depth"),
    "config is a list": (_write("config.json", "[1, 2]"), BAD, r"config\.json holds a JSON array; expected an object"),
    "vocab_size is a string": (_text_config(vocab_size="384"), BAD,
                               r"config\.json: text_config\.vocab_size is '384' \(a JSON string\); expected an "
                               r"integer"),
    "vocab_size is 1e12": (_text_config(vocab_size=10**12), BAD,
                           r"config\.json: text_config\.vocab_size is 1000000000000 .* in \[1, 2147483647\]"),
    "hidden_size is missing": (_edit_json("config.json", lambda v: v["text_config"].pop("hidden_size")), BAD,
                               r"config\.json: text_config\.hidden_size is missing"),
    "rms_norm_eps is NaN": (_text_config(rms_norm_eps=float("nan")), BAD,
                            r"text_config\.rms_norm_eps is nan .*expected a finite number"),
    "1000 layers, 2 in the checkpoint": (
        _text_config(num_hidden_layers=1000, layer_types=["sliding_attention", "full_attention"] * 500,
                     per_layer_config={f"{i:03d}": {"head_dim": 32, "num_key_value_heads": 1}
                                       for i in range(1, 1000, 2)}),
        KeyError, r"has no tensor model\.decoder\.layers\.2\.self_attn\.q_proj\.weight"),
    "layer count differs from layer_types": (_text_config(num_hidden_layers=3), BAD,
                                             r"config\.json: .*layer_types.*needs one entry per layer \(num_layers=3\)"
                                             r".*config\.json field: text_config\.layer_types"),
    "heads not divisible by kv heads": (_text_config(num_attention_heads=3, num_key_value_heads=2), BAD,
                                        r"config\.json: ModelConfig\.num_kv_heads=2 is invalid: must divide "
                                        r"num_heads=3\. \(config\.json field: text_config\.num_key_value_heads\)"),
    # model.safetensors.index.json: malformed, or naming files elsewhere.
    "index is not JSON": (_write("model.safetensors.index.json", "{oops"), BAD,
                          r"model\.safetensors\.index\.json is not valid JSON: .* line 1 column 2"),
    "index without weight_map": (_write("model.safetensors.index.json", '{"metadata": {}}'), BAD,
                                 r"index\.json: weight_map is missing"),
    "index entry in the parent folder": (_index(lambda m: m.update({Q_PROJ: "../other/model.safetensors"})), BAD,
                                         r"index\.json: weight_map\['model\.decoder\.layers\.0\.self_attn\.q_proj"
                                         r"\.weight'\] = '\.\./other/model\.safetensors' is not the name of a file"),
    "index entry is an absolute path": (_index(lambda m: m.update({Q_PROJ: "/etc/passwd"})), BAD,
                                        r"= '/etc/passwd' is not the name of a file in"),
    "index names a missing shard": (_index(lambda m: m.update({Q_PROJ: "model-9.safetensors"})), FileNotFoundError,
                                    r"index\.json puts tensors in model-9\.safetensors, which is missing"),
    "index names the wrong shard": (
        lambda folder: _index(lambda m: m.update({Q_PROJ: m["model.decoder.norm.weight"]}))(folder)
        if _shard_of(folder, Q_PROJ) != _shard_of(folder, "model.decoder.norm.weight") else None,
        BAD, r"index\.json puts tensor model\.decoder\.layers\.0\.self_attn\.q_proj\.weight in .*model-0000\d-of-"
             r"0000\d\.safetensors, which cannot be read"),
    # the shards: damaged, or not files.
    "shard truncated": (_first_shard(lambda name: lambda f: (f / name).write_bytes((f / name).read_bytes()[:-10])),
                        BAD, r"model-0000\d-of-0000\d\.safetensors is not a readable safetensors file: .*incomplete "
                             r"metadata"),
    "shard is garbage": (_first_shard(lambda name: _write(name, os.urandom(4096))), BAD,
                         r"model-0000\d-of-0000\d\.safetensors is not a readable safetensors file"),
    "shard is a symlink to /dev/zero": (_first_shard(lambda name: _symlink(name, "/dev/zero")), BAD,
                                        r"model-0000\d-of-0000\d\.safetensors is a character device"),
    "shard is a FIFO": (_first_shard(_fifo), BAD, r"model-0000\d-of-0000\d\.safetensors is a FIFO"),
    # tensors that do not fit the config, or hold what a weight cannot.
    "tensor missing": (_tensor(Q_PROJ, lambda v: None), BAD,
                       r"index\.json puts tensor model\.decoder\.layers\.0\.self_attn\.q_proj\.weight in .*which "
                       r"cannot be read: File does not contain tensor"),
    "tensor of another shape": (_tensor(Q_PROJ, lambda v: v[:, :16].copy()), BAD,
                                r"model-0000\d-of-0000\d\.safetensors: tensor model\.decoder\.layers\.0\.self_attn\."
                                r"q_proj\.weight has shape \[32, 16\]; .*config\.json makes it \[32, 32\]"),
    "int8 weights": (_tensor(Q_PROJ, lambda v: (v * 100).astype(np.int8)), BAD,
                     r"tensor model\.decoder\.layers\.0\.self_attn\.q_proj\.weight is I8; the weights of this model "
                     r"are floats"),
    "bool weights": (_tensor(Q_PROJ, lambda v: v > 0), BAD, r"q_proj\.weight is BOOL; the weights .* are floats"),
    "NaN weights": (_tensor(Q_PROJ, _with_nan), BAD,
                    r"model-0000\d-of-0000\d\.safetensors: tensor model\.decoder\.layers\.0\.self_attn\.q_proj\.weight "
                    r"is not finite \(1 of 1024 values, the first nan at index \(3, 5\)\)"),
    "infinite weights": (_tensor("model.decoder.norm.weight", lambda v: np.full_like(v, np.inf)), BAD,
                         r"tensor model\.decoder\.norm\.weight is not finite \(32 of 32 values, the first inf"),
    # the tokenizer and the generation defaults.
    "tokenizer.json is garbage": (_write("tokenizer.json", "garbage"), BAD,
                                  r"tokenizer\.json is not a tokenizers tokenizer\.json: expected value at line 1"),
    "tokenizer.json is a symlink to /dev/zero": (_symlink("tokenizer.json", "/dev/zero"), BAD,
                                                 r"tokenizer\.json is a character device"),
    "tokenizer.json is a sparse 512 MiB": (_sparse("tokenizer.json", _files.TOKENIZER_MAX_BYTES + 1), BAD,
                                           r"tokenizer\.json is 536,870,913 bytes, more than"),
    "tokenizer.json is not UTF-8": (_write("tokenizer.json", b'{"a": "\xff"}'), BAD,
                                    r"tokenizer\.json is not UTF-8 text: byte 7 is b'\\xff'"),
    "tokenizer.model is garbage": (lambda f: ((f / "tokenizer.json").unlink(), (f / "tokenizer.model").write_bytes(
        b"\x01garbage")), BAD, r"tokenizer\.model is not a sentencepiece model"),
    "tokenizer_config.json is a symlink to /dev/zero": (_symlink("tokenizer_config.json", "/dev/zero"), BAD,
                                                        r"tokenizer_config\.json is a character device"),
    "generation_config.json is a symlink to /dev/zero": (_symlink("generation_config.json", "/dev/zero"), BAD,
                                                         r"generation_config\.json is a character device"),
    "generation_config.json is not JSON": (_write("generation_config.json", '{"t_min": 0.4'), BAD,
                                           r"generation_config\.json is not valid JSON: Expecting ',' delimiter at "
                                           r"line 1 column 14"),
}


@LIMIT
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_checkpoint_folder_is_refused_naming_the_file(good, tmp_path, case):
  breaks, error, match = CASES[case]
  folder = tmp_path / "copy"
  shutil.copytree(good, folder)
  breaks(folder)
  before = _snapshot(folder)
  with pytest.raises(error, match=match):
    _fail(folder)
  assert _snapshot(folder) == before  # nothing written into it


@LIMIT
def test_shards_that_are_symlinks_to_files_elsewhere_load(good, tmp_path):
  """The hugging-face hub cache: every file of the snapshot folder a symlink to a blob outside it."""
  blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
  blobs.mkdir()
  snapshot.mkdir(parents=True)
  for path in good.iterdir():
    shutil.copy(path, blobs / path.name)
    (snapshot / path.name).symlink_to(os.path.relpath(blobs / path.name, snapshot))
  cfg, _ = dg.convert.load_hf(snapshot)
  assert cfg == CFG


@LIMIT
def test_a_model_larger_than_memory_is_refused_before_anything_is_read(good, monkeypatch):
  monkeypatch.setattr(hf, "_memory", lambda placed: (10_000, "this host's memory"))
  monkeypatch.setattr(hf.shards.Shards, "get", lambda *_: pytest.fail("a tensor was read"))
  with pytest.raises(MemoryError, match=r"The checkpoint .* needs 0\.0 GiB for its parameters in float32, more than "
                                        r"this host's memory .*largest tensor is model\.decoder\.embed_tokens\.weight"):
    dg.convert.load_hf(good, dtype="float32")


@pytest.mark.parametrize("changes", [
    {}, {"quantize": "int8"},
    {"vision": dg.model.config.VisionConfig(hidden_size=16, intermediate_size=16, num_layers=3, num_heads=2,
                                            num_kv_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                                            position_embedding_size=16),
     "image_id": 380, "begin_image_id": 381, "end_image_id": 382}])
def test_abstract_params_from_one_layer_of_each_kind_are_the_models(changes):
  """`abstract_params` traces one layer per kind (what lets a 1000-layer config fail in a second): it must
  give exactly the shapes and dtypes of the whole model's init."""
  cfg = CFG.replace(num_layers=5, layer_types=("sliding", "full", "sliding", "sliding", "full"), **changes)
  model, tokens = dg.DiffusionGemma(cfg), jax.ShapeDtypeStruct((1, 1), np.int32)
  want = flax.linen.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens, tokens)["params"])
  assert jax.tree.map(lambda x: (x.shape, x.dtype), transformer.abstract_params(cfg)) == jax.tree.map(
      lambda x: (x.shape, x.dtype), want)


def test_a_bounded_read_allocates_the_file_not_the_cap(tmp_path):
  """read(n) allocates n bytes: a 2-byte file read under the 64 MiB cap of an index must not take 64 MiB."""
  (tmp_path / "index.json").write_text("{}")
  tracemalloc.start()
  try:
    assert _files.read_json(tmp_path / "index.json", _files.INDEX_MAX_BYTES) == {}
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 2**20
  (tmp_path / "status.json").symlink_to("/proc/self/status")  # a regular file that reports size 0
  with pytest.raises(_files.BadFileError, match=r"status\.json is not valid JSON: Expecting value at line 1"):
    _files.read_json(tmp_path / "status.json")


# --- a training workdir ----------------------------------------------------------------------------------

_EVIL = "import pathlib; pathlib.Path(__file__).with_name('RAN').write_text(__name__)\n"


@pytest.fixture
def hostile_workdir(tmp_path, monkeypatch):
  """A workdir that ships modules (`evil.py`, a `projects/` package of its own), made the current folder and
  put first on the import path, as `python -m ...` run from inside it would; `projects` is not imported yet."""
  workdir = tmp_path / "workdir"
  (workdir / "projects").mkdir(parents=True)
  for name in ("evil.py", "projects/__init__.py", "projects/evil.py"):
    (workdir / name).write_text(_EVIL)
  monkeypatch.chdir(workdir)
  monkeypatch.syspath_prepend(str(workdir))
  for name in [m for m in sys.modules if m == "projects" or m.startswith("projects.")]:
    monkeypatch.delitem(sys.modules, name)
  return workdir


@LIMIT
@pytest.mark.parametrize("task, match", [
    ("evil", r"Unknown config\.data\.task 'evil'; expected one of \('lm', 'sft'\) or a module of the installed "
             r"projects package"),
    ("evil.task", r"Unknown config\.data\.task 'evil\.task'"),
    ("os.path", r"Unknown config\.data\.task 'os\.path'"),
    ("projects.evil", r"config\.data\.task='projects\.evil': the 'projects' package on the import path is "
                      r".*workdir/projects/__init__\.py, not the installed one"),
    (["lm"], r"config\.data\.task=\['lm'\] is not a task name"),
])
def test_a_task_named_by_a_saved_config_runs_no_code_from_the_workdir(hostile_workdir, task, match):
  config = ml_collections.ConfigDict({"data": {"task": task}})
  with pytest.raises(ValueError, match=match):
    tasks.task_kind(config)
  assert not list(hostile_workdir.rglob("RAN")), "a module of the workdir ran"


def test_a_task_of_the_installed_projects_package_still_resolves():
  config = ml_collections.ConfigDict({"data": {"task": "projects.sudoku.task"}})
  assert tasks.task_kind(config).needs_tokenizer is False
  with pytest.raises(ValueError, match=r"'projects\.nope': no such module in the installed projects package"):
    tasks.task_kind(ml_collections.ConfigDict({"data": {"task": "projects.nope"}}))


@LIMIT
def test_reading_a_workdir_without_a_tokenizer_says_how_to_make_one_and_writes_nothing(tmp_path):
  config = load_config_file(ROOT / "configs" / "tiny.py")
  with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.model: a training run writes it there "
                                              r"\(scripts/train\.py --workdir=.* or name a tokenizer with "
                                              r"--config\.data\.tokenizer_path=FILE"):
    dg.build.tokenizer(config, tmp_path)
  assert not any(tmp_path.iterdir())


def test_training_still_trains_the_tokenizer_of_a_fresh_workdir(tmp_path):
  """What reads refuse, training does (scripts/train.py on a new workdir): the tokenizer is trained into it."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(10):
    (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n  return x + {i}  # {i * 7}\n" * 30)
  config = load_config_file(ROOT / "configs" / "tiny.py")
  config.data.corpus, config.data.vocab_size = str(corpus), 300
  workdir = tmp_path / "workdir"
  dg.build.train_task(config, workdir).datasets("train")
  assert (workdir / "tokenizer.model").is_file()
  assert dg.build.tokenizer(config, workdir).vocab_size <= 300  # which reads then find


@LIMIT
@pytest.mark.parametrize("content, match", [
    ("{", r"config\.json is not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
    ("[]", r"config\.json holds a JSON array; expected an object"),
])
def test_a_workdir_config_that_is_not_a_json_object(tmp_path, content, match):
  (tmp_path / "config.json").write_text(content)
  with pytest.raises(_files.BadFileError, match=match):
    dg.build.workdir_config(tmp_path)


@pytest.fixture(scope="module")
def workdir_with_a_checkpoint(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("workdir")
  saver = checkpoint.Checkpointer(workdir, async_save=False)
  state = {"params": {"w": np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)}}
  saver.save(3, state, {"position": 1}, {"config": {}})
  saver.wait()
  saver.close()
  return workdir


@LIMIT
@pytest.mark.parametrize("damage, match", [
    ("data", r"Checkpoint step 3 of '.*checkpoints', item 'state' \(its params\), cannot be read \(.*\)\. It is "
             r"damaged or incomplete"),
    ("metadata", r"Checkpoint step 3 of '.*checkpoints', item 'state' \(its metadata\), cannot be read"),
])
def test_a_truncated_orbax_checkpoint_names_the_step_and_the_item(workdir_with_a_checkpoint, tmp_path, damage, match):
  workdir = tmp_path / "workdir"
  shutil.copytree(workdir_with_a_checkpoint, workdir)
  state = workdir / "checkpoints" / "3" / "state"
  files = [p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"]
  if damage == "data":
    files = [p for p in files if p.parent.parent.name.startswith("ocdbt")]
  for path in files:
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
  with pytest.raises(_files.BadFileError, match=match) as error:
    checkpoint.load_params(workdir)
  assert len(str(error.value).splitlines()) == 1  # not a TensorStore dump

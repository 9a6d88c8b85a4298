"""Adaptation in one command (issue 38): `scripts/train.py --config=configs/adapt.py --config.model.init_from=F`
trains a DiffusionGemma from a Gemma 4 folder F (tests/gemma4_reference.py, bfloat16 like released weights) with
the diffusion and AR losses, its model config and tokenizer read from F, and resumes exactly; LoRA on the same;
`build.init_from` resolving a workdir, and its errors."""

import json
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import jax
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma import training
from diffusiongemma.build import init_from
from diffusiongemma.build.config import load_config_file
from diffusiongemma.training import loop

torch = pytest.importorskip("torch")
import gemma4_reference  # noqa: E402  (after the skip: a broken reference fails, tests/hf_guard.py)

pytestmark = pytest.mark.hf
ROOT = pathlib.Path(__file__).parent.parent
STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])
VOCAB = 384


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
  """A corpus of a few standard-library modules, and a 2-layer bfloat16 Gemma 4 folder holding the tokenizer
  trained on it (tokenizer.model, so that init_from finds it)."""
  root = tmp_path_factory.mktemp("adapt")
  corpus = root / "texts"
  corpus.mkdir()
  for name in ("argparse.py", "ast.py", "dataclasses.py", "enum.py", "functools.py", "inspect.py", "textwrap.py"):
    shutil.copy(STDLIB / name, corpus / name)
  texts = dg.data.load_corpus(corpus, "train", validation_fraction=0.2)
  folder = root / "gemma4"
  gemma4_reference.make_tiny_gemma4(folder, seed=3, num_hidden_layers=2, vocab_size=VOCAB, dtype=torch.bfloat16)
  dg.data.Tokenizer.train(texts, folder / "tokenizer.model", vocab_size=VOCAB)
  return corpus, folder


def _config(gemma4, **overrides):
  corpus, folder = gemma4
  config = load_config_file(ROOT / "configs" / "adapt.py")
  config.model.init_from = str(folder)
  config.model.canvas_length = 8
  config.model.moe_impl = "dense"
  config.data.corpus = str(corpus)
  config.data.prompt_length = 8
  config.data.validation_fraction = 0.2
  config.diffusion.self_conditioning_prob = 0.0  # one denoiser pass: faster to compile
  config.train.update(batch_size=4, num_steps=4, warmup_steps=1, log_every=1, eval_every=0, checkpoint_every=2)
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  return config


def _assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _train(gemma4, workdir, *flags):
  """`scripts/train.py --config=configs/adapt.py --config.model.init_from=F` with `_config`'s settings."""
  corpus, folder = gemma4
  result = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "train.py"), "--config=configs/adapt.py", f"--workdir={workdir}",
       f"--config.model.init_from={folder}", "--config.model.canvas_length=8", "--config.model.moe_impl=dense",
       f"--config.data.corpus={corpus}", "--config.data.prompt_length=8", "--config.data.validation_fraction=0.2",
       "--config.diffusion.self_conditioning_prob=0.0", "--config.train.batch_size=4", "--config.train.num_steps=4",
       "--config.train.warmup_steps=1", "--config.train.log_every=1", "--config.train.eval_every=0",
       "--config.train.checkpoint_every=2", *flags],
      cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]


def test_adapt_from_gemma4_in_one_command_trains_both_losses_and_resumes_exactly(gemma4, tmp_path):
  """The model config, the starting weights (float32 master copies of the bfloat16 folder) and the tokenizer
  come from the folder; a run stopped after its step-2 checkpoint (step 4's removed) and resumed by the same
  command ends where the uninterrupted run did, in parameters and logged losses. The second run reads the
  first one's compiled programs (the tests' persistent cache)."""
  _, folder = gemma4
  cfg, weights = dg.convert.load_hf(folder, dtype="float32")
  task = dg.build.train_task(_config(gemma4), tmp_path / "a")
  assert task.model_config == cfg.replace(canvas_length=8, moe_impl="dense")  # dimensions from the folder
  assert task.init_from == str(folder) and task.lora is None
  setup = loop._Setup(task, tmp_path / "a")  # pylint: disable=protected-access
  _assert_same(jax.device_get(setup.init_state().params), {"params": weights})

  _train(gemma4, tmp_path / "a")
  saved = json.loads((tmp_path / "a" / "config.json").read_text())
  assert saved["model"]["num_layers"] == 2 and "init_from" not in saved["model"]  # the workdir stands alone
  assert saved["train"]["init_from"] == str(folder)
  assert saved["data"]["tokenizer_path"] == str(folder / "tokenizer.model")
  losses = [r for r in training.read_metrics(tmp_path / "a") if "train/loss" in r]
  assert len(losses) == 4 and all(r["train/ar_loss"] > 0 and r["train/diffusion_loss"] > 0 for r in losses)
  sampled = subprocess.run([sys.executable, str(ROOT / "scripts" / "sample.py"), f"--workdir={tmp_path / 'a'}",
                            "--prompt=def f(", "--max_new_tokens=8"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, check=False)  # the run as trained: its saved config and tokenizer
  assert sampled.returncode == 0 and f"{tmp_path / 'a'}/checkpoints step 4" in sampled.stdout, sampled.stderr[-3000:]

  shutil.copytree(tmp_path / "a", tmp_path / "b", ignore=shutil.ignore_patterns("tensorboard"))
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
  assert training.latest_step(tmp_path / "b") == 2
  _train(gemma4, tmp_path / "b")
  (a, step_a), (b, step_b) = training.load_params(tmp_path / "a"), training.load_params(tmp_path / "b")
  assert step_a == step_b == 4
  _assert_same(a, b)
  strip = lambda rows: [{k: v for k, v in r.items() if k.startswith("train/")} for r in rows if "train/loss" in r]
  assert strip(training.read_metrics(tmp_path / "a")) == strip(training.read_metrics(tmp_path / "b"))


@pytest.mark.slow
def test_adapt_with_lora_keeps_the_gemma4_weights_frozen(gemma4, tmp_path):
  _, folder = gemma4
  config = _config(gemma4, **{"train.lora_rank": 2, "train.num_steps": 1, "train.learning_rate": 1e-2,
                              "train.warmup_steps": 0})
  state = dg.build.train(config, tmp_path)
  assert "lora_a" in jax.device_get(state.params)["layer_0"]["attn"]["q_einsum"]
  merged = dg.build.load(config, workdir=tmp_path)  # the adapters merged into the Gemma 4 weights, in float32
  assert f"merged into {folder}" in merged.source
  _, base = dg.convert.load_hf(folder, dtype="float32")
  q = lambda params: np.asarray(params["layer_0"]["attn"]["q_einsum"])
  assert q(merged.variables["params"]).dtype == np.float32
  assert np.abs(q(merged.variables["params"]) - q(base)).max() > 0
  np.testing.assert_array_equal(merged.variables["params"]["embedder"]["input_embedding"],
                                base["embedder"]["input_embedding"])  # not adapted: the base, as read
  # scripts/convert.py given the workdir alone exports the run as trained: the merged weights, and a tokenizer.
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert.py"), f"--from_workdir={tmp_path}",
                        f"--to_hf={tmp_path / 'hf'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  _, exported = dg.convert.load_hf(tmp_path / "hf", dtype="float32")
  _assert_same(exported, merged.variables["params"])
  assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (folder / "tokenizer.model").read_bytes()


def test_init_from_a_workdir_and_what_it_refuses(gemma4, tmp_path):
  """A training workdir as the source: its saved model section and tokenizer. A source without a tokenizer, two
  different init_from values, or none at all are refused by name."""
  corpus, folder = gemma4
  workdir = tmp_path / "workdir"
  (workdir / "checkpoints" / "3").mkdir(parents=True)
  model = dg.ModelConfig(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                         num_full_kv_heads=1, full_head_dim=16, intermediate_size=16, num_experts=2, top_k=1,
                         moe_intermediate_size=8, canvas_length=8, max_positions=512)
  saved = {"model": {**model.to_dict(), "noise": "masked"}, "data": {"tokenizer_path": str(folder / "tokenizer.model")}}
  (workdir / "config.json").write_text(json.dumps(saved))
  config = _config(gemma4, **{"model.init_from": str(workdir), "model.canvas_length": None})
  assert dg.build.model_config(config) == model.replace(moe_impl="dense")  # the noise is config.diffusion's
  assert init_from.resolve(config).data.tokenizer_path == str(folder / "tokenizer.model")

  bare = tmp_path / "bare"
  shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("tokenizer.*"))
  exported = tmp_path / "exported"  # what scripts/convert.py copies next to the weights it writes
  exported.mkdir()
  assert dg.build.copy_tokenizer(workdir, exported) == exported / "tokenizer.model"
  assert (exported / "tokenizer.model").read_bytes() == (folder / "tokenizer.model").read_bytes()
  assert dg.build.copy_tokenizer(bare, exported) is None
  with pytest.raises(ValueError, match=r"init_from='.*bare' has no tokenizer .*--config.data.tokenizer_path=FILE"):
    dg.build.tokenizer(_config(gemma4, **{"model.init_from": str(bare)}), tmp_path / "w")
  with pytest.raises(ValueError, match="name different weights"):
    dg.build.model_config(_config(gemma4, **{"train.init_from": str(workdir)}))
  with pytest.raises(ValueError, match="config.model.init_from is empty"):
    dg.build.model_config(_config(gemma4, **{"model.init_from": ""}))
  with pytest.raises(FileNotFoundError, match="neither a training workdir with checkpoints nor a transformers"):
    dg.build.model_config(_config(gemma4, **{"model.init_from": str(corpus)}))

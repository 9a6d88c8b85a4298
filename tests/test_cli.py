"""What a user of the binaries meets: `--config` takes a config file or a run's saved config.json and names an
override's typo in one line; usage errors are one line, not the help text; the folders this project writes
for others (released weights, a transformers folder with this project's sentencepiece tokenizer) load in the
binaries as they are; a tokenizer other than the one a run trained with is refused by name; a run that fails
before its first save leaves no empty checkpoints/ behind."""

import json
import pathlib
import shutil
import subprocess
import sys

from absl import flags
import httpx
import jax
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma import build
from diffusiongemma.build import cli
from diffusiongemma.build import release
from diffusiongemma.data import hf_tokenizer
import chat_fixtures
import serving_helpers

ROOT = pathlib.Path(__file__).parent.parent
SHIPPED_TEXT = ROOT / "projects" / "text" / "weights" / "distilled"


def _parse(monkeypatch, *argv):
  """The `--config` flag of a fresh FlagValues, parsed from `argv` as a binary's command line."""
  values = flags.FlagValues()
  holder = cli.define_config(flag_values=values)
  argv = ["prog", *argv]
  monkeypatch.setattr(sys, "argv", argv)  # config_flags finds the overrides in sys.argv
  values(argv)
  return holder.value


def test_config_takes_a_saved_config_json_and_names_a_mistyped_override(monkeypatch, tmp_path):
  saved = tmp_path / "config.json"
  saved.write_text(json.dumps(build.config.to_json(build.config.load_config_file(ROOT / "configs" / "tiny.py")),
                              indent=2))
  config = _parse(monkeypatch, f"--config={saved}", "--config.model.num_layers=3", "--config.diffusion.noise=masked")
  assert config.model.num_layers == 3 and config.diffusion.noise == "masked" and config.data.task == "lm"
  assert _parse(monkeypatch, "--config=configs/tiny.py:").model.num_layers == build.config.load_config_file(
      ROOT / "configs" / "tiny.py").model.num_layers
  with pytest.raises(flags.IllegalFlagValueError, match=r"^--config\.model\.num_layer: configs/tiny\.py has no such "
                     r"field \('num_layer' Did you mean \"num_layers\""):
    _parse(monkeypatch, "--config=configs/tiny.py", "--config.model.num_layer=3")
  with pytest.raises(flags.IllegalFlagValueError, match=r"^--config\.modle\.num_layers: .*\('modle' Did you mean"):
    _parse(monkeypatch, "--config=configs/tiny.py", "--config.modle.num_layers=3")
  with pytest.raises(flags.IllegalFlagValueError, match="missing.py does not exist"):
    _parse(monkeypatch, f"--config={tmp_path / 'missing.py'}")
  # A bug inside get_config is reported as one, with its traceback, not as an override naming no field.
  (tmp_path / "buggy.py").write_text("import ml_collections\ndef get_config():\n"
                                     "  return ml_collections.ConfigDict({'a': 1}).b\n")
  with pytest.raises(flags.IllegalFlagValueError, match=r"(?s)buggy\.py: AttributeError: .*line 3, in get_config"):
    _parse(monkeypatch, f"--config={tmp_path / 'buggy.py'}", "--config.a=2")
  (tmp_path / "list.json").write_text("[1, 2]")
  with pytest.raises(flags.IllegalFlagValueError, match="list.json holds a JSON array; expected an object"):
    _parse(monkeypatch, f"--config={tmp_path / 'list.json'}")


def test_a_usage_error_a_bad_override_and_a_foreign_tokenizer_are_one_line_without_the_help_text(tmp_path):
  chat_fixtures.write_tokenizer(tmp_path, vocab_size=5000)  # a chat tokenizer of more ids than the model has
  for script, args, expected in (
      ("sample.py", ["--prompt=x"], "error: Pass --hf_checkpoint=DIR"),
      ("sample.py", ["--prompt=x", "--temperature=0.8"], "error: --temperature=0.8 is for --decoder=speculative"),
      ("sample.py", ["--prompt=x", "--decoder=speculative", "--show_steps"],
       "error: --decoder=speculative decodes text prompts alone; --show_steps is for --decoder=diffusion"),
      ("sample.py", ["--config=configs/tiny.py", "--config.model.num_layer=2"],
       "FATAL Flags parsing error: --config.model.num_layer: configs/tiny.py has no such field"),
      ("serve.py", [f"--workdir={SHIPPED_TEXT}", f"--tokenizer={tmp_path}"],
       f"error: The tokenizer {tmp_path}/tokenizer.json has 5000 tokens, more than the model's vocabulary of 4096")):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    lines = [line for line in result.stderr.splitlines() if "compilation_cache.py" not in line]
    assert result.returncode == 1 and len(lines) == 2 and lines[0].startswith(expected), result.stderr[-2000:]


def test_a_text_tokenizer_in_a_checkpoint_folder_completes_text_and_cannot_chat(tmp_path):
  shutil.copy(SHIPPED_TEXT / "tokenizer.model", tmp_path / "tokenizer.model")
  tok = hf_tokenizer.CheckpointTokenizer(tmp_path)
  sp = dg.data.Tokenizer(SHIPPED_TEXT / "tokenizer.model")
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (sp.bos_id, sp.eos_id, sp.pad_id) and tok.control_ids == {}
  assert tok.decode(tok.encode("def f(x):\n  return x")) == "def f(x):\n  return x"
  assert tok.encode("x", add_bos=True)[0] == sp.bos_id


def test_released_weights_load_as_a_workdir_with_their_own_tokenizer(tmp_path):
  config = build.run_config(SHIPPED_TEXT)
  assert config.data.tokenizer_path == str(SHIPPED_TEXT / "tokenizer.model")  # not the trainer's path
  weights = build.load(config, workdir=SHIPPED_TEXT)
  _, variables, provenance = release.load(SHIPPED_TEXT)
  assert weights.source == f"released weights {SHIPPED_TEXT} (step {provenance['step']})"
  jax.tree.map(np.testing.assert_array_equal, weights.variables, variables)
  assert str(build.tokenizer(config, SHIPPED_TEXT).path) == str(SHIPPED_TEXT / "tokenizer.model")
  other = tmp_path / "other.model"
  dg.data.Tokenizer.train(["def f(x):\n  return x + 1\n" * 40], other, vocab_size=300)
  mismatched = build.run_config(SHIPPED_TEXT)
  mismatched.data.tokenizer_path = str(other)
  with pytest.raises(ValueError, match=r"data\.tokenizer_path='.*other\.model' \(trained with another tokenizer"):
    build.load(mismatched, workdir=SHIPPED_TEXT)
  with pytest.raises(ValueError, match="is a training run's config, not a transformers one.*pass it as --workdir"):
    build.pretrained(SHIPPED_TEXT)


def test_a_run_that_fails_before_its_first_save_leaves_no_checkpoints_folder(tmp_path):
  config = build.config.load_config_file(ROOT / "configs" / "tiny.py")
  config.data.tokenizer_path = str(tmp_path / "missing.model")
  task = build.train_task(config, tmp_path / "run")  # the tokenizer is read when training starts
  with pytest.raises(ValueError, match="missing.model"):
    dg.training.train(task, tmp_path / "run")
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_shipped_text_model_serves_completions_with_its_own_tokenizer(tmp_path):
  """The documented command, `serve.py --workdir=projects/text/weights/distilled`, at the smallest grid: a
  completion continues the prompt (the sampler's own text, decoded by the folder's tokenizer); chat is refused
  by name (a text tokenizer has no chat tokens)."""
  server = serving_helpers.ServerProcess(SHIPPED_TEXT, tmp_path / "server.log", "--batch_sizes=1", "--warm_up=0",
                                         "--max_prompt_tokens=64", "--max_tokens=16", workdir=True)
  try:
    server.wait()
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    assert model == "distilled"
    reply = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": model, "prompt": "def add(a, b):\n", "max_tokens": 16, "temperature": 0, "seed": 0}).json()
    choice = reply["choices"][0]
    assert reply["usage"]["completion_tokens"] == 16 and choice["finish_reason"] == "length", reply
    assert choice["text"].strip() and "\ufffd" not in choice["text"], reply
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
    assert chat.status_code == 400 and "no Gemma 4 chat tokens" in chat.json()["error"]["message"]
  finally:
    assert server.stop() == 0, server.log()[-3000:]

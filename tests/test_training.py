"""Training: optimizer, NaN guard, checkpoints, exact resume, evaluation, bad inputs, learning."""

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma import training
from diffusiongemma.build.config import load_config_file
from diffusiongemma.build import tasks as build_tasks
from diffusiongemma.training import loop
from diffusiongemma.training import metrics as metrics_lib
import device_env

ROOT = pathlib.Path(__file__).parent.parent
STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])
CORPUS_FILES = ("argparse.py", "ast.py", "dataclasses.py", "enum.py", "functools.py", "inspect.py",
                "typing.py", "pathlib.py", "textwrap.py", "string.py", "json/decoder.py", "json/encoder.py",
                "contextlib.py", "copy.py", "abc.py", "bisect.py", "heapq.py", "fractions.py")
VOCAB = 384


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A few standard-library modules as a folder corpus, and a tokenizer trained on them."""
  root = tmp_path_factory.mktemp("corpus")
  folder = root / "texts"
  folder.mkdir()
  for name in CORPUS_FILES:
    if (STDLIB / name).is_file():
      shutil.copy(STDLIB / name, folder / name.replace("/", "_"))
  texts = dg.data.load_corpus(folder, "train", validation_fraction=0.2)
  tokenizer = dg.data.Tokenizer.train(texts, root / "tokenizer.model", vocab_size=VOCAB)
  return folder, root / "tokenizer.model"


def _config(corpus, **overrides):
  """configs/tiny.py shrunk for tests (2 layers, dense experts, 24-token sequences, batch 4, no
  self-conditioning; the slow tests train with it)."""
  folder, tokenizer = corpus
  config = load_config_file(ROOT / "configs" / "tiny.py")
  config.model.vocab_size = VOCAB
  config.model.num_layers = 2
  config.model.moe_impl = "dense"
  config.model.canvas_length = 8
  config.data.corpus = str(folder)
  config.data.tokenizer_path = str(tokenizer)
  config.data.vocab_size = VOCAB
  config.data.prompt_length = 8
  config.data.num_canvases = 2
  config.data.validation_fraction = 0.2
  config.train.batch_size = 4
  config.train.num_steps = 6
  config.train.warmup_steps = 2
  config.train.log_every = 1
  config.train.eval_every = 0
  config.train.eval_batches = 2
  config.train.checkpoint_every = 3
  config.diffusion.self_conditioning_prob = 0.0  # one denoiser pass: faster to compile
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  return config


def _losses(workdir, prefix="train/"):
  return [(r["step"], {k: v for k, v in r.items() if k.startswith(prefix)})
          for r in training.read_metrics(workdir) if any(k.startswith(prefix) for k in r)]


def _assert_same_params(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_config_mismatches_read_a_field_an_old_checkpoint_lacks_as_its_default():
  current = dg.build.config.to_json(load_config_file("configs/tiny.py"))
  old = json.loads(json.dumps(current))
  del old["diffusion"]["diffusion_loss_weight"]  # written before the field existed
  defaults = dg.build.config.to_json(dg.build.config.base_config())
  assert training.config_mismatches(old, current, defaults) == []
  current["diffusion"]["diffusion_loss_weight"] = 0.0
  assert training.config_mismatches(old, current, defaults) == [
      "diffusion.diffusion_loss_weight: checkpoint 1.0, config 0.0"]
  current["train"]["num_steps"] = 7  # operational: may change between runs
  current["train"]["learning_rate"] = 1.0
  assert training.config_mismatches(old, current, defaults)[-1].startswith("train.learning_rate: checkpoint")


def test_learning_rate_schedule_and_clipping():
  train = dict(learning_rate=1e-2, warmup_steps=10, num_steps=110, final_learning_rate_ratio=0.1,
               adam_b1=0.9, adam_b2=0.95, weight_decay=0.0, grad_clip=1.0)
  schedule = training.learning_rate_schedule(train)
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10), schedule(60), schedule(110)],
                             [0.0, 5e-3, 1e-2, 5.5e-3, 1e-3], rtol=1e-5)
  params = {"w": jnp.ones((2, 2))}
  grads = {"w": jnp.full((2, 2), 1e6)}  # global norm 2e6

  def first_moment(optimizer):  # Adam's mu after one update: (1 - b1) x the gradient Adam received
    _, state = optimizer.update(grads, optimizer.init(params), params)
    adam_state = state[-1][0]
    return np.asarray(adam_state.mu["w"])

  # Clipped to global norm 1 before Adam: every entry 1e6 / 2e6 = 0.5, so mu = 0.1 x 0.5.
  np.testing.assert_allclose(first_moment(training.make_optimizer(train)), 0.05, rtol=1e-6)
  train["grad_clip"] = 0.0
  assert len(training.make_optimizer(train).init(params)) == 1  # no clipping stage
  np.testing.assert_allclose(first_moment(training.make_optimizer(train)), 1e5, rtol=1e-6)


def test_in_process_resume_is_exact_and_logs_progress(corpus, tmp_path, caplog):
  """6 steps at once == 1 step (time budget spent) + resume to 6, in params and logged losses."""
  config = _config(corpus)
  caplog.set_level("INFO")
  straight = dg.build.train(config, tmp_path / "a")
  assert any("tok/s" in r.getMessage() and "ETA" in r.getMessage() and "step 6/6" in r.getMessage()
             for r in caplog.records)
  first = dg.build.train(_config(corpus, **{"train.time_budget_s": 1e-9}), tmp_path / "b")
  assert int(first.step) == 1
  resumed = dg.build.train(config, tmp_path / "b")
  assert int(resumed.step) == 6
  _assert_same_params(straight.params, resumed.params)
  _assert_same_params(straight.opt_state, resumed.opt_state)
  assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
  assert [s for s, _ in _losses(tmp_path / "a")] == [1, 2, 3, 4, 5, 6]
  assert sorted(int(p.name) for p in (tmp_path / "a" / "checkpoints").iterdir() if p.name.isdigit()) == [3, 6]
  assert list((tmp_path / "a" / "tensorboard").iterdir())
  saved = json.loads((tmp_path / "a" / "config.json").read_text())
  assert saved["model"]["num_layers"] == 2 and saved["diffusion"]["noise"] == "uniform"
  # Nothing to do when the run is complete: the same state comes back.
  again = dg.build.train(config, tmp_path / "a")
  _assert_same_params(straight.params, again.params)
  # The public restore reads the parameters alone, placed as asked.
  params, step = training.load_params(tmp_path / "a")
  assert step == 6
  _assert_same_params(straight.params, params)
  assert jax.tree.structure(params) == jax.tree.structure(straight.params)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
  params, step = training.load_params(tmp_path / "a", step=3, shardings=one)
  assert step == 3 and {a.sharding for a in jax.tree.leaves(params)} == {one}
  assert training.latest_step(tmp_path / "a") == 6 and training.latest_step(tmp_path / "nothing") is None
  with pytest.raises(ValueError, match=r"No checkpoint at step 4 .*available: \[3, 6\]"):
    training.load_params(tmp_path / "a", step=4)
  with pytest.raises(FileNotFoundError, match="No checkpoints"):
    training.load_params(tmp_path / "nothing")
  # Extending a finished run is allowed, and says that the learning-rate schedule moved.
  caplog.clear()
  longer = dg.build.train(_config(corpus, **{"train.num_steps": 7}), tmp_path / "a")
  assert int(longer.step) == 7
  assert any("num_steps is 7, the checkpoint's run had 6" in r.getMessage() for r in caplog.records)


class _SlowIterator:
  """Batches that take `seconds` of the shifted clock `now` each to arrive (no real wait)."""

  def __init__(self, iterator, seconds, now):
    self.iterator, self.seconds, self.now = iterator, seconds, now

  def __next__(self):
    self.now[0] += self.seconds
    return next(self.iterator)

  def get_state(self):
    return self.iterator.get_state()

  def set_state(self, state):
    self.iterator.set_state(state)


def test_step_accounting_splits_the_wall_time_and_a_profile_covers_its_steps(corpus, tmp_path, monkeypatch):
  """Per logging interval, perf/data_wait_s is the wait for the batch and perf/step_s the step: a 1000 s wait
  in the data iterator (on a clock that the iterator shifts, so nothing real is compared) shows in the first
  alone. The time/* spans of the last record add up to the run's wall time; the FLOPs are the analytic count
  (its match with XLA: test_train_step.py); profile_steps writes a trace."""
  shift = [0.0]
  clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + shift[0], process_time=time.process_time)
  monkeypatch.setattr(loop, "time", clock)
  monkeypatch.setattr(metrics_lib, "time", clock)
  config = _config(corpus, **{"train.num_steps": 20, "train.log_every": 5, "train.eval_every": 20,
                              "train.eval_batches": 1, "train.checkpoint_every": 10,
                              "train.profile_steps": "3,4"})
  task = dg.build.train_task(config, tmp_path)
  datasets = task.datasets

  class Slow:
    def __init__(self, dataset):
      self.dataset = dataset

    def __iter__(self):
      return _SlowIterator(iter(self.dataset), 1000.0, shift)

  task = dataclasses.replace(task, datasets=lambda split: Slow(datasets(split)) if split == "train" else
                             datasets(split))
  start = clock.perf_counter()
  loop.train(task, tmp_path)
  wall = clock.perf_counter() - start
  rows = training.read_metrics(tmp_path)
  perf = [r for r in rows if "perf/step_s" in r]
  assert [r["step"] for r in perf] == [5, 10, 15, 20]
  for r in perf:
    assert 1000 <= r["perf/data_wait_s"] < 1100, r  # the wait, and not the step (seconds, not 1000s)
    assert r["perf/step_s"] < 100, r  # the wait is not in the step
    assert r["perf/model_tflops_per_step"] == pytest.approx(loop.step_flops(task) / 1e12)
    seconds = r["perf/step_s"] + r["perf/data_wait_s"]
    assert r["perf/tokens_per_s_per_device"] == pytest.approx(
        4 * task.sequence_length / seconds / jax.device_count())
    assert 0 < r["perf/mfu"] < 1
  spans = rows[-1]
  assert set(spans) == {"step", "time/train_s", "time/cpu_s", "time/startup_s", "time/compile_s", "time/eval_s",
                        "time/checkpoint_s"}
  assert min(spans[f"time/{k}_s"] for k in ("startup", "compile", "eval", "checkpoint")) > 0
  total = sum(spans[f"time/{k}_s"] for k in ("train", "startup", "compile", "eval", "checkpoint"))
  assert total - shift[0] == pytest.approx(wall - shift[0], rel=0.05)  # the real seconds, the waits apart
  assert spans["time/train_s"] > shift[0] == 20 * 1000  # the waits are training time
  assert list((tmp_path / "profile").rglob("*.xplane.pb"))
  with pytest.raises(ValueError, match=r"profile_steps must be 'first,last'.*got '4,3'"):
    dg.build.train_task(_config(corpus, **{"train.profile_steps": "4,3"}), tmp_path / "bad")


def test_nan_guard_names_step_and_metric_or_skips(corpus, tmp_path):
  config = _config(corpus)
  setup = loop._Setup(dg.build.train_task(config, tmp_path), tmp_path)
  state = setup.init_state()
  params = jax.tree.map(lambda x: x, state.params)
  params["params"]["embedder"]["input_embedding"] = params["params"]["embedder"]["input_embedding"].at[
      5].set(jnp.nan)
  state = jax.device_put(state.replace(params=params), setup.programs.state_shardings)
  before = jax.device_get(state)
  batch = loop.to_global({"tokens": np.full((4, 24), 5, np.int32),
                            "prompt_length": np.full((4,), 8, np.int32)}, setup.batch_sharding)
  state, metrics = setup.train_step(state, batch)
  metrics = jax.device_get(metrics)
  with pytest.raises(training.NonFiniteError, match=r"Non-finite loss.* at step 1 .*nan_policy='skip'"):
    training.check_finite(metrics, 1, "error")
  assert training.check_finite(metrics, 1, "skip") is False
  assert int(state.step) == 1
  _assert_same_params(before.params, state.params)
  _assert_same_params(before.opt_state, state.opt_state)
  with pytest.raises(ValueError, match="nan_policy 'ignore'"):
    training.check_finite(metrics, 1, "ignore")


def test_the_time_budget_counts_the_whole_run_across_resumes(corpus, tmp_path, monkeypatch):
  """config.train.time_budget_s is the run's total training time (`time/train_s`, what the checkpoint carries
  across resumes): a run stopped at 2 s and resumed with a 3 s budget stops at 3 s in total, as an
  uninterrupted run does, and a run whose budget is spent trains no further step. The loop runs on a fake
  clock and a fake train step that advances it 1 s (no compiling: the loop's accounting is what is tested);
  each process's first step counts as compiling and is left out of the training time."""
  now = [0.0]
  monkeypatch.setattr(metrics_lib, "time", types.SimpleNamespace(perf_counter=lambda: now[0],
                                                                process_time=time.process_time))

  def one_second_step(self, state, batch):
    del self, batch
    now[0] += 1.0
    return state.replace(step=state.step + 1), {"loss": 1.0, "finite": 1.0}

  monkeypatch.setattr(loop._Setup, "train_step", one_second_step)  # pylint: disable=protected-access

  def run(workdir, budget):
    state = dg.build.train(_config(corpus, **{"train.time_budget_s": budget}), workdir)  # 6 steps
    return int(state.step), [r["time/train_s"] for r in training.read_metrics(workdir) if "time/train_s" in r][-1]

  assert run(tmp_path / "straight", 3.0) == (4, 3.0)
  assert run(tmp_path / "resumed", 2.0) == (3, 2.0)
  assert run(tmp_path / "resumed", 3.0) == (5, 3.0)  # its step 4 compiled: 1 s more than the first run's 2 s
  assert run(tmp_path / "resumed", 3.0) == (5, 3.0)  # spent: nothing to run


def test_checkpoint_from_another_config_fails_naming_fields_and_loses_nothing(corpus, tmp_path):
  dg.build.train(_config(corpus, **{"train.time_budget_s": 1e-9}), tmp_path)
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
  other = _config(corpus, **{"train.num_steps": 9, "model.hidden_size": 32,
                             "diffusion.noise": "masked", "train.learning_rate": 1e-3})
  with pytest.raises(training.ConfigMismatchError) as error:
    dg.build.train(other, tmp_path)
  message = str(error.value)
  for field in ("model.hidden_size: checkpoint 64, config 32", "diffusion.noise", "train.learning_rate"):
    assert field in message
  assert "train.num_steps" not in message
  with pytest.raises(training.ConfigMismatchError, match="model.hidden_size"):
    dg.build.evaluate(other, tmp_path)
  assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("noise", ["uniform", pytest.param("masked", marks=pytest.mark.slow)])
def test_evaluate_reports_losses_and_masked_perplexity_bound(corpus, tmp_path, noise):
  # Masked noise needs a mask token outside the tokenizer: one more model vocabulary entry.
  overrides = {"diffusion.noise": noise, "model.vocab_size": VOCAB + (noise == "masked")}
  dg.build.train(_config(corpus, **overrides, **{"train.time_budget_s": 1e-9}), tmp_path)
  config = _config(corpus, **overrides)
  results = dg.build.evaluate(config, tmp_path)
  assert results["step"] == 1 and results["num_batches"] == 2
  for key in ("diffusion_loss", "ar_loss", "ar_perplexity"):
    assert np.isfinite(results[key]) and results[key] > 0
  np.testing.assert_allclose(results["ar_perplexity"], np.exp(results["ar_loss"]), rtol=1e-6)
  if noise == "masked":
    np.testing.assert_allclose(results["perplexity_bound"], np.exp(results["diffusion_loss"]), rtol=1e-6)
  else:
    assert "perplexity_bound" not in results
  # After one step every prediction is still near uniform over the vocabulary.
  assert 0.5 * VOCAB < results["ar_perplexity"] < 2 * VOCAB
  assert json.loads((tmp_path / "eval.json").read_text()) == results
  assert dg.build.evaluate(config, tmp_path) == results  # fixed evaluation noise


def test_bad_inputs_fail_clearly_and_write_nothing(corpus, tmp_path, monkeypatch):
  def fails(match, workdir=None, **overrides):
    workdir = workdir or tmp_path / "work"
    with pytest.raises((ValueError, FileNotFoundError), match=match):
      dg.build.train(_config(corpus, **overrides), workdir)
    assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())
    assert not (workdir / "metrics.jsonl").exists()

  empty = tmp_path / "empty"
  empty.mkdir()
  fails("contains no files", **{"data.corpus": str(empty)})
  fails("does not exist", **{"data.corpus": str(tmp_path / "missing")})
  binary = tmp_path / "binary"
  binary.mkdir()
  (binary / "blob.bin").write_bytes(bytes(range(256)) * 64)
  fails("no readable UTF-8 text", **{"data.corpus": str(binary)})
  fails("Unsupported corpus source", **{"data.corpus": str(binary / "blob.bin")})
  short = tmp_path / "short"
  short.mkdir()
  for i in range(5):
    (short / f"{i}.txt").write_text("x")  # 2 tokens with EOS: not one 24-token sequence
  fails("fewer than one sequence", **{"data.corpus": str(short)})
  fails("Unknown config.diffusion.noise 'gaussian'", **{"diffusion.noise": "gaussian"})
  fails("nan_policy", **{"train.nan_policy": "ignore"})
  fails("compute_dtype", **{"train.compute_dtype": "int8"})
  fails("num_canvases must be >= 1", **{"data.num_canvases": 0})
  fails(r"vocabulary of 300 \(model.vocab_size\)", **{"model.vocab_size": 300})
  monkeypatch.setattr(build_tasks.jax, "device_count", lambda: 8)
  fails(r"batch_size=4 is not divisible by the 8 batch shards of the mesh \(data\*fsdp\*expert", **{})
  monkeypatch.undo()
  monkeypatch.setattr(build_tasks.jax, "process_count", lambda: 3)
  fails("batch_size=4 is not divisible by the 3 processes", **{})
  fails(r"The 1 batch shards of the mesh .* not a multiple of the 3 processes", **{"train.batch_size": 6})
  monkeypatch.undo()
  with pytest.raises(FileNotFoundError, match="No checkpoints"):
    dg.build.evaluate(_config(corpus), tmp_path / "never_trained")


def _script_flags(corpus, num_steps):
  """The --config.* overrides of the script tests (the settings of `_config`, as flags)."""
  folder, tokenizer = corpus
  return {"model.vocab_size": VOCAB, "model.num_layers": 2, "model.canvas_length": 8,
          "data.corpus": str(folder), "data.tokenizer_path": str(tokenizer), "data.vocab_size": VOCAB,
          "data.prompt_length": 8, "data.validation_fraction": 0.2, "train.batch_size": 4,
          "train.num_steps": num_steps, "train.warmup_steps": 2, "train.log_every": 1,
          "train.eval_every": 10, "train.eval_batches": 1, "train.checkpoint_every": 5}


def _script_args(corpus, workdir, num_steps, *extra):
  flags = _script_flags(corpus, num_steps)
  return [sys.executable, str(ROOT / "scripts" / "train.py"), f"--config={ROOT / 'configs' / 'tiny.py'}",
          f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in flags.items()), *extra]


def _steps_saved(workdir):
  folder = pathlib.Path(workdir) / "checkpoints"
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def _wait_for(condition, process, timeout=240):
  deadline = time.monotonic() + timeout
  while not condition():
    assert process.poll() is None, process.communicate()[1][-3000:]
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


def _final_state(workdir, step):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  manager = ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints",
                                  item_names=("state", "data", "meta"))
  state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  manager.close()
  return state


@pytest.mark.slow
def test_exact_resume_after_sigterm_and_sigkill(corpus, tmp_path):
  """N steps uninterrupted == interrupted by SIGTERM mid-run == killed (SIGKILL) right after a save:
  the same final parameters, optimizer state, rng and the same train and eval curves.

  The children share a persistent compilation cache, so only the first one compiles.
  """
  n = 30
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  run = lambda workdir: subprocess.Popen(_script_args(corpus, workdir, n), env=env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)

  def finish(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return err

  straight = tmp_path / "straight"
  finish(run(straight))

  # One run, stopped by SIGTERM mid-run, resumed, killed by SIGKILL right after its next save,
  # resumed again to the end.
  broken = tmp_path / "interrupted"
  process = run(broken)
  _wait_for(lambda: any(s >= 3 for s, _ in _losses(broken)), process)
  process.send_signal(signal.SIGTERM)
  err = finish(process)
  assert "SIGTERM: saved the checkpoint of step" in err
  stopped = max(_steps_saved(broken))
  assert 3 <= stopped < n
  process = run(broken)
  _wait_for(lambda: max(_steps_saved(broken)) > stopped, process)
  process.kill()
  process.wait()
  assert max(_steps_saved(broken)) < n
  finish(run(broken))

  expected = _final_state(straight, n)
  _assert_same_params(expected, _final_state(broken, n))
  for prefix in ("train/", "eval/"):
    assert _losses(broken, prefix) == _losses(straight, prefix)
  assert [s for s, _ in _losses(straight)] == list(range(1, n + 1))
  assert [s for s, _ in _losses(straight, "eval/")] == [0, 10, 20, 30]


@pytest.mark.slow
@pytest.mark.parametrize("noise", ["uniform", "masked"])
def test_validation_loss_drops_a_quarter_in_200_steps(corpus, tmp_path, noise, optimized_env):
  """configs/tiny.py (with this test corpus's 384-piece tokenizer): validation loss at step 200 is at
  least 25% below step 0's, for both noise processes. scripts/train.py in a process of its own: compute-bound."""
  folder, tokenizer = corpus
  overrides = {"model.vocab_size": VOCAB + (noise == "masked"), "data.corpus": folder,
               "data.tokenizer_path": tokenizer, "data.vocab_size": VOCAB, "data.validation_fraction": 0.2,
               "diffusion.noise": noise, "train.num_steps": 200, "train.eval_every": 200, "train.eval_batches": 4,
               "train.log_every": 50, "train.checkpoint_every": 200}
  result = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), f"--workdir={tmp_path}",
                           f"--config={ROOT / 'configs' / 'tiny.py'}",
                           *(f"--config.{k}={v}" for k, v in overrides.items())],
                          capture_output=True, text=True, timeout=900, check=False, env=optimized_env)
  assert result.returncode == 0, result.stderr[-3000:]
  evals = dict(_losses(tmp_path, "eval/"))
  first, last = evals[0], evals[200]
  for key in ("eval/loss", "eval/diffusion_loss", "eval/ar_loss"):
    assert last[key] <= 0.75 * first[key], (key, first[key], last[key])


def _free_port():
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_together_like_one(corpus, tmp_path):
  """scripts/train.py in two processes (jax.distributed on localhost, one CPU device each, each reading
  its shard of the data) == one process with two devices fed the same global batches: per-step losses
  and final parameters within 1e-5. Only process 0 writes config.json and metrics.jsonl."""
  n = 3
  port = _free_port()
  env = device_env.with_devices(1)
  workdir = tmp_path / "two"
  processes = [subprocess.Popen(
      _script_args(corpus, workdir, n, f"--coordinator_address=localhost:{port}", "--num_processes=2",
                   f"--process_id={i}"), env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for i in range(2)]
  reference = subprocess.Popen(
      [sys.executable, str(ROOT / "tests" / "_train_reference.py"), str(tmp_path / "one"),
       str(tmp_path / "one.npz"), json.dumps(_script_flags(corpus, n))],
      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  for process in [*processes, reference]:
    _, err = process.communicate(timeout=900)
    assert process.returncode == 0, err[-3000:]
  assert _steps_saved(workdir) == [n]
  want = np.load(tmp_path / "one.npz")
  losses = [r["train/loss"] for _, r in _losses(workdir)]
  np.testing.assert_array_equal(losses, want["losses"])  # bit-identical, as docs/scale.md says
  params, step = training.load_params(workdir)  # onto this process's one device: another topology
  assert step == n
  params = jax.tree.leaves(params)
  for i, leaf in enumerate(params):
    np.testing.assert_array_equal(np.asarray(leaf), want[f"param_{i}"])
  print(f"max |loss diff| {np.abs(np.array(losses) - want['losses']).max():.2e}, max |param diff| "
        f"{max(np.abs(np.asarray(x) - want[f'param_{i}']).max() for i, x in enumerate(params)):.2e}")
  assert json.loads((workdir / "config.json").read_text())["train"]["num_steps"] == n
  assert [s for s, _ in _losses(workdir)] == list(range(1, n + 1))  # one record per step: one writer


def test_fine_tuning_from_a_workdir_full_and_lora(corpus, tmp_path):
  """config.train.init_from starts a run from another run's weights; with lora_rank the base stays
  bit-identical, only adapters are trained and checkpointed, and build.load merges them back."""
  base_state = dg.build.train(_config(corpus, **{"train.num_steps": 3}), tmp_path / "base")
  base = jax.device_get(base_state.params)
  full = _config(corpus, **{"train.num_steps": 1, "train.init_from": str(tmp_path / "base")})
  setup = loop._Setup(dg.build.train_task(full, tmp_path / "full"), tmp_path / "full")  # pylint: disable=protected-access
  _assert_same_params(base, jax.device_get(setup.init_state().params))  # starts from the base's weights
  tuned = dg.build.train(full, tmp_path / "full")
  assert int(tuned.step) == 1

  lora = _config(corpus, **{"train.num_steps": 2, "train.init_from": str(tmp_path / "base"),
                            "train.lora_rank": 2, "train.learning_rate": 1e-2, "train.warmup_steps": 0})
  state = dg.build.train(lora, tmp_path / "lora")
  adapters = jax.device_get(state.params)
  assert "lora_a" in adapters["layer_0"]["attn"]["q_einsum"] and "embedder" not in adapters
  assert sum(x.size for x in jax.tree.leaves(adapters)) < sum(x.size for x in jax.tree.leaves(base)) / 4
  params, step = training.load_params(tmp_path / "base")
  _assert_same_params(base, params)  # the base was only read
  weights = dg.build.load(lora, workdir=tmp_path / "lora")
  assert "LoRA adapters (rank 2)" in weights.source
  merged = dg.training.lora.merge(base, adapters, dg.training.lora.LoraConfig(rank=2, alpha=16.0))
  _assert_same_params(jax.device_get(weights.variables), jax.device_get(merged))
  q = lambda v: np.asarray(v["params"]["layer_0"]["attn"]["q_einsum"])
  assert np.abs(q(weights.variables) - q(base)).max() > 0  # the adapters moved the weights
  # The workdir alone is the run as trained (its config.json): adapters merged without restating lora_rank.
  alone = dg.build.load(dg.build.run_config(tmp_path / "lora"), workdir=tmp_path / "lora")
  _assert_same_params(jax.device_get(alone.variables), jax.device_get(merged))
  # A config beside it that differs in what the weights depend on is refused by field name, not a deep error.
  with pytest.raises(ValueError, match=r"train.lora_rank=0 \(trained with 2\)"):
    dg.build.load(_config(corpus), workdir=tmp_path / "lora")
  with pytest.raises(ValueError, match=r"model.num_layers=3 \(trained with 2\)"):
    dg.build.run_config(tmp_path / "base", _config(corpus, **{"model.num_layers": 3}))
  with pytest.raises(FileNotFoundError, match="no saved config.json"):
    dg.build.run_config(tmp_path / "nowhere")
  # A binary says such a mistake in one line (build.cli.run), not in a traceback or the flags' help.
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "evaluate.py"), f"--workdir={tmp_path / 'lora'}",
                        f"--config={ROOT / 'configs' / 'tiny.py'}"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and "Traceback" not in out.stderr and "--helpfull" not in out.stderr, out.stderr
  assert "error: The config given does not match the run in" in out.stderr and "train.lora_rank=0" in out.stderr
  with pytest.raises(ValueError, match="lora_rank=2 trains adapters on frozen weights"):
    dg.build.lora_config(_config(corpus, **{"train.lora_rank": 2}))
  with pytest.raises(FileNotFoundError, match="init_from='/nowhere' is neither"):
    dg.build.train(_config(corpus, **{"train.init_from": "/nowhere"}), tmp_path / "bad")
  wrong = _config(corpus, **{"train.init_from": str(tmp_path / "base"), "model.num_layers": 3})
  with pytest.raises(ValueError, match="do not fit config.model"):
    dg.build.train(wrong, tmp_path / "wrong")

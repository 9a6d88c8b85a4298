"""Workdirs on object storage: `--workdir=gs://bucket/run` through `etils.epath`, against the session's local
GCS server (`gcs_bucket` in conftest.py). The data side stays local here (a JSONL corpus and a tokenizer
file): what is tested is that everything a run keeps in its workdir goes to the bucket and nothing to the
local disk."""

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma import _files
from diffusiongemma import training
from diffusiongemma.training import metrics as metrics_lib
from test_training import _assert_same_params, _config, _losses, _script_flags, corpus, ROOT  # noqa: F401


def test_files_and_metrics_on_gs(gcs_bucket):
  """`_files` and the JSONL writer on gs:// objects: atomic writes, bounded reads, presence, and a metrics
  file rewritten whole at each flush (objects cannot be appended to), truncated on resume."""
  root = _files.as_path(f"{gcs_bucket}/files")
  _files.atomic_write(root / "a.json", json.dumps({"x": 1}))
  assert _files.present(root / "a.json") and not _files.present(root / "missing.json")
  assert _files.read_json(root / "a.json") == {"x": 1}
  with pytest.raises(_files.BadFileError, match=r"a\.json is 8 bytes, more than the 4"):
    _files.read_bytes(root / "a.json", 4)
  with pytest.raises(FileNotFoundError, match="missing.json does not exist"):
    _files.read_bytes(root / "missing.json", 4)
  for run in range(2):  # a second writer (a resumed run) keeps what the first one flushed
    writer = metrics_lib.JsonlWriter(root / metrics_lib.METRICS_FILENAME)
    for step in range(1 + 3 * run, 4 + 3 * run):
      writer.write_scalars(step, {"loss": float(step)})
    writer.flush()
    writer.close()
  assert [r["step"] for r in training.read_metrics(str(root))] == [1, 2, 3, 4, 5, 6]
  metrics_lib.truncate_metrics(str(root), 4)
  assert [r["step"] for r in training.read_metrics(str(root))] == [1, 2, 3, 4]


def test_a_path_scheme_without_a_backend_is_refused_by_name(corpus, tmp_path, monkeypatch):
  """`pathlib.Path('s3://b/run')` is the local folder `s3:/b/run`; a workdir URI of a scheme we have no backend
  for is refused by name instead, before anything is written anywhere."""
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match=r"--workdir='s3://bucket/run': the scheme s3:// is not supported; "
                                       r"expected a local path or gs://"):
    dg.build.train(_config(corpus), "s3://bucket/run")
  monkeypatch.setitem(_files.URI_BACKENDS, "gs", ("no_such_gcs_backend", "pip install 'diffusiongemma[gcs]'"))
  with pytest.raises(ValueError, match=r"--workdir='gs://bucket/run': gs:// paths need the no_such_gcs_backend "
                                       r"package, which is not installed \(pip install 'diffusiongemma\[gcs\]'\)"):
    dg.build.train(_config(corpus), "gs://bucket/run")
  assert not list(tmp_path.iterdir())


def _pairs(path):
  """A JSONL file of short prompt/response pairs (consecutive short lines of a few stdlib modules)."""
  stdlib = sysconfig.get_paths()["stdlib"]
  lines = [line.strip() for name in ("argparse.py", "ast.py", "enum.py")
           for line in open(os.path.join(stdlib, name), encoding="utf-8").read().splitlines()]
  lines = [line for line in lines if 3 <= len(line) <= 16]
  path.write_text("".join(json.dumps({"prompt": a, "response": b}) + "\n"
                          for a, b in zip(lines[:800:2], lines[1:800:2])))
  return path


@pytest.mark.slow
def test_a_gs_workdir_trains_resumes_exports_and_samples_with_nothing_written_locally(corpus, gcs_bucket,
                                                                                       tmp_path):
  """scripts/train.py with --workdir=gs://...: stopped by SIGTERM after a checkpoint, resumed, it ends with the
  per-step metrics and parameters of an uninterrupted run on a local folder; scripts/convert.py exports that
  workdir as a transformers folder on gs:// (the same weights, read back by load_hf), scripts/sample.py
  samples from the workdir alone (its saved config) and from the exported folder, a fine-tuning run starts from it (config.train.init_from=gs://...), and TensorBoard's events
  are in the bucket. Every command runs in an empty folder, which stays empty: nothing of the workdirs lands on
  the local disk."""
  n = 40
  config_file = tmp_path / "sft_config.py"  # the SFT task: its data are read from the JSONL file alone
  config_file.write_text(f"from diffusiongemma.build.config import load_config_file\n\n\ndef get_config():\n"
                         f"  config = load_config_file({str(ROOT / 'configs' / 'tiny.py')!r})\n"
                         f"  config.data.task = 'sft'\n  return config\n")
  flags = {**_script_flags(corpus, n), "data.corpus": str(_pairs(tmp_path / "pairs.jsonl")),
           "train.eval_every": 0, "train.checkpoint_every": 3}
  flags = [f"--config={config_file}", *(f"--config.{k}={v}" for k, v in flags.items())]
  cwd = tmp_path / "cwd"
  cwd.mkdir()

  def start(script, *args):
    log = tmp_path / f"{script}.{time.monotonic_ns()}.log"
    with open(log, "w", encoding="utf-8") as f:
      process = subprocess.Popen([sys.executable, str(ROOT / "scripts" / script), *args], cwd=cwd, stdout=f,
                                 stderr=subprocess.STDOUT)
    process.log = log
    return process

  def finish(process, timeout=300):
    try:
      process.wait(timeout=timeout)
    finally:
      process.kill()
    assert process.returncode == 0, process.log.read_text()[-3000:]
    return process.log.read_text()

  workdir, local = f"{gcs_bucket}/run", tmp_path / "local"
  finish(start("train.py", *flags, f"--workdir={local}"))  # compiles; the runs below read the cache
  process = start("train.py", *flags, f"--workdir={workdir}")
  deadline = time.monotonic() + 300
  while not (training.latest_step(workdir) or 0) >= 3:
    assert process.poll() is None, process.log.read_text()[-3000:]
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.1)
  process.send_signal(signal.SIGTERM)
  assert "SIGTERM: saved the checkpoint of step" in finish(process)
  assert 3 <= training.latest_step(workdir) < n
  finish(start("train.py", *flags, f"--workdir={workdir}"))
  assert _losses(workdir) == _losses(local)
  params, step = training.load_params(workdir)
  assert step == n
  _assert_same_params(training.load_params(local)[0], params)
  assert [p.name for p in _files.as_path(f"{workdir}/tensorboard").iterdir()]

  export = f"{gcs_bucket}/export"
  finish(start("convert.py", f"--from_workdir={workdir}", f"--to_hf={export}"))
  copy = tmp_path / "export"
  copy.mkdir()
  for item in _files.as_path(export).iterdir():
    (copy / item.name).write_bytes(item.read_bytes())
  assert sorted(p.name for p in copy.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
  _, exported = dg.convert.load_hf(copy)
  _assert_same_params(jax.tree.map(np.asarray, params["params"]), exported)

  out = finish(start("sample.py", f"--workdir={workdir}", "--prompt=def f(", "--max_new_tokens=8"))  # as trained
  assert f"weights: {workdir}/checkpoints step {n}" in out
  out = finish(start("sample.py", f"--hf_checkpoint={copy}", "--prompt=def f(", "--max_new_tokens=8"))
  assert f"transformers checkpoint {copy}" in out  # the exported folder, with this project's tokenizer

  tuned = f"{gcs_bucket}/tuned"  # fine-tuning from the gs:// workdir's weights, into another gs:// workdir
  finish(start("train.py", *flags, "--config.train.num_steps=1", f"--config.train.init_from={workdir}",
               f"--workdir={tuned}"))
  assert _losses(tuned)[0][1]["train/loss"] < _losses(local)[0][1]["train/loss"] - 1  # not a random start
  assert not list(cwd.iterdir())

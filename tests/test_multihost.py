"""Training as a pod runs it: several `jax.distributed` processes that stop together, workdirs on object
storage, and resumes on another mesh. The tiny config, corpus and script helpers are test_training.py's.

Every run here is a subprocess reading the session's shared compilation cache: the first launch of a shape
compiles, the later ones load it, so each test starts one run alone before starting several at once."""

import json
import logging
import re
import signal
import subprocess
import sys
import time

import jax
import pytest

from diffusiongemma import training
from diffusiongemma.training import loop
from diffusiongemma.training import stopping
from test_training import _free_port, _losses, _script_args, _script_flags, _steps_saved, corpus, ROOT  # noqa: F401
import device_env

SLOW_PROCESS_0 = ROOT / "tests" / "_train_slow_process0.py"
NO_EVAL = "--config.train.eval_every=0"  # one program fewer to compile


class _Processes:
  """The processes of one multi-process run of scripts/train.py (or of a wrapper taking its flags), each
  logging to its own file."""

  def __init__(self, corpus, workdir, num_steps, *extra, count=2, script=None):
    port = _free_port()
    env = device_env.with_devices(1)
    args = _script_args(corpus, workdir, num_steps, NO_EVAL, *extra, f"--coordinator_address=localhost:{port}",
                        f"--num_processes={count}")
    if script is not None:
      args[1] = str(script)
    self.logs = [workdir.parent / f"{workdir.name}.{time.monotonic_ns()}.{i}.log" for i in range(count)]
    self.processes = []
    for i, log in enumerate(self.logs):
      with open(log, "w", encoding="utf-8") as f:
        self.processes.append(subprocess.Popen([*args, f"--process_id={i}"], env=env, stdout=f, stderr=f))

  def wait_for(self, condition, timeout: float = 300) -> None:
    """Polls `condition` until it holds, while every process runs."""
    deadline = time.monotonic() + timeout
    while not condition():
      for process, log in zip(self.processes, self.logs):
        assert process.poll() is None, log.read_text()[-3000:]
      assert time.monotonic() < deadline, "timed out"
      time.sleep(0.02)

  def finish(self, timeout: float) -> list[str]:
    """Waits for every process to exit 0 within `timeout` seconds (killing them otherwise); their logs."""
    deadline = time.monotonic() + timeout
    try:
      for process, log in zip(self.processes, self.logs):
        try:
          process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
          pytest.fail(f"still running after {timeout} s: {log}\n{log.read_text()[-3000:]}")
        assert process.returncode == 0, log.read_text()[-3000:]
    finally:
      for process in self.processes:
        if process.poll() is None:
          process.kill()
    return [log.read_text() for log in self.logs]


def _stopped_at(logs, pattern) -> int:
  """The step that every log names in `pattern` (one group), once: the same in all of them."""
  steps = [re.findall(pattern, log) for log in logs]
  assert all(len(s) == 1 for s in steps), steps
  assert len({s[0] for s in steps}) == 1, f"the processes stopped at different steps: {steps}"
  return int(steps[0][0])


def test_a_multiprocess_budget_is_checked_at_steps_process_0_schedules(monkeypatch):
  """Process 0 of two (faked), 1 s per step, a 10 s budget: the budget is broadcast at steps 1, 2, 6, 8, 9
  and 10 (halfway to the estimated end each time), not after every step, and the run stops at step 10, where a
  check after every step would stop it; SIGTERM is the preemption sync point's answer. With jax's preemption
  service off, a multi-process run is refused by name."""
  monkeypatch.setattr(stopping.jax, "process_count", lambda: 2)
  monkeypatch.setattr(stopping.jax, "process_index", lambda: 0)
  broadcasts = []
  monkeypatch.setattr(stopping.multihost_utils, "broadcast_one_to_all",
                      lambda value: broadcasts.append(int(value)) or value)
  with stopping.StopRule(10.0, reached_preemption=lambda step: False) as rule:
    reasons = [rule.reason(step, float(step)) for step in range(1, 11)]
  assert reasons == [None] * 9 + [stopping.TIME_BUDGET]
  assert broadcasts == [2, 6, 8, 9, 10, -1]  # the step of the next check; -1: stop now
  with stopping.StopRule(10.0, reached_preemption=lambda step: step == 3) as rule:
    assert [rule.reason(step, 0.0) for step in (1, 2, 3)] == [None, None, stopping.SIGTERM]
  jax.config.update("jax_enable_preemption_service", False)
  try:
    with pytest.raises(ValueError, match="jax_enable_preemption_service is off"):
      stopping.StopRule(10.0, reached_preemption=lambda step: False)
  finally:
    jax.config.update("jax_enable_preemption_service", True)


@pytest.mark.slow
def test_sigterm_to_one_process_or_process_0s_budget_stops_all_at_one_step(corpus, tmp_path):
  """Two processes, one workdir. SIGTERM to process 1 alone, mid-run: both save the same step and exit 0
  within 60 s. Resumed with a time budget that process 0 spends first (its steps 50 ms slower, through a test
  wrapper): both stop at one step again. Resumed to the end: the same per-step train metrics as an
  uninterrupted two-process run."""
  n = 20
  workdir = tmp_path / "stopped"
  run = _Processes(corpus, workdir, n)
  run.wait_for(lambda: any(s >= 3 for s, _ in _losses(workdir)))
  sent = time.monotonic()
  run.processes[1].send_signal(signal.SIGTERM)
  logs = run.finish(timeout=60)
  assert time.monotonic() - sent < 60
  first = _stopped_at(logs, r"SIGTERM: saved the checkpoint of step (\d+)")
  assert 3 <= first < n and max(_steps_saved(workdir)) == first

  straight = _Processes(corpus, tmp_path / "straight", n)  # compiled programs are in the cache by now
  train_s = [r["time/train_s"] for r in training.read_metrics(workdir) if "time/train_s" in r][-1]
  logs = _Processes(corpus, workdir, n, f"--config.train.time_budget_s={train_s + 0.6}",
                    script=SLOW_PROCESS_0).finish(timeout=300)
  second = _stopped_at(logs, r"Time budget of \d+ s spent at step (\d+)")
  assert first < second < n and max(_steps_saved(workdir)) == second

  _Processes(corpus, workdir, n).finish(timeout=300)
  straight.finish(timeout=300)
  assert _losses(workdir) == _losses(tmp_path / "straight")
  assert [s for s, _ in _losses(workdir)] == list(range(1, n + 1))


def test_a_checkpoint_records_its_topology_and_another_process_count_is_refused(caplog):
  """The `meta` record of where a checkpoint was written: another mesh or device count is logged as a reshard;
  another process count too when the data position is global batches (`data.batching`), and refused naming
  both counts when it is a per-process position (each process's slice of the data would change)."""
  saved = {"mesh": {"data": 1, "fsdp": 4, "expert": 2, "tensor": 1}, "num_devices": 8, "num_processes": 1}
  current = {"mesh": {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}, "num_devices": 1, "num_processes": 1}
  with caplog.at_level(logging.INFO):
    loop._check_topology(saved, current, 5)  # pylint: disable=protected-access
  assert ("Resharding the checkpoint of step 5, written on mesh data=1 fsdp=4 expert=2 tensor=1 (8 devices in 1 "
          "process), onto mesh data=1 fsdp=1 expert=1 tensor=1 (1 device in 1 process)") in caplog.text
  with pytest.raises(ValueError, match="step 5 was written by 2 processes; this run has 1"):
    loop._check_topology({**saved, "num_processes": 2}, current, 5)  # pylint: disable=protected-access
  loop._check_topology(None, current, 5)  # pylint: disable=protected-access  (written before the record)
  with caplog.at_level(logging.INFO):
    loop._check_topology({**saved, "num_processes": 2}, current, 5, {"global_batch": 5})  # pylint: disable=protected-access
  assert "(8 devices in 2 processes)" in caplog.text


@pytest.mark.slow
def test_a_checkpoint_of_8_devices_resumes_resharded_on_4_and_on_1(corpus, tmp_path):
  """Written on 8 simulated devices (mesh fsdp=4, expert=2), a checkpoint resumes on 4 (fsdp=2, expert=2) and
  then on 1: each time the restored parameters equal the saved ones (tests/_resume_on_mesh.py), the run logs
  the reshard, and training goes on to its next step. One process throughout (the data slicing stays)."""
  workdir = tmp_path / "run"
  flags = {**_script_flags(corpus, 2), "train.batch_size": 8, "train.eval_every": 0, "train.checkpoint_every": 1}

  def run(devices, mesh, num_steps, *command):
    overrides = {**flags, "train.num_steps": num_steps, **{f"mesh.{a}": n for a, n in mesh.items()}}
    env = device_env.with_devices(devices)
    if not command:
      command = (str(ROOT / "tests" / "_resume_on_mesh.py"), str(workdir), json.dumps(overrides))
    out = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr

  first = _script_args(corpus, workdir, 2, *(f"--config.{k}={v}" for k, v in
                                             {**flags, "mesh.data": 1, "mesh.fsdp": 4, "mesh.expert": 2}.items()))
  run(8, {}, 2, *first[1:])
  assert _steps_saved(workdir)[-1] == 2
  out = run(4, {"data": 1, "fsdp": 2, "expert": 2}, 3)
  assert "restored step 2 equal on mesh {'data': 1, 'fsdp': 2, 'expert': 2, 'tensor': 1}" in out
  assert ("Resharding the checkpoint of step 2, written on mesh data=1 fsdp=4 expert=2 tensor=1 (8 devices in 1 "
          "process), onto mesh data=1 fsdp=2 expert=2 tensor=1 (4 devices in 1 process)") in out
  out = run(1, {"data": 1, "fsdp": 1, "expert": 1}, 4)
  assert "restored step 3 equal on mesh {'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 1}" in out
  assert "written on mesh data=1 fsdp=2 expert=2 tensor=1 (4 devices in 1 process), onto mesh data=1" in out
  assert [s for s, _ in _losses(workdir)] == [1, 2, 3, 4]

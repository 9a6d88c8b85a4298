"""A server process for tests (scripts/serve.py on a free loopback port) and what tests ask of it, and a fake
engine for the scheduler and the app without a model.

Imported by tests (it contains none)."""

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx

from diffusiongemma.serving import programs
from diffusiongemma.serving import requests as requests_lib
from diffusiongemma.serving import rows as rows_lib

ROOT = pathlib.Path(__file__).parent.parent
MODEL = "tiny"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60) -> None:
  """Until something listens on the loopback `port`."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    with socket.socket() as s:
      if s.connect_ex(("127.0.0.1", port)) == 0:
        return
    time.sleep(0.1)
  raise TimeoutError(f"Nothing listens on port {port} after {timeout} s.")


def env() -> dict:
  """The environment for child processes: this checkout first on the path."""
  return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


class ServerProcess:
  """`python scripts/serve.py --hf_checkpoint=folder --dtype=float32 --port=<free> *args` (with `workdir`:
  `--workdir=folder` instead of the first two), its stderr in `log_path`."""

  def __init__(self, folder, log_path, *args: str, workdir: bool = False):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.log_path = pathlib.Path(log_path)
    self._log = open(self.log_path, "w", encoding="utf-8")  # pylint: disable=consider-using-with
    source = [f"--workdir={folder}"] if workdir else [f"--hf_checkpoint={folder}", "--dtype=float32"]
    command = [sys.executable, str(ROOT / "scripts" / "serve.py"), *source, f"--port={self.port}", *args]
    self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)

  def wait(self, timeout: float = 600, ready: bool = True) -> None:
    """Until /health answers (200 with `ready`, else any answer); fails with the log if the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise RuntimeError(f"The server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
      try:
        status = httpx.get(f"{self.url}/health", timeout=5).status_code
        if status == 200 or not ready:
          return
      except httpx.HTTPError:
        pass
      time.sleep(0.5)
    raise TimeoutError(f"The server was not ready within {timeout} s:\n{self.log()[-4000:]}")

  def health(self) -> dict:
    return httpx.get(f"{self.url}/health", timeout=10).json()

  def log(self) -> str:
    if not self._log.closed:
      self._log.flush()
    return self.log_path.read_text(encoding="utf-8", errors="replace")

  def records(self, event: str | None = None) -> list[dict]:
    """The JSON log records (of one `event`)."""
    out = []
    for line in self.log().splitlines():
      if line.startswith("{"):
        try:
          record = json.loads(line)
        except ValueError:
          continue
        if event is None or record.get("event") == event:
          out.append(record)
    return out

  def stop(self, timeout: float = 60) -> int:
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
      try:
        self.process.wait(timeout)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait()
    self._log.close()
    return self.process.returncode


# ---------------------------------------------------------------------------------------- a fake engine
class FakeConstraint:
  """Stands for a constraint: requests with the same name share one object, so they batch together."""

  def __init__(self, name: str):
    self.name = name

  def _program_key(self) -> tuple:
    return (self.name,)


_CONSTRAINTS: dict[str, FakeConstraint] = {}


@dataclasses.dataclass(frozen=True)
class FakePrepared:
  """A prepared request of `FakeEngine`: `key` names its group (its constraint; "plain": none)."""

  key: str
  request: requests_lib.Request = requests_lib.Request(kind="chat", model=MODEL)
  ids: tuple = (2, 3)
  seed: int = 0
  max_tokens: int = 4
  prompt_bucket: int = 64
  canvases: int = 1
  images: tuple = ()
  temperature: float = 1.0

  @property
  def constraint(self) -> FakeConstraint | None:
    return None if self.key == "plain" else _CONSTRAINTS.setdefault(self.key, FakeConstraint(self.key))


class FakeEngine:
  """Runs a batch by answering every job. `gate` (when set) holds the batch after the first job's answer;
  `compile_gate` holds each compilation until set. `batches`: the keys of each batch's jobs; `shapes`: the
  program each ran on; `compiled`: the shapes compiled, in order."""

  model_name, max_tokens_limit, batch_sizes, max_batch, mismatches, canvas = MODEL, 64, (1, 2, 4), 4, 0, 8
  max_prompt_tokens = 64
  config = type("Config", (), {"max_positions": 128})

  def __init__(self, gate=None, compile_gate=None, grid=()):
    self.batches, self.shapes, self.compiled, self.gate, self.compile_gate = [], [], [], gate, compile_gate
    self._grid = list(grid)

  def grid(self):
    return list(self._grid)

  def covering(self):
    return self._grid[:1]

  def batch_bucket(self, n):
    return next(b for b in self.batch_sizes if b >= n)

  def limits(self):
    return requests_lib.Limits()

  def compile(self, shape, constraint=None):
    del constraint
    if self.compile_gate is not None:
      self.compile_gate.wait(30)
    self.compiled.append(shape)

  def prepare(self, request):
    return FakePrepared(key=request.prompt or "chat", request=request)

  def run(self, jobs, shape):
    self.batches.append([job.prepared.key for job in jobs])
    self.shapes.append(shape)
    for i, job in enumerate(jobs):
      job.send(("done", rows_lib.Result(f"answer {job.prepared.key}", "", "stop", (5,), 1, 3, 1)))
      if i == 0 and self.gate is not None:
        self.gate.wait(10)
    return {"size": len(jobs), "compiled": False}


def shape(batch=1, prompt=64, canvases=1, constraint=()):
  return programs.Shape(batch, prompt, canvases, constraint)

"""A server process for tests (scripts/serve.py on a free loopback port) and what tests ask of it.

Imported by tests (it contains none)."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).parent.parent


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def env() -> dict:
  """The environment for child processes: this checkout first on the path."""
  return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


class ServerProcess:
  """`python scripts/serve.py --hf_checkpoint=folder --port=<free> *args`, its stderr in `log_path`."""

  def __init__(self, folder, log_path, *args: str):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.log_path = pathlib.Path(log_path)
    self._log = open(self.log_path, "w", encoding="utf-8")  # pylint: disable=consider-using-with
    command = [sys.executable, str(ROOT / "scripts" / "serve.py"), f"--hf_checkpoint={folder}", "--dtype=float32",
               f"--port={self.port}", *args]
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

"""Operating the server (scripts/serve.py in a subprocess): a full queue answers 429, a client that goes away
is cancelled, SIGTERM stops constraint builds at once, lets queued and running requests finish and exits 0,
and every request leaves one structured log record.

The server here compiles nothing at start-up (`--warm_up=0`), so its first request waits for a whole
compilation (in the background): the slow request the others queue behind.
"""

import signal
import threading
import time

import httpx
import pytest

import serving_helpers

pytestmark = [pytest.mark.slow, pytest.mark.hf]


def _until(condition, timeout=120, what="condition"):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return
    time.sleep(0.2)
  raise TimeoutError(what)


def _in_thread(fn):
  out = {}

  def run():
    try:
      out["response"] = fn()
    except Exception as e:  # pylint: disable=broad-except
      out["error"] = e

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread, out


def test_queue_limit_disconnects_and_graceful_sigterm(chat_checkpoint, tmp_path):
  server = serving_helpers.ServerProcess(chat_checkpoint, tmp_path / "server.log", "--batch_sizes=1", "--warm_up=0",
                                         "--max_queue=2", "--shutdown_grace=300", "--max_prompt_tokens=64",
                                         "--constraint_seconds=600")
  try:
    server.wait()
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    chat = f"{server.url}/v1/chat/completions"
    body = lambda text, **extra: {"model": model, "messages": [{"role": "user", "content": text}], "seed": 1, **extra}
    running, a = _in_thread(lambda: httpx.post(chat, json=body("A", stream=True), timeout=600))
    _until(lambda: server.health()["programs"]["compiling"] == 1, what="A's program compiling")
    leaving, b = _in_thread(lambda: httpx.post(chat, json=body("B"), timeout=3))  # gives up while queued
    _until(lambda: server.health()["queued"] == 2, what="B queued behind A")
    full = httpx.post(chat, json=body("C"), timeout=30)
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    leaving.join(30)
    assert isinstance(b.get("error"), httpx.ReadTimeout)
    _until(lambda: server.health()["queued"] == 1, timeout=30, what="B cancelled")  # its slot is free again
    queued, d = _in_thread(lambda: httpx.post(chat, json=body("D"), timeout=600))
    _until(lambda: server.health()["queued"] == 2, what="D queued")
    # A constraint whose build would take minutes (2^23 DFA states) is building when SIGTERM comes.
    bomb = body("E", response_format={"type": "regex", "regex": "(a|b)*a(a|b){22}"})
    building, e = _in_thread(lambda: httpx.post(chat, json=bomb, timeout=600))
    _until(lambda: server.health()["constraint_builds"] == 1, what="E's constraint building")
    assert server.health()["programs"]["compiling"] == 1  # A's program still compiling: all are in flight

    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    building.join(60)
    assert e["response"].status_code == 503 and time.monotonic() - signalled < 10  # the build did not hold it
    _until(lambda: _refused(chat, body("F")), timeout=30, what="new requests refused")
    running.join(600)
    queued.join(600)
    assert server.process.wait(300) == 0
  finally:
    server.stop()
  stream = a["response"]
  assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n"), stream.text[-500:]
  assert '"finish_reason":"' in stream.text
  assert d["response"].status_code == 200 and d["response"].json()["choices"][0]["finish_reason"] in ("stop",
                                                                                                     "length")
  records = server.records("request")
  statuses = sorted(r["status"] for r in records if r["status"] != 503)  # E, and F if it got in before the close
  assert statuses == [200, 200, 429, 499], statuses  # A and D answered, C refused, B cancelled
  for record in records:
    if record.get("status") == 200:
      assert record["completion_tokens"] >= 1 and record["passes"] >= 1 and record["latency_ms"] > 0
      assert record["batch_size"] == 1 and record["prompt_tokens"] > 0 and record["queue_ms"] >= 0
  assert server.records("shutdown") and server.records("stopped")


def _refused(url, body) -> bool:
  """Whether a new request is refused: the listener is closed, or the server answers 503."""
  try:
    return httpx.post(url, json=body, timeout=5).status_code == 503
  except httpx.TransportError:
    return True

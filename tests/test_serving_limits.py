"""Every input bounded before it costs anything, and no client stalls the others (issue 40's reproductions,
with small numbers): request limits and malformed Unicode, chunked uploads capped as they are read,
streams whose client stops reading, unexpected errors still logged, and constraint builds that run in
their own process within a budget, off the event loop, shared, and stopped when nobody waits. No model:
a fake engine (tests/serving_helpers.py); the real server is tested in tests/test_serving.py."""

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import socket
import threading
import time
import types

import pytest

import serving_helpers
from diffusiongemma.diffusion import constraints as cons
from diffusiongemma.serving import app as app_lib
from diffusiongemma.serving import constraints as builds_lib
from diffusiongemma.serving import requests as requests_lib
from diffusiongemma.serving import scheduler as scheduler_lib
from diffusiongemma.serving.errors import APIError
from serving_helpers import FakeEngine, MODEL

CHAT = "/v1/chat/completions"


def _parse(body, limits=requests_lib.Limits()):
  return requests_lib.parse(body, "chat", (MODEL,), 64, limits)


def _refused(raw: bytes | dict, limits=requests_lib.Limits()) -> APIError:
  with pytest.raises(APIError) as error:
    _parse(requests_lib.parse_json(raw if isinstance(raw, bytes) else json.dumps(raw).encode()), limits)
  return error.value


# ---------------------------------------------------------------------------------------- request limits
def test_lone_surrogates_anywhere_are_a_400_naming_the_field():
  for raw, param in ((b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
                      "messages.0.content"),
                     (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["\\udfff"]}',
                      "stop.0"),
                     (b'{"model": "tiny", "\\ud800": 1}', "\\ud800")):
    error = _refused(raw)
    assert (error.status, error.code) == (400, "invalid_unicode") and error.param.startswith(param[:5]), error
  assert _parse(requests_lib.parse_json('{"model": "tiny", "messages": [{"role": "user", "content": '
                                        '"\\ud83d\\ude00"}]}'.encode())).messages[0].content == "\U0001F600"


def test_message_count_images_and_prompt_bytes_are_capped_before_any_tokenizing():
  limits = requests_lib.Limits(messages=10, images=2, prompt_bytes=100)
  many = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 11}
  assert (_refused(many, limits).param, _refused(many, limits).code) == ("messages", "too_many_messages")
  image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
  pictures = {"model": MODEL, "messages": [{"role": "user", "content": [image] * 3}]}
  assert _refused(pictures, limits).code == "too_many_images"
  long = {"model": MODEL, "messages": [{"role": "user", "content": "\u00e9" * 51}]}  # 102 bytes in UTF-8
  assert _refused(long, limits).code == "context_length_exceeded"
  assert _parse({**long, "messages": [{"role": "user", "content": "\u00e9" * 50}]}, limits)
  with pytest.raises(APIError, match="101 bytes") as completion:
    requests_lib.parse({"model": MODEL, "prompt": "x" * 101}, "completion", (MODEL,), 64, limits)
  assert completion.value.param == "prompt"


# ---------------------------------------------------------------------------------------- the app
class _Records(logging.Handler):
  def __init__(self):
    super().__init__()
    self.records = []

  def emit(self, record):
    self.records.append(json.loads(record.getMessage()))


@pytest.fixture
def records():
  handler = _Records()
  app_lib.LOGGER.addHandler(handler)
  app_lib.LOGGER.setLevel(logging.INFO)
  yield handler.records
  app_lib.LOGGER.removeHandler(handler)


@contextlib.contextmanager
def _live(app):
  """`app` served by uvicorn on a free loopback port (in a thread); yields the port."""
  import uvicorn  # pylint: disable=import-outside-toplevel
  port = serving_helpers.free_port()
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  try:
    serving_helpers.wait_for_port(port)
    yield port
  finally:
    server.should_exit = True
    thread.join(30)


def _raw_post(port: int, path: str, head: bytes, rcvbuf: int | None = None) -> socket.socket:
  sock = socket.socket()
  if rcvbuf:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
  sock.connect(("127.0.0.1", port))
  sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n".encode() + head)
  return sock


def test_chunked_uploads_are_capped_as_they_are_read(monkeypatch, records):
  """A 400 MB chunked upload was read whole before its 413 (+815 MB): now it is refused at the cap."""
  monkeypatch.setattr(app_lib, "MAX_BODY_BYTES", 10_000)
  with _live(app_lib.create_app(FakeEngine(), admission_window=0.0, warm_up=0)) as port:
    sock = _raw_post(port, CHAT, b"transfer-encoding: chunked\r\n\r\n")
    sock.settimeout(0.05)
    answer, chunks = b"", 0
    try:
      while chunks < 1000 and b"\r\n\r\n" not in answer:  # up to 1000 chunks of 1 KiB, until it answers
        sock.sendall(b"400\r\n" + b" " * 1024 + b"\r\n")
        chunks += 1
        try:
          answer += sock.recv(65536)
        except socket.timeout:
          pass
    except (BrokenPipeError, ConnectionResetError):
      pass
    sock.settimeout(5)
    while b"\r\n\r\n" not in answer:
      answer += sock.recv(65536)
    sock.close()
  assert answer.startswith(b"HTTP/1.1 413") and chunks < 100, (answer[:100], chunks)
  assert [r["status"] for r in records if r["event"] == "request"] == [413]


def test_malformed_unicode_and_unexpected_errors_get_openai_errors_and_a_request_record(records):
  """A lone surrogate was a 500 with no request log line."""
  from starlette.testclient import TestClient  # pylint: disable=import-outside-toplevel
  engine = FakeEngine()
  with TestClient(app_lib.create_app(engine, admission_window=0.0, warm_up=0)) as client:
    surrogate = client.post(CHAT, content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}')
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "messages.0.content"

    def broken(request):
      raise RuntimeError("boom")

    engine.prepare = broken
    failed = client.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "internal_error"
  requests = [r for r in records if r["event"] == "request"]
  assert [r["status"] for r in requests] == [400, 500] and "boom" in requests[-1]["error"]


class _Flood(FakeEngine):
  """Sends canvas events of ~20 KB as fast as it can for `seconds`, then answers."""

  def __init__(self, seconds):
    super().__init__()
    self.seconds = seconds

  def run(self, jobs, shape):
    end, payload = time.monotonic() + self.seconds, {"tokens": list(range(4000))}
    while time.monotonic() < end:
      for job in jobs:
        job.send(("canvas", payload))
      time.sleep(0.001)
    return super().run(jobs, shape)


def test_a_stream_whose_client_stops_reading_is_bounded_in_memory_and_closed_at_its_deadline(records):
  """The issue's stand-in engine grew a stalled stream's queue from 222 MB to 1.47 GB in 30 s, past its
  deadline: here the queue keeps at most `MAX_CANVAS_EVENTS` and the stream is closed at the deadline."""
  timeout = 1.0
  engine = _Flood(seconds=timeout + app_lib.STUCK_SECONDS + 3)
  with _live(app_lib.create_app(engine, admission_window=0.0, warm_up=0, request_timeout=timeout)) as port:
    body = json.dumps({"model": MODEL, "prompt": "p", "stream": True}).encode()
    sock = _raw_post(port, "/v1/completions", f"content-length: {len(body)}\r\n\r\n".encode() + body, rcvbuf=4096)
    start = time.monotonic()  # and then it never reads
    while not any(r.get("event") == "request" for r in records) and time.monotonic() - start < 30:
      time.sleep(0.1)
    closed_after = time.monotonic() - start
    sock.close()
  (record,) = [r for r in records if r.get("event") == "request"]
  assert record["status"] == 504 and "not reading" in record["error"], record
  assert record["canvas_events_dropped"] > 0  # the queue stayed bounded
  assert closed_after < timeout + app_lib.STUCK_SECONDS + 2  # well before the engine's end


def test_jobs_hold_a_bounded_number_of_unread_canvas_events_but_every_other_event():
  async def scenario():
    job = scheduler_lib.Job(serving_helpers.FakePrepared("A"), asyncio.get_running_loop())
    for i in range(scheduler_lib.MAX_CANVAS_EVENTS + 50):
      job.send(("canvas", i))
    for i in range(10):
      job.send(("delta", i))
    job.send(("done", None))
    await asyncio.sleep(0.1)
    return job

  job = asyncio.run(scenario())
  assert job.events.qsize() == scheduler_lib.MAX_CANVAS_EVENTS + 11 and job.dropped == 50


# ---------------------------------------------------------------------------------------- constraint builds
def _builds_engine():
  """What `Builds` needs of an engine: a vocabulary and a sampler's stop tokens, pad and vocabulary size."""
  config = types.SimpleNamespace(vocab_size=8, pad_id=0)
  sampler = types.SimpleNamespace(stop_tokens=(1,), noise=types.SimpleNamespace(never_token=None),
                                  model=types.SimpleNamespace(config=config))
  vocabulary = {2: b"a", 3: b"b", 4: b"1", 5: b"[", 6: b"]", 7: b","}
  return types.SimpleNamespace(sampler=sampler, vocabulary=lambda: vocabulary)


def _worker_pids() -> set[int]:
  """This process's constraint build processes (children whose command line names the worker)."""
  pids = set()
  for entry in pathlib.Path("/proc").iterdir():
    try:
      stat = (entry / "stat").read_text()
      if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"constraint_worker" in (
          entry / "cmdline").read_bytes():
        pids.add(int(entry.name))
    except (OSError, ValueError, IndexError):
      continue
  return pids


def _format(kind, value):
  return requests_lib.ResponseFormat(kind, value)


BOMB = "(a|b)*a(a|b){22}"  # 2^23 byte-DFA states: minutes and gigabytes without a budget


@pytest.mark.timeout(300)
def test_constraint_builds_are_bounded_shared_cached_and_never_block_the_event_loop():
  builds = builds_lib.Builds(_builds_engine(), cons.Budget(max_dfa_states=1000, seconds=3.0), memory_mib=2048)
  gaps = []

  async def ticker(stop):
    last = time.monotonic()
    while not stop.is_set():
      await asyncio.sleep(0.02)
      gaps.append(time.monotonic() - last)
      last = time.monotonic()

  async def never_gone():
    return False

  async def scenario():
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(stop))
    far = time.monotonic() + 60
    ok = _format("regex", "(ab)+")
    first, second = await asyncio.gather(builds.get(ok, deadline=far, gone=never_gone),
                                         builds.get(ok, deadline=far, gone=never_gone))
    assert first is second and builds.built == 1  # one build served both
    assert await builds.get(ok, deadline=far, gone=never_gone) is first and builds.built == 1  # cached
    outcomes = []
    for value, budget_limit in (("(a|b)*a(a|b){12}", "--constraint_states"), (BOMB, "--constraint_seconds")):
      start = time.monotonic()
      with pytest.raises(APIError) as refused:
        await builds.get(_format("regex", value), deadline=far, gone=never_gone)
      outcomes.append((refused.value, time.monotonic() - start, budget_limit))
    schema = {"$defs": {"d0": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    assert (await builds.get(_format("json_schema", schema), deadline=far, gone=never_gone)).automaton.accepts([4])
    stop.set()
    await tick
    return outcomes

  try:
    for error, seconds, flag in asyncio.run(scenario()):
      assert error.status == 400 and error.code == "constraint_too_complex" and flag in error.message, error
      assert seconds < 3.0 + 5  # the time limit, plus the process's start and stop
  finally:
    builds.close()
  assert max(gaps) < 1.0  # the event loop kept running through every build
  assert not _worker_pids()


@pytest.mark.timeout(300)
def test_a_build_stops_when_its_client_leaves_at_the_deadline_and_at_shutdown():
  builds = builds_lib.Builds(_builds_engine(), cons.Budget(seconds=600.0), memory_mib=4096)

  async def scenario():
    left = time.monotonic() + 1.0

    async def gone():  # the client leaves after a second
      return time.monotonic() > left

    async def here():
      return False

    outcomes = {}
    for name, kwargs in (("gone", dict(deadline=time.monotonic() + 60, gone=gone)),
                         ("deadline", dict(deadline=time.monotonic() + 1.0, gone=here))):
      start = time.monotonic()
      try:
        await builds.get(_format("regex", BOMB), **kwargs)
      except (builds_lib.Gone, APIError) as e:
        outcomes[name] = (e, time.monotonic() - start)
      await asyncio.sleep(0.5)  # the build's thread sees it is cancelled and kills the process
      outcomes[name + "_processes"] = _worker_pids()
    waiting = asyncio.create_task(builds.get(_format("regex", BOMB + "x"), deadline=time.monotonic() + 60,
                                             gone=here))
    await asyncio.sleep(1.0)
    start = time.monotonic()
    builds.close()  # shutdown
    try:
      await waiting
    except APIError as e:
      outcomes["shutdown"] = (e, time.monotonic() - start)
    await asyncio.sleep(0.5)
    return outcomes

  outcomes = asyncio.run(scenario())
  assert isinstance(outcomes["gone"][0], builds_lib.Gone) and outcomes["gone"][1] < 3
  assert outcomes["deadline"][0].status == 504 and outcomes["deadline"][1] < 3
  assert outcomes["shutdown"][0].status == 503 and outcomes["shutdown"][1] < 3
  assert not outcomes["gone_processes"] and not outcomes["deadline_processes"] and not _worker_pids()

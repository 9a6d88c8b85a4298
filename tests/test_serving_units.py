"""The server's parts without a model: request checking, a row's stream of events, the scheduler (with a
fake engine) and the app's timeouts and errors in process. Fast; the real server is tested in
tests/test_serving.py."""

import asyncio
import threading
import time

import pytest

import chat_fixtures
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.serving import requests as requests_lib
from diffusiongemma.serving import rows as rows_lib
from diffusiongemma.serving.errors import APIError
from diffusiongemma.serving.scheduler import Job, Scheduler
from serving_helpers import FakeEngine, FakePrepared, MODEL


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tokenizer")
  chat_fixtures.write_tokenizer(folder)
  return hf_tokenizer.CheckpointTokenizer(folder)


def _parse(body, kind="chat"):
  return requests_lib.parse(body, kind, (MODEL,), 64)


# ---------------------------------------------------------------------------------------- requests
def test_requests_map_openai_fields_and_the_extensions():
  chat = _parse({"model": MODEL, "messages": [{"role": "developer", "content": "Be brief."},
                                              {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                 "max_completion_tokens": 9, "temperature": 0.5, "stop": "END", "seed": -3, "stream": True,
                 "stream_canvas": True, "stream_options": {"include_usage": True}, "reasoning_effort": "high",
                 "response_format": {"type": "regex", "regex": "(yes|no)"}, "n": 1, "top_p": 1, "user": "u"})
  assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
  assert (chat.max_tokens, chat.temperature, chat.stop, chat.seed) == (9, 0.5, ("END",), -3)
  assert chat.stream and chat.stream_canvas and chat.include_usage and chat.thinking
  assert chat.response_format == requests_lib.ResponseFormat("regex", "(yes|no)")
  json_mode = _parse({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                      "response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": False}})
  assert json_mode.response_format == requests_lib.ResponseFormat("json_object", {"type": "object"})
  assert not json_mode.thinking and not json_mode.stream_canvas
  completion = _parse({"model": MODEL, "prompt": ["Once"], "max_tokens": 3}, "completion")
  assert (completion.prompt, completion.max_tokens, completion.temperature) == ("Once", 3, 1.0)


@pytest.mark.parametrize("body,param,status", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model", 400),
    ({"model": "other", "messages": []}, "model", 404),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages.0.content.0", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
     "messages.0.content.0.image_url", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]},
     "messages.1.role", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
      "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"},
     "reasoning_effort", 400),
])
def test_bad_fields_are_named(body, param, status):
  with pytest.raises(APIError) as error:
    _parse(body)
  assert (error.value.status, error.value.param) == (status, param)
  assert set(error.value.body()["error"]) == {"message", "type", "param", "code"}


def test_temperature_scales_the_checkpoints_schedule_and_zero_is_nearly_greedy():
  from diffusiongemma.serving import engine  # pylint: disable=import-outside-toplevel
  assert [engine.temperature_scale(t) for t in (0, 0.04, 0.44, 1, 2)] == [0.05, 0.05, 0.44, 1.0, 2.0]


def test_deep_and_malformed_json_are_400_not_500():
  for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 70 + b"1" + b"}" * 70, b"{", b"\xff", b"[1]"):
    with pytest.raises(APIError) as error:
      requests_lib.parse_json(raw)
    assert error.value.status == 400 and error.value.code == "invalid_json"


# ---------------------------------------------------------------------------------------- rows
def _ids(tokenizer, text):
  return tokenizer.encode(text)


def _row(tokenizer, max_tokens=64, stop=(), steps=4, pieces=None):
  events = []
  stops = (tokenizer.eos_id, tokenizer.control_ids["<turn|>"])
  stream = rows_lib.fmt.ReplyStream(tokenizer, stop_ids=stops)
  row = rows_lib.Row(stream, stop_ids=stops, max_tokens=max_tokens, stop=stop, steps=steps, send=events.append,
                     pieces=pieces)
  return row, events


def _streamed(events, field="content"):
  return "".join(e[1].get(field, "") for e in events if e[0] == "delta")


def test_a_row_streams_deltas_that_add_up_to_the_answer_and_holds_back_what_may_change(tokenizer):
  row, events = _row(tokenizer)
  row.commit(_ids(tokenizer, "Hello wor"))
  row.commit(_ids(tokenizer, "ld.  "))  # trailing spaces: held back (the final answer is stripped)
  assert _streamed(events) == "Hello world."
  row.commit(_ids(tokenizer, " Bye<turn|>junk"))
  assert events[-1][0] == "done"
  result = events[-1][1]
  assert result.content == "Hello world.   Bye" == _streamed(events)
  assert result.finish_reason == "stop"
  assert result.completion_tokens == len(_ids(tokenizer, "Hello world.   Bye<turn|>"))  # the stop token counts


def test_a_stop_string_cuts_the_answer_even_across_canvases_and_is_never_streamed(tokenizer):
  row, events = _row(tokenizer, stop=("STOP", "zz"))
  row.commit(_ids(tokenizer, "abc ST"))
  assert _streamed(events) == "abc"  # " ST" may begin "STOP"
  row.commit(_ids(tokenizer, "OP tail"))
  result = events[-1][1]
  assert (result.content, result.finish_reason) == ("abc", "stop") and _streamed(events) == "abc"
  assert result.completion_tokens == len(_ids(tokenizer, "abc STOP"))  # up to the token completing it


def test_max_tokens_caps_the_row_and_thoughts_go_to_reasoning_content(tokenizer):
  first = _ids(tokenizer, "<|channel>thought\nhmm<channel|>yes")
  row, events = _row(tokenizer, max_tokens=len(first) + 4)
  row.commit(first)
  assert (_streamed(events, "reasoning_content"), _streamed(events)) == ("hmm", "yes")
  row.commit(_ids(tokenizer, "abcdefgh"))
  result = events[-1][1]
  assert (result.reasoning, result.content, result.finish_reason) == ("hmm", "yesabcd", "length")
  assert result.completion_tokens == len(first) + 4 and _streamed(events) == "yesabcd"


def test_a_row_commits_its_canvas_when_done_or_at_the_step_cap_and_counts_its_own_passes(tokenizer):
  row, events = _row(tokenizer, steps=3, pieces=lambda t: tokenizer.decode([t], skip_special_tokens=False))
  canvas = _ids(tokenizer, "abcd")
  flags = [False] * 4
  row.on_pass(0, 0, canvas, [True, False, False, False], flags, active=True, done=False)
  row.on_pass(0, 1, canvas, flags, flags, active=True, done=True)  # done: committed
  row.on_pass(0, 2, _ids(tokenizer, "zzzz"), flags, flags, active=False, done=True)  # others' pass: not again
  row.on_pass(1, 0, canvas, flags, flags, active=True, done=False)
  row.on_pass(1, 1, canvas, flags, flags, active=False, done=False)  # not its pass
  assert row.canvases == 1 and row.passes == 3
  row.on_pass(1, 2, canvas, flags, flags, active=True, done=False)  # the step cap: committed
  assert row.canvases == 2 and _streamed(events) == "abcdabcd"
  canvas_events = [e[1] for e in events if e[0] == "canvas"]
  assert [(c["canvas"], c["pass"], c["complete"]) for c in canvas_events] == [
      (0, 1, False), (0, 2, True), (1, 1, False), (1, 3, True)]
  assert canvas_events[0]["pieces"] == list("abcd") and canvas_events[0]["accepted"] == [True, False, False, False]


# ---------------------------------------------------------------------------------------- scheduler
def test_the_scheduler_batches_by_key_up_to_the_largest_size_and_answers_before_the_batch_ends():
  gate = threading.Event()
  engine = FakeEngine(gate)

  async def scenario():
    scheduler = Scheduler(engine, admission_window=0.05, max_queue=8, warm_up=0)
    await scheduler.start()
    loop = asyncio.get_running_loop()
    jobs = [Job(FakePrepared(key), loop) for key in "AAAAABBA"]
    for job in jobs:
      scheduler.submit(job)
    with pytest.raises(APIError) as full:
      scheduler.submit(Job(FakePrepared("A"), loop))
    assert full.value.status == 429 and full.value.code == "queue_full"
    first = await asyncio.wait_for(jobs[0].events.get(), 5)  # the batch is still held by the gate
    assert first[0] == "done" and len(engine.batches) == 1 and not jobs[1].events.qsize()
    scheduler.cancel(jobs[6])  # a queued job that is cancelled never runs
    gate.set()
    for job in jobs[1:6] + jobs[7:]:
      while (event := await asyncio.wait_for(job.events.get(), 5))[0] != "done":
        pass
    await scheduler.stop()

  asyncio.run(scenario())
  assert engine.batches == [["A"] * 4, ["A", "A"], ["B"]]  # job 6 (an "A") was cancelled while waiting


def test_shutdown_refuses_new_jobs_and_answers_the_waiting_ones_with_503():
  gate = threading.Event()

  async def scenario():
    scheduler = Scheduler(FakeEngine(gate), admission_window=0.0, warm_up=0)
    await scheduler.start()
    loop = asyncio.get_running_loop()
    running, waiting = Job(FakePrepared("A"), loop), Job(FakePrepared("B"), loop)
    scheduler.submit(running)
    await asyncio.wait_for(running.events.get(), 5)
    scheduler.submit(waiting)
    scheduler.begin_shutdown(0.1)
    with pytest.raises(APIError) as refused:
      scheduler.submit(Job(FakePrepared("C"), loop))
    kind, error = await asyncio.wait_for(waiting.events.get(), 5)
    gate.set()
    await scheduler.stop()
    return refused.value, kind, error

  refused, kind, error = asyncio.run(scenario())
  assert refused.status == 503 and kind == "error" and error.status == 503


# ---------------------------------------------------------------------------------------- app in process
@pytest.mark.timeout(180)  # without the deadline the requests would wait forever
def test_the_app_answers_timeouts_unknown_routes_and_methods_in_openai_shape():
  from starlette.testclient import TestClient  # pylint: disable=import-outside-toplevel
  from diffusiongemma import serving  # pylint: disable=import-outside-toplevel

  gate = threading.Event()
  slow = FakeEngine(gate)
  slow.run = lambda jobs, shape: (gate.wait(10), {"size": len(jobs)})[1]  # never answers before the gate
  app = serving.create_app(slow, admission_window=0.0, request_timeout=0.5, warm_up=0)
  with TestClient(app) as client:
    start = time.monotonic()
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                                                        "content": "x"}]})
    assert response.status_code == 504 and time.monotonic() - start < 5
    assert response.json()["error"]["code"] == "timeout"
    stream = client.post("/v1/completions", json={"model": MODEL, "prompt": "p", "stream": True})
    assert stream.status_code == 200
    assert stream.text.endswith('"code":"timeout"}}\n\ndata: [DONE]\n\n')
    gate.set()
    for method, path, status in (("get", "/nope", 404), ("get", "/v1/chat/completions", 405),
                                 ("get", "/v1/models/other", 404)):
      response = getattr(client, method)(path)
      assert response.status_code == status and set(response.json()["error"]) == {"message", "type", "param",
                                                                                  "code"}
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    slow.chat = False  # a model without a chat format: the page completes text instead
    assert client.get("/v1/models").json()["data"][0]["chat"] is False
    assert "canvas" in client.get("/").text and "drawCanvas" in client.get("/static/app.js").text

r"""Load-test an OpenAI-compatible server (ours: scripts/serve.py) from this machine, bounded in time.

  python scripts/load_test.py --url=http://127.0.0.1:8000 --requests=64 --concurrency=16 --time_limit=300 \
      [--baseline] [--max_tokens=N] [--endpoint=chat|completion] [--output=results/load.json]
  python scripts/load_test.py --mode=mixed --duration=120 --concurrency=16 --baseline \
      --output=results/load_mixed.json          # real traffic: see below

Sends chat (or completion) requests, at most `--concurrency` at a time, each with its own prompt and seed:
`--requests` of them, or as many as start within `--duration` seconds; it stops sending when
`--time_limit` seconds have passed (what is in flight then is cancelled and counted as not answered).

`--mode=mixed` draws each request from a seeded mix (`--seed`): a prompt of `--prompt_tokens` (5-1000)
words (about as many tokens), `max_tokens` in `--max_tokens_range` (8-512), `temperature` in
`--temperatures` (0.3-1.5), and every `--schema_every`-th (10th) request with a JSON schema (and the
range's largest `max_tokens`: its JSON needs the room).

With `--baseline`, the same requests first run one at a time (their own time limit; with `--duration`,
for `--baseline_duration` seconds) and the report adds the concurrent/sequential throughput ratio and the
slowest concurrent request against the slowest sequential one. Prints one JSON object (and writes it to
`--output`): requests answered, errors by kind, requests and completion tokens per second, latency p50 /
p90 / p99 / max in seconds and the slowest request's settings, the first answer's latency, the server's
batch-size histogram and how many of its batches compiled in the request path over the run, and whether
every request was answered exactly once (distinct response ids, one per request).
"""

import asyncio
import collections
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app
from absl import flags
import httpx
import numpy as np

_URL = flags.DEFINE_string("url", "http://127.0.0.1:8000", "The server's base URL.")
_MODEL = flags.DEFINE_string("model", None, "Model id (default: the server's first, from /v1/models).")
_MODE = flags.DEFINE_enum("mode", "simple", ["simple", "mixed"], "simple: short prompts, one max_tokens; mixed: "
                          "the real-traffic mix below.")
_REQUESTS = flags.DEFINE_integer("requests", 64, "How many requests to send (without --duration).")
_DURATION = flags.DEFINE_float("duration", None, "Send requests for this many seconds instead of --requests.")
_BASELINE_DURATION = flags.DEFINE_float("baseline_duration", 60.0, "With --duration: seconds of the sequential run.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 16, "How many requests in flight at once.")
_TIME_LIMIT = flags.DEFINE_float("time_limit", 300.0, "Seconds after which nothing more is sent.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "simple: max_tokens of each request (default: the server's).")
_ENDPOINT = flags.DEFINE_enum("endpoint", "chat", ["chat", "completion"], "Which endpoint to load.")
_BASELINE = flags.DEFINE_bool("baseline", False, "First run the same requests one at a time, for the ratio.")
_PROMPT_TOKENS = flags.DEFINE_list("prompt_tokens", ["5", "1000"], "mixed: prompt length range (words).")
_MAX_TOKENS_RANGE = flags.DEFINE_list("max_tokens_range", ["8", "512"], "mixed: max_tokens range.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0.3", "1.5"], "mixed: temperature range.")
_SCHEMA_EVERY = flags.DEFINE_integer("schema_every", 10, "mixed: every n-th request has a JSON schema (0: none).")
_SEED = flags.DEFINE_integer("seed", 0, "mixed: the mix's seed.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON report here.")

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be or has "
         "had not first one their its new after who they have but two been other time people years during "
         "more when city school only into world later united made used three most over state also such").split()
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


def _ranges() -> tuple:
  number = lambda values, kind: tuple(kind(v) for v in values)
  return (number(_PROMPT_TOKENS.value, int), number(_MAX_TOKENS_RANGE.value, int), number(_TEMPERATURES.value,
                                                                                           float))


def request_settings(i: int) -> dict:
  """Request i's settings: for the mixed mode drawn from the mix (the same i, the same request)."""
  if _MODE.value == "simple":
    return {"text": f"Say something about {i}.", "max_tokens": _MAX_TOKENS.value}
  (p_lo, p_hi), (m_lo, m_hi), (t_lo, t_hi) = _ranges()
  rng = np.random.default_rng([_SEED.value, i])
  words = rng.choice(WORDS, int(rng.integers(p_lo, p_hi + 1)))
  max_tokens, temperature = int(rng.integers(m_lo, m_hi + 1)), round(float(rng.uniform(t_lo, t_hi)), 3)
  schema = bool(_SCHEMA_EVERY.value) and i % _SCHEMA_EVERY.value == 0
  return {"text": " ".join(words), "max_tokens": m_hi if schema else max_tokens, "temperature": temperature,
          "schema": schema}


def _body(i: int, model: str, endpoint: str) -> dict:
  settings = request_settings(i)
  body = {"model": model, "seed": i}
  text = settings["text"]
  body.update({"messages": [{"role": "user", "content": text}]} if endpoint == "chat" else {"prompt": text})
  if settings.get("max_tokens"):
    body["max_tokens"] = settings["max_tokens"]
  if "temperature" in settings:
    body["temperature"] = settings["temperature"]
  if settings.get("schema"):
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}
  return body


def _quantiles(values) -> dict:
  values = np.asarray(values) if len(values) else np.zeros(1)
  return {q: round(float(np.percentile(values, p)), 4) for q, p in (("p50", 50), ("p90", 90), ("p99", 99))} | {
      "max": round(float(values.max()), 4)}


async def _run(client: httpx.AsyncClient, model: str, n: int | None, concurrency: int, time_limit: float,
               duration: float | None) -> dict:
  """Sends requests 0, 1, ..., `concurrency` at a time: n of them, or those that start within `duration`
  seconds, all within `time_limit` seconds; the run's statistics."""
  path = "/v1/chat/completions" if _ENDPOINT.value == "chat" else "/v1/completions"
  answers: dict[int, list] = collections.defaultdict(list)  # request -> response ids (exactly one expected)
  latencies, errors, tokens, prompts, invalid_json = {}, collections.Counter(), 0, [], 0
  first_answer, sent_count = None, 0
  numbers = itertools.count()
  start = time.perf_counter()

  async def worker():
    nonlocal tokens, first_answer, invalid_json, sent_count
    while True:
      i = next(numbers)
      elapsed = time.perf_counter() - start
      if (n is not None and i >= n) or (duration is not None and elapsed > duration) or elapsed > time_limit:
        if n is not None and i < n:
          errors["not_sent_time_limit"] += 1
          continue
        return
      body = _body(i, model, _ENDPOINT.value)
      sent_count += 1
      sent = time.perf_counter()
      try:
        response = await client.post(path, json=body)
      except httpx.HTTPError as e:
        errors[type(e).__name__] += 1
        continue
      if response.status_code != 200:
        errors[f"http_{response.status_code}"] += 1
        continue
      data = response.json()
      latencies[i] = time.perf_counter() - sent
      first_answer = latencies[i] if first_answer is None else first_answer
      answers[i].append(data["id"])
      tokens += data["usage"]["completion_tokens"]
      prompts.append(data["usage"]["prompt_tokens"])
      if "response_format" in body:
        choice = data["choices"][0]
        try:
          json.loads(choice["message"]["content"] if "message" in choice else choice["text"])
        except ValueError:
          invalid_json += 1

  tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
  remaining = time_limit - (time.perf_counter() - start)
  _, pending = await asyncio.wait(tasks, timeout=max(remaining, 0) + 60)
  for task in pending:
    task.cancel()
  errors["cancelled_at_time_limit"] += len(pending)
  seconds = time.perf_counter() - start
  sent = sent_count if n is None else n
  ids = [x for v in answers.values() for x in v]
  slowest = max(latencies, key=latencies.get, default=None)
  report = {
      "requests": sent, "concurrency": concurrency, "answered": len(latencies), "seconds": round(seconds, 3),
      "errors": sum(errors.values()), "error_kinds": {k: v for k, v in errors.items() if v},
      "requests_per_second": round(len(latencies) / seconds, 3),
      "completion_tokens_per_second": round(tokens / seconds, 2), "completion_tokens": tokens,
      "latency_seconds": _quantiles(list(latencies.values())),
      "first_answer_seconds": None if first_answer is None else round(first_answer, 4),
      "prompt_tokens": _quantiles(prompts),
      "answered_exactly_once": len(latencies) == sent and all(len(v) == 1 for v in answers.values())
                               and len(set(ids)) == len(ids)}
  if slowest is not None:
    settings = {k: v for k, v in request_settings(slowest).items() if k != "text"}
    report["slowest_request"] = {"request": slowest, "seconds": round(latencies[slowest], 4), **settings}
  if _MODE.value == "mixed":
    report["invalid_json_replies"] = invalid_json
  return report


async def _health(client) -> dict:
  return (await client.get("/health")).json()


def _server_delta(before: dict, after: dict) -> dict:
  """The server's batches over a run: sizes, and how many compiled in the request path."""
  sizes = (collections.Counter({int(k): v for k, v in after.get("batch_sizes", {}).items()})
           - collections.Counter({int(k): v for k, v in before.get("batch_sizes", {}).items()}))
  compiled = lambda h: h.get("programs", {}).get("compiled_in_request_path", 0)
  return {"batch_sizes": {str(k): v for k, v in sorted(sizes.items())},
          "batches_compiled_in_request_path": compiled(after) - compiled(before)}


async def _main() -> dict:
  async with httpx.AsyncClient(base_url=_URL.value, timeout=httpx.Timeout(_TIME_LIMIT.value + 60)) as client:
    model = _MODEL.value or (await client.get("/v1/models")).json()["data"][0]["id"]
    report = {"url": _URL.value, "model": model, "endpoint": _ENDPOINT.value, "mode": _MODE.value,
              "max_tokens": _MAX_TOKENS.value}
    if _MODE.value == "mixed":
      (p, m, t) = _ranges()
      report["mix"] = {"prompt_words": p, "max_tokens": m, "temperatures": t, "schema_every": _SCHEMA_EVERY.value,
                       "seed": _SEED.value}
    if _BASELINE.value:
      before = await _health(client)
      duration = _BASELINE_DURATION.value if _DURATION.value else None
      report["one_at_a_time"] = await _run(client, model, None if duration else _REQUESTS.value, 1,
                                           _TIME_LIMIT.value, duration)
      report["one_at_a_time"]["server"] = _server_delta(before, await _health(client))
    before = await _health(client)
    report["concurrent"] = await _run(client, model, None if _DURATION.value else _REQUESTS.value,
                                      _CONCURRENCY.value, _TIME_LIMIT.value, _DURATION.value)
    after = await _health(client)
    report["concurrent"]["server"] = _server_delta(before, after)
    if _BASELINE.value:
      serial, together = report["one_at_a_time"], report["concurrent"]
      ratio = lambda a, b: round(a / b, 2) if b else None
      report["throughput_ratio"] = ratio(together["requests_per_second"], serial["requests_per_second"])
      report["token_throughput_ratio"] = ratio(together["completion_tokens_per_second"],
                                               serial["completion_tokens_per_second"])
      report["slowest_vs_sequential_slowest"] = ratio(together["latency_seconds"]["max"],
                                                      serial["latency_seconds"]["max"])
    report["server_batch_sizes"] = report["concurrent"]["server"]["batch_sizes"]
    report["server_status"] = after.get("status")
    return report


def _git_commit() -> str | None:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=pathlib.Path(__file__).resolve().parent,
                          capture_output=True, text=True, timeout=30, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  load_before = list(os.getloadavg())
  report = asyncio.run(_main())
  report["provenance"] = {"command": " ".join(sys.argv), "load_average_before": load_before,
                          "load_average_after": list(os.getloadavg()), "cpu_count": os.cpu_count(),
                          "git_commit": _git_commit()}
  text = json.dumps(report, indent=2)
  print(text)
  if _OUTPUT.value:
    path = pathlib.Path(_OUTPUT.value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


if __name__ == "__main__":
  app.run(main)

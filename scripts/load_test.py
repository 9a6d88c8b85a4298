r"""Load-test an OpenAI-compatible server (ours: scripts/serve.py) from this machine, bounded in time.

  python scripts/load_test.py --url=http://127.0.0.1:8000 --requests=64 --concurrency=16 --time_limit=300 \
      [--baseline] [--max_tokens=N] [--endpoint=chat|completion] [--output=results/load.json]

Sends `--requests` chat (or completion) requests, at most `--concurrency` at a time, each with its own
prompt and seed, and stops sending when `--time_limit` seconds have passed (what is in flight then is
cancelled and counted as not sent). With `--baseline`, the same requests first run one at a time (their
own time limit) and the report adds the concurrent/serial throughput ratio. Prints one JSON object (and
writes it to `--output`): requests answered, errors by kind, requests and completion tokens per second,
latency p50 / p90 / p99 in seconds, the server's batch-size histogram, and whether every request was
answered exactly once (distinct response ids, one per request).
"""

import asyncio
import collections
import json
import pathlib
import time

from absl import app
from absl import flags
import httpx
import numpy as np

_URL = flags.DEFINE_string("url", "http://127.0.0.1:8000", "The server's base URL.")
_MODEL = flags.DEFINE_string("model", None, "Model id (default: the server's first, from /v1/models).")
_REQUESTS = flags.DEFINE_integer("requests", 64, "How many requests to send.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 16, "How many requests in flight at once.")
_TIME_LIMIT = flags.DEFINE_float("time_limit", 300.0, "Seconds after which nothing more is sent.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "max_tokens of each request (default: the server's).")
_ENDPOINT = flags.DEFINE_enum("endpoint", "chat", ["chat", "completion"], "Which endpoint to load.")
_BASELINE = flags.DEFINE_bool("baseline", False, "First run the same requests one at a time, for the ratio.")
_OUTPUT = flags.DEFINE_string("output", None, "Also write the JSON report here.")


def _body(i: int, model: str, endpoint: str, max_tokens: int | None) -> dict:
  text = f"Say something about {i}."
  body = {"model": model, "seed": i}
  body.update({"messages": [{"role": "user", "content": text}]} if endpoint == "chat" else {"prompt": text})
  if max_tokens:
    body["max_tokens"] = max_tokens
  return body


async def _run(client: httpx.AsyncClient, model: str, n: int, concurrency: int, time_limit: float) -> dict:
  """Sends n requests, `concurrency` at a time, within `time_limit` seconds; the run's statistics."""
  path = "/v1/chat/completions" if _ENDPOINT.value == "chat" else "/v1/completions"
  semaphore = asyncio.Semaphore(concurrency)
  answers: dict[int, list] = collections.defaultdict(list)  # request -> response ids (exactly one expected)
  latencies, errors, tokens = [], collections.Counter(), 0
  start = time.perf_counter()

  async def one(i: int):
    nonlocal tokens
    async with semaphore:
      if time.perf_counter() - start > time_limit:
        errors["not_sent_time_limit"] += 1
        return
      sent = time.perf_counter()
      try:
        response = await client.post(path, json=_body(i, model, _ENDPOINT.value, _MAX_TOKENS.value))
      except httpx.HTTPError as e:
        errors[type(e).__name__] += 1
        return
      if response.status_code != 200:
        errors[f"http_{response.status_code}"] += 1
        return
      data = response.json()
      latencies.append(time.perf_counter() - sent)
      answers[i].append(data["id"])
      tokens += data["usage"]["completion_tokens"]

  tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
  remaining = time_limit - (time.perf_counter() - start)
  _, pending = await asyncio.wait(tasks, timeout=max(remaining, 0) + 60)
  for task in pending:
    task.cancel()
  errors["cancelled_at_time_limit"] += len(pending)
  seconds = time.perf_counter() - start
  ids = [x for v in answers.values() for x in v]
  lat = np.asarray(latencies) if latencies else np.zeros(1)
  return {
      "requests": n, "concurrency": concurrency, "answered": len(latencies), "seconds": round(seconds, 3),
      "errors": sum(errors.values()), "error_kinds": {k: v for k, v in errors.items() if v},
      "requests_per_second": round(len(latencies) / seconds, 3),
      "completion_tokens_per_second": round(tokens / seconds, 2), "completion_tokens": tokens,
      "latency_seconds": {"p50": round(float(np.percentile(lat, 50)), 4),
                          "p90": round(float(np.percentile(lat, 90)), 4),
                          "p99": round(float(np.percentile(lat, 99)), 4)},
      "answered_exactly_once": len(latencies) == n and all(len(v) == 1 for v in answers.values())
                               and len(set(ids)) == len(ids)}


async def _main() -> dict:
  async with httpx.AsyncClient(base_url=_URL.value, timeout=httpx.Timeout(_TIME_LIMIT.value + 60)) as client:
    model = _MODEL.value or (await client.get("/v1/models")).json()["data"][0]["id"]
    health = (await client.get("/health")).json()
    report = {"url": _URL.value, "model": model, "endpoint": _ENDPOINT.value, "max_tokens": _MAX_TOKENS.value}
    if _BASELINE.value:
      report["one_at_a_time"] = await _run(client, model, _REQUESTS.value, 1, _TIME_LIMIT.value)
    report["concurrent"] = await _run(client, model, _REQUESTS.value, _CONCURRENCY.value, _TIME_LIMIT.value)
    if _BASELINE.value:
      serial = report["one_at_a_time"]["requests_per_second"]
      report["throughput_ratio"] = round(report["concurrent"]["requests_per_second"] / serial, 2) if serial else None
    after = (await client.get("/health")).json()
    before_sizes = collections.Counter({int(k): v for k, v in health.get("batch_sizes", {}).items()})
    sizes = collections.Counter({int(k): v for k, v in after.get("batch_sizes", {}).items()}) - before_sizes
    report["server_batch_sizes"] = {str(k): v for k, v in sorted(sizes.items())}
    report["server_status"] = after.get("status")
    return report


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  report = asyncio.run(_main())
  text = json.dumps(report, indent=2)
  print(text)
  if _OUTPUT.value:
    path = pathlib.Path(_OUTPUT.value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


if __name__ == "__main__":
  app.run(main)

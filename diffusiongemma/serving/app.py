"""The ASGI app (Starlette): the OpenAI routes, the web page, health, errors and per-request logs.

Routes: `GET /` (the page, static HTML and JS, no build step), `GET /static/<file>`, `GET /health`,
`GET /v1/models`, `GET /v1/models/<id>`, `POST /v1/chat/completions`, `POST /v1/completions`.

Every error is OpenAI-shaped (`errors.APIError`): Starlette's HTTP errors (404, 405) and unexpected
exceptions (500) included. Streams are SSE (`text/event-stream`): OpenAI chunks as canvases complete, the
opt-in `event: canvas` events after each pass, and `data: [DONE]` at the end, also after an error (sent as
`data: {"error": ...}`).

Nothing a client sends can hold the event loop or the other clients: the body is read with its size
capped as it arrives (`MAX_BODY_BYTES`, chunked uploads too); parsing, checking and tokenizing run off the
event loop, in that order, the cheap checks (fields, counts, prompt bytes) before tokenizing and decoding;
a constraint is built after them, in its own bounded process (`constraints.Builds`). The deadline,
`request_timeout` seconds, counts from the request's arrival and covers its constraint build, its wait,
its run and its stream: past it the request gets a 504 (or an error event), and a stream whose client has
stopped reading is closed. A client that goes away is cancelled, its constraint build too when nobody else
waits for it.

Each request ends with one structured log record (`event="request"`: id, endpoint, status, stream,
prompt and completion tokens, denoiser passes, finish reason, batch size, queue and total milliseconds),
errors included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pathlib
import time

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, StreamingResponse
from starlette.routing import Route

from diffusiongemma.diffusion import constraints as cons
from diffusiongemma.serving import constraints as constraints_lib
from diffusiongemma.serving import requests as requests_lib
from diffusiongemma.serving import responses
from diffusiongemma.serving.errors import APIError
from diffusiongemma.serving.scheduler import Job, Scheduler

STATIC = pathlib.Path(__file__).parent / "static"
MAX_BODY_BYTES = 32 * 2**20
DEFAULT_CONSTRAINT_BUDGET = cons.Budget(max_schema_nodes=2000, max_regex_chars=200_000, max_dfa_states=10_000,
                                        max_states=10_000, seconds=10.0)
POLL_SECONDS = 0.25  # how often a waiting request checks its client and its deadline
STUCK_SECONDS = 2.0  # past its deadline, a stream still blocked on a client that does not read is closed
KEEPALIVE_SECONDS = 10.0
LOGGER = logging.getLogger("diffusiongemma.serving")


def log_event(**fields) -> None:
  LOGGER.info(json.dumps(fields, default=str))


_Gone = constraints_lib.Gone  # the client disconnected


class _DeadlineStream(StreamingResponse):
  """A stream that ends at `deadline` (monotonic seconds) even while a send waits for a client that has
  stopped reading (its generator answers the request's own deadline, a little earlier, with an error event
  when it can still send); `on_expired()` is called then, before the body's generator is closed."""

  def __init__(self, content, deadline: float, on_expired, **kwargs):
    super().__init__(content, **kwargs)
    self.deadline, self.on_expired = deadline, on_expired

  async def __call__(self, scope, receive, send) -> None:
    with anyio.move_on_after(max(self.deadline - time.monotonic(), 0)) as scope_:
      await super().__call__(scope, receive, send)
    if scope_.cancelled_caught:
      self.on_expired()
      await self.body_iterator.aclose()


def _error(e: APIError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
  del request
  messages = {404: "Not found.", 405: "Method not allowed."}
  return _error(APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail)), code=None))


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
  del request
  return _error(exc)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
  log_event(event="internal_error", path=request.url.path, error=repr(exc))
  return _error(APIError(500, "Internal server error.", code="internal_error"))


class Server:
  """The routes over one `Engine` and its `Scheduler`."""

  def __init__(self, engine, scheduler: Scheduler, builds: constraints_lib.Builds, *, request_timeout: float):
    self.engine, self.scheduler, self.builds, self.timeout = engine, scheduler, builds, request_timeout
    self.created = int(time.time())
    self.completed = 0

  # ---------------------------------------------------------------------------------------- small routes
  async def index(self, request: Request):
    del request
    return FileResponse(STATIC / "index.html")

  async def static(self, request: Request):
    name = request.path_params["name"]
    path = STATIC / name
    if "/" in name or name.startswith(".") or not path.is_file():
      raise HTTPException(404)
    return FileResponse(path)

  async def health(self, request: Request):
    del request
    status = {**self.scheduler.status(), **self.builds.status(), "model": self.engine.model_name,
              "completed": self.completed}
    return JSONResponse(status, status_code=200 if status["status"] == "ok" else 503)

  def _model(self) -> dict:
    return {"id": self.engine.model_name, "object": "model", "created": self.created, "owned_by": "diffusiongemma",
            "max_model_len": self.engine.config.max_positions, "chat": getattr(self.engine, "chat", True)}

  async def models(self, request: Request):
    del request
    return JSONResponse({"object": "list", "data": [self._model()]})

  async def model(self, request: Request):
    if request.path_params["model"] != self.engine.model_name:
      raise APIError(404, f"The model {request.path_params['model']!r} does not exist.", "model", "model_not_found")
    return JSONResponse(self._model())

  # ---------------------------------------------------------------------------------------- generation
  async def chat(self, request: Request):
    return await self._generate(request, "chat")

  async def completions(self, request: Request):
    return await self._generate(request, "completion")

  async def _body(self, request: Request, deadline: float) -> bytes:
    """The body, read with its size capped as it arrives (a chunked upload has no length to check first),
    by the request's deadline."""
    too_large = APIError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.", code="body_too_large")
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
      raise too_large
    chunks, total = [], 0
    with anyio.move_on_after(max(deadline - time.monotonic(), 0)) as scope:
      async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY_BYTES:
          raise too_large
        chunks.append(chunk)
    if scope.cancelled_caught:
      raise APIError(408, f"The request body did not arrive within {self.timeout:g} seconds.", code="timeout")
    return b"".join(chunks)

  def _parse(self, raw: bytes, kind: str) -> requests_lib.Request:
    """The checked request (blocking: JSON, field checks, limits; run off the event loop)."""
    return requests_lib.parse(requests_lib.parse_json(raw), kind, (self.engine.model_name,),
                              self.engine.max_tokens_limit, self.engine.limits())

  async def _prepare(self, request: Request, kind: str, deadline: float, record: dict):
    """The request's `Prepared` job, built in order of cost: body, checks, tokens and images, constraint."""
    parsed = await run_in_threadpool(self._parse, await self._body(request, deadline), kind)
    record["stream"] = parsed.stream
    prepared = await run_in_threadpool(self.engine.prepare, parsed)
    if parsed.response_format.kind != "text":
      constraint = await self.builds.get(parsed.response_format, deadline=deadline, gone=request.is_disconnected)
      prepared = self.engine.with_constraint(prepared, constraint)
    return parsed, prepared

  async def _generate(self, request: Request, kind: str):
    start = time.monotonic()
    record = {"event": "request", "endpoint": request.url.path, "status": 200}
    try:
      parsed, prepared = await self._prepare(request, kind, start + self.timeout, record)
      job = Job(prepared, asyncio.get_running_loop(), "chatcmpl" if kind == "chat" else "cmpl", created=start)
      record.update(id=job.id, prompt_tokens=len(prepared.ids), seed=prepared.seed)
      self.scheduler.submit(job)
    except APIError as e:
      record.update(status=e.status, error=e.message, param=e.param)
      log_event(**record, latency_ms=_ms(start))
      raise
    except _Gone:
      record.update(status=499, error="client disconnected")
      log_event(**record, latency_ms=_ms(start))
      return JSONResponse({}, status_code=499)
    except Exception as e:  # pylint: disable=broad-except  (an unexpected failure still gets its request record)
      record.update(status=500, error=repr(e))
      log_event(**record, latency_ms=_ms(start))
      raise APIError(500, "Internal server error.", code="internal_error") from e
    writer = responses.Writer(job, self.engine.model_name)
    if parsed.stream:

      def expired():
        record.update(status=504, error="deadline passed while the client was not reading the stream")

      return _DeadlineStream(self._stream(job, writer, request, record), job.created + self.timeout + STUCK_SECONDS,
                             expired, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
      async for kind_, payload in self._events(job, request):
        if kind_ == "done":
          self._finished(record, job, payload)
          return JSONResponse(writer.body(payload))
    except APIError as e:
      record.update(status=e.status, error=e.message)
      raise
    except _Gone:
      record.update(status=499, error="client disconnected")
      return JSONResponse({}, status_code=499)
    finally:
      self.scheduler.cancel(job)
      log_event(**record, queue_ms=_ms(job.created, job.started), latency_ms=_ms(job.created))
    raise APIError(500, "The request ended without a result.")

  def _finished(self, record: dict, job: Job, result) -> None:
    self.completed += 1
    record.update(completion_tokens=result.completion_tokens, passes=result.passes, canvases=result.canvases,
                  finish_reason=result.finish_reason, batch_size=job.batch_size)

  async def _events(self, job: Job, request: Request):
    """The job's events until it is done; a 504 at its deadline; `_Gone` when the client leaves.
    Yields ("keepalive", None) after `KEEPALIVE_SECONDS` of silence."""
    deadline = job.created + self.timeout
    quiet_since = time.monotonic()
    while True:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        raise APIError(504, f"The request did not finish within {self.timeout:g} seconds.", code="timeout")
      try:
        kind, payload = await asyncio.wait_for(job.events.get(), min(POLL_SECONDS, remaining))
      except asyncio.TimeoutError:
        if await request.is_disconnected():
          raise _Gone() from None
        if time.monotonic() - quiet_since > KEEPALIVE_SECONDS:
          quiet_since = time.monotonic()
          yield "keepalive", None
        continue
      quiet_since = time.monotonic()
      if kind == "error":
        raise payload
      yield kind, payload
      if kind == "done":
        return

  async def _stream(self, job: Job, writer: responses.Writer, request: Request, record: dict):
    request_ = job.prepared.request
    try:
      if writer.chat:
        yield writer.chunk({"role": "assistant", "content": ""})
      async for kind, payload in self._events(job, request):
        if kind == "keepalive":
          yield ": keep-alive\n\n"
        elif kind == "delta":
          yield writer.chunk(payload)
        elif kind == "canvas":
          yield writer.canvas(payload)
        elif kind == "done":
          self._finished(record, job, payload)
          yield writer.final(payload, request_.include_usage)
      yield responses.DONE
    except APIError as e:
      record.update(status=e.status, error=e.message)
      yield responses.sse(e.body()) + responses.DONE
    except (_Gone, asyncio.CancelledError, GeneratorExit):
      if record["status"] == 200:
        record.update(status=499, error="client disconnected")
      raise
    finally:
      self.scheduler.cancel(job)
      if job.dropped:
        record["canvas_events_dropped"] = job.dropped
      log_event(**record, queue_ms=_ms(job.created, job.started), latency_ms=_ms(job.created))


def _ms(start: float | None, end: float | None = None) -> float | None:
  if start is None:
    return None
  return round(1000 * ((end if end is not None else time.monotonic()) - start), 1)


def create_app(engine, *, admission_window: float = 0.01, max_queue: int = 256, request_timeout: float = 600.0,
               warm_up: int = 1, max_padding: float = 4.0, seeded_alone: bool = False,
               constraint_budget: cons.Budget | None = None, constraint_memory_mib: float = 1024) -> Starlette:
  """The app serving `engine`; `app.state.begin_shutdown(grace)` (on its event loop: `app.state.scheduler.loop`)
  starts a graceful shutdown. `warm_up`:
  compile the engine's declared grid at start-up (0: on demand); `max_padding`: see `programs`; `seeded_alone`:
  see `scheduler`;
  `constraint_budget`, `constraint_memory_mib`: the limits of one constraint build (`constraints.Builds`)."""
  scheduler = Scheduler(engine, admission_window=admission_window, max_queue=max_queue, warm_up=warm_up,
                        max_padding=max_padding, seeded_alone=seeded_alone, log=log_event)
  builds = constraints_lib.Builds(engine, constraint_budget or DEFAULT_CONSTRAINT_BUDGET,
                                  memory_mib=constraint_memory_mib)
  server = Server(engine, scheduler, builds, request_timeout=request_timeout)

  def begin_shutdown(grace: float) -> None:
    """On the event loop: constraint builds stop at once, requests get `grace` seconds."""
    builds.close()
    scheduler.begin_shutdown(grace)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    del app
    await scheduler.start()
    log_event(event="started", model=engine.model_name, batch_sizes=list(engine.batch_sizes),
              max_prompt_tokens=engine.max_prompt_tokens, programs_declared=scheduler.status()["programs"]["declared"])
    yield
    builds.close()
    await scheduler.stop()
    log_event(event="stopped", completed=server.completed)

  routes = [
      Route("/", server.index), Route("/static/{name}", server.static), Route("/health", server.health),
      Route("/v1/models", server.models), Route("/v1/models/{model:path}", server.model),
      Route("/v1/chat/completions", server.chat, methods=["POST"]),
      Route("/v1/completions", server.completions, methods=["POST"]),
  ]
  app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
      HTTPException: _http_error, APIError: _api_error, Exception: _server_error})
  app.state.scheduler, app.state.server, app.state.builds = scheduler, server, builds
  app.state.begin_shutdown = begin_shutdown
  return app

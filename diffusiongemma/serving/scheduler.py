"""`Scheduler`: requests that arrive together run as one batch, one batch at a time, on one worker thread,
each on a compiled program (`programs`), while a second thread compiles programs in the background.

- `submit` queues a `Job` (429 when `max_queue` jobs wait, 503 once shutting down).
- When the device is free and a job waits, the scheduler waits `admission_window` seconds for others to
  arrive, then plans a batch: the oldest job, the jobs of its group that fit it (`programs.select`), and
  the cheapest compiled program that covers them (`Compiler.best`). When none does, that batch waits for
  its program (compiled first, before the start-up grid) and the next group's oldest job is tried, so
  jobs whose programs are ready keep running. A program more than `max_padding` times the batch's own
  is used, and the batch's own is compiled for next time.
- The batch runs on the worker thread (`engine.run`, a blocking compiled call); each job's events reach
  its asyncio queue as they happen, so a job that finishes leaves (its client is answered) while the rest
  of its batch runs on. Canvas events are dropped (counted) when `MAX_CANVAS_EVENTS` wait unread, so a
  client that stops reading holds a bounded queue.
- `cancel` (a client gone, a timeout) removes a waiting job, or silences a running one (its row runs to
  the end of the compiled call, which cannot be cut short, and is discarded).
- `begin_shutdown(grace)`: no new jobs; what is queued or running may finish for `grace` seconds, then
  gets a clean 503 error.
- `seeded_alone`: a request with a `seed` runs alone on its own program (batch 1, its prompt bucket and
  canvases, waiting for that program if it is not compiled), so that its answer is the same under any load
  (batch invariance does not hold bitwise: docs/serving.md); requests without one batch as above.
Start-up (`warm_up`): the compiler compiles `engine.grid()`; the status is "warming" until its
`covering()` programs are ready (every request of the grid can then be served) and "ok" after; the
rest of the grid goes on compiling in the background, smallest first. warm_up=0 compiles on demand.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
import uuid

from diffusiongemma.serving import programs
from diffusiongemma.serving.errors import APIError

MAX_CANVAS_EVENTS = 64  # unread canvas events one job may hold; later ones are dropped until it reads


class Job:
  """One request in the scheduler: its `prepared` input, its event queue, its timings and batch size.
  `created`: when the request arrived (its deadline counts from there)."""

  def __init__(self, prepared, loop: asyncio.AbstractEventLoop, prefix: str = "chatcmpl",
               created: float | None = None):
    self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
    self.prepared, self.loop = prepared, loop
    self.events: asyncio.Queue = asyncio.Queue()
    self.cancelled = False
    self.created = time.monotonic() if created is None else created
    self.started: float | None = None
    self.batch_size = 0
    self.dropped = 0  # canvas events dropped because the client did not read them

  def send(self, event: tuple) -> None:
    """Delivers an event from any thread."""
    if self.cancelled:
      return
    try:
      self.loop.call_soon_threadsafe(self._put, event)
    except RuntimeError:  # the loop has closed: nobody is listening
      pass

  def _put(self, event: tuple) -> None:
    if event[0] == "canvas" and self.events.qsize() >= MAX_CANVAS_EVENTS:
      self.dropped += 1
      return
    self.events.put_nowait(event)  # the others are few: a delta per canvas, one end


class Scheduler:
  """See the module docstring. `log(**fields)` receives structured records."""

  def __init__(self, engine, *, admission_window: float = 0.01, max_queue: int = 256, warm_up: int = 1,
               max_padding: float = 4.0, seeded_alone: bool = False, log=None):
    self.engine, self.window, self.max_queue, self.warm = engine, admission_window, max_queue, warm_up
    self.max_padding, self.seeded_alone = max_padding, seeded_alone
    self.log = log or (lambda **_: None)
    self.queue: list[Job] = []
    self.running: list[Job] = []
    self.draining = False
    self.batches = 0
    self.batch_sizes: collections.Counter = collections.Counter()
    self.compiled_in_request_path = 0
    self._inbox: queue.Queue = queue.Queue()
    self._started = False
    self._declared = list(engine.grid()) if warm_up else []
    self._covering = set(engine.covering()) if warm_up else set()
    self._warm_start = time.perf_counter()

  async def start(self) -> None:
    self.loop = asyncio.get_running_loop()
    self.ready, self._wake = asyncio.Event(), asyncio.Event()
    self.compiler = programs.Compiler(self.engine.compile, self._compiled)
    for shape in self._declared:
      self.compiler.request(shape, priority=1 if shape in self._covering else 2)
    if not self._covering:
      self.ready.set()
    threading.Thread(target=self._work, name="engine-worker", daemon=True).start()
    self._task = asyncio.create_task(self._schedule())
    self._started = True

  def _compiled(self, shape: programs.Shape, seconds: float, error: str | None) -> None:
    """On the compiler thread, after each program."""
    self.log(event="compiled", **shape.describe(), seconds=seconds, declared=shape in self._declared,
             **({"error": error} if error else {}))
    covering_done = self._covering and all(s in self.compiler.ready or s in self.compiler.failed
                                           for s in self._covering)
    try:
      if covering_done and not self.ready.is_set():
        self.loop.call_soon_threadsafe(self._warmed)
      self.loop.call_soon_threadsafe(self._wake.set)
    except RuntimeError:  # the loop has closed
      pass

  def _warmed(self) -> None:
    if not self.ready.is_set():
      self.ready.set()
      self.log(event="warm_up", programs=len(self._covering), declared=len(self._declared),
               seconds=round(time.perf_counter() - self._warm_start, 3))

  def _work(self) -> None:
    """The worker thread: one batch at a time."""
    while (item := self._inbox.get()) is not None:
      batch, shape, done = item
      try:
        report = self.engine.run(batch, shape)
      except APIError as e:
        report = {"error": e.message}
        for job in batch:
          job.send(("error", e))
      except Exception as e:  # pylint: disable=broad-except  (the batch fails, the server stays up)
        report = {"error": repr(e)}
        for job in batch:
          job.send(("error", APIError(500, f"Generation failed: {e!r}")))
      try:
        self.loop.call_soon_threadsafe(done.set_result, report)
      except RuntimeError:
        return

  def submit(self, job: Job) -> None:
    if self.draining:
      raise APIError(503, "The server is shutting down.", code="shutting_down")
    if len(self.queue) >= self.max_queue:
      raise APIError(429, f"The queue is full ({self.max_queue} requests waiting); retry later.",
                     code="queue_full")
    self.queue.append(job)
    self._wake.set()

  def cancel(self, job: Job) -> None:
    job.cancelled = True
    if job in self.queue:
      self.queue.remove(job)

  def _alone(self, job: Job) -> bool:
    """With `seeded_alone`, a request with a seed runs alone on its own program (see docs/serving.md)."""
    return self.seeded_alone and job.prepared.request.seed is not None

  def _plan(self) -> tuple[list[Job], programs.Shape] | None:
    """The next batch and its program, or None while every waiting group waits for its program."""
    canvas, seen = self.engine.canvas, set()
    for head in list(self.queue):
      group = ("alone", head.id) if self._alone(head) else programs.group_key(head.prepared)
      if group in seen or head not in self.queue:
        continue
      seen.add(group)
      if self._alone(head):
        jobs = [head]
      else:
        jobs = programs.select([j for j in self.queue if programs.group_key(j.prepared) == group
                                and not self._alone(j)], self.engine.max_batch, canvas, self.max_padding)
      need = programs.exact([j.prepared for j in jobs], self.engine.batch_bucket)
      if need.images:  # programs with images are compiled by the call that needs them
        return jobs, need
      constraint = jobs[0].prepared.constraint
      shape = self.compiler.best(need, canvas)
      if self._alone(head) and shape != need:  # only its own program gives its answer
        shape = None
      if shape is None:
        if need in self.compiler.failed:
          for job in jobs:
            job.send(("error", APIError(500, f"Compiling its program failed: {self.compiler.failed[need]}")))
            self.cancel(job)
          continue
        self.compiler.request(need, constraint, priority=0)
        continue
      if shape.positions(canvas) > self.max_padding * need.positions(canvas):
        self.compiler.request(need, constraint, priority=0)
      return jobs, shape
    return None

  async def _schedule(self) -> None:
    while True:
      if not self.queue:
        self._wake.clear()
        await self._wake.wait()
        continue
      await asyncio.sleep(self.window)  # the admission window: let requests that arrive together batch
      self._wake.clear()
      plan = self._plan() if self.queue else None
      if plan is None:
        await self._wake.wait()  # a new job, or a program ready
        continue
      batch, shape = plan
      now = time.monotonic()
      for job in batch:
        self.queue.remove(job)
        job.started, job.batch_size = now, len(batch)
      self.running = batch
      done = self.loop.create_future()
      self._inbox.put((batch, shape, done))
      report = await done
      self.running = []
      self.batches += 1
      self.batch_sizes[len(batch)] += 1
      self.compiled_in_request_path += bool(report.get("compiled"))
      self.log(event="batch", **report)

  # ------------------------------------------------------------------------------------------ shutdown
  def begin_shutdown(self, grace: float) -> None:
    """Refuses new jobs; after `grace` seconds, whatever is left gets a clean 503."""
    self.draining = True
    self.log(event="shutdown", queued=len(self.queue), running=len(self.running), grace_seconds=grace)
    self.loop.call_later(grace, self._expire)

  def _expire(self) -> None:
    for job in self.queue + self.running:
      job.send(("error", APIError(503, "The server shut down before this request finished.",
                                  code="shutting_down")))
      self.cancel(job)

  async def stop(self) -> None:
    if not self._started:
      return
    self.draining = True
    self._expire()
    self.compiler.stop()
    self._inbox.put(None)
    self._task.cancel()

  def status(self) -> dict:
    state = "shutting_down" if self.draining else "ok" if self.ready.is_set() else "warming"
    ready = len(self.compiler.ready) if self._started else 0
    return {"status": state, "queued": len(self.queue), "running": len(self.running), "batches": self.batches,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "programs": {"ready": ready, "declared": len(self._declared),
                         "compiling": self.compiler.pending() if self._started else 0,
                         "compiled_in_request_path": self.compiled_in_request_path},
            "stream_mismatches": self.engine.mismatches}

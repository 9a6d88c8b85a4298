"""`Scheduler`: requests that arrive together run as one batch, one batch at a time, on one worker thread.

- `submit` queues a `Job` (429 when `max_queue` jobs wait, 503 once shutting down).
- When the device is free and a job waits, the scheduler waits `admission_window` seconds for others to
  arrive, then takes the oldest job's batch key (`engine.Prepared.key`) and every waiting job with the same
  key, up to the largest batch size, in arrival order; other keys wait for the next batch.
- The batch runs on the worker thread (`engine.run`, a blocking compiled call); each job's events reach
  its asyncio queue as they happen, so a job that finishes leaves (its client is answered) while the rest
  of its batch runs on.
- `cancel` (a client gone, a timeout) removes a waiting job, or silences a running one (its row runs to
  the end of the compiled call, which cannot be cut short, and is discarded).
- `begin_shutdown(grace)`: no new jobs; what is queued or running may finish for `grace` seconds, then
  gets a clean 503 error.
The worker compiles (`engine.warm_up`, the `warm_up` smallest prompt buckets; 0: nothing) before it takes
the first batch; jobs submitted meanwhile wait.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import threading
import time
import uuid

from diffusiongemma.serving.errors import APIError


class Job:
  """One request in the scheduler: its `prepared` input, its event queue, its timings and batch size."""

  def __init__(self, prepared, loop: asyncio.AbstractEventLoop, prefix: str = "chatcmpl"):
    self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
    self.prepared, self.loop = prepared, loop
    self.events: asyncio.Queue = asyncio.Queue()
    self.cancelled = False
    self.created = time.monotonic()
    self.started: float | None = None
    self.batch_size = 0

  def send(self, event: tuple) -> None:
    """Delivers an event from any thread."""
    if self.cancelled:
      return
    try:
      self.loop.call_soon_threadsafe(self.events.put_nowait, event)
    except RuntimeError:  # the loop has closed: nobody is listening
      pass


class Scheduler:
  """See the module docstring. `log(**fields)` receives structured records."""

  def __init__(self, engine, *, admission_window: float = 0.01, max_queue: int = 256, warm_up: int = 1,
               log=None):
    self.engine, self.window, self.max_queue, self.warm = engine, admission_window, max_queue, warm_up
    self.log = log or (lambda **_: None)
    self.queue: list[Job] = []
    self.running: list[Job] = []
    self.draining = False
    self.batches = 0
    self.batch_sizes: collections.Counter = collections.Counter()
    self._inbox: queue.Queue = queue.Queue()
    self._started = False

  async def start(self) -> None:
    self.loop = asyncio.get_running_loop()
    self.ready, self._wake = asyncio.Event(), asyncio.Event()
    threading.Thread(target=self._work, name="engine-worker", daemon=True).start()
    self._task = asyncio.create_task(self._schedule())
    self._started = True

  def _work(self) -> None:
    """The worker thread: compiles, then runs one batch at a time."""
    if self.warm:
      try:
        self.engine.warm_up(self.log, prompt_buckets=self.warm)
      except Exception as e:  # pylint: disable=broad-except  (serve anyway; each request reports its error)
        self.log(event="warm_up_failed", error=repr(e))
    self.loop.call_soon_threadsafe(self.ready.set)
    while (item := self._inbox.get()) is not None:
      batch, done = item
      try:
        report = self.engine.run(batch)
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

  def _take(self) -> list[Job]:
    key = self.queue[0].prepared.key
    chosen = list(itertools.islice((j for j in self.queue if j.prepared.key == key), self.engine.max_batch))
    for job in chosen:
      self.queue.remove(job)
    return chosen

  async def _schedule(self) -> None:
    await self.ready.wait()
    while True:
      while not self.queue:
        self._wake.clear()
        await self._wake.wait()
      await asyncio.sleep(self.window)  # the admission window: let requests that arrive together batch
      if not self.queue:
        continue
      batch = self._take()
      now = time.monotonic()
      for job in batch:
        job.started, job.batch_size = now, len(batch)
      self.running = batch
      done = self.loop.create_future()
      self._inbox.put((batch, done))
      report = await done
      self.running = []
      self.batches += 1
      self.batch_sizes[len(batch)] += 1
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
    self._inbox.put(None)
    self._task.cancel()

  def status(self) -> dict:
    state = "shutting_down" if self.draining else "ok" if self.ready.is_set() else "warming_up"
    return {"status": state, "queued": len(self.queue), "running": len(self.running), "batches": self.batches,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "stream_mismatches": self.engine.mismatches}

"""The server's compiled programs: their shapes, which one serves a batch, and the background compiler.

A program is one compilation of `Sampler.generate`, named by its `Shape`: batch size, prompt bucket
(tokens), reply canvases, the constraint's padded table sizes, images. Temperature and seed are inputs
of every program, one per row, so neither is part of a shape: one program serves every temperature.

A batch can run on any compiled program that *covers* it (batch, prompt bucket and canvases at least its
own, the same constraint sizes and images): its rows are padded up (prompt and reply canvases; empty rows
are copies of the first, discarded). `best` picks the cheapest compiled one, by positions = batch x
(prompt + canvases x canvas length), the work of one denoiser pass over the cache. So no batch waits for
a compile while a compiled program can serve it. When the cheapest costs more than `max_padding` times
the batch's own exact program, the exact one is compiled in the background and used once it is ready;
when none covers it, the batch waits for that compile while other batches run.

`select` builds a batch from the requests that can share one call (same constraint object, same number
of images), oldest first: a request joins while padding every row to the batch's prompt bucket and
canvases keeps the rows' positions within `max_padding` times their own.

`Compiler`: one background thread compiling requested shapes, requests waiting for one first, then
the start-up grid in its order (`Engine.grid`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True, order=True)
class Shape:
  """What one compiled program serves (see the module docstring). `constraint`: the constraint's program
  key (`Constraint._program_key()`), () without one; `images`: images per row."""

  batch: int
  prompt: int
  canvases: int
  constraint: tuple = ()
  images: int = 0

  def positions(self, canvas: int) -> int:
    return self.batch * (self.prompt + self.canvases * canvas)

  def covers(self, other: Shape) -> bool:
    return (self.batch >= other.batch and self.prompt >= other.prompt and self.canvases >= other.canvases
            and self.constraint == other.constraint and self.images == other.images)

  def describe(self) -> dict:
    return {"batch": self.batch, "prompt_bucket": self.prompt, "canvases": self.canvases,
            "constrained": bool(self.constraint), "images": self.images}


def group_key(prepared) -> tuple:
  """Requests with equal keys can share one call: one constraint object (its tables are the call's), and
  as many images each."""
  return (id(prepared.constraint) if prepared.constraint is not None else None, len(prepared.images))


def exact(preps: Sequence, batch_bucket: Callable[[int], int]) -> Shape:
  """The batch's own program: its batch bucket, largest prompt bucket and canvases."""
  first = preps[0]
  key = () if first.constraint is None else first.constraint._program_key()  # pylint: disable=protected-access
  return Shape(batch_bucket(len(preps)), max(p.prompt_bucket for p in preps), max(p.canvases for p in preps),
               key, len(first.images))


def select(jobs: Sequence, max_batch: int, canvas: int, max_padding: float) -> list:
  """The oldest job and the next ones of its group that fit (see the module docstring); `jobs` in arrival
  order, each with `.prepared`."""
  head = jobs[0]
  group = group_key(head.prepared)
  chosen, own = [head], head.prepared.prompt_bucket + head.prepared.canvases * canvas
  prompt, canvases = head.prepared.prompt_bucket, head.prepared.canvases
  for job in jobs[1:]:
    if len(chosen) == max_batch:
      break
    p = job.prepared
    if group_key(p) != group:
      continue
    new_prompt, new_canvases = max(prompt, p.prompt_bucket), max(canvases, p.canvases)
    new_own = own + p.prompt_bucket + p.canvases * canvas
    if (len(chosen) + 1) * (new_prompt + new_canvases * canvas) <= max_padding * new_own:
      chosen.append(job)
      prompt, canvases, own = new_prompt, new_canvases, new_own
  return chosen


class Compiler:
  """A background thread that compiles requested shapes (see the module docstring).

  compile_fn(shape, constraint) compiles one program and returns its seconds; on_ready(shape, seconds,
  error) is called (on the compiler thread) after each, error None when it worked.
  """

  def __init__(self, compile_fn: Callable, on_ready: Callable):
    self.compile_fn, self.on_ready = compile_fn, on_ready
    self.ready: set[Shape] = set()
    self.failed: dict[Shape, str] = {}
    self.compiling: Shape | None = None
    self._queue: list = []  # (priority, order, shape, constraint)
    self._queued: dict[Shape, int] = {}  # shape -> its best queued priority
    self._order = itertools.count()
    self._cv = threading.Condition()
    self._stopped = False
    self._thread = threading.Thread(target=self._work, name="program-compiler", daemon=True)
    self._thread.start()

  def best(self, need: Shape, canvas: int) -> Shape | None:
    """The cheapest compiled shape covering `need`, or None."""
    with self._cv:
      covering = [s for s in self.ready if s.covers(need)]
    return min(covering, key=lambda s: (s.positions(canvas), s)) if covering else None

  def request(self, shape: Shape, constraint=None, priority: int = 0) -> None:
    """Queues `shape` unless it is compiled, failed or queued already (a lower priority number goes first;
    requests waiting for it use 0)."""
    with self._cv:
      if shape in self.ready or shape in self.failed or shape == self.compiling:
        return
      if shape in self._queued and self._queued[shape] <= priority:
        return
      self._queued[shape] = priority
      heapq.heappush(self._queue, (priority, next(self._order), shape, constraint))
      self._cv.notify()

  def pending(self) -> int:
    with self._cv:
      return len(self._queued) + (self.compiling is not None)

  def stop(self) -> None:
    with self._cv:
      self._stopped = True
      self._cv.notify()

  def _work(self) -> None:
    while True:
      with self._cv:
        while not self._stopped and not self._queue:
          self._cv.wait()
        if self._stopped:
          return
        priority, _, shape, constraint = heapq.heappop(self._queue)
        if self._queued.get(shape) != priority:  # a stale entry: it was queued again ahead
          continue
        del self._queued[shape]
        self.compiling = shape
      start, error = time.perf_counter(), None
      try:
        self.compile_fn(shape, constraint)
      except Exception as e:  # pylint: disable=broad-except  (the batches that need it get the error)
        error = repr(e)
      with self._cv:
        self.compiling = None
        if error is None:
          self.ready.add(shape)
        else:
          self.failed[shape] = error
      self.on_ready(shape, round(time.perf_counter() - start, 3), error)

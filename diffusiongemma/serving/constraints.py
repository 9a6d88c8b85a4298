"""`Builds`: the server's constraint builds (JSON schema or regex -> token automaton), bounded, shared and
cancellable, so that no client's `response_format` can stall the others.

- `get(response_format, deadline, gone)` runs on the event loop: a cached constraint comes back at once (no
  lock: the cache is only touched on the loop); otherwise the request waits for that format's build,
  started by the first request that needs it and shared by the ones that need it meanwhile. While it
  waits it checks every `CLIENT_POLL_SECONDS` whether its client has left (`gone()`, then `Gone`) or its deadline
  has passed (504). When the last request waiting for a build leaves, the build is killed.
- A build runs `constraints.from_regex` / `from_json_schema` under a `constraints.Budget` in a build
  process (`constraint_worker`; started once, it keeps the vocabulary and takes one build at a time):
  outlines-core builds the byte DFA in one call that nothing can interrupt, so only a process can be
  stopped at the time limit, at the memory limit (its resident memory, polled; the process's own
  baseline of imports and vocabulary included), or when nobody waits any more; a stopped process is
  replaced. Past a limit the request gets a 400 that names it and the server flag that sets it.
- At most `max_builds` builds run at once; new formats beyond that wait for a slot, and beyond
  `max_pending` (running and waiting) they get a 429.
- `close()` kills every build: shutting down never waits for one.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
from multiprocessing import connection
import os
import subprocess
import sys
import threading
import time

from diffusiongemma.diffusion import constraints as cons
from diffusiongemma.sampling import constrained
from diffusiongemma.serving.errors import APIError, invalid

POLL_SECONDS = 0.05  # how often a build is checked (its result, time, memory, waiters)
CLIENT_POLL_SECONDS = 0.25  # how often a waiting request checks its client and its deadline
# The server flag behind each limit, for the 400 that names it.
FLAGS = {"seconds": "--constraint_seconds", "max_states": "--constraint_states",
         "max_dfa_states": "--constraint_states", "memory_mib": "--constraint_memory_mib"}


class Gone(Exception):
  """The client went away while its request waited."""


@dataclasses.dataclass
class _Build:
  """One format's build: the future its waiters await, how many wait, and the flag that stops it."""

  future: asyncio.Future
  cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
  waiters: int = 0


class Builds:
  """See the module docstring. `engine`: its `tokenizer` and `sampler` define the automata; `budget`: a
  `constraints.Budget` (its `seconds` is also the process's time limit); `memory_mib`: the build process's
  resident memory limit; `cache_size`: how many built constraints are kept (least recently used out)."""

  def __init__(self, engine, budget: cons.Budget, *, memory_mib: float = 1024, cache_size: int = 16,
               max_builds: int = 2, max_pending: int = 8):
    self.engine, self.budget, self.memory_mib = engine, budget, memory_mib
    self.cache_size, self.max_pending = cache_size, max_pending
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._building: dict[tuple, _Build] = {}
    self._pool = concurrent.futures.ThreadPoolExecutor(max_builds, thread_name_prefix="constraint-build")
    self._workers = _Workers()
    self._closed = False
    self.built = 0

  @property
  def running(self) -> int:
    return len(self._building)

  async def get(self, response_format, *, deadline: float, gone) -> constrained.Constraint:
    """The format's constraint (see the module docstring); `deadline` in `time.monotonic()` seconds,
    `gone()` an awaitable check that the client has left."""
    key = response_format.key()
    if key in self._cache:
      self._cache.move_to_end(key)
      return self._cache[key]
    if self._closed:
      raise APIError(503, "The server is shutting down.", code="shutting_down")
    build = self._building.get(key)
    if build is None:
      if len(self._building) >= self.max_pending:
        raise APIError(429, f"Too many new constraints are being built ({self.max_pending}); retry later.",
                       "response_format", "constraint_builds_full")
      build = self._building[key] = _Build(asyncio.get_running_loop().create_future())
      self._start(key, build, response_format)
    build.waiters += 1
    try:
      while not build.future.done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise APIError(504, "The request did not finish within its time limit (its constraint was still "
                         "building).", code="timeout")
        await asyncio.wait([build.future], timeout=min(CLIENT_POLL_SECONDS, remaining))
        if not build.future.done() and await gone():
          raise Gone()
      return build.future.result()
    finally:
      build.waiters -= 1
      if build.waiters == 0 and not build.future.done():  # nobody waits any more: stop it
        build.cancel.set()
        self._building.pop(key, None)

  def _start(self, key, build: _Build, response_format) -> None:
    loop = asyncio.get_running_loop()
    job = (response_format.kind, response_format.value, constrained.automaton_args(self.engine.sampler), self.budget)
    running = loop.run_in_executor(self._pool, _run, self._workers, self.engine.vocabulary(), job, build.cancel,
                                   self.budget.seconds, self.memory_mib)

    def finished(outcome: asyncio.Future) -> None:
      if self._building.get(key) is build:
        del self._building[key]
      if build.future.done():
        return
      if build.cancel.is_set() and not self._closed:  # nobody waits for it
        build.future.cancel()
        return
      try:
        constraint = self._constraint(response_format, ("cancelled",) if outcome.cancelled() else outcome.result())
      except Exception as e:  # pylint: disable=broad-except  (delivered to the waiters)
        build.future.set_exception(e)
        return
      self._cache[key] = constraint
      self.built += 1
      while len(self._cache) > self.cache_size:
        self._cache.popitem(last=False)
      build.future.set_result(constraint)

    running.add_done_callback(finished)

  def _constraint(self, response_format, outcome: tuple) -> constrained.Constraint:
    """The build's outcome as a constraint, or the `APIError` that answers it."""
    param = "response_format.regex" if response_format.kind == "regex" else "response_format"
    kind, *rest = outcome
    if kind == "ok":
      description = "regex" if response_format.kind == "regex" else "JSON schema"
      return constrained.Constraint(rest[0], description)
    if kind == "budget":
      limit, message = rest
      flag = FLAGS.get(limit)
      raise invalid(param, f"{message} ({f'its flag: {flag}' if flag else 'a limit of this server'})",
                    "constraint_too_complex")
    if kind == "invalid":
      raise invalid(param, f"Invalid {response_format.kind.replace('_', ' ')}: {rest[0]}")
    if kind == "cancelled":
      raise APIError(503, "The constraint build was stopped (the server is shutting down).", code="shutting_down")
    raise APIError(500, f"The constraint build failed: {rest[0]}", param, "constraint_build_failed")

  def close(self) -> None:
    """Stops every build (their waiters get a 503) and takes no new ones."""
    self._closed = True
    for build in list(self._building.values()):
      build.cancel.set()
    self._pool.shutdown(wait=False, cancel_futures=True)
    self._workers.close()

  def status(self) -> dict:
    return {"constraints_cached": len(self._cache), "constraint_builds": self.running}


# ------------------------------------------------------------------------------------------ the processes
class _Worker:
  """A build process (`python -m diffusiongemma.serving.constraint_worker`): it imports the constraint code
  once, takes the vocabulary once, then builds one automaton per job until it is killed."""

  def __init__(self, vocabulary: dict[int, bytes]):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    self.process = subprocess.Popen([sys.executable, "-m", "diffusiongemma.serving.constraint_worker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    self.send = connection.Connection(os.dup(self.process.stdin.fileno()), readable=False)
    self.receive = connection.Connection(os.dup(self.process.stdout.fileno()), writable=False)
    self.process.stdin.close()
    self.process.stdout.close()
    self.send.send(vocabulary)
    self.ready = False  # it answers "ready" once it has imported the constraint code and read the vocabulary

  def kill(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait()
    self.send.close()
    self.receive.close()


class _Workers:
  """Idle build processes kept for the next build; a process that was stopped is replaced by a new one."""

  def __init__(self):
    self._idle: list[_Worker] = []
    self._lock = threading.Lock()

  def take(self, vocabulary) -> _Worker:
    with self._lock:
      if self._idle:
        return self._idle.pop()
    return _Worker(vocabulary)

  def give_back(self, worker: _Worker) -> None:
    with self._lock:
      self._idle.append(worker)

  def close(self) -> None:
    with self._lock:
      idle, self._idle = self._idle, []
    for worker in idle:
      worker.kill()


def _resident_mib(pid: int) -> float:
  """A process's resident memory in MiB (0 where /proc is not there to read)."""
  try:
    with open(f"/proc/{pid}/statm", encoding="ascii") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except (OSError, ValueError, IndexError):
    return 0.0


def _run(workers: _Workers, vocabulary, job: tuple, cancel: threading.Event, seconds: float | None,
         memory_mib: float | None) -> tuple:
  """One build on a worker process, to its end, its time or memory limit, or `cancel` (then the process is
  killed; a process that answered goes back to `workers`)."""
  worker = workers.take(vocabulary)
  outcome, reusable = None, False
  try:
    while not worker.ready and outcome is None:  # a new process: its start-up is not the build's time
      if cancel.is_set():
        outcome = ("cancelled",)
      elif worker.receive.poll(POLL_SECONDS):
        worker.ready = worker.receive.recv() == ("ready",)
      elif worker.process.poll() is not None:
        outcome = ("error", f"the build process exited with code {worker.process.returncode}")
    if outcome is None:
      worker.send.send(job)
    limit = None if seconds is None else time.monotonic() + seconds + 1.0  # the worker checks `seconds` too
    while outcome is None:
      if cancel.is_set():
        outcome = ("cancelled",)
      elif worker.receive.poll(POLL_SECONDS):
        outcome = worker.receive.recv()
        reusable = outcome[0] in ("ok", "invalid") or (outcome[0] == "budget" and outcome[1] != "memory_mib")
      elif limit is not None and time.monotonic() > limit:
        outcome = ("budget", "seconds", f"The constraint did not build within the limit seconds={seconds:g}; "
                   "simplify the regex or schema.")
      elif memory_mib is not None and _resident_mib(worker.process.pid) > memory_mib:
        outcome = ("budget", "memory_mib", f"The constraint's build used more than the limit memory_mib="
                   f"{memory_mib:g}; simplify the regex or schema.")
      elif worker.process.poll() is not None:
        outcome = ("error", f"the build process exited with code {worker.process.returncode}")
  except (EOFError, OSError) as e:
    outcome = ("error", f"the build process failed: {e!r}")
  finally:
    if reusable and worker.process.poll() is None:
      workers.give_back(worker)
    else:
      worker.kill()
  return outcome

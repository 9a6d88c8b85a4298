"""When a run stops before its last step, decided by every process together.

A run stops early, after saving, on SIGTERM (a preemption) or once its time budget is spent. With several
processes that must happen at one step for all of them: a process that leaves the loop for a save while the
others enter the next train step leaves each waiting in a collective the other never joins (measured before
this module: SIGTERM to one of two processes, both aborted a minute later). So no process decides alone:

- SIGTERM, one process: a Python handler sets a flag that the loop reads after each step.
- SIGTERM, several processes: jax's preemption service (started by `jax.distributed.initialize`) catches the
  signal in whichever process gets it and tells the coordination service, which tells every process; each
  then reports the step it is at, and `reached_preemption(step)` (orbax's check on jax's sync point, what
  MaxText uses) is true for all of them at the largest of those steps. Without a notice it reads a local flag
  (about 0.2 us a step, docs/scale.md). A Python handler is not installed then: it would hide the signal from
  the service.
- Time budget, one process: its own clock, after each step.
- Time budget, several processes: process 0's clock decides and a broadcast (one small collective) tells the
  others. A collective after every step would cost milliseconds on CPU (docs/scale.md), so it runs only at the
  steps the previous broadcast named: at each check process 0 estimates the steps left from its mean step time
  so far and names the check halfway there, one step ahead near the end. A run of N steps does about log2(N)
  checks; one whose steps suddenly turn more than twice as slow can overrun its budget by the steps between
  two checks.
The NaN guard needs none of this: it reads the step's metrics, which are the same global values everywhere.
"""

from __future__ import annotations

import signal
import threading

from collections.abc import Callable

import jax
from jax.experimental import multihost_utils
import numpy as np

SIGTERM = "SIGTERM"
TIME_BUDGET = "time budget"
_STOP = -1  # what process 0 broadcasts when the budget is spent
_LAST = 2**31 - 1  # the furthest check it names (an int32)


class StopRule:
  """The loop asks `reason(step, train_s)` after each step: SIGTERM, TIME_BUDGET or None (go on), the same
  answer at the same step in every process. Use it as a context manager (it installs the SIGTERM handler of a
  one-process run, in the main thread only)."""

  def __init__(self, time_budget_s: float, reached_preemption: Callable[[int], bool]):
    """reached_preemption: the collective SIGTERM check of a multi-process run (`Checkpointer.reached_
    preemption`); unused with one process."""
    self.time_budget_s = time_budget_s
    self.multiprocess = jax.process_count() > 1
    self._reached_preemption = reached_preemption
    self._sigterm = False
    self._previous = None
    self._next_check = None  # multi-process: the step of the next budget check (None: the first step seen)
    self._first = None  # process 0: (step, train_s) at the first check, for the mean step time
    if self.multiprocess and not jax.config.jax_enable_preemption_service:
      raise ValueError("jax_enable_preemption_service is off: a multi-process run needs jax's preemption service "
                       "to stop every process at one step on SIGTERM; unset JAX_ENABLE_PREEMPTION_SERVICE.")

  def __enter__(self):
    if not self.multiprocess and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self._sigterm = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def reason(self, step: int, train_s: float) -> str | None:
    """Why the run stops after `step` (SIGTERM first), or None. `train_s`: the run's training seconds so
    far (earlier runs it resumes included), as this process measures them."""
    sigterm = self._reached_preemption(step) if self.multiprocess else self._sigterm
    if sigterm:
      return SIGTERM
    if self.time_budget_s > 0 and self._budget_spent(step, train_s):
      return TIME_BUDGET
    return None

  def _budget_spent(self, step: int, train_s: float) -> bool:
    if not self.multiprocess:
      return train_s >= self.time_budget_s
    if self._next_check is not None and step < self._next_check:
      return False
    decision = self._schedule(step, train_s) if jax.process_index() == 0 else 0
    decision = int(multihost_utils.broadcast_one_to_all(np.int32(decision)))  # process 0's, everywhere
    if decision == _STOP:
      return True
    self._next_check = decision
    return False

  def _schedule(self, step: int, train_s: float) -> int:
    """Process 0: _STOP, or the step of the next check (halfway to the estimated end of the budget)."""
    left = self.time_budget_s - train_s
    if left <= 0:
      return _STOP
    if self._first is None or step <= self._first[0]:
      self._first = self._first or (step, train_s)
      return step + 1
    seconds_per_step = max(train_s - self._first[1], 1e-9) / (step - self._first[0])
    return min(step + max(1, int(left / seconds_per_step) // 2), _LAST)

r"""What the coordinated stop check costs a multi-process run per step (`training.stopping`): two
`jax.distributed` CPU processes on this machine time, per call and best of `--repeats` rounds of `--calls`,

- `reached_preemption`: orbax's check of jax's preemption sync point (what every step calls);
- `broadcast_one_to_all`: one int32 from process 0 to all (what a time-budget check calls, at the steps
  process 0 schedules);
- `process_allgather`: the per-step collective a simpler design would call after every step.

  python -m benchmarks.stop_check [--calls=500] [--repeats=3]

Prints one line per process (the collectives wait for both, so the two lines agree).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from absl import app
from absl import flags

_CALLS = flags.DEFINE_integer("calls", 500, "Calls per timed round.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds (the best is kept).")
_WORKER = flags.DEFINE_string("worker", None, "Internal: 'address,process_id' of a worker process.")


def _best_seconds(fn, calls: int, repeats: int) -> float:
  for _ in range(20):  # compiles, connects
    fn()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      fn()
    best = min(best, (time.perf_counter() - start) / calls)
  return best


def _worker(address: str, process_id: int) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  jax.distributed.initialize(coordinator_address=address, num_processes=2, process_id=process_id)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from orbax.checkpoint import multihost  # pylint: disable=import-outside-toplevel

  step = iter(range(10**9))
  value = np.zeros((), np.int32)
  times = {
      "reached_preemption": _best_seconds(lambda: multihost.reached_preemption(next(step)), _CALLS.value,
                                          _REPEATS.value),
      "broadcast_one_to_all": _best_seconds(lambda: multihost_utils.broadcast_one_to_all(value), _CALLS.value,
                                            _REPEATS.value),
      "process_allgather": _best_seconds(lambda: multihost_utils.process_allgather(value), _CALLS.value,
                                         _REPEATS.value),
  }
  print(f"process {process_id}: " + ", ".join(f"{k} {v * 1e6:,.1f} us" for k, v in times.items()), flush=True)


def main(argv):
  del argv
  if _WORKER.value:
    address, process_id = _WORKER.value.split(",")
    _worker(address, int(process_id))
    return
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  workers = [subprocess.Popen([sys.executable, "-m", "benchmarks.stop_check", f"--worker=localhost:{port},{i}",
                               f"--calls={_CALLS.value}", f"--repeats={_REPEATS.value}"],
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
             for i in range(2)]
  if any(w.wait() for w in workers):
    raise SystemExit("a worker failed")


if __name__ == "__main__":
  app.run(main)

"""scripts/train.py with process 0's train steps made 50 ms slower (a test hook, never a flag): the time
budget of a multi-process run is then spent by process 0's clock first, and test_multihost.py checks that every
process still stops at the step process 0 decides.

  python _train_slow_process0.py <the flags of scripts/train.py>
"""

import pathlib
import runpy
import sys
import time

import jax

from diffusiongemma.training import loop

SCRIPT = pathlib.Path(__file__).parent.parent / "scripts" / "train.py"
_train_step = loop._Setup.train_step  # pylint: disable=protected-access


def _slow_on_process_0(self, state, batch):
  out = _train_step(self, state, batch)
  if jax.process_index() == 0:
    time.sleep(0.05)
  return out


if __name__ == "__main__":
  loop._Setup.train_step = _slow_on_process_0  # pylint: disable=protected-access
  sys.argv[0] = str(SCRIPT)
  runpy.run_path(str(SCRIPT), run_name="__main__")

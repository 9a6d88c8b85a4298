"""How the binaries run: `run(main)` is absl's `app.run`, except that a mistake in what the user gave (a bad
value, a missing or damaged file, a config that does not fit: `ValueError`, `OSError`) ends in one line on
stderr naming it, not in a traceback; `DG_TRACEBACK=1` shows the traceback."""

from __future__ import annotations

import os
import sys

from absl import app

TRACEBACK_VARIABLE = "DG_TRACEBACK"


def run(main) -> None:
  """`app.run(main)`; a `ValueError` or `OSError` from `main` prints `error: <message>` and exits 1."""

  def guarded(argv):
    try:
      return main(argv)
    except (ValueError, OSError) as error:
      if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
        raise
      print(f"error: {error}\n(set {TRACEBACK_VARIABLE}=1 for the traceback)", file=sys.stderr, flush=True)
      sys.exit(1)

  app.run(guarded)

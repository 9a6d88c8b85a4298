"""A constraint build process of the server (`serving.constraints`): `python -m` this module, then send it
the vocabulary `{id: bytes}` (it answers `("ready",)`) and, one at a time, jobs `(kind, value, automaton
args, budget)`; it answers each with `("ok", automaton)` or `(reason, ...)`, in `multiprocessing.connection`
frames on stdin and stdout. Its parent kills it at a limit or when nobody waits for its build."""

import os
import sys
from multiprocessing import connection

from diffusiongemma.diffusion import constraints as cons


def build(kind: str, value, vocabulary, args: dict, budget: cons.Budget) -> tuple:
  """One automaton, or why not: ("budget", limit, message), ("invalid", message), ("error", message)."""
  try:
    if kind == "regex":
      return ("ok", cons.from_regex(value, vocabulary, budget=budget, **args))
    return ("ok", cons.from_json_schema(value, vocabulary, budget=budget, **args))
  except cons.BudgetExceeded as e:
    return ("budget", e.limit, str(e))
  except MemoryError:
    return ("budget", "memory_mib", "The constraint's build ran out of memory.")
  except (ValueError, RecursionError, TypeError) as e:
    return ("invalid", str(e))
  except Exception as e:  # pylint: disable=broad-except  (reported to the request, the worker lives on)
    return ("error", repr(e))


def main() -> None:
  receive = connection.Connection(os.dup(sys.stdin.fileno()), writable=False)
  send = connection.Connection(os.dup(sys.stdout.fileno()), readable=False)
  sys.stdout = sys.stderr  # nothing else may write into the framing
  vocabulary = receive.recv()
  send.send(("ready",))
  while True:
    try:
      kind, value, args, budget = receive.recv()
    except EOFError:
      return
    send.send(build(kind, value, vocabulary, args, budget))


if __name__ == "__main__":
  main()

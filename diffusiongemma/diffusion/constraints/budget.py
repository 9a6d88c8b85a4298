"""`Budget`: limits on one constraint build (JSON schema -> regex -> byte DFA -> token automaton), so that a
client's regex or schema cannot cost unbounded time or memory (see `automaton`'s module docstring)."""

from __future__ import annotations

import dataclasses
import time


class BudgetExceeded(ValueError):
  """A build went past one of its `Budget`'s limits; `limit` names the field, `value` its setting."""

  def __init__(self, limit: str, value, message: str):
    super().__init__(message)
    self.limit, self.value = limit, value


@dataclasses.dataclass(frozen=True)
class Budget:
  """Limits on one build (None: unlimited). Each is checked as soon as its quantity is known."""

  max_schema_nodes: int | None = None  # subschemas a JSON schema's compilation visits ($refs expanded)
  max_regex_chars: int | None = None  # the regex (a schema's, once compiled) in the engine's syntax
  max_dfa_states: int | None = None  # byte-level DFA states
  max_states: int | None = None  # token automaton states
  seconds: float | None = None  # wall time from the build's start, checked between and inside the steps

  def deadline(self) -> float | None:
    return None if self.seconds is None else time.monotonic() + self.seconds

  def check(self, limit: str, value: int, what: str) -> None:
    """Raises `BudgetExceeded` when `value` is over the limit named `limit`."""
    bound = getattr(self, limit)
    if bound is not None and value > bound:
      raise BudgetExceeded(limit, bound, f"The constraint's {what} reached {value}, over the limit "
                           f"{limit}={bound}; simplify the regex or schema.")

  def check_time(self, deadline: float | None) -> None:
    """Raises `BudgetExceeded` once `deadline` (from `deadline()`) has passed."""
    if deadline is not None and time.monotonic() > deadline:
      raise BudgetExceeded("seconds", self.seconds, f"The constraint did not build within the limit "
                           f"seconds={self.seconds:g}; simplify the regex or schema.")

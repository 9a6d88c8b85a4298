"""Temperature schedules: the temperature of each denoising step of a canvas.

A schedule is a small frozen object called as `schedule(remaining, total) -> T` (float32), where `remaining`
counts the steps left including this one (N, N - 1, ..., 1) and `total` is the step cap N
(`max_denoising_steps`). Logits are divided by T before the step's statistics, draws and self-conditioning.
A new schedule is a new class here and one registry line in `build/registry.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp

Array = jax.Array


class Schedule(Protocol):

  def __call__(self, remaining: Array, total: int) -> Array: ...


def _positive(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
    raise ValueError(f"{name}={value!r} is invalid: must be a positive finite number.")


def _check(name: str, t_max, t_min) -> None:
  _positive(f"{name}.t_max", t_max)
  _positive(f"{name}.t_min", t_min)
  if t_min > t_max:
    raise ValueError(f"{name}.t_min={t_min!r} is invalid: must be at most t_max={t_max!r}.")


@dataclasses.dataclass(frozen=True)
class Linear:
  """The released schedule: T = t_min + (t_max - t_min) * n / N at n steps remaining, so the first step
  runs at t_max and the last just above t_min (raising N stretches it, it does not change its ends)."""

  t_max: float = 0.8
  t_min: float = 0.4

  def __post_init__(self):
    _check("Linear", self.t_max, self.t_min)

  def __call__(self, remaining: Array, total: int) -> Array:
    ratio = jnp.asarray(remaining, jnp.float32) / jnp.float32(total)
    return jnp.float32(self.t_min) + jnp.float32(self.t_max - self.t_min) * ratio


@dataclasses.dataclass(frozen=True)
class Cosine:
  """T = t_min + (t_max - t_min) * (1 - cos(pi * n / N)) / 2: t_max at the first step, lingering near both
  ends and falling fastest midway."""

  t_max: float = 0.8
  t_min: float = 0.4

  def __post_init__(self):
    _check("Cosine", self.t_max, self.t_min)

  def __call__(self, remaining: Array, total: int) -> Array:
    ratio = jnp.asarray(remaining, jnp.float32) / jnp.float32(total)
    return jnp.float32(self.t_min) + jnp.float32(self.t_max - self.t_min) * 0.5 * (1 - jnp.cos(jnp.pi * ratio))


@dataclasses.dataclass(frozen=True)
class Constant:
  """The same temperature at every step."""

  temperature: float = 1.0

  def __post_init__(self):
    _positive("Constant.temperature", self.temperature)

  def __call__(self, remaining: Array, total: int) -> Array:
    del total
    return jnp.full(jnp.shape(remaining), self.temperature, jnp.float32)

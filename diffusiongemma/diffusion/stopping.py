"""Stopping rules: when a canvas is done before the step cap.

A rule is a small frozen object with `init(batch_size, canvas_length) -> state` (any pytree, carried by
the compiled loop) and `rule(state, stats) -> (stop [B] bool, state)`, called after every step with that
step's `TokenStats` (whose `argmax` is the canvas that would be committed). Rules combine with `AllOf`
(gemma's `ChainedEarlyStop`) and `AnyOf`. A new rule is a new class; config strings map to them in
`build/registry.py`. The step cap (`max_denoising_steps`) ends a canvas whatever the rule says.

Axes: B batch, C canvas, S history.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from diffusiongemma.diffusion.acceptance import TokenStats

Array = jax.Array


class StoppingRule(Protocol):

  def init(self, batch_size: int, canvas_length: int) -> Any: ...

  def __call__(self, state: Any, stats: TokenStats) -> tuple[Array, Any]: ...


@dataclasses.dataclass(frozen=True)
class NoEarlyStop:
  """Never stops early: every canvas runs `max_denoising_steps` steps."""

  def init(self, batch_size: int, canvas_length: int) -> tuple:
    del batch_size, canvas_length
    return ()

  def __call__(self, state, stats):
    return jnp.zeros(stats.argmax.shape[:1], bool), state


@dataclasses.dataclass(frozen=True)
class ArgmaxStable:
  """The argmax canvas equals each of the previous `steps` steps' argmax canvases (history starts empty,
  so never on the first step); `steps=0` is always stable."""

  steps: int = 1

  def __post_init__(self):
    if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
      raise ValueError(f"ArgmaxStable.steps={self.steps!r} is invalid: an integer >= 0.")

  def init(self, batch_size: int, canvas_length: int) -> Array:
    return jnp.full((self.steps, batch_size, canvas_length), -1, jnp.int32)  # [S, B, C]

  def __call__(self, history, stats):
    argmax = stats.argmax
    stable = jnp.all(history == argmax[None], axis=(0, 2))
    if self.steps:
      history = jnp.concatenate([history[1:], argmax[None]], axis=0)
    return stable, history


@dataclasses.dataclass(frozen=True)
class MeanEntropyBelow:
  """The mean entropy of the tempered distribution over the canvas is strictly below `threshold`."""

  threshold: float = 0.005

  def __post_init__(self):
    value = self.threshold
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
      raise ValueError(f"MeanEntropyBelow.threshold={value!r} is invalid: must be a positive finite number.")

  def init(self, batch_size: int, canvas_length: int) -> tuple:
    del batch_size, canvas_length
    return ()

  def __call__(self, state, stats):
    return jnp.mean(stats.entropy, axis=-1) < self.threshold, state


@dataclasses.dataclass(frozen=True)
class _Combined:
  rules: Sequence[StoppingRule]

  def __post_init__(self):
    object.__setattr__(self, "rules", tuple(self.rules))
    if not self.rules:
      raise ValueError(f"{type(self).__name__} needs at least one rule (NoEarlyStop never stops).")

  def init(self, batch_size: int, canvas_length: int) -> tuple:
    return tuple(rule.init(batch_size, canvas_length) for rule in self.rules)

  def _each(self, state, stats):
    results = [rule(s, stats) for rule, s in zip(self.rules, state)]
    return jnp.stack([stop for stop, _ in results]), tuple(s for _, s in results)


@dataclasses.dataclass(frozen=True)
class AllOf(_Combined):
  """Stops a row when every rule says so (the released rule: stable argmax and low mean entropy)."""

  def __call__(self, state, stats):
    stops, state = self._each(state, stats)
    return jnp.all(stops, axis=0), state


@dataclasses.dataclass(frozen=True)
class AnyOf(_Combined):
  """Stops a row when any rule says so."""

  def __call__(self, state, stats):
    stops, state = self._each(state, stats)
    return jnp.any(stops, axis=0), state


def stable_and_confident(stability_threshold: int = 1, confidence_threshold: float = 0.005) -> AllOf:
  """The released rule (transformers' `StableAndConfidentStoppingCriteria`)."""
  return AllOf((ArgmaxStable(stability_threshold), MeanEntropyBelow(confidence_threshold)))

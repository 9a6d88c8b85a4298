"""Acceptance rules: which of a denoising step's sampled tokens are kept.

A rule is a small frozen object called as `rule(stats, eligible) -> accepted [B, C] bool`, where `stats`
are the step's per-position statistics of the temperature-scaled distribution (`TokenStats`) and
`eligible` [B, C] marks the positions that may still change (all of them for uniform noise; the
still-masked ones for masked noise). Every rule accepts at least one eligible position of each row that
has one; ties are broken towards the lower position (stable sorts). A new rule is a new class; config
names map to them in `build/registry.py`.

Axes: B batch, C canvas.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Protocol

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


@flax.struct.dataclass
class TokenStats:
  """Per-position statistics of one step's tempered distribution softmax(logits / T): each [B, C]."""

  entropy: Array  # float32, nats
  confidence: Array  # float32, the top probability
  argmax: Array  # int32
  sample: Array  # int32, one draw per position
  margin: Array | None = None  # float32, top probability minus the runner-up's (when a rule needs it)


class AcceptanceRule(Protocol):
  """`needs_margin`: the rule reads `TokenStats.margin` (the vocabulary head then computes it)."""

  needs_margin: ClassVar[bool]

  def __call__(self, stats: TokenStats, eligible: Array) -> Array: ...


def _check_number(rule, field: str, low: float, high: float, low_open: bool) -> None:
  value = getattr(rule, field)
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
  ok = ok and (value > low if low_open else value >= low) and value <= high
  if not ok:
    interval = f"{'(' if low_open else '['}{low}, {high}]"
    raise ValueError(f"{type(rule).__name__}.{field}={value!r} is invalid: must be a number in {interval}.")


def _best_or_above(score: Array, threshold: float, eligible: Array) -> Array:
  """Eligible positions whose score is >= threshold; where a row has none, its single best (the first of
  equal maxima)."""
  above = (score >= threshold) & eligible
  key = jnp.where(eligible, score, -jnp.inf)
  best = jnp.argmax(key, axis=-1)  # [B]
  top1 = (jnp.arange(score.shape[-1])[None] == best[:, None]) & eligible
  return jnp.where(above.any(-1, keepdims=True), above, top1)


def _scatter_sorted(order: Array, sorted_mask: Array) -> Array:
  """The inverse of taking `order` along the last axis: mask[b, order[b, i]] = sorted_mask[b, i]."""
  rows = jnp.arange(order.shape[0])[:, None]
  return jnp.zeros(sorted_mask.shape, bool).at[rows, order].set(sorted_mask)


@dataclasses.dataclass(frozen=True)
class EntropyBound:
  """The released rule (EB-sampler): the k lowest-entropy eligible positions with
  sum(entropy_1..k) - max(entropy_1..k) <= bound.

  Sorted ascending, max(entropy_1..k) is the k-th entropy, so the left side is the cumulative sum of the k - 1
  smaller ones: non-decreasing in k, so the accepted set is a prefix and always holds the first one.
  """

  bound: float = 0.1
  needs_margin: ClassVar[bool] = False

  def __post_init__(self):
    _check_number(self, "bound", 0.0, math.inf, low_open=False)

  def __call__(self, stats: TokenStats, eligible: Array) -> Array:
    token_entropy = stats.entropy
    key = jnp.where(eligible, token_entropy, jnp.inf)  # [B, C]
    order = jnp.argsort(key, axis=-1, stable=True)
    sorted_eligible = jnp.take_along_axis(eligible, order, axis=-1)
    sorted_entropy = jnp.where(sorted_eligible, jnp.take_along_axis(token_entropy, order, axis=-1), 0.0)
    cumulative = jnp.cumsum(sorted_entropy, axis=-1)
    selected = (cumulative - sorted_entropy <= self.bound) & sorted_eligible
    return _scatter_sorted(order, selected)


@dataclasses.dataclass(frozen=True)
class Confidence:
  """Eligible positions whose top probability is >= threshold (Fast-dLLM); else the single most confident."""

  threshold: float = 0.9
  needs_margin: ClassVar[bool] = False

  def __post_init__(self):
    _check_number(self, "threshold", 0.0, 1.0, low_open=True)

  def __call__(self, stats: TokenStats, eligible: Array) -> Array:
    return _best_or_above(stats.confidence, self.threshold, eligible)


@dataclasses.dataclass(frozen=True)
class Margin:
  """Eligible positions whose top probability exceeds the runner-up's by >= threshold (Kim et al. 2025,
  "Train for the worst, plan for the best": ordering by the top-2 margin); else the single largest margin.
  A position torn between two tokens waits even when each is likely, which is what puzzles need."""

  threshold: float = 0.9
  needs_margin: ClassVar[bool] = True

  def __post_init__(self):
    _check_number(self, "threshold", 0.0, 1.0, low_open=True)

  def __call__(self, stats: TokenStats, eligible: Array) -> Array:
    if stats.margin is None:
      raise ValueError("Margin acceptance needs TokenStats.margin: build the vocabulary head with margin=True.")
    return _best_or_above(stats.margin, self.threshold, eligible)


@dataclasses.dataclass(frozen=True)
class TopCount:
  """The `count` most confident eligible positions (LLaDA-style; all eligible ones when fewer remain)."""

  count: int = 1
  needs_margin: ClassVar[bool] = False

  def __post_init__(self):
    if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
      raise ValueError(f"TopCount.count={self.count!r} is invalid: must be a positive integer.")

  def __call__(self, stats: TokenStats, eligible: Array) -> Array:
    key = jnp.where(eligible, -stats.confidence, jnp.inf)
    order = jnp.argsort(key, axis=-1, stable=True)
    sorted_eligible = jnp.take_along_axis(eligible, order, axis=-1)
    selected = (jnp.arange(key.shape[-1])[None] < self.count) & sorted_eligible
    return _scatter_sorted(order, selected)


@dataclasses.dataclass(frozen=True)
class ConfidentPrefix:
  """Left to right: the first eligible position, and after it every eligible position up to the first one
  whose top probability is below the threshold. Every pass writes the next token, as AR decoding would, and
  goes on while the model is sure of what follows; a confident position after an unsure one waits (its
  context is not settled), so the text is committed in order."""

  threshold: float = 0.9
  needs_margin: ClassVar[bool] = False

  def __post_init__(self):
    _check_number(self, "threshold", 0.0, 1.0, low_open=True)

  def __call__(self, stats: TokenStats, eligible: Array) -> Array:
    position = jnp.arange(eligible.shape[-1])[None]
    first = jnp.argmax(eligible, axis=-1)[:, None]  # [B, 1]: the first eligible position (0 if none)
    unsure = eligible & (stats.confidence < self.threshold) & (position > first)
    stop = jnp.min(jnp.where(unsure, position, eligible.shape[-1]), axis=-1, keepdims=True)  # first unsure after it
    return eligible & (position >= first) & (position < stop)

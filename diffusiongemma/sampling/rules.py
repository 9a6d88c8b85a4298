"""The small swappable pieces of the sampler: temperature schedule, acceptance rules, stopping rules.

Each acceptance rule maps per-position statistics of one denoising step to a boolean mask [B, C] of
positions whose sampled token is kept. `eligible` [B, C] marks the positions a rule may choose from
(all of them for uniform noise; the still-masked ones for masked noise); every rule accepts at least one
eligible position of each row that has one. Ties are broken towards the lower position (stable sorts).

Axes: B batch, C canvas, V vocab, S stability history.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffusiongemma.sampling.config import SamplerConfig

Array = jax.Array


def temperature(config: SamplerConfig, remaining: Array) -> Array:
  """T = t_min + (t_max - t_min) * n / N at `remaining` steps n (N .. 1), in float32."""
  ratio = jnp.asarray(remaining, jnp.float32) / jnp.float32(config.max_denoising_steps)
  return jnp.float32(config.t_min) + jnp.float32(config.t_max - config.t_min) * ratio


def entropy(logits: Array) -> Array:
  """Entropy of softmax(logits) over the last axis, float32: [..., V] -> [...]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def _scatter_sorted(order: Array, sorted_mask: Array) -> Array:
  """The inverse of taking `order` along the last axis: mask[b, order[b, i]] = sorted_mask[b, i]."""
  rows = jnp.arange(order.shape[0])[:, None]
  return jnp.zeros(sorted_mask.shape, bool).at[rows, order].set(sorted_mask)


def accept_by_entropy(token_entropy: Array, eligible: Array, bound: float) -> Array:
  """The k lowest-entropy eligible positions with sum(entropy_1..k) - max(entropy_1..k) <= bound.

  Sorted ascending, max(entropy_1..k) is the k-th entropy, so the left side is the cumulative sum of the
  k - 1 smaller ones: non-decreasing in k, so the accepted set is a prefix and always holds the first one.
  """
  key = jnp.where(eligible, token_entropy, jnp.inf)  # [B, C]
  order = jnp.argsort(key, axis=-1, stable=True)
  sorted_eligible = jnp.take_along_axis(eligible, order, axis=-1)
  sorted_entropy = jnp.where(sorted_eligible, jnp.take_along_axis(token_entropy, order, axis=-1), 0.0)
  cumulative = jnp.cumsum(sorted_entropy, axis=-1)
  selected = (cumulative - sorted_entropy <= bound) & sorted_eligible
  return _scatter_sorted(order, selected)


def accept_by_confidence(confidence: Array, eligible: Array, threshold: float) -> Array:
  """Eligible positions whose top probability is >= threshold; else the single most confident one."""
  above = (confidence >= threshold) & eligible
  key = jnp.where(eligible, confidence, -jnp.inf)
  best = jnp.argmax(key, axis=-1)  # [B]; the first of equal maxima
  top1 = (jnp.arange(confidence.shape[-1])[None] == best[:, None]) & eligible
  return jnp.where(above.any(-1, keepdims=True), above, top1)


def accept_by_count(confidence: Array, eligible: Array, count: int) -> Array:
  """The `count` most confident eligible positions (all eligible ones when fewer remain)."""
  key = jnp.where(eligible, -confidence, jnp.inf)
  order = jnp.argsort(key, axis=-1, stable=True)
  sorted_eligible = jnp.take_along_axis(eligible, order, axis=-1)
  selected = (jnp.arange(confidence.shape[-1])[None] < count) & sorted_eligible
  return _scatter_sorted(order, selected)


def accept(config: SamplerConfig, scaled_logits: Array, token_entropy: Array, eligible: Array) -> Array:
  """The acceptance mask [B, C] of `config.acceptance` for temperature-scaled logits [B, C, V]."""
  if config.acceptance == "entropy":
    return accept_by_entropy(token_entropy, eligible, config.entropy_bound)
  confidence = jnp.max(jax.nn.softmax(scaled_logits, axis=-1), axis=-1)  # [B, C]
  if config.acceptance == "confidence":
    return accept_by_confidence(confidence, eligible, config.confidence_accept)
  return accept_by_count(confidence, eligible, config.tokens_per_step)


def history_length(config: SamplerConfig) -> int:
  """Slots of argmax history the stopping rule keeps (at least one, so shapes stay static)."""
  return max(config.stability_threshold, 1)


def should_stop(config: SamplerConfig, history: Array, argmax: Array, token_entropy: Array
                ) -> tuple[Array, Array]:
  """(stop [B], new history [S, B, C]) after a step whose argmax canvas is `argmax` [B, C].

  'stable': the argmax equals every one of the last `stability_threshold` argmax canvases (the history
  starts at -1, so never on the first step) and the mean entropy is below `confidence_threshold`.
  'fixed': never (the step cap ends the canvas).
  """
  new_history = jnp.concatenate([history[1:], argmax[None]], axis=0)
  if config.stopping == "fixed":
    return jnp.zeros(argmax.shape[:1], bool), new_history
  if config.stability_threshold == 0:
    stable = jnp.ones(argmax.shape[:1], bool)
  else:
    stable = jnp.all(history == argmax[None], axis=(0, 2))
  confident = jnp.mean(token_entropy, axis=-1) < config.confidence_threshold
  return stable & confident, new_history

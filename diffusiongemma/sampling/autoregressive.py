"""Autoregressive decoding with the causal encoder: one `lax.while_loop`, one token per forward pass.

Axes: B batch, M new tokens, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


@flax.struct.dataclass
class ARSampleOutput:
  """tokens [B, M] (pad after a row's first stop token); num_forward_passes [B] (one per new token)."""

  tokens: Array
  num_forward_passes: Array


def sample_token(key: Array, logits: Array, temperature: Array, top_p: Array) -> Array:
  """One token from logits [V]: argmax when temperature == 0, else nucleus sampling at `temperature`."""
  greedy = jnp.argmax(logits)
  scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  order = jnp.argsort(-scaled, stable=True)
  probs = jax.nn.softmax(scaled)[order]
  keep_sorted = jnp.cumsum(probs) - probs < top_p  # the smallest prefix reaching top_p (at least one)
  keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
  sampled = jax.random.categorical(key, jnp.where(keep, scaled, -jnp.inf))
  return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def decode(encode: Callable, last_logits: Array, cache, keys: Array, temperature: Array, top_p: Array,
           stop_tokens: Array, pad_id: int, max_new_tokens: int) -> ARSampleOutput:
  """Decodes up to `max_new_tokens` after the prompt whose last logits [B, V] and cache are given.

  `encode(tokens [B, 1], cache) -> (logits [B, 1, V], cache)` appends one token per row. Row b's i-th
  token uses key fold_in(keys[b], i). Stops when every row has produced a stop token.
  """
  b = last_logits.shape[0]

  def body(carry):
    i, logits, cache, tokens, finished, passes = carry
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, i)
    token = jax.vmap(sample_token, in_axes=(0, 0, None, None))(step_keys, logits, temperature, top_p)
    token = jnp.where(finished, pad_id, token)
    tokens = tokens.at[:, i].set(token)
    passes = passes + (~finished).astype(jnp.int32)
    finished = finished | jnp.isin(token, stop_tokens)
    logits, cache = jax.lax.cond(i + 1 < max_new_tokens, lambda c: encode(token[:, None], c),
                                 lambda c: (logits[:, None], c), cache)
    return i + 1, logits[:, 0], cache, tokens, finished, passes

  carry = (jnp.zeros((), jnp.int32), last_logits, cache, jnp.full((b, max_new_tokens), pad_id, jnp.int32),
           jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32))
  carry = jax.lax.while_loop(lambda c: (c[0] < max_new_tokens) & ~jnp.all(c[4]), body, carry)
  return ARSampleOutput(tokens=carry[3], num_forward_passes=carry[5])

"""Discrete noise processes for block diffusion: uniform-state (released) and masked (absorbing).

Both corrupt each token independently with probability t (a linear schedule, alpha_t = 1 - t) and
return the noisy tokens with the per-position loss weights of their training objective:

- `UniformNoise`: a corrupted token is replaced by one drawn uniformly from the whole vocabulary (it
  may equal the original). The released model's loss is a plain cross-entropy over every position of
  the canvas, corrupted and clean alike (weight 1, no 1/t).
- `MaskedNoise`: a corrupted token becomes `mask_token_id` (MDLM/LLaDA absorbing state). The loss is
  the continuous-time ELBO: cross-entropy on masked positions only, weighted by 1/t, so its mean per
  token bounds the negative log-likelihood and exp() of it bounds the perplexity. The model never has
  to predict the mask token, so its logit is removed before the cross-entropy.

The mask token is the last id of the model vocabulary (`vocab_size - 1`) unless the config names one;
the tokenizer must not use it (see `mask_token_id`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array
NOISES = ("uniform", "masked")


@dataclasses.dataclass(frozen=True)
class UniformNoise:
  """Replace each token with probability t by a uniformly random token of the vocabulary."""

  vocab_size: int
  name = "uniform"
  mask_token_id = None

  def corrupt(self, rng: Array, tokens: Array, t: Array) -> tuple[Array, Array]:
    """(noisy tokens, corrupted mask) for `tokens` [...] and `t` broadcastable to them."""
    k_pick, k_token = jax.random.split(rng)
    corrupted = jax.random.uniform(k_pick, tokens.shape) < t
    random_tokens = jax.random.randint(k_token, tokens.shape, 0, self.vocab_size, tokens.dtype)
    return jnp.where(corrupted, random_tokens, tokens), corrupted

  def loss_weights(self, corrupted: Array, t: Array) -> Array:
    del t
    return jnp.ones(corrupted.shape, jnp.float32)

  def prepare_logits(self, logits: Array) -> Array:
    return logits


@dataclasses.dataclass(frozen=True)
class MaskedNoise:
  """Replace each token with probability t by `mask_token_id` (absorbing state)."""

  vocab_size: int
  mask_token_id: int
  name = "masked"

  def corrupt(self, rng: Array, tokens: Array, t: Array) -> tuple[Array, Array]:
    corrupted = jax.random.uniform(rng, tokens.shape) < t
    return jnp.where(corrupted, jnp.asarray(self.mask_token_id, tokens.dtype), tokens), corrupted

  def loss_weights(self, corrupted: Array, t: Array) -> Array:
    return corrupted.astype(jnp.float32) / t

  def prepare_logits(self, logits: Array) -> Array:
    """The mask token is never a target: its logit is removed before the softmax.

    A large finite negative rather than -inf, so that clean positions (weight 0) never give 0 * inf.
    """
    return logits.at[..., self.mask_token_id].set(-1e9)


def mask_token_id(vocab_size: int, configured: int = -1) -> int:
  """The absorbing-state token: `configured` if >= 0, else the last id of the model vocabulary."""
  token = vocab_size - 1 if configured < 0 else configured
  if not 0 <= token < vocab_size:
    raise ValueError(f"mask_token_id {token} is outside the model vocabulary [0, {vocab_size}).")
  return token


def make_noise(name: str, vocab_size: int, mask_token: int = -1) -> UniformNoise | MaskedNoise:
  """The noise process called `name` ('uniform' or 'masked') over `vocab_size` tokens."""
  if name == "uniform":
    return UniformNoise(vocab_size)
  if name == "masked":
    return MaskedNoise(vocab_size, mask_token_id(vocab_size, mask_token))
  raise ValueError(f"Unknown noise {name!r} (config.diffusion.noise); expected one of {NOISES}.")


def sample_time(rng: Array, shape, eps: float) -> Array:
  """Noise levels t ~ U(eps, 1 - eps)."""
  return jax.random.uniform(rng, shape, jnp.float32, eps, 1.0 - eps)

"""Discrete noise processes of block diffusion: uniform-state (released) and masked (absorbing).

A noise process is one frozen object that training and sampling share, so that a model is always sampled
with the noise it learned (`for_model(model_config)`; `ModelConfig.noise` names it):

- training: `corrupt` a clean canvas at noise level t (each token independently with probability t, a
  linear schedule alpha_t = 1 - t), the per-position `loss_weights` of its objective, and `prepare_logits`
  (the token that must never be predicted is removed);
- sampling: the `initial_canvas`, which positions may still change (`fixed` marks those that may not),
  and `renoise`, what becomes of the positions a step did not accept.

`UniformNoise` (released): a corrupted token is replaced by one drawn uniformly from the whole vocabulary
(it may equal the original); the loss is a plain cross-entropy over every position of the canvas,
corrupted and clean alike (weight 1, no 1/t). Sampling starts from uniformly random tokens and re-draws
every position that was not accepted: nothing is ever fixed (the released algorithm), unless an initial
canvas gives positions that must stay (infilling).

`MaskedNoise` (MDLM/LLaDA): a corrupted token becomes `mask_token_id`. The loss is the continuous-time
ELBO: cross-entropy on masked positions only, weighted by 1/t, so its mean per token bounds the negative
log-likelihood (`loss_is_elbo`). The model never has to predict the mask token, so its logit is removed.
Sampling starts from all mask tokens; accepted tokens are fixed for good; the others stay masked. The
mask token is the last id of the vocabulary unless one is named; the tokenizer must not use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp

Array = jax.Array
NEVER_LOGIT = -1e9  # the logit of a token that must never be predicted or sampled (finite: 0 * NEVER is 0)


class NoiseProcess(Protocol):
  """What training and sampling need of a noise process (see the module docstring)."""

  name: str
  vocab_size: int
  loss_is_elbo: bool  # the weighted loss bounds the negative log-likelihood

  @property
  def never_token(self) -> int | None: ...

  def corrupt(self, rng: Array, tokens: Array, t: Array) -> tuple[Array, Array]: ...

  def loss_weights(self, corrupted: Array, t: Array) -> Array: ...

  def prepare_logits(self, logits: Array) -> Array: ...

  def initial_canvas(self, keys: Array, length: int) -> Array: ...

  def initial_fixed(self, canvas: Array) -> Array: ...

  def renoise(self, keys: Array, canvas: Array, sampled: Array, accepted: Array,
              fixed: Array) -> tuple[Array, Array]: ...


def uniform_tokens(keys: Array, length: int, vocab_size: int) -> Array:
  """Per-row uniformly random tokens over the whole vocabulary: keys [B] -> [B, length]."""
  return jax.vmap(lambda k: jax.random.randint(k, (length,), 0, vocab_size, jnp.int32))(keys)


def _check_vocab(vocab_size) -> None:
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
    raise ValueError(f"vocab_size={vocab_size!r} is invalid: a noise process needs an integer >= 2.")


@dataclasses.dataclass(frozen=True)
class UniformNoise:
  """Replace each token with probability t by a uniformly random token of the vocabulary."""

  vocab_size: int
  name: ClassVar[str] = "uniform"
  loss_is_elbo: ClassVar[bool] = False

  def __post_init__(self):
    _check_vocab(self.vocab_size)

  @property
  def never_token(self) -> None:
    return None

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

  def initial_canvas(self, keys: Array, length: int) -> Array:
    """Uniformly random tokens [B, length], one key per row."""
    return uniform_tokens(keys, length, self.vocab_size)

  def initial_fixed(self, canvas: Array) -> Array:
    return jnp.zeros(canvas.shape, bool)

  def renoise(self, keys, canvas, sampled, accepted, fixed):
    """Accepted positions take their sample; every other position that is not fixed is re-drawn."""
    fresh = uniform_tokens(keys, canvas.shape[-1], self.vocab_size)
    return jnp.where(fixed, canvas, jnp.where(accepted, sampled, fresh)), fixed


@dataclasses.dataclass(frozen=True)
class MaskedNoise:
  """Replace each token with probability t by `mask_token_id` (absorbing state); None: `vocab_size - 1`."""

  vocab_size: int
  mask_token_id: int | None = None
  name: ClassVar[str] = "masked"
  loss_is_elbo: ClassVar[bool] = True

  def __post_init__(self):
    _check_vocab(self.vocab_size)
    token = self.vocab_size - 1 if self.mask_token_id in (None, -1) else self.mask_token_id
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
      raise ValueError(f"mask_token_id={self.mask_token_id!r} is outside the model vocabulary "
                       f"[0, {self.vocab_size}) (None or -1: the last id, {self.vocab_size - 1}).")
    object.__setattr__(self, "mask_token_id", token)

  @property
  def never_token(self) -> int:
    return self.mask_token_id

  def corrupt(self, rng: Array, tokens: Array, t: Array) -> tuple[Array, Array]:
    corrupted = jax.random.uniform(rng, tokens.shape) < t
    return jnp.where(corrupted, jnp.asarray(self.mask_token_id, tokens.dtype), tokens), corrupted

  def loss_weights(self, corrupted: Array, t: Array) -> Array:
    return corrupted.astype(jnp.float32) / t

  def prepare_logits(self, logits: Array) -> Array:
    """The mask token is never a target nor a sample: its logit becomes `NEVER_LOGIT`."""
    return logits.at[..., self.mask_token_id].set(NEVER_LOGIT)

  def initial_canvas(self, keys: Array, length: int) -> Array:
    return jnp.full((keys.shape[0], length), self.mask_token_id, jnp.int32)

  def initial_fixed(self, canvas: Array) -> Array:
    """Given tokens of an initial canvas (anything but the mask) stay."""
    return canvas != self.mask_token_id

  def renoise(self, keys, canvas, sampled, accepted, fixed):
    """Accepted positions take their sample and are fixed for good; the others stay masked."""
    del keys
    accepted = accepted & ~fixed
    return jnp.where(accepted, sampled, canvas), fixed | accepted


# Noise process names (`ModelConfig.noise`, `config.diffusion.noise`) -> (vocab_size, mask_token_id) -> process.
PROCESSES: dict[str, Callable[[int, int | None], NoiseProcess]] = {
    "uniform": lambda vocab_size, mask_token_id: UniformNoise(vocab_size),
    "masked": MaskedNoise,
}


def for_model(config) -> NoiseProcess:
  """The noise process a model was trained with: `config.noise` (a `ModelConfig`) over its vocabulary."""
  if config.noise not in PROCESSES:
    raise ValueError(f"ModelConfig.noise={config.noise!r} is unknown; expected one of {tuple(PROCESSES)}.")
  return PROCESSES[config.noise](config.vocab_size, config.mask_token_id)


def sample_time(rng: Array, shape, eps: float) -> Array:
  """Noise levels t ~ U(eps, 1 - eps)."""
  return jax.random.uniform(rng, shape, jnp.float32, eps, 1.0 - eps)

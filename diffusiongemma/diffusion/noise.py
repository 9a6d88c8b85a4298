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

Likelihood bound (`nelbo_terms`, what `evaluation.likelihood` estimates with samples of t): per position,
the integrand over t of the continuous-time negative ELBO of the process, for a model whose reverse
process is parameterised by its clean-token prediction softmax(logits). Masked: the MDLM term, 1/t x the
cross-entropy on masked positions (the weighted loss itself). Uniform (the released model trains with
plain cross-entropy, which is not a bound): with K tokens, alpha = 1 - t, the true and the model's
marginals r = q_t(. | x0) = alpha e_x0 + (1 - alpha) / K and m = alpha p + (1 - alpha) / K, forward rate
beta = 1 / alpha, the reverse rates out of the noisy token z are R(z -> y) = beta / K r_y / r_z and the
model's R'(z -> y) = beta / K m_y / m_z, and the term is the path-measure KL rate
sum_{y != z} R' - R + R log(R / R'), which is >= 0 and 0 when p = e_x0 (Campbell et al. 2022; the
uniform-state ELBO of Schiff et al. 2024 and Sahoo et al. 2025).
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
  fixes_accepted: bool  # accepted positions never change again (what `SamplerConfig.reuse` relies on)

  @property
  def never_token(self) -> int | None: ...

  def corrupt(self, rng: Array, tokens: Array, t: Array) -> tuple[Array, Array]: ...

  def loss_weights(self, corrupted: Array, t: Array) -> Array: ...

  def prepare_logits(self, logits: Array) -> Array: ...

  def initial_canvas(self, keys: Array, length: int) -> Array: ...

  def initial_fixed(self, canvas: Array) -> Array: ...

  def renoise(self, keys: Array, canvas: Array, sampled: Array, accepted: Array,
              fixed: Array) -> tuple[Array, Array]: ...

  def nelbo_terms(self, logits: Array, clean: Array, noisy: Array, corrupted: Array, t: Array) -> Array: ...


def _log_probs(logits: Array) -> Array:
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def uniform_nelbo_terms(logits: Array, clean: Array, noisy: Array, t: Array) -> Array:
  """The uniform-state term of the module docstring, per position: logits [..., K], clean, noisy and t [...].

  Written with x = K r and x' = K m (x_y = 1 - alpha, and 1 - alpha + K alpha at x0), c = log(K alpha /
  (1 - alpha)), so that log x'_y - log(1 - alpha) = softplus(c + log p_y) stays exact for tiny p_y:
    term = beta [K alpha (1[z = x0] - p_z) / (x'_z x_z)
                 + (sum_y r_y (log x_y - log x'_y) + log x'_z - log x_z) / x_z].
  """
  log_p = _log_probs(logits)  # [..., K]
  k = log_p.shape[-1]
  alpha = 1.0 - t.astype(jnp.float32)
  c = jnp.log(k * alpha) - jnp.log1p(-alpha)  # [...]
  lift = jax.nn.softplus(c[..., None] + log_p)  # [..., K]: log x'_y - log(1 - alpha)
  lift_clean = jnp.take_along_axis(lift, clean[..., None], axis=-1)[..., 0]
  lift_noisy = jnp.take_along_axis(lift, noisy[..., None], axis=-1)[..., 0]
  p_noisy = jnp.exp(jnp.take_along_axis(log_p, noisy[..., None], axis=-1)[..., 0])
  same = (noisy == clean).astype(jnp.float32)
  softplus_c = jax.nn.softplus(c)
  # sum_y r_y (log x_y - log x'_y): alpha at x0, (1 - alpha) / K spread over every y.
  cross = alpha * (softplus_c - lift_clean) + (1.0 - alpha) / k * (softplus_c - jnp.sum(lift, axis=-1))
  x_noisy = (1.0 - alpha) + k * alpha * same
  model_noisy = (1.0 - alpha) + k * alpha * p_noisy
  rates = k * alpha * (same - p_noisy) / (model_noisy * x_noisy)
  return (rates + (cross + lift_noisy - same * softplus_c) / x_noisy) / alpha


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
  fixes_accepted: ClassVar[bool] = False  # accepted tokens may change later (every position is re-drawn)

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

  def nelbo_terms(self, logits, clean, noisy, corrupted, t):
    """Per-position integrand of the negative ELBO (module docstring); t broadcastable to `clean`."""
    del corrupted  # a corrupted token may equal the clean one: the term reads the tokens themselves
    return uniform_nelbo_terms(logits, clean, noisy, jnp.broadcast_to(t, clean.shape))


@dataclasses.dataclass(frozen=True)
class MaskedNoise:
  """Replace each token with probability t by `mask_token_id` (absorbing state); None: `vocab_size - 1`."""

  vocab_size: int
  mask_token_id: int | None = None
  name: ClassVar[str] = "masked"
  loss_is_elbo: ClassVar[bool] = True
  fixes_accepted: ClassVar[bool] = True  # an accepted token stays for good

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

  def nelbo_terms(self, logits, clean, noisy, corrupted, t):
    """1/t x the cross-entropy of the clean token on masked positions (the MDLM bound), 0 elsewhere."""
    del noisy
    log_p = _log_probs(self.prepare_logits(logits))
    ce = -jnp.take_along_axis(log_p, clean[..., None], axis=-1)[..., 0]
    return self.loss_weights(corrupted, jnp.broadcast_to(t, clean.shape)) * ce


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

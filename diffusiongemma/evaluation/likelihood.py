"""Log-likelihoods of continuations under a DiffusionGemma model: exact from the causal encoder, or a
Monte Carlo estimate of the diffusion bound under the trained noise.

A request is a pair of token lists (inputs, targets), as a causal LM is scored: `inputs` is the context
followed by every target but the last, and the last len(targets) inputs predict the targets (input
j predicts the token after it). The harness builds them from text (`evaluation.harness`).

`exact`: one encoder pass; the hidden states at the target positions go through the model's own head
(the tied embedding, the float32 soft-cap: `Embedder.decode`, what the AR loss reads), log_softmax,
summed over the targets; `is_greedy` when every target is the argmax. The head runs over at most
`head_chunk` target positions at a time (a rolling window may have thousands, and the released vocabulary
is 262k). Requests are batched right-padded to a multiple of `bucket` so that nearby lengths share one
compiled program.

`elbo`: log p(continuation | context) >= -NELBO, block by block as the model generates: the clean
context and earlier canvases of the continuation sit in the cache (one encoder pass), and each canvas
of C continuation tokens is a diffusion over C positions. Per sample: one t ~ U(eps, 1 - eps) per
canvas, the continuation corrupted at t by the model's noise process, one denoiser pass (all canvases
at once, block-causally, no self-conditioning), and the noise's `nelbo_terms` summed over the
continuation positions. Positions of the last canvas after the continuation are held at full noise
(random tokens for uniform noise, the mask for masked noise) and not scored: the bound is that of the
continuation followed by anything. The estimate is the mean over `samples` draws times (1 - 2 eps) (the
integral over [eps, 1 - eps]; the two end pieces, of order eps, are left out), reported as a bound:
its expectation is a lower bound of the log-likelihood, a single estimate is not. `is_greedy` comes
from the encoder, as in `exact`. Randomness is per request (a key from its tokens), so batching does
not change a result.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Request = tuple[Sequence[int], Sequence[int]]  # (inputs, targets)
HEAD_CHUNK = 256  # target positions per pass of the vocabulary head in `exact`


def bucketed(n: int, bucket: int) -> int:
  return max(bucket, -(-n // bucket) * bucket)


def request_key(base: Array, tokens: Sequence[int], salt: int = 0) -> Array:
  """A key of `base` for these tokens (and `salt`): the same request gets the same key in any batch."""
  digest = zlib.crc32(np.asarray(tokens, np.int64).tobytes()) & 0x7FFFFFFF
  return jax.random.fold_in(jax.random.fold_in(base, digest), salt)


def _pad_batch(requests: Sequence[Request], pad_id: int, bucket: int, target_bucket: int):
  """inputs [B, L], lengths [B], targets [B, T], target positions [B, T], target mask [B, T]."""
  b = len(requests)
  length = bucketed(max(len(i) for i, _ in requests), bucket)
  width = bucketed(max(len(t) for _, t in requests), target_bucket)
  inputs = np.full((b, length), pad_id, np.int32)
  lengths = np.zeros((b,), np.int32)
  targets = np.zeros((b, width), np.int32)
  positions = np.zeros((b, width), np.int32)
  mask = np.zeros((b, width), bool)
  for row, (inp, tgt) in enumerate(requests):
    n, m = len(inp), len(tgt)
    inputs[row, :n], lengths[row] = inp, n
    targets[row, :m] = tgt
    positions[row, :m] = np.arange(n - m, n)
    mask[row, :m] = True
  return inputs, lengths, targets, positions, mask


def _head(module, x):
  return module.embedder.decode(x)


@functools.partial(jax.jit, static_argnames=("model", "chunk"))
def _exact(model, variables, inputs, lengths, targets, positions, mask, *, chunk: int):
  hidden, _ = model.apply(variables, inputs, num_tokens=lengths, return_hidden=True, method=model.encode)
  picked = jnp.take_along_axis(hidden, positions[..., None], axis=1)  # [B, T, D]
  b, t, d = picked.shape

  def score(part):
    x, target = part  # [B, chunk, D], [B, chunk]
    logits = model.apply(variables, x, method=_head)  # [B, chunk, V] float32, soft-capped
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return (jnp.take_along_axis(log_p, target[..., None], axis=-1)[..., 0],
            jnp.argmax(logits, axis=-1) == target)

  split = lambda x: jnp.moveaxis(x.reshape(b, t // chunk, chunk, *x.shape[2:]), 1, 0)
  token_log_p, hits = jax.lax.map(score, (split(picked), split(targets)))  # [T / chunk, B, chunk]
  token_log_p, hits = (jnp.moveaxis(x, 0, 1).reshape(b, t) for x in (token_log_p, hits))
  return jnp.sum(jnp.where(mask, token_log_p, 0.0), axis=-1), jnp.all(hits | ~mask, axis=-1)


def exact(model, variables, requests: Sequence[Request], *, bucket: int = 64,
          head_chunk: int = HEAD_CHUNK) -> list[tuple[float, bool]]:
  """(summed log-probability of the targets, is_greedy) per request, in one padded batch; the head runs
  over `head_chunk` target positions at a time, so a long window never holds all its [T, V] logits."""
  longest = max(len(t) for _, t in requests)
  chunk = min(head_chunk, bucketed(longest, 16))
  arrays = _pad_batch(requests, model.config.pad_id, bucket, chunk)
  log_p, greedy = jax.device_get(_exact(model, variables, *map(jnp.asarray, arrays), chunk=chunk))
  return [(float(lp), bool(g)) for lp, g in zip(log_p, greedy)]


@functools.partial(jax.jit, static_argnames=("model", "noise", "samples", "eps"))
def _elbo(model, noise, variables, inputs, lengths, starts, clean, scored, keys, *, samples: int, eps: float):
  """-NELBO estimate [B]: clean [B, n * C] continuation tokens (pad after), scored [B, n * C] bool."""
  c = model.config.canvas_length
  b, width = clean.shape
  _, cache = model.apply(variables, inputs, num_tokens=lengths, method=model.encode)
  cache = cache.with_length(starts)
  block = jnp.arange(width) // c  # [n * C]

  def one(key):
    k_t, k_noise, k_tail = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, 3))(key), 1, 0)
    t = jax.vmap(lambda k: jax.random.uniform(k, (width // c,), jnp.float32, eps, 1.0 - eps))(k_t)[:, block]
    noisy, corrupted = jax.vmap(noise.corrupt)(k_noise, clean, t)
    full, _ = jax.vmap(noise.corrupt)(k_tail, clean, jnp.ones_like(t))
    noisy = jnp.where(scored, noisy, full)
    logits = model.apply(variables, noisy, cache, block_length=c, method=model.denoise)  # [B, n * C, V]
    terms = noise.nelbo_terms(logits, clean, noisy, corrupted, t)
    return jnp.sum(jnp.where(scored, terms, 0.0), axis=-1)  # [B]

  sample_keys = jax.vmap(lambda k: jax.random.split(k, samples))(keys)  # [B, S]
  total = jax.lax.map(one, jnp.moveaxis(sample_keys, 1, 0))  # [S, B]
  return -(1.0 - 2.0 * eps) * jnp.mean(total, axis=0)


def elbo(model, variables, noise, requests: Sequence[Request], base_key: Array, *, samples: int,
         eps: float = 1e-4, bucket: int = 64) -> list[float]:
  """The bound's estimate per request (module docstring), in one padded batch."""
  pad_id = model.config.pad_id
  # The encoder reads the context and the whole continuation: the clean cache of earlier canvases.
  sequences = [list(inp) + [tgt[-1]] for inp, tgt in requests]
  inputs, lengths, *_ = _pad_batch([(s, s[-1:]) for s in sequences], pad_id, bucket, 1)
  width = bucketed(max(len(t) for _, t in requests), model.config.canvas_length)
  clean = np.full((len(requests), width), pad_id, np.int32)
  scored = np.zeros(clean.shape, bool)
  for row, (_, tgt) in enumerate(requests):
    clean[row, :len(tgt)], scored[row, :len(tgt)] = tgt, True
  starts = np.array([len(s) - len(t) for s, (_, t) in zip(sequences, requests)], np.int32)
  keys = jnp.stack([request_key(base_key, s) for s in sequences])
  values = _elbo(model, noise, variables, *map(jnp.asarray, (inputs, lengths, starts, clean, scored)), keys,
                 samples=samples, eps=float(eps))
  return [float(v) for v in jax.device_get(values)]

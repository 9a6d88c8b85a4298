"""`ARSampler`: token-by-token decoding with the causal encoder, the diffusion sampler's yardstick.

The same weights and KV cache as diffusion sampling, one token per forward pass, in one `lax.while_loop`.

Axes: B batch, M new tokens, V vocab.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from diffusiongemma.model.attention import KVCache
from diffusiongemma.sampling import prompts as prompts_lib

Array = jax.Array


@flax.struct.dataclass
class ARSampleOutput:
  """tokens [B, M] (pad after a row's first stop token); num_forward_passes [B] (one per new token)."""

  tokens: Array
  num_forward_passes: Array


@flax.struct.dataclass
class _DecodeLoop:
  """The carry of the decoding loop."""

  index: Array  # [] int32: the position (in new tokens) being decoded
  logits: Array  # [B, V] the logits that predict it
  cache: KVCache
  tokens: Array  # [B, M]
  finished: Array  # [B] bool
  passes: Array  # [B] int32


def _nucleus(scaled: Array, top_p) -> Array:
  """[V] bool: the smallest set of tokens, most likely first, whose probability reaches `top_p` (at least
  one; every token when top_p >= 1)."""
  order = jnp.argsort(-scaled, stable=True)
  probs = jax.nn.softmax(scaled)[order]
  keep_sorted = jnp.cumsum(probs) - probs < top_p
  return jnp.zeros_like(keep_sorted).at[order].set(keep_sorted) | (top_p >= 1)


def nucleus_log_probs(logits: Array, temperature, top_p) -> Array:
  """[..., V] float32: the log-probabilities `sample_token` draws from at temperature > 0 (softmax of
  logits / temperature over the nucleus of `top_p`, renormalised; -inf outside it)."""
  scaled = logits.astype(jnp.float32) / temperature
  if isinstance(top_p, (int, float)) and top_p >= 1:  # known here: no sort
    return jax.nn.log_softmax(scaled, axis=-1)
  keep = jnp.vectorize(_nucleus, signature="(v),()->(v)")(scaled, top_p)
  return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)


def sample_token(key: Array, logits: Array, temperature: Array, top_p: Array) -> Array:
  """One token from logits [V]: argmax when temperature == 0, else nucleus sampling at `temperature`."""
  def sample(logits):
    scaled = logits.astype(jnp.float32) / temperature
    return jax.random.categorical(key, jnp.where(_nucleus(scaled, top_p), scaled, -jnp.inf)).astype(jnp.int32)

  greedy = lambda logits: jnp.argmax(logits).astype(jnp.int32)
  return jax.lax.cond(temperature > 0, sample, greedy, logits)  # greedy decoding sorts nothing


class ARSampler(prompts_lib.StaticArgument):
  """Autoregressive decoding of a DiffusionGemma's encoder: greedy, or temperature with nucleus (top-p).

  One compiled program per (sampler, batch size, prompt bucket, max_new_tokens); a row stops after a
  stop token (then pad); the loop ends when every row has. Row b's i-th token uses key
  fold_in(keys[b], i), so rows are independent of their batch.
  """

  def __init__(self, model: nn.Module, *, stop_tokens=None, prompt_bucket: int = 64):
    self.model = model
    self.stop_tokens = prompts_lib.check_stop_tokens(stop_tokens, model.config)
    if isinstance(prompt_bucket, bool) or not isinstance(prompt_bucket, int) or prompt_bucket < 1:
      raise ValueError(f"prompt_bucket={prompt_bucket!r} is invalid: must be a positive integer.")
    self.prompt_bucket = prompt_bucket

  def _key(self):
    return (self.model, self.stop_tokens, self.prompt_bucket)

  def generate(self, params, prompt_tokens, rng, max_new_tokens: int = 256, prompt_lengths=None, *,
               temperature: float = 0.0, top_p: float = 1.0) -> ARSampleOutput:
    """Up to `max_new_tokens` tokens after each prompt (inputs as `Sampler.generate`).

    temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to the smallest set of
    tokens whose probability reaches `top_p` (nucleus).
    """
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
      raise ValueError(f"temperature={temperature!r} is invalid: must be >= 0 (0 is greedy).")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
      raise ValueError(f"top_p={top_p!r} is invalid: must lie in (0, 1].")
    max_new_tokens = prompts_lib.check_max_new_tokens(max_new_tokens)
    prompt, lengths = prompts_lib.prepare(self.model.config, prompt_tokens, prompt_lengths, max_new_tokens,
                                          self.prompt_bucket)
    return _program(self, prompts_lib.variables(params), prompt, lengths,
                    prompts_lib.row_keys(rng, prompt.shape[0]), jnp.float32(temperature), jnp.float32(top_p),
                    max_new_tokens=max_new_tokens)


@functools.partial(jax.jit, static_argnames=("sampler", "max_new_tokens"))
def _program(sampler: ARSampler, variables, prompt, lengths, keys, temperature, top_p, *,
             max_new_tokens: int) -> ARSampleOutput:
  model, mc = sampler.model, sampler.model.config
  b = prompt.shape[0]
  stop_tokens = jnp.asarray(sampler.stop_tokens, jnp.int32)
  encode = lambda tokens, cache, num=None: model.apply(variables, tokens, cache, num_tokens=num,
                                                       method=model.encode)
  logits, cache = encode(prompt, KVCache.empty(mc, b, prompt.shape[1] + max_new_tokens), lengths)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]

  def body(loop: _DecodeLoop) -> _DecodeLoop:
    i = loop.index
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, i)
    token = jax.vmap(sample_token, in_axes=(0, 0, None, None))(step_keys, loop.logits, temperature, top_p)
    token = jnp.where(loop.finished, mc.pad_id, token)
    logits, cache = jax.lax.cond(i + 1 < max_new_tokens, lambda c: encode(token[:, None], c),
                                 lambda c: (loop.logits[:, None], c), loop.cache)
    return _DecodeLoop(index=i + 1, logits=logits[:, 0], cache=cache, tokens=loop.tokens.at[:, i].set(token),
                       finished=loop.finished | jnp.isin(token, stop_tokens),
                       passes=loop.passes + (~loop.finished).astype(jnp.int32))

  loop = _DecodeLoop(index=jnp.zeros((), jnp.int32), logits=last, cache=cache,
                     tokens=jnp.full((b, max_new_tokens), mc.pad_id, jnp.int32),
                     finished=jnp.zeros((b,), bool), passes=jnp.zeros((b,), jnp.int32))
  loop = jax.lax.while_loop(lambda lp: (lp.index < max_new_tokens) & ~jnp.all(lp.finished), body, loop)
  return ARSampleOutput(tokens=loop.tokens, num_forward_passes=loop.passes)

"""`Sampler`: block-diffusion generation as one compiled program, and autoregressive decoding.

Axes: B batch, L prompt length, C canvas, K canvases, N steps, V vocab.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Mapping

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma.model.attention import KVCache
from diffusiongemma.sampling import autoregressive, steps
from diffusiongemma.sampling.config import SamplerConfig

Array = jax.Array


@flax.struct.dataclass
class SampleOutput:
  """What `generate` returns.

  tokens [B, K * C]: the new tokens only (not the prompt), all K = ceil(max_new_tokens / C) canvases
    (not truncated to max_new_tokens, as the reference); after a row's first stop token, pad.
  num_denoiser_passes [B]: passes that counted for the row (none after it stopped or finished).
  tokens_per_forward [B]: non-pad new tokens / num_denoiser_passes (the reference's definition).
  canvas_passes [B, K]: denoiser passes (steps) per canvas; 0 for canvases after a row finished.
  trace: with `return_trace`, a `StepTrace` of [K, N, B, C] arrays (argmax canvas, canvas after
    re-noising, accepted positions) for every step; else None.
  """

  tokens: Array
  num_denoiser_passes: Array
  tokens_per_forward: Array
  canvas_passes: Array
  trace: steps.StepTrace | None = None


def _variables(params) -> dict:
  """Accepts a bare parameter tree or `{'params': ...}` variables."""
  if isinstance(params, Mapping) and set(params.keys()) == {"params"}:
    return dict(params)
  return {"params": params}


def _check_max_new_tokens(max_new_tokens) -> int:
  if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
      or max_new_tokens < 1):
    raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: must be an integer >= 1.")
  return int(max_new_tokens)


def row_keys(rng, batch_size: int) -> Array:
  """One typed PRNG key per row: a single key is split; [B] keys (typed or raw) are used as given."""
  rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.shape == (2,) or rng.shape == (batch_size, 2):
      rng = jax.random.wrap_key_data(rng.astype(jnp.uint32))
    else:
      raise ValueError(f"rng must be a PRNG key or {batch_size} keys (one per row), got shape {rng.shape}.")
  if rng.shape == ():
    return jax.random.split(rng, batch_size)
  if rng.shape != (batch_size,):
    raise ValueError(f"rng must be a PRNG key or {batch_size} keys (one per row), got shape {rng.shape}.")
  return rng


class Sampler:
  """Block-diffusion sampling with the released algorithm (transformers' `generate`), fully compiled.

  For each canvas of C tokens, until K = ceil(max_new_tokens / C) canvases or every row has stopped:
    1. start from uniformly random tokens over the whole vocabulary (masked noise: all mask tokens);
    2. for n = N .. 1 steps remaining, while the row is not done: one denoiser pass over the canvas,
       with the previous pass's temperature-scaled logits as self-conditioning; sample every position
       from softmax(logits / T_n), T_n = t_min + (t_max - t_min) n / N; keep the samples the acceptance
       rule accepts (default: the entropy bound, at least one per step) and re-noise every other
       position; the row is done when the stopping rule fires (default: argmax canvas unchanged and mean
       entropy below the confidence threshold); done rows stop changing and stop counting passes;
    3. commit the argmax canvas; pad everything after the first stop token; a row with a stop token is
       finished and its later canvases are pad;
    4. encode the committed canvas into the KV cache and go on to the next canvas.

  The whole of it is one `jax.jit` program (a `lax.while_loop` over canvases around a `lax.while_loop`
  over steps), compiled once per (model, config, batch size, prompt-length bucket, number of canvases):
  the sampler is a static argument (hashed by its frozen model and config, so equal samplers share
  programs) and nothing returns to the host between steps. Randomness is per row (one key per row,
  folded with the canvas and step indices), so a row's output does not depend on the other rows of its
  batch.
  """

  _traces: collections.Counter = collections.Counter()  # (model, config) -> traces of its program

  def __init__(self, model: nn.Module, config: SamplerConfig | None = None):
    self.model = model
    self.config = config = config or SamplerConfig()
    mc = model.config
    if config.canvas_length is not None and config.canvas_length != mc.canvas_length:
      raise ValueError(f"SamplerConfig.canvas_length={config.canvas_length} differs from the model's "
                       f"canvas_length={mc.canvas_length}; use None or {mc.canvas_length}.")
    self.stop_tokens = config.stop_tokens if config.stop_tokens is not None else (mc.eos_id,)
    bad = [t for t in self.stop_tokens if not 0 <= t < mc.vocab_size]
    if bad:
      raise ValueError(f"SamplerConfig.stop_tokens={self.stop_tokens} has ids {bad} outside the vocabulary "
                       f"[0, {mc.vocab_size}).")
    if config.noise == "masked" and not 0 <= steps.mask_token(config, mc.vocab_size) < mc.vocab_size:
      raise ValueError(f"SamplerConfig.mask_token_id={config.mask_token_id} is outside the vocabulary "
                       f"[0, {mc.vocab_size}).")

  def _key(self):
    return (self.model, self.config)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, Sampler) and self._key() == other._key()

  @property
  def trace_count(self) -> int:
    """How many times the generation program of this (model, config) was traced (= compiled)."""
    return Sampler._traces[self._key()]

  @property
  def canvas_length(self) -> int:
    return self.model.config.canvas_length

  # ---------------------------------------------------------------------------------------- inputs
  def _prepare(self, prompt_tokens, prompt_lengths, new_positions: int):
    """Validated, bucket-padded prompts [B, L'] and lengths [B] (host-side, before compiling).

    `prompt_tokens` may also be a list of token lists of different lengths (padded here).
    """
    mc = self.model.config
    ragged = isinstance(prompt_tokens, (list, tuple)) and prompt_tokens and all(
        isinstance(p, (list, tuple, np.ndarray)) for p in prompt_tokens)
    if ragged and prompt_lengths is None and len({len(p) for p in prompt_tokens}) > 1:
      prompt_lengths = [len(p) for p in prompt_tokens]
      width = max(prompt_lengths)
      prompt_tokens = [list(p) + [mc.pad_id] * (width - len(p)) for p in prompt_tokens]
    prompt = np.asarray(prompt_tokens)
    if prompt.ndim == 1:
      prompt = prompt[None]
    if prompt.ndim != 2 or not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(f"prompt_tokens must be integer token ids of shape [batch, length], got shape "
                       f"{prompt.shape} and dtype {prompt.dtype}.")
    b, l = prompt.shape
    if b == 0 or l == 0:
      raise ValueError(f"Empty prompt: prompt_tokens has shape {prompt.shape}; every row needs at least one "
                       "token (e.g. BOS).")
    if prompt_lengths is None:
      lengths = np.full((b,), l, np.int32)
    else:
      lengths = np.asarray(prompt_lengths).astype(np.int32).reshape(-1)
      if lengths.shape != (b,):
        raise ValueError(f"prompt_lengths has shape {lengths.shape}; expected ({b},), one per row.")
      if (lengths < 1).any():
        raise ValueError(f"Empty prompt: prompt_lengths={lengths.tolist()} has rows of length < 1.")
      if (lengths > l).any():
        raise ValueError(f"prompt_lengths={lengths.tolist()} exceeds the prompt_tokens length {l}.")
    real = np.arange(l)[None] < lengths[:, None]
    outside = real & ((prompt < 0) | (prompt >= mc.vocab_size))
    if outside.any():
      raise ValueError(f"prompt_tokens has ids outside the vocabulary [0, {mc.vocab_size}): "
                       f"{sorted(set(prompt[outside].tolist()))[:10]}.")
    longest = int(lengths.max())
    if longest + new_positions > mc.max_positions:
      raise ValueError(f"The prompt is too long: {longest} prompt tokens + {new_positions} new positions "
                       f"exceed the model's max_positions={mc.max_positions}.")
    bucket = self.config.prompt_bucket
    padded = -(-l // bucket) * bucket
    prompt = np.where(real, prompt, mc.pad_id)
    prompt = np.pad(prompt, ((0, 0), (0, padded - l)), constant_values=mc.pad_id)
    return jnp.asarray(prompt, jnp.int32), jnp.asarray(lengths, jnp.int32)

  def _initial_canvas(self, initial_canvas, batch_size: int, num_canvases: int) -> tuple[Array, Array]:
    """(canvases [B, K * C], how many of them are given) so that the compiled shapes never change."""
    c, v = self.canvas_length, self.model.config.vocab_size
    full = np.zeros((batch_size, num_canvases * c), np.int32)
    if initial_canvas is None:
      return jnp.asarray(full), jnp.zeros((), jnp.int32)
    canvas = np.asarray(initial_canvas)
    if canvas.ndim == 1:
      canvas = canvas[None]
    if (canvas.ndim != 2 or canvas.shape[0] != batch_size or canvas.shape[1] % c
        or not 0 < canvas.shape[1] // c <= num_canvases):
      raise ValueError(f"initial_canvas has shape {canvas.shape}; expected [{batch_size}, k * {c}] (the "
                       f"model's canvas length {c}) for the first k <= {num_canvases} canvases.")
    if not np.issubdtype(canvas.dtype, np.integer) or ((canvas < 0) | (canvas >= v)).any():
      raise ValueError(f"initial_canvas must hold token ids in the vocabulary [0, {v}).")
    full[:, :canvas.shape[1]] = canvas
    return jnp.asarray(full), jnp.asarray(canvas.shape[1] // c, jnp.int32)

  # ---------------------------------------------------------------------------------------- diffusion
  def generate(self, params, prompt_tokens, rng, max_new_tokens: int = 256, prompt_lengths=None,
               initial_canvas=None, *, return_trace: bool = False) -> SampleOutput:
    """Generates ceil(max_new_tokens / C) canvases after each prompt.

    prompt_tokens [B, L] (right-padded when `prompt_lengths` [B] is given); rng: one key (split per row)
    or [B] keys; initial_canvas [B, k * C]: the starting tokens of the first k canvases (instead of
    random ones), e.g. the reference's `decoder_input_ids`.
    """
    num_canvases = math.ceil(_check_max_new_tokens(max_new_tokens) / self.canvas_length)
    prompt, lengths = self._prepare(prompt_tokens, prompt_lengths, num_canvases * self.canvas_length)
    b = prompt.shape[0]
    canvas, num_given = self._initial_canvas(initial_canvas, b, num_canvases)
    return self._program(_variables(params), prompt, lengths, canvas, num_given, row_keys(rng, b),
                         num_canvases=num_canvases, return_trace=return_trace)

  def _denoiser(self, variables, cache: KVCache) -> steps.Denoiser:
    model = self.model
    return lambda canvas, sc, mask: model.apply(variables, canvas, cache, sc, mask, method=model.denoise)

  def _encode(self, variables, tokens, cache, num_tokens=None, logits: bool = True):
    """(logits or, with logits=False, final hidden states, cache) after appending `tokens`."""
    model = self.model
    return model.apply(variables, tokens, cache, num_tokens=num_tokens, return_hidden=not logits,
                       method=model.encode)

  def start_canvas(self, keys: Array, canvas_index) -> tuple[Array, Array]:
    """(first canvas [B, C], step keys [B]) of canvas `canvas_index`, from the row keys."""
    cfg, mc = self.config, self.model.config
    canvas_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, canvas_index)
    init_keys, step_keys = jnp.moveaxis(jax.vmap(jax.random.split)(canvas_keys), 1, 0)
    if cfg.noise == "masked":
      canvas = jnp.full((keys.shape[0], mc.canvas_length), steps.mask_token(cfg, mc.vocab_size), jnp.int32)
    else:
      canvas = steps.uniform_tokens(init_keys, mc.canvas_length, mc.vocab_size)
    return canvas, step_keys

  @functools.partial(jax.jit, static_argnames=("self", "num_canvases", "return_trace"))
  def _program(self, variables, prompt, lengths, initial, num_given, keys, *, num_canvases: int,
               return_trace: bool):
    Sampler._traces[self._key()] += 1
    cfg, mc = self.config, self.model.config
    b, c = prompt.shape[0], mc.canvas_length
    stop_tokens = jnp.asarray(self.stop_tokens, jnp.int32)
    cache = KVCache.empty(mc, b, prompt.shape[1] + num_canvases * c)
    _, cache = self._encode(variables, prompt, cache, lengths, logits=False)

    def canvas_body(carry):
      k, cache, tokens, finished, canvas_passes, trace = carry
      start, step_keys = self.start_canvas(keys, k)
      start = jnp.where(k < num_given, jax.lax.dynamic_slice_in_dim(initial, k * c, c, axis=1), start)
      state = steps.init_state(cfg, start, finished, mc.vocab_size)
      state, step_trace = steps.denoise_canvas(cfg, self._denoiser(variables, cache), state, step_keys,
                                               return_trace)
      committed = state.argmax  # [B, C]
      is_stop = jnp.isin(committed, stop_tokens)
      seen = jnp.cumsum(is_stop, axis=-1)
      after_stop = (seen > 1) | ((seen == 1) & ~is_stop)
      committed = jnp.where(after_stop | finished[:, None], mc.pad_id, committed)
      tokens = jax.lax.dynamic_update_slice_in_dim(tokens, committed, k * c, axis=1)
      canvas_passes = canvas_passes.at[:, k].set(state.passes)
      if return_trace:
        trace = jax.tree.map(lambda all_, one: all_.at[k].set(one), trace, step_trace)
      finished = finished | is_stop.any(axis=-1)
      commit = lambda cc: self._encode(variables, committed, cc, logits=False)[1]
      cache = jax.lax.cond(k + 1 < num_canvases, commit, lambda cc: cc, cache)
      return k + 1, cache, tokens, finished, canvas_passes, trace

    trace = None
    if return_trace:
      shape = (num_canvases, cfg.max_denoising_steps, b, c)
      trace = steps.StepTrace(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32),
                              jnp.zeros(shape, bool))
    carry = (jnp.zeros((), jnp.int32), cache, jnp.full((b, num_canvases * c), mc.pad_id, jnp.int32),
             jnp.zeros((b,), bool), jnp.zeros((b, num_canvases), jnp.int32), trace)
    carry = jax.lax.while_loop(lambda cr: (cr[0] < num_canvases) & ~jnp.all(cr[3]), canvas_body, carry)
    _, _, tokens, _, canvas_passes, trace = carry
    passes = canvas_passes.sum(axis=-1)
    valid = jnp.sum(tokens != mc.pad_id, axis=-1)
    return SampleOutput(tokens=tokens, num_denoiser_passes=passes,
                        tokens_per_forward=valid / jnp.maximum(passes, 1), canvas_passes=canvas_passes,
                        trace=trace)

  # ---------------------------------------------------------------------------------------- AR
  def autoregressive(self, params, prompt_tokens, rng, max_new_tokens: int = 256, prompt_lengths=None, *,
                     temperature: float = 0.0, top_p: float = 1.0) -> autoregressive.ARSampleOutput:
    """Token-by-token decoding with the encoder (same weights, same KV cache): the speed baseline.

    temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to the smallest set of
    tokens whose probability reaches `top_p` (nucleus). Stops per row after a stop token (then pad).
    """
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
      raise ValueError(f"temperature={temperature!r} is invalid: must be >= 0 (0 is greedy).")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
      raise ValueError(f"top_p={top_p!r} is invalid: must lie in (0, 1].")
    max_new_tokens = _check_max_new_tokens(max_new_tokens)
    prompt, lengths = self._prepare(prompt_tokens, prompt_lengths, max_new_tokens)
    return self._ar_program(_variables(params), prompt, lengths, row_keys(rng, prompt.shape[0]),
                            jnp.float32(temperature), jnp.float32(top_p), max_new_tokens=max_new_tokens)

  @functools.partial(jax.jit, static_argnames=("self", "max_new_tokens"))
  def _ar_program(self, variables, prompt, lengths, keys, temperature, top_p, *, max_new_tokens: int):
    mc = self.model.config
    cache = KVCache.empty(mc, prompt.shape[0], prompt.shape[1] + max_new_tokens)
    logits, cache = self._encode(variables, prompt, cache, lengths)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    encode = lambda tokens, cc: self._encode(variables, tokens, cc)
    return autoregressive.decode(encode, last, cache, keys, temperature, top_p,
                                 jnp.asarray(self.stop_tokens, jnp.int32), mc.pad_id, max_new_tokens)

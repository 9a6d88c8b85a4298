"""The pure denoising step, its loop state, and the `lax.while_loop` that runs one canvas.

`denoise_step(config, denoiser, state, keys)` is a pure function of its inputs: the model enters only
through `denoiser(canvas, self_conditioning_logits, self_conditioning_mask) -> logits [B, C, V]`, and the
randomness only through one key per row, folded with the step index. Running it in a Python loop or in
`lax.while_loop` gives the same tokens.

Axes: B batch, C canvas, V vocab, N steps, S stability history.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from diffusiongemma.sampling import rules
from diffusiongemma.sampling.config import SamplerConfig

Array = jax.Array
Denoiser = Callable[[Array, Array, Array], Array]
_NEVER = -1e9  # logit of a token that must never be sampled (the mask token of masked noise)


@flax.struct.dataclass
class DenoiseState:
  """The loop carry of one canvas. Rows with `done` set no longer change (nor count passes)."""

  step: Array  # [] int32: steps taken; the next step has N - step steps remaining
  canvas: Array  # [B, C] int32: the (partly noisy) canvas the next pass sees
  argmax: Array  # [B, C] int32: argmax canvas of the last pass (what is committed)
  sc_logits: Array  # [B, C, V] float32: temperature-scaled logits fed back as self-conditioning
  has_sc: Array  # [B] bool: false before the first pass (a zero self-conditioning signal)
  history: Array  # [S, B, C] int32: the last argmax canvases, -1 before any
  fixed: Array  # [B, C] bool: masked noise: positions already unmasked (never re-noised)
  done: Array  # [B] bool
  passes: Array  # [B] int32: denoiser passes that counted for this row
  accepted: Array  # [B, C] bool: positions accepted by the last step


@flax.struct.dataclass
class StepTrace:
  """Per-step record of one canvas (with `return_trace`): [N, B, C] each; steps not run are zero."""

  argmax: Array
  canvas: Array
  accepted: Array


def mask_token(config: SamplerConfig, vocab_size: int) -> int:
  return vocab_size - 1 if config.mask_token_id is None else config.mask_token_id


def init_state(config: SamplerConfig, canvas: Array, done: Array, vocab_size: int) -> DenoiseState:
  """The state before the first pass over `canvas` [B, C]; `done` [B] rows are skipped entirely."""
  b, c = canvas.shape
  if config.noise == "masked":
    fixed = canvas != mask_token(config, vocab_size)  # given tokens of an initial canvas stay
  else:
    fixed = jnp.zeros((b, c), bool)
  return DenoiseState(
      step=jnp.zeros((), jnp.int32),
      canvas=canvas.astype(jnp.int32),
      argmax=canvas.astype(jnp.int32),
      sc_logits=jnp.zeros((b, c, vocab_size), jnp.float32),
      has_sc=jnp.zeros((b,), bool),
      history=jnp.full((rules.history_length(config), b, c), -1, jnp.int32),
      fixed=fixed,
      done=done,
      passes=jnp.zeros((b,), jnp.int32),
      accepted=jnp.zeros((b, c), bool),
  )


def uniform_tokens(keys: Array, length: int, vocab_size: int) -> Array:
  """Per-row uniformly random tokens over the whole vocabulary: keys [B] -> [B, length]."""
  return jax.vmap(lambda k: jax.random.randint(k, (length,), 0, vocab_size, jnp.int32))(keys)


def denoise_step(config: SamplerConfig, denoiser: Denoiser, state: DenoiseState, keys: Array) -> DenoiseState:
  """One denoising pass: sample, accept, re-noise, check stopping (the released algorithm).

  The denoiser sees the canvas and the previous step's scaled logits; every position is sampled from
  softmax(logits / T); the acceptance rule keeps some of the samples; uniform noise re-draws every other
  position, masked noise leaves them masked. The argmax canvas, the canvas and the logits of rows that
  were already done are kept as they were.
  """
  b, c = state.canvas.shape
  logits = denoiser(state.canvas, state.sc_logits, state.has_sc)  # [B, C, V]
  vocab_size = logits.shape[-1]
  if config.noise == "masked":
    logits = logits.at[..., mask_token(config, vocab_size)].set(_NEVER)
  scaled = logits / rules.temperature(config, config.max_denoising_steps - state.step)
  step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, state.step)
  sample_keys, noise_keys = jnp.moveaxis(jax.vmap(jax.random.split)(step_keys), 1, 0)
  sampled = jax.vmap(jax.random.categorical)(sample_keys, scaled).astype(jnp.int32)  # [B, C]
  argmax = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
  token_entropy = rules.entropy(scaled)  # [B, C]
  accepted = rules.accept(config, scaled, token_entropy, ~state.fixed)
  if config.noise == "masked":
    canvas = jnp.where(accepted, sampled, state.canvas)
    fixed = state.fixed | accepted
    argmax = jnp.where(fixed, canvas, argmax)
  else:
    canvas = jnp.where(accepted, sampled, uniform_tokens(noise_keys, c, vocab_size))
    fixed = state.fixed

  done = state.done
  keep = done[:, None]
  argmax = jnp.where(keep, state.argmax, argmax)
  canvas = jnp.where(keep, state.canvas, canvas)
  fixed = jnp.where(keep, state.fixed, fixed)
  scaled = jnp.where(keep[..., None], state.sc_logits, scaled)
  stop, history = rules.should_stop(config, state.history, argmax, token_entropy)
  if config.noise == "masked":
    stop |= jnp.all(fixed, axis=-1)  # nothing left to unmask
  return DenoiseState(
      step=state.step + 1,
      canvas=canvas,
      argmax=argmax,
      sc_logits=scaled,
      has_sc=jnp.ones((b,), bool),
      history=history,
      fixed=fixed,
      done=done | stop,
      passes=state.passes + (~done).astype(jnp.int32),
      accepted=accepted & ~keep,
  )


def should_continue(config: SamplerConfig, state: DenoiseState) -> Array:
  return (state.step < config.max_denoising_steps) & ~jnp.all(state.done)


def denoise_canvas(config: SamplerConfig, denoiser: Denoiser, state: DenoiseState, keys: Array,
                   return_trace: bool = False) -> tuple[DenoiseState, StepTrace | None]:
  """Steps until every row is done or the step cap is reached, in one `lax.while_loop`."""
  if not return_trace:
    state = jax.lax.while_loop(lambda s: should_continue(config, s),
                               lambda s: denoise_step(config, denoiser, s, keys), state)
    return state, None

  n = config.max_denoising_steps
  shape = (n,) + state.canvas.shape
  trace = StepTrace(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool))

  def body(carry):
    s, t = carry
    i = s.step
    s = denoise_step(config, denoiser, s, keys)
    t = StepTrace(t.argmax.at[i].set(s.argmax), t.canvas.at[i].set(s.canvas),
                  t.accepted.at[i].set(s.accepted))
    return s, t

  return jax.lax.while_loop(lambda carry: should_continue(config, carry[0]), body, (state, trace))

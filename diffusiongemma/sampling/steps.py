"""The pure denoising step, its loop state, and the `lax.while_loop` that runs one canvas.

`denoise_step(rules, denoiser, state, keys)` is a pure function of its inputs: the model enters only
through `denoiser(canvas, self_conditioning_logits, self_conditioning_mask) -> logits [B, C, V]`, the
process only through `rules` (schedule, noise, acceptance and stopping objects), and the randomness only
through one key per row, folded with the step index. Running it in a Python loop or in `lax.while_loop`
gives the same tokens.

Axes: B batch, C canvas, V vocab, N steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from diffusiongemma.diffusion import acceptance as acceptance_lib
from diffusiongemma.diffusion import noise as noise_lib
from diffusiongemma.diffusion import stopping as stopping_lib

Array = jax.Array
Denoiser = Callable[[Array, Array, Array], Array]


@dataclasses.dataclass(frozen=True)
class Rules:
  """Everything a denoising step needs besides the model and its randomness (hashable: static).

  Schedule: at step n of N remaining (N .. 1) the logits are divided by T = t_min + (t_max - t_min) n / N.
  """

  max_denoising_steps: int
  t_max: float
  t_min: float
  noise: noise_lib.NoiseProcess
  acceptance: acceptance_lib.AcceptanceRule
  stopping: stopping_lib.StoppingRule


@flax.struct.dataclass
class DenoiseState:
  """The loop carry of one canvas. Rows with `done` set no longer change (nor count passes)."""

  step: Array  # [] int32: steps taken; the next step has N - step steps remaining
  canvas: Array  # [B, C] int32: the (partly noisy) canvas the next pass sees
  argmax: Array  # [B, C] int32: argmax canvas of the last pass (what is committed)
  sc_logits: Array  # [B, C, V] float32: temperature-scaled logits fed back as self-conditioning
  has_sc: Array  # [B] bool: false before the first pass (a zero self-conditioning signal)
  stop_state: Any  # the stopping rule's carry (e.g. the argmax history)
  fixed: Array  # [B, C] bool: positions that may no longer change (masked noise: unmasked ones)
  done: Array  # [B] bool
  passes: Array  # [B] int32: denoiser passes that counted for this row
  accepted: Array  # [B, C] bool: positions accepted by the last step


@flax.struct.dataclass
class StepTrace:
  """Per-step record of one canvas (with `return_trace`): [N, B, C] each; steps not run are zero."""

  argmax: Array
  canvas: Array
  accepted: Array

  @classmethod
  def zeros(cls, shape) -> "StepTrace":
    return cls(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool))


def temperature(rules: Rules, remaining: Array) -> Array:
  """T = t_min + (t_max - t_min) * n / N at `remaining` steps n (N .. 1), in float32."""
  ratio = jnp.asarray(remaining, jnp.float32) / jnp.float32(rules.max_denoising_steps)
  return jnp.float32(rules.t_min) + jnp.float32(rules.t_max - rules.t_min) * ratio


def token_stats(scaled_logits: Array, keys: Array) -> acceptance_lib.TokenStats:
  """Entropy, top probability, argmax and one sample per position of softmax(scaled_logits) [B, C, V]."""
  logp = jax.nn.log_softmax(scaled_logits.astype(jnp.float32), axis=-1)
  probs = jnp.exp(logp)
  return acceptance_lib.TokenStats(
      entropy=-jnp.sum(probs * logp, axis=-1),
      confidence=jnp.max(probs, axis=-1),
      argmax=jnp.argmax(scaled_logits, axis=-1).astype(jnp.int32),
      sample=jax.vmap(jax.random.categorical)(keys, scaled_logits).astype(jnp.int32))


def init_state(rules: Rules, canvas: Array, done: Array, vocab_size: int) -> DenoiseState:
  """The state before the first pass over `canvas` [B, C]; `done` [B] rows are skipped entirely."""
  b, c = canvas.shape
  canvas = canvas.astype(jnp.int32)
  return DenoiseState(
      step=jnp.zeros((), jnp.int32),
      canvas=canvas,
      argmax=canvas,
      sc_logits=jnp.zeros((b, c, vocab_size), jnp.float32),
      has_sc=jnp.zeros((b,), bool),
      stop_state=rules.stopping.init(b, c),
      fixed=rules.noise.initial_fixed(canvas),
      done=done,
      passes=jnp.zeros((b,), jnp.int32),
      accepted=jnp.zeros((b, c), bool),
  )


def denoise_step(rules: Rules, denoiser: Denoiser, state: DenoiseState, keys: Array) -> DenoiseState:
  """One denoising pass: sample, accept, re-noise, check stopping (the released algorithm).

  The denoiser sees the canvas and the previous step's scaled logits; every position is sampled from
  softmax(logits / T); the acceptance rule keeps some of the samples among the positions not fixed; the
  noise process decides what becomes of the others (uniform: re-drawn; masked: still masked). A row stops
  when the stopping rule says so or nothing is left to change. The argmax canvas, the canvas and the
  logits of rows that were already done are kept as they were.
  """
  b = state.canvas.shape[0]
  logits = rules.noise.prepare_logits(denoiser(state.canvas, state.sc_logits, state.has_sc))  # [B, C, V]
  scaled = logits / temperature(rules, rules.max_denoising_steps - state.step)
  step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, state.step)
  sample_keys, noise_keys = jnp.moveaxis(jax.vmap(jax.random.split)(step_keys), 1, 0)
  stats = token_stats(scaled, sample_keys)
  accepted = rules.acceptance(stats, ~state.fixed)
  canvas, fixed = rules.noise.renoise(noise_keys, state.canvas, stats.sample, accepted, state.fixed)
  argmax = jnp.where(fixed, canvas, stats.argmax)

  done = state.done
  keep = done[:, None]
  argmax = jnp.where(keep, state.argmax, argmax)
  canvas = jnp.where(keep, state.canvas, canvas)
  fixed = jnp.where(keep, state.fixed, fixed)
  scaled = jnp.where(keep[..., None], state.sc_logits, scaled)
  stop, stop_state = rules.stopping(state.stop_state, stats.replace(argmax=argmax))
  stop |= jnp.all(fixed, axis=-1)  # nothing left to change
  return DenoiseState(
      step=state.step + 1,
      canvas=canvas,
      argmax=argmax,
      sc_logits=scaled,
      has_sc=jnp.ones((b,), bool),
      stop_state=stop_state,
      fixed=fixed,
      done=done | stop,
      passes=state.passes + (~done).astype(jnp.int32),
      accepted=accepted & ~keep,
  )


def should_continue(rules: Rules, state: DenoiseState) -> Array:
  return (state.step < rules.max_denoising_steps) & ~jnp.all(state.done)


def denoise_canvas(rules: Rules, denoiser: Denoiser, state: DenoiseState, keys: Array,
                   return_trace: bool = False) -> tuple[DenoiseState, StepTrace | None]:
  """Steps until every row is done or the step cap is reached, in one `lax.while_loop`."""
  if not return_trace:
    state = jax.lax.while_loop(lambda s: should_continue(rules, s),
                               lambda s: denoise_step(rules, denoiser, s, keys), state)
    return state, None

  def body(carry):
    s, t = carry
    i = s.step
    s = denoise_step(rules, denoiser, s, keys)
    t = StepTrace(t.argmax.at[i].set(s.argmax), t.canvas.at[i].set(s.canvas),
                  t.accepted.at[i].set(s.accepted))
    return s, t

  trace = StepTrace.zeros((rules.max_denoising_steps,) + state.canvas.shape)
  return jax.lax.while_loop(lambda carry: should_continue(rules, carry[0]), body, (state, trace))

"""The pure denoising step, its loop state, and the `lax.while_loop` that runs one canvas.

`denoise_step(rules, denoiser, state, keys)` is a pure function of its inputs: the model enters only
through `denoiser` (the denoiser pass to final hidden states, and the vocabulary head that turns them into
the step's statistics, draw and self-conditioning embedding, `sampling.vocab`), the process only through
`rules` (schedule, noise, acceptance and stopping objects), and the randomness only through one key per
row, folded with the step index. Running it in a Python loop or in `lax.while_loop` gives the same tokens.

No [B, C, V] array: the loop carries self-conditioning as the expected embedding [B, C, D] in the
parameter dtype, and the head streams the vocabulary.

Axes: B batch, C canvas, D model, V vocab, N steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from diffusiongemma.diffusion import acceptance as acceptance_lib
from diffusiongemma.diffusion import noise as noise_lib
from diffusiongemma.diffusion import schedules as schedules_lib
from diffusiongemma.diffusion import stopping as stopping_lib
from diffusiongemma.sampling import vocab

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Rules:
  """Everything a denoising step needs besides the model and its randomness (hashable: static). At step n
  of N remaining (N .. 1) the logits are divided by `schedule(n, N)`. `greedy`: accepted positions take
  their argmax instead of a draw (`SamplerConfig.draw == "argmax"`)."""

  max_denoising_steps: int
  schedule: schedules_lib.Schedule
  noise: noise_lib.NoiseProcess
  acceptance: acceptance_lib.AcceptanceRule
  stopping: stopping_lib.StoppingRule
  greedy: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Denoiser:
  """The model on a fixed cache, as a step uses it: `hidden(canvas [B, C], self-conditioning embedding
  [B, C, D], its row mask [B], rows that are done [B]) -> final hidden states [B, C, D]` (those of rows
  that are done are not used; the model may skip work on them), and the vocabulary head with its table
  (the embedding [V, D]) that turns them into the step's statistics (`Sampler.denoiser` builds it).
  `constraint`, if given, takes over the vocabulary end of the step (`sample_step`, same signature as
  `plain_sample_step`). `temperature_scale` [B], if given, multiplies each row's temperature (a traced
  input, so one program serves every temperature)."""

  hidden: Callable[[Array, Array, Array, Array], Array]
  head: vocab.VocabHead
  table: Array
  constraint: Any = None  # e.g. `sampling.constrained.CanvasConstraint`, whose `sample_step` is used
  # With reuse (`SamplerConfig.reuse`): `subset(tokens [B, W], slots [B, W], self-conditioning [B, W, D], its
  # row mask, done rows, canvas keys, canvas values) -> (hidden [B, W, D], keys, values)`, the widths W a
  # pass may take (ascending, the last the whole canvas), the refresh period (a whole pass every
  # `refresh` passes; 0: only the first) and the passes a slot is computed while fixed before it settles.
  subset: Callable | None = None
  widths: tuple[int, ...] = ()
  refresh: int = 0
  delay: int = 1
  temperature_scale: Array | None = None  # [B] float32


@flax.struct.dataclass
class Reuse:
  """What a pass that reuses settled positions carries (`SamplerConfig.reuse="settled"`): every canvas
  slot's keys and values per layer [B, C, K, H] and final hidden state [B, C, D] as last computed, and how
  many passes computed each slot while its token was fixed [B, C] int32 (a slot settles, and passes leave
  it out, once that reaches the denoiser's `delay`)."""

  keys: tuple[Array, ...]
  values: tuple[Array, ...]
  hidden: Array
  fixed_passes: Array

  def settled(self, delay: int) -> Array:
    return self.fixed_passes >= delay

  @classmethod
  def empty(cls, layer_dims: Sequence[tuple[int, int]], batch: int, canvas: int, hidden_size: int, dtype
            ) -> "Reuse":
    kv = lambda: tuple(jnp.zeros((batch, canvas, k, h), dtype) for k, h in layer_dims)
    return cls(keys=kv(), values=kv(), hidden=jnp.zeros((batch, canvas, hidden_size), dtype),
               fixed_passes=jnp.zeros((batch, canvas), jnp.int32))


@flax.struct.dataclass
class DenoiseState:
  """The loop carry of one canvas. Rows with `done` set no longer change (nor count passes)."""

  step: Array  # [] int32: steps taken; the next step has N - step steps remaining
  canvas: Array  # [B, C] int32: the (partly noisy) canvas the next pass sees
  argmax: Array  # [B, C] int32: argmax canvas of the last pass (what is committed)
  sc_embedding: Array  # [B, C, D] parameter dtype: softmax(logits / T) @ E * sqrt(D), fed back
  has_sc: Array  # [B] bool: false before the first pass (a zero self-conditioning signal)
  stop_state: Any  # the stopping rule's carry (e.g. the argmax history)
  fixed: Array  # [B, C] bool: positions that may no longer change (masked noise: unmasked ones)
  done: Array  # [B] bool
  passes: Array  # [B] int32: denoiser passes that counted for this row
  positions: Array  # [B] int32: canvas positions those passes computed (C each; with reuse, the pass's width)
  accepted: Array  # [B, C] bool: positions accepted by the last step
  reuse: Reuse | None = None  # with `SamplerConfig.reuse="settled"`


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
  """The schedule's temperature at `remaining` steps n (N .. 1), in float32."""
  return rules.schedule(remaining, rules.max_denoising_steps)


def token_stats(scaled_logits: Array, keys: Array) -> acceptance_lib.TokenStats:
  """Entropy, top probability, argmax and one draw per position of softmax(scaled_logits) [B, C, V] given
  whole, with one uniform per position from each row's key [B] (the streamed head's draw, exactly)."""
  return vocab.token_stats(scaled_logits, vocab.uniforms(keys, scaled_logits.shape[1]))


def init_state(rules: Rules, canvas: Array, done: Array, hidden_size: int, dtype=jnp.float32,
               given: Array | None = None) -> DenoiseState:
  """The state before the first pass over `canvas` [B, C]; `done` [B] rows are skipped entirely. `dtype`:
  the self-conditioning embedding's (the parameter dtype). `given` [B, C] bool: positions held as they are
  (infilling): fixed from the start, so never accepted, re-noised or changed."""
  b, c = canvas.shape
  canvas = canvas.astype(jnp.int32)
  return DenoiseState(
      step=jnp.zeros((), jnp.int32),
      canvas=canvas,
      argmax=canvas,
      sc_embedding=jnp.zeros((b, c, hidden_size), dtype),
      has_sc=jnp.zeros((b,), bool),
      stop_state=rules.stopping.init(b, c),
      fixed=(rules.noise.initial_fixed(canvas) if given is None
             else rules.noise.initial_fixed(canvas) | given),
      done=done,
      passes=jnp.zeros((b,), jnp.int32),
      positions=jnp.zeros((b,), jnp.int32),
      accepted=jnp.zeros((b, c), bool),
  )


@flax.struct.dataclass
class SampledStep:
  """What the vocabulary end of a step gives the rest of it (all rows; done rows are restored after)."""

  stats: acceptance_lib.TokenStats  # [B, C] each; `sample` complete where accepted
  soft_embedding: Array  # [B, C, D]: the next pass's self-conditioning
  accepted: Array  # [B, C] bool
  canvas: Array  # [B, C] int32: after re-noising
  fixed: Array  # [B, C] bool
  argmax: Array  # [B, C] int32: what would be committed


def plain_sample_step(rules: Rules, denoiser: Denoiser, state: DenoiseState, hidden: Array, temp: Array,
                      uniforms: Array, noise_keys: Array) -> SampledStep:
  """The released step's vocabulary end, streamed: statistics, acceptance, the draw of the accepted
  positions only, re-noising, and the argmax canvas (fixed positions keep their token)."""
  head = denoiser.head(denoiser.table, hidden, temp, uniforms)
  stats = head.stats
  committed = stats.argmax  # [B, C]
  accepted = rules.acceptance(stats, ~state.fixed)
  sample = denoiser.head.draw(denoiser.table, hidden, head, accepted & ~state.done[:, None], uniforms, temp)
  stats = stats.replace(sample=sample)
  canvas, fixed = rules.noise.renoise(noise_keys, state.canvas, stats.sample, accepted, state.fixed)
  argmax = jnp.where(fixed, canvas, committed)
  return SampledStep(stats=stats, soft_embedding=head.soft_embedding, accepted=accepted, canvas=canvas,
                     fixed=fixed, argmax=argmax)


def denoise_step(rules: Rules, denoiser: Denoiser, state: DenoiseState, keys: Array,
                 hidden: Array | None = None) -> DenoiseState:
  """One denoising pass: sample, accept, re-noise, check stopping (the released algorithm).

  The denoiser sees the canvas and the previous step's self-conditioning embedding; the head gives the
  statistics of softmax(logits / T) per position; the acceptance rule keeps some positions among those
  not fixed, and only those draw their token (one uniform per position, inverse CDF: the draw does not
  change which are accepted); the noise process decides what becomes of the others (uniform: re-drawn;
  masked: still masked). A row stops when the stopping rule says so or nothing is left to change. The
  argmax canvas, the canvas and the self-conditioning of rows that were already done are kept as they were.

  With `denoiser.constraint`, its `sample_step` replaces `plain_sample_step` (the statistics, acceptance,
  draw, re-noising and the argmax canvas; `sampling.constrained`); the rest of the step is the same.
  `hidden` [B, C, D]: the denoiser's output for this state when the caller already has it (the sampler's
  first pass of a canvas, fused with encoding the previous one); otherwise `denoiser.hidden` runs.
  """
  b, c = state.canvas.shape
  remaining = rules.max_denoising_steps - state.step
  temp = temperature(rules, remaining)
  if denoiser.temperature_scale is not None:
    temp = temp * denoiser.temperature_scale  # [B]: per row
  step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, state.step)
  sample_keys, noise_keys = jnp.moveaxis(jax.vmap(jax.random.split)(step_keys), 1, 0)
  uniforms = vocab.uniforms(sample_keys, c)  # [B, C]
  if rules.greedy:  # u = 0 < every top probability: each draw is its argmax
    uniforms = jnp.zeros_like(uniforms)
  reuse, width = state.reuse, c
  if hidden is None and reuse is not None:
    hidden, reuse, width = reuse_pass(denoiser, state)
  elif hidden is None:
    hidden = denoiser.hidden(state.canvas, state.sc_embedding, state.has_sc, state.done)  # [B, C, D]
  elif reuse is not None:  # a whole pass the caller ran, its keys and values already in `state.reuse`
    reuse = reuse.replace(hidden=hidden, fixed_passes=reuse.fixed_passes + state.fixed)
  sample_step = plain_sample_step if denoiser.constraint is None else denoiser.constraint.sample_step
  out = sample_step(rules, denoiser, state, hidden, temp, uniforms, noise_keys)
  stats, accepted, canvas, fixed, argmax = out.stats, out.accepted, out.canvas, out.fixed, out.argmax

  done = state.done
  keep = done[:, None]
  argmax = jnp.where(keep, state.argmax, argmax)
  canvas = jnp.where(keep, state.canvas, canvas)
  fixed = jnp.where(keep, state.fixed, fixed)
  sc_embedding = jnp.where(keep[..., None], state.sc_embedding, out.soft_embedding)
  stop, stop_state = rules.stopping(state.stop_state, stats.replace(argmax=argmax))
  stop |= jnp.all(fixed, axis=-1)  # nothing left to change
  return DenoiseState(
      step=state.step + 1,
      canvas=canvas,
      argmax=argmax,
      sc_embedding=sc_embedding,
      has_sc=jnp.ones((b,), bool),
      stop_state=stop_state,
      fixed=fixed,
      done=done | stop,
      passes=state.passes + (~done).astype(jnp.int32),
      positions=state.positions + jnp.where(done, 0, width),
      accepted=accepted & ~keep,
      reuse=reuse,
  )


def reuse_pass(denoiser: Denoiser, state: DenoiseState) -> tuple[Array, Reuse, Array]:
  """The pass of a sampler that reuses settled positions: (hidden [B, C, D], the reuse state after it, the
  width it computed []).

  Slots not yet settled are recomputed (all of them on the first pass and every `denoiser.refresh`
  passes), gathered into the narrowest of `denoiser.widths` that holds every row's (rows that are done
  need none and keep everything; a row with fewer fills its extra slots with copies of its first, whose
  results are the same); they attend to the other slots through the keys and values those had when last
  computed, and the settled slots keep their last hidden state. A slot settles once `denoiser.delay` passes
  have computed it while fixed (its token final): each accepted token is recomputed at least once with
  itself in place before it is reused (twice with delay 2: its keys and values still move on the pass after
  it is placed, dKV-Cache's delayed caching).
  """
  reuse = state.reuse
  full = (state.step == 0) | ((denoiser.refresh > 0) & (state.step % max(denoiser.refresh, 1) == 0))
  compute = (~reuse.settled(denoiser.delay) | full) & ~state.done[:, None]  # [B, C]
  count = compute.sum(-1)  # [B]
  order = jnp.argsort(~compute, axis=-1, stable=True)  # the slots to compute first, in order
  rows = jnp.arange(state.canvas.shape[0])[:, None]

  def at_width(width: int):
    def run(reuse: Reuse):
      slots = order[:, :width]
      slots = jnp.where(jnp.arange(width)[None] < count[:, None], slots, slots[:, :1])  # [B, W]
      hidden, keys, values = denoiser.subset(
          jnp.take_along_axis(state.canvas, slots, 1), slots,
          jnp.take_along_axis(state.sc_embedding, slots[..., None], 1), state.has_sc, state.done, reuse.keys,
          reuse.values)
      keep = lambda new, old: jnp.where(state.done.reshape((-1,) + (1,) * (old.ndim - 1)), old, new)
      hidden = reuse.hidden.at[rows, slots].set(hidden.astype(reuse.hidden.dtype))
      return reuse.replace(keys=tuple(map(keep, keys, reuse.keys)),
                           values=tuple(map(keep, values, reuse.values)), hidden=keep(hidden, reuse.hidden))
    return run

  widths = denoiser.widths
  sizes = jnp.asarray(widths, jnp.int32)
  branch = jnp.searchsorted(sizes, jnp.max(count), side="left")
  branch = jnp.where(full, len(widths) - 1, jnp.minimum(branch, len(widths) - 1))
  reuse = jax.lax.switch(branch, [at_width(w) for w in widths], reuse)
  return (reuse.hidden, reuse.replace(fixed_passes=reuse.fixed_passes + (compute & state.fixed)),
          sizes[branch])


def should_continue(rules: Rules, state: DenoiseState) -> Array:
  return (state.step < rules.max_denoising_steps) & ~jnp.all(state.done)


def denoise_canvas(rules: Rules, denoiser: Denoiser, state: DenoiseState, keys: Array,
                   return_trace: bool = False,
                   emit: Callable[[DenoiseState, DenoiseState], None] | None = None,
                   first_hidden: Array | None = None) -> tuple[DenoiseState, StepTrace | None]:
  """Steps until every row is done or the step cap is reached, in one `lax.while_loop`. `emit(before,
  after)`, if given, is called in the program after every step (e.g. a host callback streaming the
  canvas); it cannot change the step. `first_hidden`: the denoiser's output for `state`, computed by the
  caller: the first step uses it (and runs before the loop, as every canvas's first step runs)."""

  def step(s, hidden=None):
    after = denoise_step(rules, denoiser, s, keys, hidden)
    if emit is not None:
      emit(s, after)
    return after

  def record(s: DenoiseState, t: StepTrace, i: Array) -> StepTrace:
    return StepTrace(t.argmax.at[i].set(s.argmax), t.canvas.at[i].set(s.canvas),
                     t.accepted.at[i].set(s.accepted))

  trace = StepTrace.zeros((rules.max_denoising_steps,) + state.canvas.shape) if return_trace else None
  if first_hidden is not None:
    i = state.step
    state = step(state, first_hidden)
    trace = record(state, trace, i) if return_trace else None
  if not return_trace:
    return jax.lax.while_loop(lambda s: should_continue(rules, s), step, state), None

  def body(carry):
    s, t = carry
    i = s.step
    s = step(s)
    return s, record(s, t, i)

  return jax.lax.while_loop(lambda carry: should_continue(rules, carry[0]), body, (state, trace))

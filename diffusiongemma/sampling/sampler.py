"""`Sampler`: block-diffusion generation as one compiled program.

Axes: B batch, L prompt length, C canvas, K canvases, N steps, V vocab.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from collections.abc import Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma.diffusion import acceptance as acceptance_lib
from diffusiongemma.diffusion import constraints as cons
from diffusiongemma.diffusion import noise as noise_lib
from diffusiongemma.diffusion import schedules as schedules_lib
from diffusiongemma.diffusion import stopping as stopping_lib
from diffusiongemma.model.attention import KVCache
from diffusiongemma.sampling import constrained
from diffusiongemma.sampling import prompts as prompts_lib
from diffusiongemma.sampling import steps
from diffusiongemma.sampling import vocab
from diffusiongemma.sampling.config import SamplerConfig

Array = jax.Array
CACHE_BUCKET = 1024  # a cache passed in grows to a multiple of this, so that chat turns share programs


@flax.struct.dataclass
class SampleOutput:
  """What `generate` returns.

  tokens [B, K * C]: the new tokens only (not the prompt), all K = ceil(max_new_tokens / C) canvases
    (not truncated to max_new_tokens, as the reference); after a row's first stop token, pad.
  num_denoiser_passes [B]: passes that counted for the row (none after it stopped or finished).
  tokens_per_forward [B]: the row's new (non-pad) tokens / its denoiser passes (the reference's
    definition; `sampling.stats` names the run-level summaries); with `given`, given positions are not new.
  canvas_passes [B, K]: denoiser passes (steps) per canvas; 0 for canvases after a row finished.
  denoised_positions [B]: canvas positions those passes computed, the work they cost: C per pass, fewer
    where a pass reused settled positions (`SamplerConfig.reuse`: the pass's width).
  trace: with `return_trace`, a `StepTrace` of [K, N, B, C] arrays (argmax canvas, canvas after
    re-noising, accepted positions) for every step; else None.
  cache: with `return_cache`, the KV cache after the call: the prompt and every committed canvas but the
    last (which the reference never encodes either); else None.
  """

  tokens: Array
  num_denoiser_passes: Array
  tokens_per_forward: Array
  canvas_passes: Array
  denoised_positions: Array
  trace: steps.StepTrace | None = None
  cache: KVCache | None = None


@flax.struct.dataclass
class _CanvasLoop:
  """The carry of the loop over canvases."""

  index: Array  # [] int32: the canvas being generated
  cache: KVCache
  tokens: Array  # [B, K * C] committed tokens so far (pad elsewhere)
  finished: Array  # [B] bool: the row produced a stop token
  canvas_passes: Array  # [B, K] int32
  positions: Array  # [B] int32: canvas positions the denoiser computed
  trace: steps.StepTrace | None
  automaton_state: Array | None  # [B] int32 with a constraint: the state after the committed canvases
  pending: Array | None  # [B, C] with `fuse_commit`: the last committed canvas, not yet in the cache


@dataclasses.dataclass(frozen=True)
class PassEvent:
  """What `generate(..., on_pass=fn)` hands `fn` after every denoiser pass, on the host (numpy arrays).

  canvas_index: which canvas of the call (from 0); step: the pass within it (from 0); argmax [B, C]: the
  canvas that would be committed now; canvas [B, C]: what the next pass sees (accepted tokens, re-noised
  or masked others); accepted [B, C]: positions this pass accepted; fixed [B, C]: positions that can no
  longer change (masked noise: unmasked ones; given positions); active [B]: rows this pass counted for
  (a row that was already done or finished is not active); done [B]: rows whose canvas is done after it.
  """

  canvas_index: int
  step: int
  argmax: np.ndarray
  canvas: np.ndarray
  accepted: np.ndarray
  fixed: np.ndarray
  active: np.ndarray
  done: np.ndarray


class _Listeners:
  """The host end of streaming: `generate` registers its `on_pass` under a fresh id for the duration of the
  call and the compiled program (which takes the id as an argument, so one program serves every
  listener) sends each pass to `emit` with that id."""

  def __init__(self):
    self._lock = threading.Lock()
    self._next = 0
    self._listeners: dict[int, Callable[[PassEvent], None]] = {}

  @contextlib.contextmanager
  def registered(self, listener: Callable[[PassEvent], None]):
    with self._lock:
      self._next += 1
      key = self._next
      self._listeners[key] = listener
    try:
      yield key
    finally:
      with self._lock:
        del self._listeners[key]

  def run(self, listener: Callable[[PassEvent], None] | None, program: Callable[[jax.Array], object]):
    """`program(key)` with `listener` registered under `key` for the call (a zero key without one); every
    event has reached the listener when this returns."""
    if listener is None:
      return program(jnp.zeros((), jnp.int32))
    with self.registered(listener) as key:
      out = jax.block_until_ready(program(jnp.asarray(key, jnp.int32)))
      jax.effects_barrier()  # every event has reached the listener before it is removed
    return out

  def emit(self, key, canvas_index, step, argmax, canvas, accepted, fixed, active, done) -> None:
    listener = self._listeners.get(int(key))
    if listener is not None:
      listener(PassEvent(int(canvas_index), int(step), *map(np.asarray, (argmax, canvas, accepted, fixed,
                                                                           active, done))))


LISTENERS = _Listeners()


@dataclasses.dataclass(frozen=True)
class Sampler:
  """Block-diffusion sampling with the released algorithm (transformers' `generate`), fully compiled.

  A sampler is its components, a frozen value (`dataclasses.replace(sampler, acceptance=Margin(0.9))`
  swaps one): the model, `config` (the limits and the released rules' numbers), the `noise` process
  (default: the model's own, `ModelConfig.noise`), the `acceptance` rule (default
  `EntropyBound(config.entropy_bound)`), the `stopping` rule (default `stable_and_confident(...)` of
  `config`) and the temperature `schedule` (default `Linear(config.t_max, config.t_min)`).

  For each canvas of C tokens, until K = ceil(max_new_tokens / C) canvases or every row has stopped:
    1. start from the noise process's initial canvas (uniform: random tokens over the whole vocabulary;
       masked: all mask tokens), or the given `initial_canvas`;
    2. for n = N .. 1 steps remaining, while the row is not done: one denoiser pass over the canvas, with
       the previous pass's tempered distribution as self-conditioning (its expected embedding
       softmax(logits / T) @ E * sqrt(D), the same as feeding those logits); per position, the entropy,
       top probability and argmax of softmax(logits / T_n), T_n = schedule(n, N), streamed over the
       vocabulary (`sampling.vocab`, `SamplerConfig.vocab_chunk_size`); the acceptance rule picks
       positions, which draw their token from that distribution (one uniform each, inverse CDF), and the
       noise process re-noises the others; the row is done when the stopping rule fires or nothing is
       left to change; done rows stop changing, stop counting passes, and their tokens skip the experts;
    3. commit the argmax canvas; pad everything after the first stop token; a row with a stop token is
       finished and its later canvases are pad;
    4. encode the committed canvas into the KV cache and go on to the next canvas.

  The whole of it is one `jax.jit` program (a `lax.while_loop` over canvases around a `lax.while_loop`
  over steps), compiled once per (sampler, batch size, prompt-length bucket, number of canvases, cache
  capacity, streaming or not): the sampler is a static argument, hashed by its components, so equal
  samplers share programs, and nothing returns to the host between steps (but the optional per-pass
  stream). Randomness is per row (one key per row, folded with the canvas and step indices), so a row's
  output does not depend on the other rows of its batch.
  """

  model: nn.Module
  config: SamplerConfig = SamplerConfig()
  noise: noise_lib.NoiseProcess | None = None
  acceptance: acceptance_lib.AcceptanceRule | None = None
  stopping: stopping_lib.StoppingRule | None = None
  schedule: schedules_lib.Schedule | None = None
  stop_tokens: tuple[int, ...] = dataclasses.field(init=False, compare=False, repr=False)
  head: vocab.VocabHead = dataclasses.field(init=False, compare=False, repr=False)
  derived: frozenset[str] = dataclasses.field(init=False, compare=False, repr=False)  # made from config

  def __post_init__(self):
    config, mc = self.config, self.model.config
    if not isinstance(config, SamplerConfig):
      raise ValueError(f"Sampler config must be a SamplerConfig, got {type(config).__name__}.")
    if config.canvas_length is not None and config.canvas_length != mc.canvas_length:
      raise ValueError(f"SamplerConfig.canvas_length={config.canvas_length} differs from the model's "
                       f"canvas_length={mc.canvas_length}; use None or {mc.canvas_length}.")
    try:
      stop_tokens = prompts_lib.check_stop_tokens(config.stop_tokens, mc)
    except ValueError as error:
      raise ValueError(f"SamplerConfig.{error}") from None
    set_ = lambda name, value: object.__setattr__(self, name, value)
    set_("derived", frozenset(n for n in ("noise", "acceptance", "stopping", "schedule") if getattr(self, n) is None))
    if self.noise is None:
      set_("noise", noise_lib.for_model(mc))
    if self.noise.vocab_size != mc.vocab_size:
      raise ValueError(f"The {self.noise.name} noise draws from {self.noise.vocab_size} tokens but the model "
                       f"has vocab_size={mc.vocab_size}.")
    if self.acceptance is None:
      set_("acceptance", acceptance_lib.EntropyBound(config.entropy_bound))
    if self.stopping is None:
      set_("stopping", stopping_lib.stable_and_confident(config.stability_threshold,
                                                         config.confidence_threshold))
    if self.schedule is None:
      set_("schedule", schedules_lib.Linear(config.t_max, config.t_min))
    if config.reuse != "none" and not self.noise.fixes_accepted:
      raise ValueError(f"SamplerConfig.reuse={config.reuse!r} needs a noise process whose accepted positions stay "
                       f"fixed (masked); the {self.noise.name} noise rewrites every position at every pass, so "
                       "nothing would settle. Use reuse='none'.")
    set_("stop_tokens", stop_tokens)
    set_("head", vocab.VocabHead.for_model(mc, self.noise.never_token, config.vocab_chunk_size,
                                           config.vocab_budget_mib,
                                           margin=getattr(self.acceptance, "needs_margin", False)))

  @property
  def rules(self) -> steps.Rules:
    return steps.Rules(max_denoising_steps=self.config.max_denoising_steps, schedule=self.schedule,
                       noise=self.noise, acceptance=self.acceptance, stopping=self.stopping,
                       greedy=self.config.draw == "argmax")

  @property
  def canvas_length(self) -> int:
    return self.model.config.canvas_length

  def replace(self, **changes) -> "Sampler":
    """This sampler with `changes`; components that came from the config (or the model) are made again
    from the new ones unless given. (`dataclasses.replace` keeps every component as it is.)"""
    for name in self.derived:
      changes.setdefault(name, None)
    return dataclasses.replace(self, **changes)

  def settings(self) -> dict:
    """Every setting this sampler runs with, as JSON values (for result files)."""
    return {**dataclasses.asdict(self.config), "stop_tokens": list(self.stop_tokens),
            "noise": self.noise.name, "never_token": self.noise.never_token,
            "acceptance_rule": repr(self.acceptance), "stopping_rule": repr(self.stopping),
            "schedule": repr(self.schedule), "vocab_auto_block_mib": self.head.auto_block_mib,
            "dtype": self.model.config.dtype, "moe_impl": self.model.config.moe_impl}

  # ---------------------------------------------------------------------------------------- inputs
  def _initial_canvas(self, initial_canvas, batch_size: int, num_canvases: int,
                      given=None) -> tuple[Array, Array, np.ndarray | None]:
    """(canvases [B, K * C], how many of them are given, the given positions [B, K * C] or None) so that
    the compiled shapes never change."""
    c, v = self.canvas_length, self.model.config.vocab_size
    full = np.zeros((batch_size, num_canvases * c), np.int32)
    if initial_canvas is None:
      if given is not None:
        raise ValueError("given (the positions held for infilling) needs the initial_canvas that holds them.")
      return jnp.asarray(full), jnp.zeros((), jnp.int32), None
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
    held = None
    if given is not None:
      mask = np.asarray(given)
      mask = mask[None] if mask.ndim == 1 else mask
      if mask.shape != canvas.shape or mask.dtype != np.bool_:
        raise ValueError(f"given must be a bool mask of initial_canvas's shape {canvas.shape}, got "
                         f"{mask.dtype} {mask.shape}.")
      held = np.zeros(full.shape, bool)
      held[:, :canvas.shape[1]] = mask
    return jnp.asarray(full), jnp.asarray(canvas.shape[1] // c, jnp.int32), held

  def _fit_cache(self, cache: KVCache, batch_size: int, needed_after: int) -> KVCache:
    """`cache` with room for `needed_after` more positions after its longest row (grown by buckets)."""
    if not isinstance(cache, KVCache) or cache.batch_size != batch_size:
      raise ValueError(f"cache must be a KVCache of {batch_size} rows (one per prompt), got "
                       f"{getattr(cache, 'batch_size', type(cache).__name__)}.")
    needed = int(jnp.max(cache.length)) + needed_after
    if needed <= cache.capacity:
      return cache
    capacity = min(-(-needed // CACHE_BUCKET) * CACHE_BUCKET, self.model.config.max_positions)
    return cache.resized(capacity)

  # ---------------------------------------------------------------------------------------- generate
  def generate(self, params, prompt_tokens, rng, max_new_tokens: int = 256, prompt_lengths=None,
               initial_canvas=None, *, cache: KVCache | None = None, return_cache: bool = False,
               return_trace: bool = False, images=None, given=None, constraint=None,
               on_pass: Callable[[PassEvent], None] | None = None, temperature_scale=None,
               compile_only: bool = False) -> SampleOutput | None:
    """Generates ceil(max_new_tokens / C) canvases after each prompt.

    prompt_tokens [B, L] (right-padded when `prompt_lengths` [B] is given, or a list of token lists);
    rng: one key (split per row) or [B] keys; initial_canvas [B, k * C]: the starting tokens of the first
    k canvases (instead of the noise's), e.g. the reference's `decoder_input_ids`. `cache`: a KV cache
    (of an earlier call with `return_cache=True`) the prompt continues: only the prompt is encoded.
    `images`: (pixel_values [N, P, 3 * patch^2], image_position_ids [N, P, 2]) of every image of the
    batch, row 0's first (`data.images.stack`), for a model with a vision encoder; their soft tokens fill
    the prompts' expanded `image_id` placeholders (`data.images.expand_image_placeholders`), in order, at
    the prompt's encoding only. Rows without placeholders batch with rows that have some.

    given [B, k * C] bool (infilling, with `initial_canvas`): positions of `initial_canvas` that are held:
    the other positions start as the noise's (random tokens, or the mask), given ones are never
    re-noised, accepted or changed, for either noise, and are not counted as new tokens
    (`constraints.infill_canvas` builds both from text with `[MASK]` markers). A stop token drawn in a
    hole still ends the output (everything after it, given text too, becomes pad): give a stop token at
    the end of the text, or a constraint, to keep it whole.
    constraint: a `sampling.constrained.Constraint` built for this sampler: every output then matches it
    (see that module; constraints whose padded tables have the same sizes share one program). Checked
    before anything compiles.
    on_pass: called on the host after every denoiser pass with a `PassEvent` (the canvas as it denoises:
    argmax, canvas, accepted and fixed positions, per row), from inside the running program, so it is
    live; it cannot change the result, and it runs before `generate` returns. Any callable works with
    one compiled program (the program streams to whichever listener its call registered).
    temperature_scale [B]: multiplies each row's temperature schedule; an input of the program, so one
    program serves every value (None: the schedule as it is, the program without the input).
    compile_only: compile the program this call would run (for these shapes and static settings), run
    nothing and return None; a later call with the same shapes finds it compiled.
    """
    num_canvases = math.ceil(prompts_lib.check_max_new_tokens(max_new_tokens) / self.canvas_length)
    cached = 0 if cache is None else int(jnp.max(cache.length))
    prompt, lengths = prompts_lib.prepare(self.model.config, prompt_tokens, prompt_lengths,
                                          num_canvases * self.canvas_length, self.config.prompt_bucket,
                                          cached)
    b = prompt.shape[0]
    canvas, num_given, held = self._initial_canvas(initial_canvas, b, num_canvases, given)
    tables = None
    if constraint is not None:
      if not isinstance(constraint, constrained.Constraint):
        raise ValueError("constraint must be a sampling.constrained.Constraint, got "
                         f"{type(constraint).__name__}.")
      constraint.check(self, max_new_tokens)
      if held is not None:
        t = int(num_given) * self.canvas_length
        constrained.check_given_fits(constraint, np.asarray(canvas)[:, :t], held[:, :t],
                                     num_canvases * self.canvas_length - t)
      tables = constraint.tables
    if cache is not None:  # the last canvas is never encoded
      cache = self._fit_cache(cache, b, prompt.shape[1] + (num_canvases - 1) * self.canvas_length)
    images = prompts_lib.check_images(self.model.config, images, prompt, lengths)
    if on_pass is not None and not callable(on_pass):
      raise ValueError(f"on_pass must be a callable taking a PassEvent, got {type(on_pass).__name__}.")
    run = functools.partial(
        _program, self, prompts_lib.variables(params), prompt, lengths, canvas, num_given,
        prompts_lib.row_keys(rng, b), cache, images, None if held is None else jnp.asarray(held), tables,
        num_canvases=num_canvases, return_trace=return_trace, return_cache=return_cache,
        constraint=constraint, stream=on_pass is not None,
        temperature_scale=None if temperature_scale is None else jnp.asarray(temperature_scale, jnp.float32))
    if compile_only:
      _program.lower(*run.args, jnp.zeros((), jnp.int32), **run.keywords).compile()
      return None
    return LISTENERS.run(on_pass, run)

  def start_canvas(self, keys: Array, canvas_index) -> tuple[Array, Array]:
    """(first canvas [B, C], step keys [B]) of canvas `canvas_index`, from the row keys."""
    canvas_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, canvas_index)
    init_keys, step_keys = jnp.moveaxis(jax.vmap(jax.random.split)(canvas_keys), 1, 0)
    return self.noise.initial_canvas(init_keys, self.canvas_length), step_keys

  def denoiser(self, variables, cache: KVCache) -> steps.Denoiser:
    """The model's denoiser on a fixed cache and its vocabulary head, as the step wants them."""
    model = self.model
    hidden = lambda canvas, sc, mask, done: model.apply(
        variables, canvas, cache, None, mask, return_hidden=True, self_conditioning_embedding=sc,
        skip_rows=done, method=model.denoise)
    subset = None
    if self.config.reuse != "none":
      subset = lambda tokens, slots, sc, mask, done, keys, values: model.apply(
          variables, tokens, slots, cache, keys, values, self_conditioning_embedding=sc,
          self_conditioning_mask=mask, skip_rows=done, method=model.denoise_subset)
    return steps.Denoiser(hidden, self.head, model.apply(variables, method=model.embedding_table), subset=subset,
                          widths=self.reuse_widths, refresh=self.config.reuse_refresh,
                          delay=self.config.reuse_delay)

  @property
  def reuse_widths(self) -> tuple[int, ...]:
    """The widths a pass that reuses settled positions may take, ascending: the canvas in
    `config.reuse_widths` equal steps, at least 4 positions (or the canvas, if shorter)."""
    c, n = self.canvas_length, self.config.reuse_widths
    return tuple(sorted({max(min(c, 4), -(-c * i // n)) for i in range(1, n + 1)}))

  def encode_denoise(self, variables, committed: Array, state: steps.DenoiseState, cache: KVCache
                     ) -> tuple[Array, KVCache]:
    """(the first pass's hidden states of the canvas of `state`, the cache with `committed` appended):
    encoding the previous canvas and the next canvas's first pass in one model pass."""
    model = self.model
    return model.apply(variables, committed, state.canvas, cache, self_conditioning_embedding=state.sc_embedding,
                       self_conditioning_mask=state.has_sc, skip_rows=state.done, method=model.encode_denoise)

  def encode(self, variables, tokens: Array, cache: KVCache, num_tokens: Array | None = None,
             images: tuple[Array, Array] | None = None) -> KVCache:
    """The cache after appending `tokens` [B, L] (the first `num_tokens` [B] of each row), with the soft
    tokens of `images` (pixel values, position ids) in their placeholders."""
    model = self.model
    pixel_values, position_ids = (None, None) if images is None else images
    return model.apply(variables, tokens, cache, num_tokens=num_tokens, return_hidden=True,
                       pixel_values=pixel_values, image_position_ids=position_ids, method=model.encode)[1]


@functools.partial(jax.jit, static_argnames=("sampler", "num_canvases", "return_trace", "return_cache",
                                             "constraint", "stream"))
def _program(sampler: Sampler, variables, prompt, lengths, initial, num_given, keys, cache, images, given,
             tables, listener, *, num_canvases: int, return_trace: bool, return_cache: bool, constraint,
             stream: bool, temperature_scale=None) -> SampleOutput:
  """given [B, K * C] bool or None; tables: the constraint's `AutomatonTables` or None (`constraint` None);
  listener: the id of the host listener every pass is sent to (`stream`); temperature_scale [B] or None."""
  rules, mc = sampler.rules, sampler.model.config
  b, c = prompt.shape[0], mc.canvas_length
  fuse, reuse = sampler.config.fuse_commit, sampler.config.reuse != "none"
  stop_tokens = jnp.asarray(sampler.stop_tokens, jnp.int32)
  if cache is None:  # room for the prompt and every canvas but the last, which is never encoded
    cache = KVCache.empty(mc, b, prompt.shape[1] + (num_canvases - 1) * c)
  cache = sampler.encode(variables, prompt, cache, lengths, images)
  ends = None if constraint is None else cons.canvas_ends(tables, num_canvases, initial, given)  # [K, B, S]

  def canvas_body(loop: _CanvasLoop) -> _CanvasLoop:
    k = loop.index
    start, step_keys = sampler.start_canvas(keys, k)
    held = None
    if given is None:
      start = jnp.where(k < num_given, jax.lax.dynamic_slice_in_dim(initial, k * c, c, axis=1), start)
    else:  # infilling: given positions from the initial canvas, the others from the noise
      held = jax.lax.dynamic_slice_in_dim(given, k * c, c, axis=1)
      start = jnp.where(held, jax.lax.dynamic_slice_in_dim(initial, k * c, c, axis=1), start)
    state = steps.init_state(rules, start, loop.finished, mc.hidden_size, mc.param_dtype, held)
    if reuse:
      state = state.replace(reuse=steps.Reuse.empty([mc.layer_dims(i) for i in range(mc.num_layers)], b, c,
                                                    mc.hidden_size, mc.dtype))
    cache, first_hidden = loop.cache, None
    if fuse:  # the previous canvas is encoded in this canvas's first pass
      def first_pass(cc):
        if not reuse:
          return sampler.denoiser(variables, cc).hidden(state.canvas, state.sc_embedding, state.has_sc,
                                                        state.done), cc, state.reuse
        slots = jnp.broadcast_to(jnp.arange(c), (b, c))
        hidden, keys, values = sampler.denoiser(variables, cc).subset(
            state.canvas, slots, state.sc_embedding, state.has_sc, state.done, state.reuse.keys,
            state.reuse.values)
        return hidden, cc, state.reuse.replace(keys=keys, values=values)

      def fused(cc):
        hidden, cc, (keys, values) = sampler.encode_denoise(variables, loop.pending, state, cc)
        return hidden, cc, None if not reuse else state.reuse.replace(keys=keys, values=values)

      first_hidden, cache, first_reuse = jax.lax.cond(k > 0, fused, first_pass, cache)
      state = state.replace(reuse=first_reuse)
    denoiser = sampler.denoiser(variables, cache)
    if temperature_scale is not None:
      denoiser = dataclasses.replace(denoiser, temperature_scale=temperature_scale)
    if constraint is not None:
      denoiser = dataclasses.replace(denoiser, constraint=constrained.CanvasConstraint(
          tables=tables, start=loop.automaton_state, end_ok=ends[k]))
    emit = None
    if stream:
      emit = lambda before, after: jax.debug.callback(
          LISTENERS.emit, listener, k, before.step, after.argmax, after.canvas, after.accepted, after.fixed,
          ~before.done, after.done, ordered=True)
    state, step_trace = steps.denoise_canvas(rules, denoiser, state, step_keys, return_trace, emit, first_hidden)
    committed = state.argmax  # [B, C]
    is_stop = jnp.isin(committed, stop_tokens)
    seen = jnp.cumsum(is_stop, axis=-1)
    after_stop = (seen > 1) | ((seen == 1) & ~is_stop)
    committed = jnp.where(after_stop | loop.finished[:, None], mc.pad_id, committed)
    trace = loop.trace
    if return_trace:
      trace = jax.tree.map(lambda all_, one: all_.at[k].set(one), trace, step_trace)
    commit = lambda cc: sampler.encode(variables, committed, cc)
    automaton_state = loop.automaton_state
    if constraint is not None:
      automaton_state = cons.advance(tables, automaton_state, committed)
    return _CanvasLoop(
        index=k + 1,
        cache=cache if fuse else jax.lax.cond(k + 1 < num_canvases, commit, lambda cc: cc, cache),
        tokens=jax.lax.dynamic_update_slice_in_dim(loop.tokens, committed, k * c, axis=1),
        finished=loop.finished | is_stop.any(axis=-1),
        canvas_passes=loop.canvas_passes.at[:, k].set(state.passes),
        positions=loop.positions + state.positions,
        trace=trace, automaton_state=automaton_state, pending=committed if fuse else None)

  loop = _CanvasLoop(
      index=jnp.zeros((), jnp.int32), cache=cache, tokens=jnp.full((b, num_canvases * c), mc.pad_id, jnp.int32),
      finished=jnp.zeros((b,), bool), canvas_passes=jnp.zeros((b, num_canvases), jnp.int32),
      positions=jnp.zeros((b,), jnp.int32),
      trace=steps.StepTrace.zeros((num_canvases, rules.max_denoising_steps, b, c)) if return_trace else None,
      automaton_state=None if constraint is None else jnp.full((b,), constraint.automaton.start, jnp.int32),
      pending=jnp.full((b, c), mc.pad_id, jnp.int32) if fuse else None)
  loop = jax.lax.while_loop(lambda lp: (lp.index < num_canvases) & ~jnp.all(lp.finished), canvas_body, loop)
  if fuse and return_cache:  # as unfused: every committed canvas but the call's last canvas slot is encoded
    loop = loop.replace(cache=jax.lax.cond(
        (loop.index > 0) & (loop.index < num_canvases), lambda cc: sampler.encode(variables, loop.pending, cc),
        lambda cc: cc, loop.cache))
  passes = loop.canvas_passes.sum(axis=-1)
  new = loop.tokens != mc.pad_id
  valid = jnp.sum(new if given is None else new & ~given, axis=-1)
  return SampleOutput(tokens=loop.tokens, num_denoiser_passes=passes,
                      tokens_per_forward=valid / jnp.maximum(passes, 1), canvas_passes=loop.canvas_passes,
                      denoised_positions=loop.positions,
                      trace=loop.trace, cache=loop.cache if return_cache else None)


def compiled_programs() -> int:
  """How many sampler programs this process has compiled (to tell a call that compiled from one that did
  not)."""
  size = getattr(_program, "_cache_size", None)
  return size() if size is not None else 0

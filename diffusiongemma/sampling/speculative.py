"""Self-speculative decoding: the denoiser drafts a canvas in one pass, the causal encoder checks it in one
pass, and the text is exactly the encoder's greedy (AR) decoding.

Each iteration: the denoiser sees a canvas whose first position holds the next token (known: the encoder's
prediction) and masks after it, and drafts the rest with its argmax; the encoder encodes that block after
the cache, which both commits it and gives its next-token argmax at every position; the drafts that agree
with it, from the left, are accepted, so an iteration commits 1 + (accepted drafts) tokens, and the cache
keeps only those (its `length`; later writes overwrite the rest). A model trained for masked noise whose
denoiser agrees with its encoder (e.g. distilled from its own greedy decoding) accepts many.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusiongemma.model.attention import KVCache
from diffusiongemma.sampling import prompts as prompts_lib
from diffusiongemma.sampling import sampler as sampler_lib


@flax.struct.dataclass
class SpeculativeOutput:
  tokens: jax.Array  # [B, max_new_tokens] int32: each row's new tokens (after a stop token: anything)
  num_denoiser_passes: jax.Array  # [B] int32: denoiser passes (as many encoder passes over the blocks)


@dataclasses.dataclass(frozen=True)
class SelfSpeculativeSampler:
  """`generate(params, prompts [B, L], max_new_tokens, prompt_lengths)`: greedy AR text, drafted by the
  denoiser a canvas at a time. `mask_id`: the masked-noise token the denoiser was trained to fill."""

  model: nn.Module
  mask_id: int
  stop_tokens: tuple[int, ...] | None = None  # None: the model's eos
  draft_length: int | None = None  # positions drafted per pass, the known one included (None: the canvas)
  prompt_bucket: int = 64  # prompts padded to a multiple of this: one program per bucket, not per width

  def __post_init__(self):
    cfg = self.model.config
    if self.draft_length is not None and (isinstance(self.draft_length, bool) or not isinstance(
        self.draft_length, int) or not 2 <= self.draft_length <= cfg.canvas_length):
      raise ValueError(f"SelfSpeculativeSampler.draft_length={self.draft_length!r} is invalid; expected None (the "
                       f"canvas) or an int in [2, canvas_length={cfg.canvas_length}].")
    if isinstance(self.mask_id, bool) or not isinstance(self.mask_id, int) or not 0 <= self.mask_id < cfg.vocab_size:
      raise ValueError(f"SelfSpeculativeSampler.mask_id={self.mask_id!r} is invalid; expected a token id in "
                       f"[0, {cfg.vocab_size}) (the masked-noise token of the model's training).")
    if isinstance(self.prompt_bucket, bool) or not isinstance(self.prompt_bucket, int) or self.prompt_bucket < 1:
      raise ValueError(f"SelfSpeculativeSampler.prompt_bucket={self.prompt_bucket!r} is invalid; expected a "
                       "positive int.")
    object.__setattr__(self, "stop_tokens", prompts_lib.check_stop_tokens(self.stop_tokens, cfg))

  @property
  def block_length(self) -> int:
    """Positions of a drafted block (the next token, known, and the drafts after it)."""
    return self.draft_length or self.model.config.canvas_length

  def generate(self, params, prompt_tokens, max_new_tokens: int, prompt_lengths=None,
               on_pass: Callable[[sampler_lib.PassEvent], None] | None = None) -> SpeculativeOutput:
    """`params`: a parameter tree or `{'params': ...}`; `prompt_tokens` and `prompt_lengths` as
    `Sampler.generate` ([B, L] right-padded with lengths [B], or a list of token lists). `on_pass`: called
    on the host after every iteration with a `sampling.PassEvent` whose `canvas_index` counts the
    iterations, `step` is 0, `argmax` and `canvas` hold the drafted block [B, block_length] (its first
    position the known next token), `accepted` and `fixed` the positions committed (the known token and
    the drafts the encoder agreed with, from the left), `active` the rows still decoding before it and
    `done` after it."""
    max_new_tokens = prompts_lib.check_max_new_tokens(max_new_tokens)
    tokens, lengths = prompts_lib.prepare(self.model.config, prompt_tokens, prompt_lengths,
                                          max_new_tokens + self.block_length, self.prompt_bucket)
    if on_pass is not None and not callable(on_pass):
      raise ValueError(f"on_pass must be a callable taking a PassEvent, got {type(on_pass).__name__}.")
    run = functools.partial(_program, self, prompts_lib.variables(params), tokens, lengths,
                            max_new_tokens=max_new_tokens, stream=on_pass is not None)
    return sampler_lib.LISTENERS.run(on_pass, run)


@functools.partial(jax.jit, static_argnames=("sampler", "max_new_tokens", "stream"))
def _program(sampler: SelfSpeculativeSampler, variables, tokens, lengths, listener, *, max_new_tokens: int,
             stream: bool) -> SpeculativeOutput:
  model, cfg = sampler.model, sampler.model.config
  b, c = tokens.shape[0], sampler.block_length
  rows = jnp.arange(b)
  cache = KVCache.empty(cfg, b, tokens.shape[1] + max_new_tokens + c)
  logits, cache = model.apply(variables, tokens, cache, num_tokens=lengths, method=model.encode)
  first = jnp.argmax(logits[rows, lengths - 1], -1).astype(jnp.int32)  # AR greedy's first new token
  out = jnp.full((b, max_new_tokens + c), cfg.pad_id, jnp.int32)
  stops = jnp.asarray(sampler.stop_tokens, jnp.int32)

  def body(carry):
    cache, nxt, out, count, passes, done, iteration = carry
    canvas = jnp.full((b, c), sampler.mask_id, jnp.int32).at[:, 0].set(nxt)
    draft = jnp.argmax(model.apply(variables, canvas, cache, method=model.denoise), -1).astype(jnp.int32)
    block = draft.at[:, 0].set(nxt)
    logits, written = model.apply(variables, block, cache, method=model.encode)
    predicted = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, C]: the token after each block position
    accepted = jnp.cumprod(predicted[:, :-1] == block[:, 1:], axis=1).sum(1)  # drafts agreeing from the left
    take = jnp.where(done, 0, 1 + accepted)  # [B]: committed this iteration
    slot = jnp.arange(c)[None]
    keep = slot < take[:, None]
    index = count[:, None] + slot
    out = out.at[rows[:, None], index].set(jnp.where(keep, block, out[rows[:, None], index]))
    stopped = (keep & jnp.isin(block, stops)).any(1)
    cache = written.replace(length=cache.length + take)
    count = count + take
    now_done = done | stopped | (count >= max_new_tokens)
    if stream:
      jax.debug.callback(sampler_lib.LISTENERS.emit, listener, iteration, 0, block, block, keep, keep, ~done,
                         now_done, ordered=True)
    return (cache, predicted[rows, accepted], out, count, passes + (~done).astype(jnp.int32), now_done,
            iteration + 1)

  zeros = jnp.zeros((b,), jnp.int32)
  carry = (cache, first, out, zeros, zeros, jnp.zeros((b,), bool), jnp.zeros((), jnp.int32))
  _, _, out, _, passes, _, _ = jax.lax.while_loop(lambda carry: ~carry[-2].all(), body, carry)
  return SpeculativeOutput(tokens=out[:, :max_new_tokens], num_denoiser_passes=passes)

"""Self-speculative decoding: the denoiser drafts a canvas in one pass, the causal encoder checks it in one
pass, and the text is distributed exactly as the encoder's AR decoding (greedy, or sampling at a temperature).

Each iteration: the denoiser sees a canvas whose first position holds the next token (known) and masks after
it, and drafts the rest (its argmax, or a draw from its tempered distribution q); the encoder encodes that
block after the cache, which both commits it and gives its next-token distribution p at every position.
Greedy: the drafts that agree with the encoder's argmax, from the left, are accepted. At a temperature
(speculative sampling, Leviathan et al. 2023; Chen et al. 2023): draft x at a position is accepted with
probability min(1, p(x) / q(x)), and the first rejected one is replaced by a draw from norm(max(0, p - q)),
or, when every draft is accepted, the next token is drawn from p after them. An iteration commits 1 +
(accepted drafts) tokens, and the cache keeps only those (its `length`; later writes overwrite the rest). A
model whose denoiser agrees with its encoder (e.g. distilled from its own decoding) accepts many.
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
from diffusiongemma.sampling import autoregressive
from diffusiongemma.sampling import prompts as prompts_lib
from diffusiongemma.sampling import sampler as sampler_lib


@flax.struct.dataclass
class SpeculativeOutput:
  tokens: jax.Array  # [B, max_new_tokens] int32: each row's new tokens (after a stop token: anything)
  num_denoiser_passes: jax.Array  # [B] int32: denoiser passes (as many encoder passes over the blocks)


@dataclasses.dataclass(frozen=True)
class SelfSpeculativeSampler:
  """`generate(params, prompts [B, L], max_new_tokens, prompt_lengths, rng=)`: the encoder's AR text, drafted
  by the denoiser a canvas at a time: greedy (temperature 0), or distributed exactly as `ARSampler` at
  `temperature` and `top_p` (then `rng` is needed; row b uses keys from rng's row key b, so rows are
  independent of their batch). `mask_id`: the masked-noise token the denoiser was trained to fill."""

  model: nn.Module
  mask_id: int
  stop_tokens: tuple[int, ...] | None = None  # None: the model's eos
  draft_length: int | None = None  # positions drafted per pass, the known one included (None: the canvas)
  prompt_bucket: int = 64  # prompts padded to a multiple of this: one program per bucket, not per width
  temperature: float = 0.0  # 0: greedy; > 0: AR sampling's distribution at this temperature
  top_p: float = 1.0  # with a temperature: the nucleus, as ARSampler's

  def __post_init__(self):
    cfg = self.model.config
    if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
        0 <= self.temperature < float("inf")):
      raise ValueError(f"SelfSpeculativeSampler.temperature={self.temperature!r} is invalid; expected a finite "
                       "number >= 0 (0 is greedy).")
    if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
      raise ValueError(f"SelfSpeculativeSampler.top_p={self.top_p!r} is invalid; expected a number in (0, 1].")
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_p", float(self.top_p))
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

  @classmethod
  def of(cls, sampler: sampler_lib.Sampler, **fields) -> SelfSpeculativeSampler:
    """The self-speculative decoder of a block-diffusion `Sampler`'s model: its mask token (a model trained
    with masked noise), stop tokens and prompt bucket; `fields`: the others (draft_length, temperature, ...)."""
    if sampler.noise.name != "masked":
      raise ValueError(f"Self-speculative decoding drafts with a masked-noise denoiser; this model samples with "
                       f"{sampler.noise.name!r} noise (ModelConfig.noise, config.diffusion.noise).")
    return cls(sampler.model, sampler.noise.mask_token_id, stop_tokens=sampler.stop_tokens,
               prompt_bucket=sampler.config.prompt_bucket, **fields)

  @property
  def block_length(self) -> int:
    """Positions of a drafted block (the next token, known, and the drafts after it)."""
    return self.draft_length or self.model.config.canvas_length

  def generate(self, params, prompt_tokens, max_new_tokens: int, prompt_lengths=None,
               on_pass: Callable[[sampler_lib.PassEvent], None] | None = None, rng=None) -> SpeculativeOutput:
    """`params`: a parameter tree or `{'params': ...}`; `prompt_tokens` and `prompt_lengths` as
    `Sampler.generate` ([B, L] right-padded with lengths [B], or a list of token lists). `on_pass`: called
    on the host after every iteration with a `sampling.PassEvent` whose `canvas_index` counts the
    iterations, `step` is 0, `argmax` and `canvas` hold the drafted block [B, block_length] (its first
    position the known next token), `accepted` and `fixed` the positions committed (the known token and
    the drafts the encoder agreed with, from the left), `active` the rows still decoding before it and
    `done` after it. `rng`: one key (split per row) or [B] keys; needed at a temperature, unused when greedy."""
    max_new_tokens = prompts_lib.check_max_new_tokens(max_new_tokens)
    tokens, lengths = prompts_lib.prepare(self.model.config, prompt_tokens, prompt_lengths,
                                          max_new_tokens + self.block_length, self.prompt_bucket)
    if on_pass is not None and not callable(on_pass):
      raise ValueError(f"on_pass must be a callable taking a PassEvent, got {type(on_pass).__name__}.")
    if self.temperature > 0 and rng is None:
      raise ValueError(f"SelfSpeculativeSampler(temperature={self.temperature}) samples: generate needs rng= (a "
                       "PRNG key, or one per row).")
    keys = prompts_lib.row_keys(jax.random.key(0) if rng is None else rng, tokens.shape[0])
    run = functools.partial(_program, self, prompts_lib.variables(params), tokens, lengths, keys,
                            max_new_tokens=max_new_tokens, stream=on_pass is not None)
    return sampler_lib.LISTENERS.run(on_pass, run)


@functools.partial(jax.jit, static_argnames=("sampler", "max_new_tokens", "stream"))
def _program(sampler: SelfSpeculativeSampler, variables, tokens, lengths, keys, listener, *, max_new_tokens: int,
             stream: bool) -> SpeculativeOutput:
  model, cfg = sampler.model, sampler.model.config
  b, c = tokens.shape[0], sampler.block_length
  rows = jnp.arange(b)
  sampled = sampler.temperature > 0
  log_probs = functools.partial(autoregressive.nucleus_log_probs, temperature=sampler.temperature,
                                top_p=sampler.top_p)
  draw = jax.vmap(lambda key, log_p: jax.random.categorical(key, log_p).astype(jnp.int32))  # a row's key each
  cache = KVCache.empty(cfg, b, tokens.shape[1] + max_new_tokens + c)
  logits, cache = model.apply(variables, tokens, cache, num_tokens=lengths, method=model.encode)
  last = logits[rows, lengths - 1]
  keys = jax.vmap(jax.random.split)(keys)  # [B, 2]: the first token's, the iterations'
  first = draw(keys[:, 0], log_probs(last)) if sampled else jnp.argmax(last, -1).astype(jnp.int32)
  out = jnp.full((b, max_new_tokens + c), cfg.pad_id, jnp.int32)
  stops = jnp.asarray(sampler.stop_tokens, jnp.int32)

  def body(carry):
    cache, nxt, out, count, passes, done, iteration = carry
    canvas = jnp.full((b, c), sampler.mask_id, jnp.int32).at[:, 0].set(nxt)
    drafted = model.apply(variables, canvas, cache, method=model.denoise)  # [B, C, V]
    if sampled:  # three keys per row and iteration: the drafts, the acceptances, the next token
      step = jax.vmap(lambda key: jax.random.split(jax.random.fold_in(key, iteration), 3))(keys[:, 1])
      log_q = log_probs(drafted)
      draft = draw(step[:, 0], log_q)
    else:
      draft = jnp.argmax(drafted, -1).astype(jnp.int32)
    block = draft.at[:, 0].set(nxt)
    logits, written = model.apply(variables, block, cache, method=model.encode)
    if sampled:  # log_p[:, i]: the encoder's distribution of the token after block[:, :i + 1]
      log_p = log_probs(logits)
      at = lambda log, x: jnp.take_along_axis(log, x[..., None], -1)[..., 0]
      ratio = at(log_p[:, :-1], block[:, 1:]) - at(log_q[:, 1:], block[:, 1:])  # log p(x) / q(x) per draft
      uniform = jax.vmap(lambda key: jax.random.uniform(key, (c - 1,)))(step[:, 1])
      accepted = jnp.cumprod(jnp.log(uniform) < ratio, axis=1).sum(1)  # each with probability min(1, p / q)
      p = jnp.exp(log_p[rows, accepted])  # [B, V]: after the accepted drafts
      q = jnp.where((accepted < c - 1)[:, None], jnp.exp(log_q[rows, jnp.minimum(accepted + 1, c - 1)]), 0.0)
      residual = jnp.maximum(p - q, 0.0)  # where the first draft was rejected (none: p, the bonus token)
      residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p)
      following = draw(step[:, 2], jnp.log(residual))
    else:
      predicted = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, C]: the token after each block position
      accepted = jnp.cumprod(predicted[:, :-1] == block[:, 1:], axis=1).sum(1)  # drafts agreeing from the left
      following = predicted[rows, accepted]
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
    return cache, following, out, count, passes + (~done).astype(jnp.int32), now_done, iteration + 1

  zeros = jnp.zeros((b,), jnp.int32)
  carry = (cache, first, out, zeros, zeros, jnp.zeros((b,), bool), jnp.zeros((), jnp.int32))
  _, _, out, _, passes, _, _ = jax.lax.while_loop(lambda carry: ~carry[-2].all(), body, carry)
  return SpeculativeOutput(tokens=out[:, :max_new_tokens], num_denoiser_passes=passes)

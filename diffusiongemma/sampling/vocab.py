"""The vocabulary end of a denoising step, streamed: statistics, one draw and the self-conditioning signal
of the tempered distribution softmax(logits / T), without a [B, C, V] array.

`VocabHead` streams the tied LM head over the vocabulary in chunks with an online log-sum-exp (entropy,
top probability, runner-up, argmax, the soft embedding), and draws by inverse CDF only where a token is
accepted. The algorithm and the choice of chunks: docs/sampler.md.

Axes: B batch, C canvas, D model, V vocab, U vocabulary chunk, N chunks, R draw slots per row.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from diffusiongemma.diffusion import acceptance as acceptance_lib
from diffusiongemma.diffusion.noise import NEVER_LOGIT
from diffusiongemma.model import layers
from diffusiongemma.model.config import ModelConfig

Array = jax.Array
Restrict = Callable[[Array, Array], Array]
AUTO = "auto"  # a chunk size chosen from the memory budget
DEFAULT_BUDGET_MIB = 256  # of one float32 [B, C, U] array of the head (U = V: one chunk)
CPU_BLOCK_MIB = 8  # "auto" on a CPU: MiB of one float32 [B, C, U] block at most (the caches)
_CHUNK_MULTIPLE = 128


@flax.struct.dataclass
class _Running:
  """Online statistics of exp(l - max) over the chunks seen so far, per position [B, C] (rows: [B, C, D])."""

  max: Array  # float32
  mass: Array  # float32: sum exp(l - max)
  spread: Array  # float32: sum exp(l - max) (l - max)
  argmax: Array  # int32, the first of equal maxima
  rows: Array | None  # float32 [B, C, D]: sum exp(l - max) E_l (None: not asked for)
  second: Array | None = None  # float32: the largest logit but the argmax's (None: not asked for)

  def merge(self, other: "_Running") -> "_Running":
    """Both chunks' statistics; `other` comes later in the vocabulary (ties keep the earlier argmax)."""
    top = jnp.maximum(self.max, other.max)
    a, b = jnp.exp(self.max - top), jnp.exp(other.max - top)
    rows = second = None
    if self.rows is not None:
      rows = a[..., None] * self.rows + b[..., None] * other.rows
    if self.second is not None:  # the runner-up is the losing chunk's max or either chunk's own runner-up
      second = jnp.maximum(jnp.minimum(self.max, other.max), jnp.maximum(self.second, other.second))
    return _Running(max=top, mass=a * self.mass + b * other.mass,
                    spread=(a * (self.spread + (self.max - top) * self.mass)
                            + b * (other.spread + (other.max - top) * other.mass)),
                    argmax=jnp.where(other.max > self.max, other.argmax, self.argmax), rows=rows,
                    second=second)


def default_auto_block_mib(backend: str | None = None) -> float | None:
  """The cap on "auto" chunks' blocks on `backend` (default: jax's): none where whole-vocabulary matmuls pay
  (GPU, TPU), `CPU_BLOCK_MIB` elsewhere (docs/sampler.md)."""
  backend = jax.default_backend() if backend is None else backend
  return None if backend in ("gpu", "cuda", "rocm", "tpu") else CPU_BLOCK_MIB


def _chunk_running(scaled: Array, first: Array | int, table: Array | None, margin: bool = False) -> _Running:
  """Statistics of one chunk of scaled logits [B, C, U] whose first token id is `first`; with its table
  rows [U, D], the weighted rows too; with `margin`, the runner-up logit."""
  top = jnp.max(scaled, axis=-1)
  shifted = scaled - top[..., None]
  weights = jnp.exp(shifted)  # [B, C, U]
  argmax = _first_max(scaled, top)
  second = None
  if margin:
    ids = jnp.arange(scaled.shape[-1], dtype=jnp.int32)
    second = jnp.max(jnp.where(ids == argmax[..., None], -jnp.inf, scaled), axis=-1)
  return _Running(max=top, mass=jnp.sum(weights, axis=-1), spread=jnp.sum(weights * shifted, axis=-1),
                  argmax=argmax + first, rows=None if table is None else layers.weighted_rows(weights, table),
                  second=second)


def _first_max(x: Array, top: Array) -> Array:
  """jnp.argmax(x, -1) given the max: the least index where x equals it. A min over a float iota runs
  5-10x faster than XLA's CPU argmax (an index-carrying reduction); floats hold ids exactly below 2^24."""
  ids = jnp.arange(x.shape[-1], dtype=jnp.float32)
  return jnp.min(jnp.where(x == top[..., None], ids, x.shape[-1]), axis=-1).astype(jnp.int32)


def _first_crossing(scaled: Array, first, log_normalizer: Array, argmax: Array, target: Array,
                    below: Array) -> tuple[Array, Array, Array]:
  """In one chunk [..., U] of the vocabulary ordered by id without the argmax: the first token whose
  cumulative probability exp(l - log_normalizer), added to `below` (the earlier chunks'), exceeds `target`.
  Returns (that token or -1, the chunk's last token with probability or -1, the cumulative after it)."""
  ids = first + jnp.arange(scaled.shape[-1], dtype=jnp.int32)
  probs = jnp.where(ids == argmax[..., None], 0.0, jnp.exp(scaled - log_normalizer[..., None]))
  cumulative = below[..., None] + jnp.cumsum(probs, axis=-1)
  crossed = cumulative > target[..., None]
  token = jnp.where(crossed.any(-1), ids[jnp.argmax(crossed, axis=-1)], -1)
  last = jnp.max(jnp.where(probs > 0, ids, -1), axis=-1)
  return token, last, cumulative[..., -1]


def _draw_rest(fold, log_normalizer: Array, argmax: Array, confidence: Array, uniforms: Array) -> Array:
  """The draw where u >= the top probability: the first token other than the argmax whose cumulative
  probability exceeds u - p(argmax), over the vocabulary's chunks in order (`fold`, see
  `VocabHead._fold`). If rounding leaves the target above the total: the last token with probability."""
  target = uniforms - confidence
  none = jnp.full(argmax.shape, -1, jnp.int32)

  def step(carry, first, rows, scaled):
    del rows
    found, last, below = carry
    token, chunk_last, below = _first_crossing(scaled, first, log_normalizer, argmax, target, below)
    return jnp.where(found >= 0, found, token), jnp.maximum(last, chunk_last), below

  found, last, _ = fold(functools.partial(step, (none, none, jnp.zeros(argmax.shape, jnp.float32))), step)
  return jnp.where(found >= 0, found, jnp.where(last >= 0, last, argmax)).astype(jnp.int32)


@flax.struct.dataclass
class HeadOutput:
  """What the vocabulary head gives a step, per position."""

  stats: acceptance_lib.TokenStats  # `sample`: the argmax where u < the top probability, else -1
  soft_embedding: Array  # [B, C, D] softmax(l) @ E * sqrt(D) in the parameter dtype: self-conditioning
  log_normalizer: Array  # [B, C] float32 log sum exp(l): log-probabilities are l - log_normalizer


def _finish(running: _Running, uniforms: Array, scale: Array | None) -> HeadOutput:
  confidence = 1.0 / running.mass
  margin = None
  if running.second is not None:  # p(top) - p(runner-up) = (1 - exp(second - max)) / mass
    margin = (1.0 - jnp.exp(running.second - running.max)) / running.mass
  stats = acceptance_lib.TokenStats(
      entropy=jnp.log(running.mass) - running.spread / running.mass, confidence=confidence,
      argmax=running.argmax, sample=jnp.where(uniforms < confidence, running.argmax, -1), margin=margin)
  soft = None if running.rows is None else layers.soft_embedding(running.rows, running.mass, scale)
  return HeadOutput(stats=stats, soft_embedding=soft, log_normalizer=running.max + jnp.log(running.mass))


def complete_draw(scaled_logits: Array, out: HeadOutput, uniforms: Array) -> Array:
  """The draw [B, C] at every position, given the whole scaled logits [B, C, V] that `out` (the head's
  output on them, with the same uniforms) came from: `out.stats.sample` where it is set, else the rest of
  the inverse CDF."""
  scaled = scaled_logits.astype(jnp.float32)
  stats = out.stats
  flat = lambda x: x.reshape(-1)
  rest = _draw_rest(lambda start, step: start(0, None, _flat(scaled)), flat(out.log_normalizer),
                    flat(stats.argmax), flat(stats.confidence), flat(uniforms)).reshape(uniforms.shape)
  return jnp.where(stats.sample >= 0, stats.sample, rest)


def token_stats(scaled_logits: Array, uniforms: Array) -> acceptance_lib.TokenStats:
  """Statistics and the draw (one uniform per position, [B, C]) of softmax(scaled_logits) [B, C, V] given
  whole: the unchunked path."""
  flat = _flat(scaled_logits.astype(jnp.float32))  # [P, V], as the streamed head
  out = _unflat(_finish(_chunk_running(flat, 0, None, margin=True), uniforms.reshape(-1), None), uniforms.shape)
  return out.stats.replace(sample=complete_draw(scaled_logits, out, uniforms))


def uniforms(keys: Array, canvas_length: int) -> Array:
  """One uniform in [0, 1) per position [B, C], one key per row."""
  return jax.vmap(lambda k: jax.random.uniform(k, (canvas_length,), jnp.float32))(keys)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VocabHead:
  """The tied LM head and the tempered distribution's statistics, streamed over the vocabulary (see the
  module docstring). Frozen and hashable: part of a sampler's static description."""

  vocab_size: int
  softcap: float | None
  dtype: str  # the head matmul's (the model's compute dtype)
  never_token: int | None = None  # removed from the distribution (masked noise: the mask token)
  chunk_size: int | str | None = None  # tokens per chunk; None: the whole vocabulary at once; "auto"
  budget_mib: float = DEFAULT_BUDGET_MIB  # for chunk_size "auto": MiB of one float32 [B, C, U] array
  auto_block_mib: float | None = None  # for chunk_size "auto": MiB of one [B, C, U] block at most (CPU: 8)
  draw_slots: int = 4  # positions per row whose draw one pass of `draw` recomputes
  margin: bool = False  # also the top-1 minus top-2 probability (`TokenStats.margin`), for rules that use it

  def __post_init__(self):
    size = self.chunk_size
    if size is not None and size != AUTO and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
      raise ValueError(f"vocab_chunk_size={self.chunk_size!r} is invalid: None (the whole vocabulary), "
                       f"{AUTO!r} (from the memory budget) or a positive integer.")
    if isinstance(self.budget_mib, bool) or not isinstance(self.budget_mib, (int, float)) or not self.budget_mib > 0:
      raise ValueError(f"vocab_budget_mib={self.budget_mib!r} is invalid: a positive number of MiB.")
    positive = lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if not positive(self.draw_slots):
      raise ValueError(f"draw_slots={self.draw_slots!r} is invalid: a positive integer.")
    block = self.auto_block_mib
    if block is not None and (isinstance(block, bool) or not isinstance(block, (int, float)) or not block > 0):
      raise ValueError(f"auto_block_mib={block!r} is invalid: None or a positive number of MiB.")

  @classmethod
  def for_model(cls, config: ModelConfig, never_token: int | None = None, chunk_size: int | str | None = None,
                budget_mib: float = DEFAULT_BUDGET_MIB, margin: bool = False) -> "VocabHead":
    """The head of `config`'s model; for chunk_size "auto", the backend's cap asked here, once."""
    return cls(vocab_size=config.vocab_size, softcap=config.final_logit_softcap, dtype=config.dtype,
               never_token=never_token, chunk_size=chunk_size, budget_mib=budget_mib,
               auto_block_mib=default_auto_block_mib() if chunk_size == AUTO else None, margin=margin)

  def chunk_for(self, positions: int) -> int | None:
    """Tokens per chunk for `positions` (B x C) positions at once, None for one chunk: `chunk_size`, or
    for "auto" the fewest chunks whose float32 [B, C, U] blocks fit the smaller of `budget_mib` and
    `auto_block_mib` (docs/sampler.md)."""
    if self.chunk_size != AUTO:
      return self.chunk_size
    column = 4 * positions  # bytes of one vocabulary entry's float32 logits
    budget = int(min(self.budget_mib, self.auto_block_mib or math.inf) * 2**20)
    size = self.vocab_size
    if column * size > budget:
      fits = max(_CHUNK_MULTIPLE, budget // column // _CHUNK_MULTIPLE * _CHUNK_MULTIPLE)
      chunks = -(-self.vocab_size // fits)
      size = -(-self.vocab_size // chunks)  # the same chunks, evened out (the last one less padded)
      size = -(-size // _CHUNK_MULTIPLE) * _CHUNK_MULTIPLE
    return None if size >= self.vocab_size else size

  def _chunked_table(self, table: Array, chunk_size: int | None) -> Array:
    """The table as [N, U, D], zero rows after the vocabulary (their logits are removed)."""
    size = self.vocab_size if chunk_size is None else min(chunk_size, self.vocab_size)
    n = -(-self.vocab_size // size)
    table = jnp.pad(table, ((0, n * size - self.vocab_size), (0, 0)))
    return table.reshape(n, size, table.shape[-1])

  def scaled_logits(self, table: Array, hidden: Array, first, temperature: Array,
                    restrict: Restrict | None = None) -> Array:
    """logits / T of the table rows [U, D] starting at token id `first` for hidden [..., D]: float32
    [..., U], the never token and ids past the vocabulary at `NEVER_LOGIT`."""
    logits = layers.head_logits(hidden, table, jnp.dtype(self.dtype), self.softcap)
    ids = first + jnp.arange(table.shape[0])
    removed = ids >= self.vocab_size
    if self.never_token is not None:
      removed |= ids == self.never_token
    if table.shape[0] != self.vocab_size or self.never_token is not None:  # chunks, or the never token
      logits = jnp.where(removed, NEVER_LOGIT, logits)
    temperature = jnp.asarray(temperature)  # a scalar, or one per leading axis of hidden (e.g. [B])
    scaled = logits / temperature.reshape(temperature.shape + (1,) * (logits.ndim - temperature.ndim))
    return scaled if restrict is None else restrict(scaled, first)

  def _fold(self, table: Array, hidden: Array, temperature: Array, restrict: Restrict | None,
            lead: tuple[int, ...]):
    """`fold(start, step)`: carry = start(first id, rows, scaled) on the first chunk of the vocabulary, then
    carry = step(carry, first id, rows, scaled) on each later one in order (no loop for one chunk); rows
    [U, D] are the chunk's table rows, scaled [P, U] its logits / T for hidden [P, D], computed inside the
    loop; `restrict` sees them in the positions' shape `lead` (P = prod(lead)). The later chunks are indexed
    inside the loop, so no copy of the table is made."""
    positions = hidden.shape[0]
    chunked = self._chunked_table(table, self.chunk_for(positions))
    if jnp.ndim(temperature):  # per row [B] (leading axes of `lead`): per flattened position [P]
      temperature = jnp.broadcast_to(temperature.reshape(temperature.shape + (1,) * (len(lead) - temperature.ndim)),
                                     lead).reshape(-1)
    wrapped = restrict
    if restrict is not None:
      wrapped = lambda s, first: restrict(s.reshape(lead + s.shape[-1:]), first).reshape(s.shape)
    scaled = lambda first, rows: self.scaled_logits(rows, hidden, first, temperature, wrapped)

    def fold(start, step):
      carry = start(0, chunked[0], scaled(0, chunked[0]))
      if chunked.shape[0] == 1:
        return carry

      def body(carry, index):
        rows = jax.lax.dynamic_index_in_dim(chunked, index, keepdims=False)
        first = index * chunked.shape[1]
        return step(carry, first, rows, scaled(first, rows)), None

      return jax.lax.scan(body, carry, jnp.arange(1, chunked.shape[0], dtype=jnp.int32))[0]

    return fold

  def __call__(self, table: Array, hidden: Array, temperature: Array, uniforms: Array,
               restrict: Restrict | None = None) -> HeadOutput:
    """The statistics, the argmax part of the draw and the soft embedding of softmax(head(hidden) / T).

    table: the embedding [V, D]; hidden: final hidden states [B, C, D]; temperature: a scalar or [B]; uniforms
    [B, C] in [0, 1). `stats.sample` is -1 where `draw` must finish the draw.
    """
    lead = hidden.shape[:-1]
    fold = self._fold(table, _flat(hidden), temperature, restrict, lead)
    chunk = lambda first, rows, scaled: _chunk_running(scaled, first, rows, self.margin)
    running = fold(chunk, lambda running, first, rows, scaled: running.merge(chunk(first, rows, scaled)))
    return _unflat(_finish(running, uniforms.reshape(-1), layers.embed_scale(table.shape[-1], table.dtype)), lead)

  def draw(self, table: Array, hidden: Array, out: HeadOutput, need: Array, uniforms: Array,
           temperature: Array, restrict: Restrict | None = None) -> Array:
    """`out.stats.sample` [B, C] completed at the positions `need` [B, C] where it is -1: `draw_slots`
    positions of each row per pass over the vocabulary, looping while any row has some left (no pass when
    none has). Elsewhere the sample is left as it is."""
    stats = out.stats
    b, c = need.shape
    slots = min(self.draw_slots, c)
    rows = jnp.arange(b)[:, None]

    def body(carry):
      sample, left = carry
      order = jnp.argsort(~left, axis=-1, stable=True)[:, :slots]  # [B, R]: each row's first positions left
      pick = lambda x: x[rows, order].reshape(-1)  # [B * R]
      picked = jnp.take_along_axis(hidden, order[..., None], axis=1)  # [B, R, D]
      fold = self._fold(table, _flat(picked), temperature, restrict, (b, slots))
      drawn = _draw_rest(fold, pick(out.log_normalizer), pick(stats.argmax), pick(stats.confidence),
                         pick(uniforms)).reshape(b, slots)
      sample = sample.at[rows, order].set(jnp.where(left[rows, order], drawn, sample[rows, order]))
      return sample, left.at[rows, order].set(False)

    left = need & (stats.sample < 0)
    return jax.lax.while_loop(lambda carry: carry[1].any(), body, (stats.sample, left))[0]


def _flat(hidden: Array) -> Array:
  """hidden [..., D] as [P, D]. The head works on positions flattened: with a leading axis of size 1
  (batch 1) XLA's CPU fusions of a product summed over the vocabulary ran ~4x slower (docs/sampler.md)."""
  return hidden.reshape(-1, hidden.shape[-1])


def _unflat(out, lead: tuple[int, ...]):
  """Every array of `out` [P, ...] back to the positions' shape `lead` [..., ...] (P = prod(lead))."""
  return jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]), out)

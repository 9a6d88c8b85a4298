"""Grouped-query attention for sliding and full layers, and the fixed-capacity KV cache.

Axes: B batch, L query length, S key length, D model, N query heads, K kv heads, G query heads per kv
head, H head dim.

The cache stores, per layer, keys and values at slot == position, so that its shapes are static and a
row's cache is "the first `length[b]` positions". The encoder writes new tokens at their positions and
attends causally (and within the window on sliding layers); the denoiser reads the cache and never
writes it: a canvas attends bidirectionally to every cached position (sliding layers: only the last
W - 1 of them, as transformers' sliding cache keeps) plus the whole canvas.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from diffusiongemma.model import layers
from diffusiongemma.model.config import FULL, ModelConfig

Array = jax.Array
_NEG_INF = -2.3819763e38  # Large negative logit for masked keys (the float32 min, as in Gemma).


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values [B, S, K, H] at slot == position, and each row's length [B]."""

  keys: tuple[Array, ...]
  values: tuple[Array, ...]
  length: Array  # [B] int32: positions 0 .. length - 1 are filled.

  @property
  def capacity(self) -> int:
    return self.keys[0].shape[1]

  @property
  def batch_size(self) -> int:
    return self.length.shape[0]

  @classmethod
  def empty(cls, config: ModelConfig, batch_size: int, capacity: int, dtype=None) -> "KVCache":
    dtype = jnp.dtype(dtype or config.dtype)
    keys, values = [], []
    for layer in range(config.num_layers):
      kv_heads, head_dim = config.layer_dims(layer)
      keys.append(jnp.zeros((batch_size, capacity, kv_heads, head_dim), dtype))
      values.append(jnp.zeros((batch_size, capacity, kv_heads, head_dim), dtype))
    return cls(tuple(keys), tuple(values), jnp.zeros((batch_size,), jnp.int32))

  def resized(self, capacity: int) -> "KVCache":
    """The same cache with room for `capacity` positions (zeros added at the end; only growing)."""
    if capacity < self.capacity:
      raise ValueError(f"A KVCache only grows: capacity {capacity} < {self.capacity}.")
    pad = lambda x: jnp.pad(x, ((0, 0), (0, capacity - x.shape[1]), (0, 0), (0, 0)))
    return self.replace(keys=tuple(map(pad, self.keys)), values=tuple(map(pad, self.values)))

  def with_length(self, length: Array) -> "KVCache":
    """The same cache seen as holding only positions < length (e.g. a canvas start in training)."""
    return self.replace(length=jnp.broadcast_to(jnp.asarray(length, jnp.int32), self.length.shape))


class Attention(nn.Module):
  """Self-attention of one layer: q/k RMSNorm with scale, scale-less v norm, RoPE, scaling 1.0."""

  config: ModelConfig
  layer: int

  @property
  def is_full(self) -> bool:
    return self.config.layer_types[self.layer] == FULL

  def setup(self):
    cfg = self.config
    kv_heads, head_dim = cfg.layer_dims(self.layer)
    self.kv_heads, self.head_dim = kv_heads, head_dim
    pdt = jnp.dtype(cfg.param_dtype)
    init = layers.fan_in_init([1])
    weight = lambda name, init, shape, axes, contract: layers.weight(self, name, init, shape, pdt, axes,
                                                                     contract=contract, quantize=cfg.quantize)
    self.q_einsum = weight("q_einsum", init, (cfg.num_heads, cfg.hidden_size, head_dim),
                           ("q_heads", "embed", "head_dim"), (1,))
    self.k_einsum = weight("k_einsum", init, (kv_heads, cfg.hidden_size, head_dim),
                           ("kv_heads", "embed", "head_dim"), (1,))
    self.shares_kv = self.is_full and cfg.full_k_eq_v
    if not self.shares_kv:
      self.v_einsum = weight("v_einsum", init, (kv_heads, cfg.hidden_size, head_dim),
                             ("kv_heads", "embed", "head_dim"), (1,))
    self.attn_vec_einsum = weight("attn_vec_einsum", layers.fan_in_init([0, 1]),
                                  (cfg.num_heads, head_dim, cfg.hidden_size), ("q_heads", "head_dim", "embed"),
                                  (0, 1))
    self._query_norm = layers.RMSNorm(cfg.rms_norm_eps, param_dtype=pdt, axis_name="head_dim")
    self._key_norm = layers.RMSNorm(cfg.rms_norm_eps, param_dtype=pdt, axis_name="head_dim")
    if self.is_full:
      self.inv_freq = layers.rope_inv_freq(head_dim, cfg.full_rope_theta, cfg.full_partial_rotary_factor)
    else:
      self.inv_freq = layers.rope_inv_freq(head_dim, cfg.rope_theta)

  def project(self, x: Array, positions: Array) -> tuple[Array, Array, Array]:
    """Queries [B, L, N, H], keys and values [B, L, K, H] of x at the given positions."""
    dt = jnp.dtype(self.config.dtype)
    q = layers.einsum("BLD,NDH->BLNH", x, self.q_einsum, dt)
    k_raw = layers.einsum("BLD,KDH->BLKH", x, self.k_einsum, dt)
    v_raw = k_raw if self.shares_kv else layers.einsum("BLD,KDH->BLKH", x, self.v_einsum, dt)
    q = layers.apply_rope(self._query_norm(q), positions, self.inv_freq)
    k = layers.apply_rope(self._key_norm(k_raw), positions, self.inv_freq)
    v = layers.rms_norm(v_raw, None, self.config.rms_norm_eps)
    return q, k, v

  def attend(self, q: Array, k: Array, v: Array, mask: Array) -> Array:
    """softmax(q k^T) v over keys where mask [B, L or 1, S] is true, then the output projection.

    The products run as [B, K, G*L, H] x [B, S, K, H]: with the query and output heads leading (one
    transpose each way), XLA's CPU dots ran about twice as fast as with the [B, L, K, G, H] layout.
    """
    b, l, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, l, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, L, H]
    logits = jnp.einsum("BKGLH,BSKH->BKGLS", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask[:, None, None], logits, _NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    if jax.default_backend() == "cpu":
      # Keep the softmax out of the next matmul: XLA's CPU fusion of the two ran slower (a generation at batch
      # 8 ~4% slower end to end, docs/sampler.md). The values are the same.
      probs = jax.lax.optimization_barrier(probs)
    out = layers.einsum("BKGLS,BSKH->BKGLH", probs, v, v.dtype)  # [B, K, G, L, H]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, l, n, h)
    return layers.einsum("BLNH,NHD->BLD", out, self.attn_vec_einsum, self.config.dtype)

  def encode(self, x: Array, positions: Array, valid: Array, keys: Array, values: Array,
             new_length: Array, extra_mask: Array | None = None) -> tuple[Array, Array, Array]:
    """Causal attention of new tokens over the cache after writing them into it.

    x: [B, L, D] at `positions` [B, L]; `valid` [B, L] marks real (not padding) tokens, which alone are
    written; keys/values [B, S, K, H]; `new_length` [B] is the cache length after the write.
    `extra_mask` [B, L, S] opens more keys on top of the causal (and window) mask: the soft tokens of
    one image, which see each other both ways.
    """
    q, k, v = self.project(x, positions)
    capacity = keys.shape[1]
    slots = jnp.where(valid, positions, capacity)  # padding goes out of range and is dropped
    rows = jnp.arange(x.shape[0])[:, None]
    keys = keys.at[rows, slots].set(k.astype(keys.dtype), mode="drop")
    values = values.at[rows, slots].set(v.astype(values.dtype), mode="drop")
    key_pos = jnp.arange(capacity)[None, None, :]  # [1, 1, S]
    query_pos = positions[:, :, None]  # [B, L, 1]
    mask = (key_pos <= query_pos) & (key_pos < new_length[:, None, None])
    if not self.is_full:
      mask &= key_pos > query_pos - self.config.sliding_window
    if extra_mask is not None:
      mask |= extra_mask
    return self.attend(q, keys.astype(q.dtype), values.astype(q.dtype), mask), keys, values

  def encode_denoise(self, x: Array, positions: Array, keys: Array, values: Array, length: Array
                     ) -> tuple[Array, Array, Array, Array, Array]:
    """`encode` of the first half of x and `denoise` of the second half, in one pass: x [B, 2C, D] holds C
    committed tokens, written into the cache at `positions` [B, :C] and attending causally (as `encode`),
    then a canvas of C at the C positions after them, attending to the cache including the committed
    tokens and bidirectionally to itself (as `denoise` after that encode). Returns (out [B, 2C, D], keys,
    values, the canvas's own keys and values [B, C, K, H]), the same as the two calls up to the order of
    float sums."""
    q, k, v = self.project(x, positions)
    b, c = x.shape[0], x.shape[1] // 2
    keys = keys.at[jnp.arange(b)[:, None], positions[:, :c]].set(k[:, :c].astype(keys.dtype))
    values = values.at[jnp.arange(b)[:, None], positions[:, :c]].set(v[:, :c].astype(values.dtype))
    new_length = length + c
    slot = jnp.arange(keys.shape[1])[None, None, :]  # [1, 1, S]
    query_pos = positions[:, :c, None]  # [B, C, 1]: the committed tokens (causal, as encode)
    encoder = (slot <= query_pos) & (slot < new_length[:, None, None])
    decoder = slot < new_length[:, None, None]  # [B, 1, S]: the canvas (as denoise)
    if not self.is_full:
      encoder &= slot > query_pos - self.config.sliding_window
      decoder &= slot >= new_length[:, None, None] - (self.config.sliding_window - 1)
    mask = jnp.concatenate([
        jnp.concatenate([encoder, jnp.zeros((b, c, c), bool)], axis=2),
        jnp.concatenate([jnp.broadcast_to(decoder, (b, c, keys.shape[1])), jnp.ones((b, c, c), bool)], axis=2),
    ], axis=1)  # [B, 2C, S + C]
    all_keys = jnp.concatenate([keys.astype(q.dtype), k[:, c:]], axis=1)
    all_values = jnp.concatenate([values.astype(q.dtype), v[:, c:]], axis=1)
    return self.attend(q, all_keys, all_values, mask), keys, values, k[:, c:], v[:, c:]

  def denoise_subset(self, x: Array, positions: Array, index: Array, keys: Array, values: Array,
                     length: Array, canvas_keys: Array, canvas_values: Array) -> tuple[Array, Array, Array]:
    """`denoise` of some canvas positions only: x [B, W, D] at canvas slots `index` [B, W] (positions
    `positions`), attending to the cache as `denoise` does and to every canvas slot: the W given ones with
    their fresh keys and values, the others with those of `canvas_keys` / `canvas_values` [B, C, K, H] (an
    earlier pass's). Returns (out [B, W, D], the canvas keys and values with the W slots replaced). With
    `index` holding every slot this is `denoise` (up to the order of float sums)."""
    q, k, v = self.project(x, positions)
    rows = jnp.arange(x.shape[0])[:, None]
    canvas_keys = canvas_keys.at[rows, index].set(k.astype(canvas_keys.dtype))
    canvas_values = canvas_values.at[rows, index].set(v.astype(canvas_values.dtype))
    slot = jnp.arange(keys.shape[1])[None, None, :]  # [1, 1, S]
    cache_mask = slot < length[:, None, None]  # [B, 1, S]
    if not self.is_full:
      cache_mask &= slot >= length[:, None, None] - (self.config.sliding_window - 1)
    mask = jnp.concatenate([cache_mask, jnp.ones((x.shape[0], 1, canvas_keys.shape[1]), bool)], axis=2)
    all_keys = jnp.concatenate([keys.astype(q.dtype), canvas_keys.astype(q.dtype)], axis=1)
    all_values = jnp.concatenate([values.astype(q.dtype), canvas_values.astype(q.dtype)], axis=1)
    return self.attend(q, all_keys, all_values, mask), canvas_keys, canvas_values

  def denoise(self, x: Array, positions: Array, keys: Array, values: Array, length: Array,
              block_length: int | None = None) -> Array:
    """Bidirectional attention of a canvas over [cache ; canvas]; the cache is only read.

    With `block_length` < the canvas length, x holds several consecutive canvases (blocks) denoised in
    one pass, block-causally: block i sees the cache up to its own start, length + i * block_length, and
    itself, exactly as if it were denoised alone after a cache of the clean earlier blocks.
    """
    q, k, v = self.project(x, positions)
    b, c = x.shape[:2]
    block_length = block_length or c
    if c % block_length:
      raise ValueError(f"Canvas length {c} is not a multiple of block_length={block_length}.")
    # One block: every query sees the same keys, so the mask is per row [B, 1, S + C].
    queries = c if block_length < c else 1
    block = jnp.arange(c) // block_length  # [C]
    visible_end = length[:, None] + block[None, :queries] * block_length  # [B, Q] cache end each query sees
    slot = jnp.arange(keys.shape[1])[None, None, :]  # [1, 1, S]
    cache_mask = slot < visible_end[:, :, None]  # [B, Q, S]
    if not self.is_full:
      cache_mask &= slot >= visible_end[:, :, None] - (self.config.sliding_window - 1)
    canvas_mask = jnp.broadcast_to(block[:queries, None] == block[None, :], (b, queries, c))
    mask = jnp.concatenate([cache_mask, canvas_mask], axis=2)
    keys = jnp.concatenate([keys.astype(q.dtype), k], axis=1)
    values = jnp.concatenate([values.astype(q.dtype), v], axis=1)
    return self.attend(q, keys, values, mask)

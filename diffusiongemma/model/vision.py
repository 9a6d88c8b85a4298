"""The Gemma 4 vision encoder: image patches -> soft tokens in the text embedding space.

What transformers' `Gemma4VisionModel` + `embed_vision` compute (DiffusionGemma's encoder uses both):
  1. patch embedder: pixels in [0, 1] -> 2x - 1 -> linear, plus a learned 2-D position table (an x row
     and a y row per patch; padding patches, at (-1, -1), get none);
  2. a bidirectional transformer over the patches of each image (q/k RMSNorm with scale, scale-free v
     norm, attention scaling 1.0, 2-D RoPE: the first half of each head rotates with x, the second with
     y; padding patches are never attended to), GeGLU feed-forward, pre and post norms;
  3. pooler: the mean of each k x k neighbourhood of patches (k = `pooling_kernel_size`) is one soft
     token, times sqrt(width), in float32; then optionally standardised, (x - bias) * scale;
  4. `embed_vision`: RMSNorm without scale, then a linear map into the text width.

An image of n soft tokens comes from n * k^2 patches; inputs are padded to a common patch count P (a
multiple of k^2), so each image has T = P / k^2 soft-token slots, of which the first n are valid.

Axes: B images, P patches, T soft tokens, C pixels per patch, D vision width, E text width, N heads,
K kv heads, H head dim.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusiongemma.model import layers
from diffusiongemma.model.config import VisionConfig

Array = jax.Array

__all__ = ["VisionConfig", "VisionEmbedder", "VisionTower", "check_placeholders", "dummy_image", "image_block_mask",
           "merge_soft_tokens", "num_soft_tokens", "pool_soft_tokens"]


class PatchEmbedder(nn.Module):
  """Patch pixels [B, P, C] and positions [B, P, 2] -> [B, P, D]."""

  config: VisionConfig
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, pixels: Array, positions: Array, padding: Array) -> Array:
    cfg = self.config
    input_proj = layers.param(self, "input_proj", layers.fan_in_init([0]), (cfg.patch_pixels, cfg.hidden_size),
                              self.param_dtype, (None, "embed"))
    table = layers.param(self, "position_embedding_table", nn.initializers.normal(0.02),
                         (2, cfg.position_embedding_size, cfg.hidden_size), self.param_dtype,
                         (None, None, "embed"))
    x = jnp.einsum("BPC,CD->BPD", (2 * (pixels.astype(jnp.float32) - 0.5)).astype(self.dtype),
                   input_proj.astype(self.dtype))
    index = jnp.maximum(positions, 0)  # padding (-1) looks up row 0, then is zeroed
    position_embedding = table[0][index[..., 0]] + table[1][index[..., 1]]  # [B, P, D]
    position_embedding = jnp.where(padding[..., None], 0, position_embedding)
    return x + position_embedding.astype(self.dtype)


def _rope_2d(x: Array, positions: Array, inv_freq: Array) -> Array:
  """Rotate-half RoPE of the first half of each head by x, the second half by y. x: [B, P, N, H]."""
  half = x.shape[-1] // 2
  return jnp.concatenate([layers.apply_rope(x[..., :half], positions[..., 0], inv_freq),
                          layers.apply_rope(x[..., half:], positions[..., 1], inv_freq)], axis=-1)


class VisionAttention(nn.Module):
  """Bidirectional self-attention over each image's patches; the first `lengths` [B] patches are real."""

  config: VisionConfig
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  def setup(self):
    cfg, pdt = self.config, self.param_dtype
    init = layers.fan_in_init([1])
    self.q_einsum = layers.param(self, "q_einsum", init, (cfg.num_heads, cfg.hidden_size, cfg.head_dim), pdt,
                                 ("q_heads", "embed", "head_dim"))
    self.k_einsum = layers.param(self, "k_einsum", init, (cfg.num_kv_heads, cfg.hidden_size, cfg.head_dim),
                                 pdt, ("kv_heads", "embed", "head_dim"))
    self.v_einsum = layers.param(self, "v_einsum", init, (cfg.num_kv_heads, cfg.hidden_size, cfg.head_dim),
                                 pdt, ("kv_heads", "embed", "head_dim"))
    self.attn_vec_einsum = layers.param(self, "attn_vec_einsum", layers.fan_in_init([0, 1]),
                                        (cfg.num_heads, cfg.head_dim, cfg.hidden_size), pdt,
                                        ("q_heads", "head_dim", "embed"))
    self._query_norm = layers.RMSNorm(cfg.rms_norm_eps, param_dtype=pdt, axis_name="head_dim")
    self._key_norm = layers.RMSNorm(cfg.rms_norm_eps, param_dtype=pdt, axis_name="head_dim")
    # Both halves use the same frequencies: theta^(-2i / (H / 2)) for i < H / 4.
    self.inv_freq = layers.rope_inv_freq(cfg.head_dim // 2, cfg.rope_theta)

  def __call__(self, x: Array, positions: Array, lengths: Array) -> Array:
    dt = self.dtype
    q = jnp.einsum("BPD,NDH->BPNH", x, self.q_einsum.astype(dt))
    k = jnp.einsum("BPD,KDH->BPKH", x, self.k_einsum.astype(dt))
    v = jnp.einsum("BPD,KDH->BPKH", x, self.v_einsum.astype(dt))
    q = _rope_2d(self._query_norm(q), positions, self.inv_freq)
    k = _rope_2d(self._key_norm(k), positions, self.inv_freq)
    v = layers.rms_norm(v, None, self.config.rms_norm_eps)
    # Padding patches come last (as the preprocessing writes them), so a per-image key length masks them;
    # this form also lets a GPU use its fused attention kernel.
    out = jax.nn.dot_product_attention(q, k, v, scale=1.0, key_value_seq_lengths=lengths)  # [B, P, N, H]
    return jnp.einsum("BPNH,NHD->BPD", out, self.attn_vec_einsum.astype(dt))


class VisionBlock(nn.Module):
  """x + post_norm(attn(pre_norm(x))), then the same around a GeGLU feed-forward."""

  config: VisionConfig
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  def setup(self):
    cfg, pdt = self.config, self.param_dtype
    norm = lambda: layers.RMSNorm(cfg.rms_norm_eps, param_dtype=pdt)
    self.attn = VisionAttention(cfg, self.dtype, pdt)
    self.pre_attention_norm, self.post_attention_norm = norm(), norm()
    self.pre_ffw_norm, self.post_ffw_norm = norm(), norm()
    self.mlp = layers.FeedForward(cfg.hidden_size, cfg.intermediate_size, self.dtype, pdt)

  def __call__(self, x: Array, positions: Array, lengths: Array) -> Array:
    h = x + self.post_attention_norm(self.attn(self.pre_attention_norm(x), positions, lengths))
    return h + self.post_ffw_norm(self.mlp(self.pre_ffw_norm(h)))


def pool_soft_tokens(x: Array, positions: Array, padding: Array, kernel: int) -> tuple[Array, Array]:
  """Mean of each kernel x kernel neighbourhood of patches: ([B, T, D] float32, valid [B, T]).

  Soft token j of an image with a grid `width` patches wide is the neighbourhood
  (x // kernel) + (width // kernel) * (y // kernel) == j, so an image of n * kernel^2 real patches fills
  slots 0 .. n - 1 (row-major over the pooled grid). Padding patches add zeros; a slot is valid when any
  patch (padding included, which falls in slot 0) maps to it, as in transformers.
  """
  b, p, d = x.shape
  t = p // kernel**2
  index = jnp.maximum(positions, 0)
  width = jnp.max(index[..., 0], axis=-1, keepdims=True) + 1  # [B, 1]
  slot = index[..., 0] // kernel + (width // kernel) * (index[..., 1] // kernel)  # [B, P]
  flat = (jnp.arange(b)[:, None] * t + slot).reshape(-1)  # [B * P]
  x = jnp.where(padding[..., None], 0, x.astype(jnp.float32)) / kernel**2
  pooled = jnp.zeros((b * t, d), jnp.float32).at[flat].add(x.reshape(b * p, d), mode="drop")
  valid = jnp.zeros((b * t,), jnp.int32).at[flat].add(1, mode="drop") > 0
  return pooled.reshape(b, t, d), valid.reshape(b, t)


class VisionTower(nn.Module):
  """Pixels [B, P, C] in [0, 1] and positions [B, P, 2] ((-1, -1) = padding, after the real patches)
  -> soft tokens [B, P / k^2, D] (in the vision width) and which of them are valid [B, P / k^2]."""

  config: VisionConfig
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  def setup(self):
    cfg = self.config
    self.patch_embedder = PatchEmbedder(cfg, self.dtype, self.param_dtype)
    self.blocks = [VisionBlock(cfg, self.dtype, self.param_dtype, name=f"layer_{i}")
                   for i in range(cfg.num_layers)]
    if cfg.standardize:
      self.std_bias = layers.param(self, "std_bias", nn.initializers.zeros, (cfg.hidden_size,),
                                   self.param_dtype, ("embed",))
      self.std_scale = layers.param(self, "std_scale", nn.initializers.ones, (cfg.hidden_size,),
                                    self.param_dtype, ("embed",))

  def __call__(self, pixels: Array, positions: Array) -> tuple[Array, Array]:
    cfg = self.config
    kernel = cfg.pooling_kernel_size
    if pixels.ndim != 3 or pixels.shape[-1] != cfg.patch_pixels or positions.shape != (*pixels.shape[:2], 2):
      raise ValueError(f"Expected pixel values [images, patches, {cfg.patch_pixels}] and position ids "
                       f"[images, patches, 2]; got {pixels.shape} and {positions.shape}.")
    if pixels.shape[1] % kernel**2:
      raise ValueError(f"The patch count {pixels.shape[1]} is not a multiple of pooling_kernel_size^2 = "
                       f"{kernel**2}: pad images with preprocessing's `stack`.")
    padding = jnp.all(positions == -1, axis=-1)  # [B, P]
    lengths = jnp.sum(~padding, axis=-1).astype(jnp.int32)  # [B]
    x = self.patch_embedder(pixels, positions, padding)
    for block in self.blocks:
      x = block(x, positions, lengths)
    soft, valid = pool_soft_tokens(x, positions, padding, kernel)
    soft = soft * jnp.float32(math.sqrt(cfg.hidden_size))
    if cfg.standardize:
      soft = (soft - self.std_bias.astype(jnp.float32)) * self.std_scale.astype(jnp.float32)
    return soft.astype(self.dtype), valid


class VisionEmbedder(nn.Module):
  """Soft tokens [B, T, D] -> the text embedding space [B, T, E]: RMSNorm without scale, then linear."""

  vision_size: int
  text_size: int
  eps: float
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, soft: Array) -> Array:
    projection = layers.param(self, "embedding_projection", layers.fan_in_init([0]),
                              (self.vision_size, self.text_size), self.param_dtype, (None, "embed"))
    normed = layers.rms_norm(soft, None, self.eps)
    return jnp.einsum("BTD,DE->BTE", normed, projection.astype(self.dtype))


def dummy_image(config: VisionConfig) -> tuple[Array, Array]:
  """One image of a single soft token (pixels [1, k^2, C], positions [1, k^2, 2]): enough to create the
  vision parameters in `init`."""
  kernel = config.pooling_kernel_size
  grid = jnp.stack(jnp.meshgrid(jnp.arange(kernel), jnp.arange(kernel), indexing="xy"), axis=-1)
  return jnp.zeros((1, kernel**2, config.patch_pixels), jnp.float32), grid.reshape(1, kernel**2, 2)


def num_soft_tokens(config: VisionConfig, positions: Array) -> Array:
  """Soft tokens of each image [B] from its position ids [B, P, 2]: real patches / k^2."""
  real = jnp.sum(~jnp.all(positions == -1, axis=-1), axis=-1)
  return real // config.pooling_kernel_size**2


def check_placeholders(config: VisionConfig, is_image: Array, positions: Array) -> None:
  """Raises if the prompt's image placeholders and the images' soft tokens differ in number.

  Only for concrete arrays (a call outside `jit`); under `jit` the counts cannot be read and a mismatch
  goes unnoticed (surplus placeholders get an arbitrary soft token): build prompts with
  `data.images.expand_image_placeholders`, which checks.
  """
  if isinstance(is_image, jax.core.Tracer) or isinstance(positions, jax.core.Tracer):
    return
  placeholders = int(jnp.sum(is_image))
  soft = int(jnp.sum(num_soft_tokens(config, positions)))
  if placeholders != soft:
    raise ValueError(f"The prompt has {placeholders} image soft-token placeholders but the "
                     f"{positions.shape[0]} images have {soft} soft tokens: expand each image placeholder "
                     "with data.images.expand_image_placeholders using the images' num_soft_tokens.")


def merge_soft_tokens(x: Array, is_image: Array, features: Array, valid: Array) -> Array:
  """x [B, L, E] with the placeholders (`is_image` [B, L]) replaced, in row-major order, by the valid
  soft tokens of `features` [N, T, E] (`valid` [N, T]) in image order: transformers' masked_scatter."""
  n, t, e = features.shape
  source = jnp.nonzero(valid.reshape(-1), size=n * t, fill_value=0)[0]  # [N*T] r-th valid soft token
  rank = jnp.cumsum(is_image.reshape(-1)) - 1  # [B*L] which soft token each placeholder takes
  taken = features.reshape(n * t, e)[source[jnp.clip(rank, 0, n * t - 1)]].reshape(x.shape)
  return jnp.where(is_image[..., None], taken.astype(x.dtype), x)


def image_block_mask(is_image: Array, positions: Array, capacity: int) -> Array:
  """[B, L, S]: query and key are soft tokens of the same image (a maximal run of placeholders).

  The new tokens sit at `positions` [B, L] of a cache of `capacity` slots; cached keys belong to no
  image of this call (an image is encoded in one call), as in transformers' prefill with
  `mm_token_type_ids`.
  """
  b = is_image.shape[0]
  previous = jnp.pad(is_image[:, :-1], ((0, 0), (1, 0)))
  block = jnp.where(is_image, jnp.cumsum(is_image & ~previous, axis=1) - 1, -1)  # [B, L]
  slots = jnp.where(is_image, positions, capacity)
  key_block = jnp.full((b, capacity), -1, block.dtype).at[jnp.arange(b)[:, None], slots].set(
      block, mode="drop")  # [B, S]
  return (block[:, :, None] >= 0) & (block[:, :, None] == key_block[:, None, :])

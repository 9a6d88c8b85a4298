"""The DiffusionGemma transformer: one set of weights, a causal encoder and a bidirectional denoiser.

Axes: B batch, L length, C canvas, D model, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusiongemma.model import layers, moe, vision
from diffusiongemma.model.attention import Attention, KVCache
from diffusiongemma.model.config import FULL, SLIDING, ModelConfig

Array = jax.Array


class Block(nn.Module):
  """One layer: attention, then the dense and expert feed-forward branches, then the layer scalar.

    h   = x + post_attention_norm(attn(pre_attention_norm(x)))
    ffn = post_ffw1_norm(mlp(pre_ffw_norm(h))) + post_ffw2_norm(experts(pre_ffw2_norm(h), router(h)))
    out = (h + post_ffw_norm(ffn)) * scalar

  The scalar is kept separately for the encoder and the decoder (as the checkpoint does).
  """

  config: ModelConfig
  layer: int

  def setup(self):
    cfg = self.config
    pdt, dt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    norm = lambda: layers.RMSNorm(cfg.rms_norm_eps, param_dtype=pdt)
    self.attn = Attention(cfg, self.layer)
    self.pre_attention_norm, self.post_attention_norm = norm(), norm()
    self.pre_ffw_norm, self.post_ffw_norm = norm(), norm()
    self.post_ffw1_norm, self.pre_ffw2_norm, self.post_ffw2_norm = norm(), norm(), norm()
    self.mlp = layers.FeedForward(cfg.hidden_size, cfg.intermediate_size, dt, pdt, cfg.quantize)
    self.router = moe.Router(cfg)
    self.experts = moe.Experts(cfg)
    scalar = lambda name: layers.param(self, name, nn.initializers.ones, (), pdt, ())
    self.encoder_scalar, self.decoder_scalar = scalar("encoder_scalar"), scalar("decoder_scalar")

  def _feed_forward(self, h: Array, scalar: Array, skip: Array | None = None) -> Array:
    """skip [B, L] bool: tokens whose output is not needed (the experts leave them out)."""
    b, l, d = h.shape
    dense = self.post_ffw1_norm(self.mlp(self.pre_ffw_norm(h)))
    tokens = h.reshape(b * l, d)
    weights, experts = self.router(tokens)
    skip = None if skip is None else skip.reshape(b * l)
    sparse = self.experts(self.pre_ffw2_norm(tokens), weights, experts, skip).reshape(b, l, d)
    out = h + self.post_ffw_norm(dense + self.post_ffw2_norm(sparse))
    return out * scalar.astype(out.dtype)

  def encode(self, x, positions, valid, keys, values, new_length, extra_mask=None):
    attn, keys, values = self.attn.encode(self.pre_attention_norm(x), positions, valid, keys, values,
                                          new_length, extra_mask)
    h = x + self.post_attention_norm(attn)
    return self._feed_forward(h, self.encoder_scalar), keys, values

  def denoise(self, x, positions, keys, values, length, block_length=None, skip_rows=None):
    h = x + self.post_attention_norm(self.attn.denoise(self.pre_attention_norm(x), positions, keys,
                                                       values, length, block_length))
    skip = None if skip_rows is None else jnp.broadcast_to(skip_rows[:, None], x.shape[:2])
    return self._feed_forward(h, self.decoder_scalar, skip)

  def denoise_subset(self, x, positions, index, keys, values, length, canvas_keys, canvas_values, skip_rows=None):
    attn, canvas_keys, canvas_values = self.attn.denoise_subset(
        self.pre_attention_norm(x), positions, index, keys, values, length, canvas_keys, canvas_values)
    h = x + self.post_attention_norm(attn)
    skip = None if skip_rows is None else jnp.broadcast_to(skip_rows[:, None], x.shape[:2])
    return self._feed_forward(h, self.decoder_scalar, skip), canvas_keys, canvas_values

  def encode_denoise(self, x, positions, keys, values, length, skip_rows=None):
    """`encode` of x[:, :C] and `denoise` of x[:, C:] after it, in one pass (`Attention.encode_denoise`):
    each half with its own layer scalar."""
    attn, keys, values, canvas_keys, canvas_values = self.attn.encode_denoise(
        self.pre_attention_norm(x), positions, keys, values, length)
    h = x + self.post_attention_norm(attn)
    b, l = x.shape[:2]
    is_canvas = jnp.arange(l) >= l // 2  # [2C]
    scalar = jnp.where(is_canvas, self.decoder_scalar, self.encoder_scalar)[None, :, None]
    skip = None if skip_rows is None else skip_rows[:, None] & is_canvas[None]
    return self._feed_forward(h, scalar, skip), keys, values, canvas_keys, canvas_values


class SelfConditioning(nn.Module):
  """Adds a GeGLU of the previous step's expected embedding to the canvas embedding, then RMSNorm
  without scale (always applied, also when the signal is zero)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, signal: Array | None) -> Array:
    cfg = self.config
    pdt = jnp.dtype(cfg.param_dtype)
    pre_norm = layers.RMSNorm(cfg.rms_norm_eps, param_dtype=pdt, name="pre_norm")
    mlp = layers.FeedForward(cfg.hidden_size, cfg.intermediate_size, jnp.dtype(cfg.dtype), pdt, cfg.quantize,
                              name="mlp")
    if signal is None and self.is_initializing():
      signal = jnp.zeros_like(x)
    if signal is not None:  # a zero signal adds exactly zero: skip the work
      x = x + mlp(pre_norm(signal))
    return layers.rms_norm(x, None, cfg.rms_norm_eps)


class DiffusionGemma(nn.Module):
  """DiffusionGemma: a causal sparse-MoE encoder and a bidirectional canvas denoiser on tied weights.

  - `encode(tokens, cache)`: causal over `tokens` [B, L] placed after each row's cache, appends their
    keys and values to the cache and returns next-token logits [B, L, V]. `num_tokens` [B] marks rows
    with fewer real tokens (the rest is padding, neither written nor attended to).
  - `denoise(canvas, cache, self_conditioning_logits)`: the canvas [B, C] at positions after the cache,
    attending bidirectionally to the cache and itself; returns float32 logits [B, C, V] (or, with
    `return_hidden`, the final hidden states). The optional logits [B, C, V] of a previous pass (or their
    expected embedding [B, C, D], `self_conditioning_embedding`) enter through self-conditioning;
    `self_conditioning_mask` [B] zeroes that signal per row (None means a zero signal, which is not the
    same as zero logits).
  - `__call__(prompt, canvas, ...)`: encode the prompt, then denoise the canvas.

  With `config.vision` (the Gemma 4 vision encoder), `encode` also takes images: `pixel_values`
  [images, patches, 3 * patch^2] and `image_position_ids` [images, patches, 2] (`data.images.preprocess`
  and `stack`). Their soft tokens
  replace, in order, the embeddings of the `image_id` placeholders of `tokens` (row by row; a row may
  have none), and, with `vision.bidirectional_attention`, the soft tokens of one image attend to each
  other both ways in every layer (transformers' `generate` with `mm_token_type_ids`). Images never
  change positions, and the cache then serves the canvas as usual. Without images nothing of this runs.
  """

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embedder = layers.Embedder(cfg.vocab_size, cfg.hidden_size, cfg.final_logit_softcap,
                                    jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype))
    block = Block
    if cfg.remat:
      block = nn.remat(Block, methods=["encode", "denoise", "encode_denoise", "denoise_subset"])
    self.blocks = [block(cfg, i, name=f"layer_{i}") for i in range(cfg.num_layers)]
    self.final_norm = layers.RMSNorm(cfg.rms_norm_eps, param_dtype=jnp.dtype(cfg.param_dtype))
    self.self_conditioning = SelfConditioning(cfg)
    if cfg.vision is not None:
      dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
      self.vision_tower = vision.VisionTower(cfg.vision, dt, pdt)
      self.embed_vision = vision.VisionEmbedder(cfg.vision.hidden_size, cfg.hidden_size, cfg.vision.rms_norm_eps,
                                                dt, pdt)

  def image_embeddings(self, pixel_values: Array, image_position_ids: Array) -> tuple[Array, Array]:
    """Soft tokens of images in the text embedding space [images, slots, D], and which are valid
    [images, slots] (the first `num_soft_tokens` of each): transformers' `get_image_features` before it
    drops the others."""
    self._require_vision()
    soft, valid = self.vision_tower(pixel_values, image_position_ids)
    return self.embed_vision(soft), valid

  def init_cache(self, batch_size: int, capacity: int, dtype=None) -> KVCache:
    """An empty cache holding up to `capacity` positions per row."""
    return KVCache.empty(self.config, batch_size, capacity, dtype)

  def encode(self, tokens: Array, cache: KVCache | None = None, *, num_tokens: Array | None = None,
             return_hidden: bool = False, pixel_values: Array | None = None,
             image_position_ids: Array | None = None):
    """Causal encoding of `tokens` [B, L] after the cache. Returns (logits [B, L, V], cache).

    `pixel_values` and `image_position_ids`: the images whose soft tokens fill the `image_id`
    placeholders of `tokens` (see the class docstring).
    """
    b, l = tokens.shape
    if cache is None:
      cache = self.init_cache(b, l)
    num_tokens = jnp.full((b,), l, jnp.int32) if num_tokens is None else num_tokens.astype(jnp.int32)
    positions = cache.length[:, None] + jnp.arange(l, dtype=jnp.int32)[None]  # [B, L]
    valid = jnp.arange(l)[None] < num_tokens[:, None]
    new_length = cache.length + num_tokens
    x = self.embedder.encode(tokens)  # [B, L, D]
    image_mask = None
    if pixel_values is not None:
      x, image_mask = self._merge_images(x, tokens, valid, positions, cache.capacity, pixel_values,
                                         image_position_ids)
    keys, values = [], []
    for i, block in enumerate(self.blocks):
      x, k, v = block.encode(x, positions, valid, cache.keys[i], cache.values[i], new_length, image_mask)
      keys.append(k)
      values.append(v)
    x = self.final_norm(x)
    cache = KVCache(tuple(keys), tuple(values), new_length)
    if return_hidden:
      return x, cache
    return self.embedder.decode(x), cache

  def _merge_images(self, x, tokens, valid, positions, capacity, pixel_values, image_position_ids):
    """x [B, L, D] with the images' soft tokens in place of the placeholders, and the extra attention
    mask [B, L, S] of same-image soft tokens (None without bidirectional image attention)."""
    cfg = self.config
    self._require_vision()
    if image_position_ids is None:
      raise ValueError("pixel_values were given without image_position_ids.")
    is_image = (tokens == cfg.image_id) & valid  # [B, L]
    vision.check_placeholders(cfg.vision, is_image, image_position_ids)
    features, soft_valid = self.image_embeddings(pixel_values, image_position_ids)
    x = vision.merge_soft_tokens(x, is_image, features, soft_valid)
    if not cfg.vision.bidirectional_attention:
      return x, None
    return x, vision.image_block_mask(is_image, positions, capacity)

  def _require_vision(self) -> None:
    if self.config.vision is None:
      raise ValueError("This model has no vision encoder (ModelConfig.vision=None): it cannot take images.")

  def denoise(self, canvas: Array, cache: KVCache | None = None, self_conditioning_logits: Array | None = None,
              self_conditioning_mask: Array | None = None, *, block_length: int | None = None,
              self_conditioning_embedding: Array | None = None, return_hidden: bool = False,
              skip_rows: Array | None = None) -> Array:
    """Denoiser logits [B, C, V] (float32) for `canvas` [B, C] given a read-only cache.

    Self-conditioning comes as the previous pass's logits [B, C, V] (their expected embedding is taken
    here) or directly as that expected embedding, softmax(logits) @ E * sqrt(D) [B, C, D]
    (`self_conditioning_embedding`, what the sampler carries: `Embedder.soft_encode`'s value), not both.
    `return_hidden`: the final hidden states [B, C, D] (after the final norm, in the compute dtype)
    instead of the logits, for a vocabulary head that streams the vocabulary (`sampling.vocab`).
    `skip_rows` [B]: rows whose output is not needed (a sampler's finished rows); the grouped experts
    skip their tokens (their output is then meaningless), the other rows' outputs are unchanged.

    `block_length` (static) denoises C / block_length consecutive canvases in one block-causal pass
    (training every canvas at once): block i attends to the cache up to length + i * block_length and to
    itself. The cache must then hold the clean earlier blocks, e.g. the encoder cache of the clean
    sequence, whose `length` is each row's first-canvas start.
    """
    b, c = canvas.shape
    if self_conditioning_logits is not None and self_conditioning_embedding is not None:
      raise ValueError("denoise takes self_conditioning_logits or self_conditioning_embedding, not both.")
    if cache is None:
      cache = self.init_cache(b, 0)
    x = self.embedder.encode(canvas)  # [B, C, D]
    signal = None
    if self_conditioning_logits is not None:
      signal = self.embedder.soft_encode(self_conditioning_logits)
    elif self_conditioning_embedding is not None:
      signal = self_conditioning_embedding.astype(x.dtype)
    if signal is not None and self_conditioning_mask is not None:
      signal = signal * self_conditioning_mask.astype(signal.dtype)[:, None, None]
    x = self.self_conditioning(x, signal)
    positions = cache.length[:, None] + jnp.arange(c, dtype=jnp.int32)[None]  # [B, C]
    for i, block in enumerate(self.blocks):
      x = block.denoise(x, positions, cache.keys[i], cache.values[i], cache.length, block_length, skip_rows)
    x = self.final_norm(x)
    return x if return_hidden else self.embedder.decode(x)

  def encode_denoise(self, committed: Array, canvas: Array, cache: KVCache, *,
                     self_conditioning_embedding: Array | None = None,
                     self_conditioning_mask: Array | None = None,
                     skip_rows: Array | None = None
                     ) -> tuple[Array, KVCache, tuple[tuple[Array, ...], tuple[Array, ...]]]:
    """`encode(committed, cache)` then `denoise(canvas, that cache, ..., return_hidden=True)` in one pass:
    (the canvas's final hidden states [B, C, D], the cache with the committed tokens [B, C] appended, the
    canvas's own keys and values per layer [B, C, K, H], as `denoise_subset` keeps them).

    What a sampler does at the start of every canvas but the first (it commits the previous canvas, then
    denoises the next): one pass over 2C tokens instead of two over C, so the weights are read once. The
    committed tokens attend causally and the canvas as `denoise` does; the values equal the two calls' up
    to the order of float sums (tested). Every row's C committed tokens are real (no images, no padding).
    """
    b, c = canvas.shape
    if committed.shape != canvas.shape:
      raise ValueError(f"encode_denoise takes a committed canvas and a canvas of the same shape, got "
                       f"{committed.shape} and {canvas.shape}.")
    x_canvas = self.embedder.encode(canvas)  # [B, C, D]
    signal = None if self_conditioning_embedding is None else self_conditioning_embedding.astype(x_canvas.dtype)
    if signal is not None and self_conditioning_mask is not None:
      signal = signal * self_conditioning_mask.astype(signal.dtype)[:, None, None]
    x = jnp.concatenate([self.embedder.encode(committed), self.self_conditioning(x_canvas, signal)], axis=1)
    positions = cache.length[:, None] + jnp.arange(2 * c, dtype=jnp.int32)[None]  # [B, 2C]
    keys, values, canvas_keys, canvas_values = [], [], [], []
    for i, block in enumerate(self.blocks):
      x, k, v, ck, cv = block.encode_denoise(x, positions, cache.keys[i], cache.values[i], cache.length,
                                             skip_rows)
      keys.append(k)
      values.append(v)
      canvas_keys.append(ck)
      canvas_values.append(cv)
    return (self.final_norm(x[:, c:]), KVCache(tuple(keys), tuple(values), cache.length + c),
            (tuple(canvas_keys), tuple(canvas_values)))

  def denoise_subset(self, tokens: Array, index: Array, cache: KVCache, canvas_keys: tuple[Array, ...],
                     canvas_values: tuple[Array, ...], *, self_conditioning_embedding: Array | None = None,
                     self_conditioning_mask: Array | None = None, skip_rows: Array | None = None
                     ) -> tuple[Array, tuple[Array, ...], tuple[Array, ...]]:
    """The denoiser's final hidden states [B, W, D] at canvas slots `index` [B, W] only (their tokens
    `tokens` [B, W], their self-conditioning embedding [B, W, D]), the other slots entering attention with
    the keys and values an earlier pass left in `canvas_keys` / `canvas_values` (per layer [B, C, K, H]);
    returns those with the W slots' fresh ones written in. What a sampler that reuses settled positions
    runs (`Sampler` with `SamplerConfig.reuse`); with `index` = every slot it is `denoise` exactly (up to
    the order of float sums) and the keys and values are that pass's."""
    x = self.embedder.encode(tokens)  # [B, W, D]
    signal = None if self_conditioning_embedding is None else self_conditioning_embedding.astype(x.dtype)
    if signal is not None and self_conditioning_mask is not None:
      signal = signal * self_conditioning_mask.astype(signal.dtype)[:, None, None]
    x = self.self_conditioning(x, signal)
    positions = cache.length[:, None] + index.astype(jnp.int32)  # [B, W]
    keys, values = [], []
    for i, block in enumerate(self.blocks):
      x, k, v = block.denoise_subset(x, positions, index, cache.keys[i], cache.values[i], cache.length,
                                     canvas_keys[i], canvas_values[i], skip_rows)
      keys.append(k)
      values.append(v)
    return self.final_norm(x), tuple(keys), tuple(values)

  def embedding_table(self) -> Array:
    """The embedding [V, D], which is also the LM head (tied), for a head outside the module."""
    return self.embedder.input_embedding

  def __call__(self, prompt: Array, canvas: Array, self_conditioning_logits: Array | None = None,
               self_conditioning_mask: Array | None = None) -> Array:
    if self.config.vision is not None and self.is_initializing():
      self.image_embeddings(*vision.dummy_image(self.config.vision))  # creates the vision parameters
    _, cache = self.encode(prompt)
    return self.denoise(canvas, cache, self_conditioning_logits, self_conditioning_mask)


@functools.lru_cache(maxsize=16)
def _template(config: ModelConfig):
  """The parameter shapes of a (small) model, traced once per config: loading the same model again traces
  nothing, and the cache holds shapes only."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return jax.eval_shape(lambda: nn.unbox(DiffusionGemma(config).init(jax.random.key(0), tokens, tokens))["params"])


def abstract_params(config: ModelConfig):
  """The parameter tree's shapes and dtypes (`jax.ShapeDtypeStruct`s, unboxed): no memory allocated.

  A layer's parameters depend only on its kind (sliding or full) and a vision layer's on nothing, so a model
  with one layer of each kind is traced and its layers stand for all the others: as fast for 10,000 layers
  as for 2 (a loaded config is checked against its checkpoint before anything is built).
  """
  kinds = tuple(t for t in (SLIDING, FULL) if t in config.layer_types)
  vision_cfg = None if config.vision is None else dataclasses.replace(config.vision, num_layers=1)
  template = _template(config.replace(num_layers=len(kinds), layer_types=kinds, vision=vision_cfg))
  params = {k: v for k, v in template.items() if not k.startswith("layer_")}
  params.update({f"layer_{i}": template[f"layer_{kinds.index(t)}"] for i, t in enumerate(config.layer_types)})
  if vision_cfg is not None:
    tower = {k: v for k, v in template["vision_tower"].items() if k != "layer_0"}
    tower.update({f"layer_{i}": template["vision_tower"]["layer_0"] for i in range(config.vision.num_layers)})
    params["vision_tower"] = tower
  return params


def count_parameters(config: ModelConfig) -> dict[str, int]:
  """Total parameters and parameters active per token (the k of E experts), via `jax.eval_shape`.

  The tied embedding is counted once in both; no memory is allocated. With a vision encoder, both
  include it, and `vision` counts it alone (tower and projection).
  """
  flat = jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]
  total = sum(leaf.size for _, leaf in flat)
  experts = sum(leaf.size for path, leaf in flat if any(getattr(p, "key", None) == "experts" for p in path))
  active = total - experts + experts * config.top_k // config.num_experts
  counts = {"total": total, "active": active}
  if config.vision is not None:
    counts["vision"] = sum(leaf.size for path, leaf in flat
                           if getattr(path[0], "key", None) in ("vision_tower", "embed_vision"))
  return counts

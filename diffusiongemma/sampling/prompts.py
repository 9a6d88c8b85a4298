"""Host-side input handling shared by the samplers: prompts, per-row keys, parameters, limits.

Everything here runs before a program is compiled, so bad input is refused with a message naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma.model import ModelConfig

Array = jax.Array


class StaticArgument:
  """Hashed and compared by `_key()`: a frozen description, so that equal samplers are one static jit
  argument and share compiled programs."""

  def _key(self) -> tuple:
    raise NotImplementedError

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return type(other) is type(self) and self._key() == other._key()


def pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded [B, L] token lists and their lengths [B]."""
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.full((len(prompts), max(int(lengths.max(initial=0)), 1)), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, lengths


def prepare(cfg: ModelConfig, prompt_tokens, prompt_lengths, new_positions: int, bucket: int,
            cached: int = 0) -> tuple[Array, Array]:
  """Validated, bucket-padded prompts [B, L'] and lengths [B].

  `prompt_tokens` is [B, L] (right-padded when `prompt_lengths` [B] is given), [L] for one row, or a list
  of token lists of different lengths. `cached`: positions already in a KV cache before the prompt.
  """
  ragged = isinstance(prompt_tokens, (list, tuple)) and len(prompt_tokens) and all(
      isinstance(p, (list, tuple, np.ndarray)) for p in prompt_tokens)
  if ragged and prompt_lengths is None and len({len(p) for p in prompt_tokens}) > 1:
    prompt_tokens, prompt_lengths = pad(prompt_tokens, cfg.pad_id)
  prompt = np.asarray(prompt_tokens)
  if prompt.ndim == 1:
    prompt = prompt[None]
  if prompt.ndim == 2 and 0 in prompt.shape:  # before the dtype: numpy makes [[], []] float
    raise ValueError(f"Empty prompt: prompt_tokens has shape {prompt.shape}; every row needs at least one "
                     "token (e.g. BOS).")
  if prompt.ndim != 2 or not np.issubdtype(prompt.dtype, np.integer):
    raise ValueError(f"prompt_tokens must be integer token ids of shape [batch, length], got shape "
                     f"{prompt.shape} and dtype {prompt.dtype}.")
  b, l = prompt.shape
  if prompt_lengths is None:
    lengths = np.full((b,), l, np.int32)
  else:
    lengths = np.asarray(prompt_lengths).astype(np.int32).reshape(-1)
    if lengths.shape != (b,):
      raise ValueError(f"prompt_lengths has shape {lengths.shape}; expected ({b},), one per row.")
    if (lengths < 1).any():
      raise ValueError(f"Empty prompt: prompt_lengths={lengths.tolist()} has rows of length < 1.")
    if (lengths > l).any():
      raise ValueError(f"prompt_lengths={lengths.tolist()} exceeds the prompt_tokens length {l}.")
  real = np.arange(l)[None] < lengths[:, None]
  outside = real & ((prompt < 0) | (prompt >= cfg.vocab_size))
  if outside.any():
    raise ValueError(f"prompt_tokens has ids outside the vocabulary [0, {cfg.vocab_size}): "
                     f"{sorted(set(prompt[outside].tolist()))[:10]}.")
  longest = cached + int(lengths.max())
  if longest + new_positions > cfg.max_positions:
    raise ValueError(f"The prompt is too long: {longest} prompt tokens (cached included) + {new_positions} "
                     f"new positions exceed the model's max_positions={cfg.max_positions}.")
  padded = -(-l // bucket) * bucket
  prompt = np.where(real, prompt, cfg.pad_id)
  prompt = np.pad(prompt, ((0, 0), (0, padded - l)), constant_values=cfg.pad_id)
  return jnp.asarray(prompt, jnp.int32), jnp.asarray(lengths, jnp.int32)


def check_images(cfg: ModelConfig, images, prompt: Array, lengths: Array) -> tuple[Array, Array] | None:
  """`images` = (pixel_values [N, P, 3 * patch^2], image_position_ids [N, P, 2]) as arrays, checked against
  the model and against the image placeholders of the prompts [B, L] (their first `lengths` [B] tokens)."""
  placeholders = None
  if cfg.vision is not None:
    real = np.arange(prompt.shape[1])[None] < np.asarray(lengths)[:, None]
    placeholders = int(np.sum((np.asarray(prompt) == cfg.image_id) & real))
  if images is None:
    if placeholders:
      raise ValueError(f"The prompts hold {placeholders} image soft-token placeholders (token {cfg.image_id}) "
                       "but no images were given.")
    return None
  if cfg.vision is None:
    raise ValueError("images were given, but this model has no vision encoder (ModelConfig.vision=None).")
  if not isinstance(images, (tuple, list)) or len(images) != 2:
    raise ValueError("images must be a pair (pixel_values [N, P, 3 * patch^2], image_position_ids [N, P, 2]), "
                     f"e.g. from data.images.stack; got {type(images).__name__}.")
  pixel_values, position_ids = np.asarray(images[0]), np.asarray(images[1])
  patch = cfg.vision.patch_size
  if (pixel_values.ndim != 3 or pixel_values.shape[-1] != 3 * patch * patch
      or position_ids.shape != pixel_values.shape[:2] + (2,)):
    raise ValueError(f"images have pixel_values {pixel_values.shape} and position ids {position_ids.shape}; "
                     f"expected [N, P, {3 * patch * patch}] and [N, P, 2] (patches of {patch} pixels).")
  real_patches = np.sum(~np.all(position_ids == -1, axis=-1), axis=-1)  # [N]
  soft = int(np.sum(real_patches // cfg.vision.pooling_kernel_size**2))
  if soft != placeholders:
    raise ValueError(f"The prompts hold {placeholders} image soft-token placeholders (token {cfg.image_id}) but "
                     f"the {pixel_values.shape[0]} images have {soft} soft tokens: expand one placeholder per "
                     "image with data.images.expand_image_placeholders.")
  return jnp.asarray(pixel_values, jnp.float32), jnp.asarray(position_ids, jnp.int32)


def check_max_new_tokens(max_new_tokens) -> int:
  if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer))
      or max_new_tokens < 1):
    raise ValueError(f"max_new_tokens={max_new_tokens!r} is invalid: must be an integer >= 1.")
  return int(max_new_tokens)


def check_stop_tokens(stop_tokens: Sequence[int] | None, cfg: ModelConfig) -> tuple[int, ...]:
  """The stop tokens (None: the model's eos), each inside the vocabulary."""
  tokens = tuple(stop_tokens) if stop_tokens is not None else (cfg.eos_id,)
  bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
  if bad:
    raise ValueError(f"stop_tokens={tokens} has ids {bad} outside the vocabulary [0, {cfg.vocab_size}).")
  return tokens


def row_keys(rng, batch_size: int) -> Array:
  """One typed PRNG key per row: a single key is split; [B] keys (typed or raw) are used as given."""
  rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.shape == (2,) or rng.shape == (batch_size, 2):
      rng = jax.random.wrap_key_data(rng.astype(jnp.uint32))
    else:
      raise ValueError(f"rng must be a PRNG key or {batch_size} keys (one per row), got shape {rng.shape}.")
  if rng.shape == ():
    return jax.random.split(rng, batch_size)
  if rng.shape != (batch_size,):
    raise ValueError(f"rng must be a PRNG key or {batch_size} keys (one per row), got shape {rng.shape}.")
  return rng


def variables(params) -> dict:
  """Accepts a bare parameter tree or `{'params': ...}` variables."""
  if isinstance(params, Mapping) and set(params.keys()) == {"params"}:
    return dict(params)
  return {"params": params}

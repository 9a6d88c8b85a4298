"""Small building blocks: parameters with logical axes, RMSNorm, the scaled embedder, GeGLU, RoPE.

Axes: B batch, L length, D model, F feed-forward, V vocab, H head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def param(module: nn.Module, name: str, init: Callable, shape: Sequence[int], dtype,
          axes: Sequence[str]) -> Array:
  """A parameter carrying logical axis names, so that sharding rules need no module changes."""
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype)


def weight(module: nn.Module, name: str, init: Callable, shape: Sequence[int], dtype, axes: Sequence[str], *,
           contract: Sequence[int], quantize: str = "none") -> Array:
  """A matmul weight whose `contract` axes are summed over in its einsum: a `param`, or with
  `quantize="int8"` int8 values and a float32 scale per output channel (`{name}_scale`, size 1 along the
  contracted axes; `model.quantize.int8`), dequantised to `dtype` here, where the weight is used."""
  if quantize == "none":
    return param(module, name, init, shape, dtype, axes)
  values = param(module, name, nn.initializers.zeros, shape, jnp.int8, axes)
  scale_shape = tuple(1 if i in contract else n for i, n in enumerate(shape))
  scale_axes = tuple(None if i in contract else a for i, a in enumerate(axes))
  scale = param(module, f"{name}_scale", nn.initializers.ones, scale_shape, jnp.float32, scale_axes)
  return values.astype(dtype) * scale.astype(dtype)


def fan_in_init(in_axes: Sequence[int]) -> Callable:
  """Normal initialiser with variance 1 / fan-in over `in_axes`."""
  return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=tuple(in_axes),
                                          out_axis=())


def rms_norm(x: Array, scale: Array | None, eps: float) -> Array:
  """x / rms(x) * scale, in float32 and cast back; the scale is used as is (not 1 + scale)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  return y.astype(x.dtype)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis, with a learned scale (initialised to one) or without one."""

  eps: float
  use_scale: bool = True
  param_dtype: jnp.dtype = jnp.float32
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = None
    if self.use_scale:
      scale = param(self, "scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype,
                    (self.axis_name,))
    return rms_norm(x, scale, self.eps)


class Embedder(nn.Module):
  """Token embedding times sqrt(D), tied with the LM head; logits are float32 and soft-capped."""

  vocab_size: int
  hidden_size: int
  softcap: float | None
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  def setup(self):
    self.input_embedding = param(self, "input_embedding", fan_in_init([1]),
                                 (self.vocab_size, self.hidden_size), self.param_dtype, ("vocab", "embed"))

  @property
  def scale(self) -> Array:
    return embed_scale(self.hidden_size, self.param_dtype)

  def encode(self, tokens: Array) -> Array:
    return (self.input_embedding[tokens] * self.scale).astype(self.dtype)  # [B, L, D]

  def soft_encode(self, logits: Array) -> Array:
    """Expected embedding under softmax(logits): the self-conditioning signal."""
    logits = logits.astype(jnp.float32)
    weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # [B, L, V]
    rows = weighted_rows(weights, self.input_embedding)  # [B, L, D]
    total = jnp.sum(weights, axis=-1)
    return soft_embedding(rows, total, self.scale).astype(self.dtype)

  def decode(self, x: Array) -> Array:
    return head_logits(x, self.input_embedding, self.dtype, self.softcap)  # [B, L, V]


def einsum(equation: str, x: Array, w: Array, dtype) -> Array:
  """jnp.einsum of x and w cast to `dtype`, accumulated in float32, then cast to `dtype`: the values of a
  `dtype` einsum, faster on CPU in bfloat16 (docs/sampler.md)."""
  out = jnp.einsum(equation, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
  return out.astype(dtype)


def embed_scale(hidden_size: int, param_dtype) -> Array:
  """sqrt(D), cast to the weight dtype first as the reference does (53.066 becomes 53.0 in bfloat16)."""
  return jnp.asarray(hidden_size**0.5, param_dtype)


def head_logits(x: Array, table: Array, dtype, softcap: float | None) -> Array:
  """The tied LM head on x [..., D] against (a slice of) the embedding table [V, D]: float32 logits
  [..., V] of a matmul in `dtype` (accumulated in float32; the reference rounds them to `dtype` first),
  then the softcap."""
  logits = jnp.einsum("...D,VD->...V", x.astype(dtype), table.astype(dtype),
                      preferred_element_type=jnp.float32)
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  return logits


def weighted_rows(weights: Array, table: Array) -> Array:
  """sum_v weights[..., v] * table[v] [..., D] in float32, the weights cast to the table's dtype first (the
  reference casts the probabilities to the embedding dtype)."""
  return jnp.einsum("...V,VD->...D", weights.astype(table.dtype), table, preferred_element_type=jnp.float32)


def soft_embedding(rows: Array, total: Array, scale: Array) -> Array:
  """softmax(logits) @ E * sqrt(D) in the parameter dtype (`scale`'s), from `weighted_rows` of
  exp(logits - max) [..., D] and their sum [...]: normalising after the sum lets a streamed vocabulary
  add its chunks first."""
  return (rows / total[..., None]).astype(scale.dtype) * scale


class FeedForward(nn.Module):
  """Dense GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

  hidden_size: int
  intermediate_size: int
  dtype: jnp.dtype
  param_dtype: jnp.dtype
  quantize: str = "none"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    gating = weight(self, "gating_einsum", fan_in_init([2]), (2, self.intermediate_size, self.hidden_size),
                    self.param_dtype, (None, "mlp", "embed"), contract=(2,), quantize=self.quantize)
    linear = weight(self, "linear", fan_in_init([0]), (self.intermediate_size, self.hidden_size),
                    self.param_dtype, ("mlp", "embed"), contract=(0,), quantize=self.quantize)
    # [B, L, 2F] against the weights seen as [2F, D] (a free reshape): one plain matmul. With [2, F, D] in
    # the equation, XLA's CPU dot copied the weights transposed at every call.
    gate_up = einsum("BLD,GD->BLG", x, gating.reshape(-1, gating.shape[-1]), self.dtype)
    gate_up = gate_up.reshape(*gate_up.shape[:-1], 2, self.intermediate_size)  # [B, L, 2, F]
    h = jax.nn.gelu(gate_up[..., 0, :], approximate=True) * gate_up[..., 1, :]
    return einsum("BLF,FD->BLD", h, linear, self.dtype)


def rope_inv_freq(head_dim: int, theta: float, rotary_fraction: float = 1.0) -> Array:
  """Inverse frequencies of "proportional" RoPE: [H / 2], zero beyond the rotated fraction.

  The first int(rotary_fraction * H / 2) pairs rotate with theta^(-2i / H) (the exponent uses the whole
  head dim); the others have frequency 0 and pass unchanged. With fraction 1 this is standard RoPE.
  """
  rotated = int(rotary_fraction * head_dim // 2)
  exponent = jnp.arange(head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim
  inv_freq = 1.0 / (theta**exponent)
  return jnp.where(jnp.arange(head_dim // 2) < rotated, inv_freq, 0.0)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
  """Rotate-half RoPE. x: [B, L, N, H], positions: [B, L]."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, L, H/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, L, 1, H]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  first, second = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-second, first], axis=-1) * sin

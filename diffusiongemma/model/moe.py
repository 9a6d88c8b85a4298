"""The router and the sparse mixture of GeGLU experts.

Axes: T tokens, D model, E experts, k chosen experts per token, F expert feed-forward, X tile rows.

Three interchangeable implementations of the same function (`ModelConfig.moe_impl`):
- `grouped` (default): sort the T*k (token, expert) assignments by expert, pad each expert's group up
  to a multiple of a tile of X rows, and run one batched einsum over tiles, each tile multiplying by its
  expert's weights. No token is dropped, and the work is at most (T*k + E*X) rows instead of T*E, so
  the cost stays flat as E grows at fixed k. This is what is truly sparse on CPU.
- `ragged`: the sorted assignments through `jax.lax.ragged_dot` (real kernels on GPU/TPU; on CPU it
  costs as much as all experts, see NOTES.md).
- `dense`: every expert on every token, weighted by the (mostly zero) routing weights. The reference.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusiongemma.model import layers
from diffusiongemma.model.config import ModelConfig

Array = jax.Array
_TILE_MULTIPLE = 8


class Router(nn.Module):
  """Top-k routing as the reference: RMSNorm without scale on the residual, times a learned scale and
  D^-0.5, linear to E logits, float32 softmax over all experts, top-k, renormalise, per-expert scale."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array) -> tuple[Array, Array]:
    cfg = self.config
    pdt = jnp.dtype(cfg.param_dtype)
    w = layers.param(self, "router_logits", layers.fan_in_init([0]), (cfg.hidden_size, cfg.num_experts),
                     pdt, ("embed", "experts"))
    scale = layers.param(self, "router_scale", nn.initializers.ones, (cfg.hidden_size,), pdt, ("embed",))
    per_expert = layers.param(self, "per_expert_scale", nn.initializers.ones, (cfg.num_experts,), pdt,
                              ("experts",))
    h = layers.rms_norm(x, None, cfg.rms_norm_eps) * scale.astype(x.dtype) * (cfg.hidden_size**-0.5)
    logits = jnp.einsum("TD,DE->TE", h.astype(x.dtype), w.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.top_k)  # [T, k]
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * per_expert.astype(jnp.float32)[experts], experts


def _geglu(gate_up: Array) -> Array:
  return jax.nn.gelu(gate_up[..., 0, :], approximate=True) * gate_up[..., 1, :]


def tile_size(num_tokens: int, top_k: int, num_experts: int) -> int:
  """Rows per tile: the mean group size, rounded up to a multiple of 8."""
  mean = -(-num_tokens * top_k // num_experts)
  return max(_TILE_MULTIPLE, -(-mean // _TILE_MULTIPLE) * _TILE_MULTIPLE)


class Experts(nn.Module):
  """E GeGLU experts with fused gate/up weights; combines the k chosen experts' outputs per token."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, weights: Array, experts: Array) -> Array:
    """x: [T, D]; weights, experts: [T, k] routing weights and expert ids. Returns [T, D]."""
    cfg = self.config
    pdt = jnp.dtype(cfg.param_dtype)
    shape = (cfg.num_experts, 2, cfg.moe_intermediate_size, cfg.hidden_size)
    gating = layers.param(self, "gating_einsum", layers.fan_in_init([3]), shape, pdt,
                          ("experts", None, "expert_mlp", "embed"))
    linear = layers.param(self, "linear", layers.fan_in_init([1]), shape[:1] + shape[2:], pdt,
                          ("experts", "expert_mlp", "embed"))
    gating, linear = gating.astype(x.dtype), linear.astype(x.dtype)
    impl = {"grouped": _grouped, "ragged": _ragged, "dense": _dense}[cfg.moe_impl]
    return impl(x, weights, experts, gating, linear)


def _dense(x, weights, experts, gating, linear):
  num_experts = gating.shape[0]
  combine = jnp.zeros((x.shape[0], num_experts), jnp.float32)
  combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)  # [T, E]
  h = _geglu(jnp.einsum("TD,EGFD->TEGF", x, gating))  # [T, E, F]
  out = jnp.einsum("TEF,EFD->TED", h, linear)
  return jnp.einsum("TED,TE->TD", out.astype(jnp.float32), combine).astype(x.dtype)


def _sort_assignments(experts: Array, num_experts: int):
  """Assignments sorted by expert: (order [T*k], sorted expert ids [T*k], group sizes [E])."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return order, flat[order], sizes


def _combine(rows: Array, order: Array, weights: Array, num_tokens: int) -> Array:
  """Weighted sum of the k expert outputs of each token; rows [T*k, D] are in sorted order."""
  top_k = weights.shape[1]
  unsorted = jnp.zeros_like(rows).at[order].set(rows)  # [T*k, D]
  unsorted = unsorted.reshape(num_tokens, top_k, -1).astype(jnp.float32)
  return jnp.einsum("TkD,Tk->TD", unsorted, weights)


def _ragged(x, weights, experts, gating, linear):
  num_tokens, top_k = experts.shape
  num_experts, _, ffn, dim = gating.shape
  order, _, sizes = _sort_assignments(experts, num_experts)
  rows = x[order // top_k]  # [T*k, D]
  gate_up = jax.lax.ragged_dot(rows, gating.reshape(num_experts, 2 * ffn, dim).transpose(0, 2, 1), sizes)
  h = _geglu(gate_up.reshape(-1, 2, ffn))
  out = jax.lax.ragged_dot(h, linear, sizes)  # [T*k, D]
  return _combine(out, order, weights, num_tokens).astype(x.dtype)


def _grouped(x, weights, experts, gating, linear):
  num_tokens, top_k = experts.shape
  num_experts = gating.shape[0]
  tile = tile_size(num_tokens, top_k, num_experts)
  # Each expert's group is padded to whole tiles: sum ceil(n_e / X) <= T*k / X + E tiles in all.
  num_tiles = -(-num_tokens * top_k // tile) + num_experts
  order, sorted_experts, sizes = _sort_assignments(experts, num_experts)
  tiles_per_expert = -(-sizes // tile)
  tile_end = jnp.cumsum(tiles_per_expert)  # [E] first tile after each expert's tiles
  padded_start = (tile_end - tiles_per_expert) * tile  # [E] first padded row of each expert
  group_start = jnp.cumsum(sizes) - sizes  # [E] first sorted assignment of each expert
  rank = jnp.arange(num_tokens * top_k) - group_start[sorted_experts]
  dest = padded_start[sorted_experts] + rank  # [T*k] padded row of each sorted assignment
  buffer = jnp.zeros((num_tiles * tile, x.shape[1]), x.dtype).at[dest].set(x[order // top_k])
  # Tiles past the last expert's are empty; give them any valid expert.
  tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(num_tiles), side="right"),
                            num_experts - 1)
  tiles = buffer.reshape(num_tiles, tile, -1)  # [tiles, X, D]
  h = _geglu(jnp.einsum("nXD,nGFD->nXGF", tiles, gating[tile_expert]))
  out = jnp.einsum("nXF,nFD->nXD", h, linear[tile_expert]).reshape(num_tiles * tile, -1)
  return _combine(out[dest], order, weights, num_tokens).astype(x.dtype)

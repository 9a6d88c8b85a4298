"""Per-device memory of a config on a mesh, from `jax.eval_shape` and the sharding rules: nothing allocated.

Parameters and optimizer state are exact (every tensor's shard shape under `param_specs`). The KV cache
is exact for its shape (every layer's keys and values, split over the batch axes). Activations are an
estimate of the largest live buffers of one step, named so the reader can check them:

- inference (a denoiser pass over a canvas, batch B split over data x fsdp x expert = b per device):
  the float32 logits [b, C, V] (x3: logits, self-conditioning signal, sampler probabilities), the
  attention scores of the widest layer [b, N, C, S + C] in float32, and the MoE dispatch buffer.
- training (one sequence of L tokens per example, rematerialised layers): the residual stream saved at
  each layer boundary [layers, b, L, D], one layer's recomputed internals (attention scores, MoE
  buffers) and the float32 logits [b, L, V] with their gradient (x2), for the encoder and the denoiser.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusiongemma.model import DiffusionGemma, ModelConfig
from diffusiongemma.model import moe
from diffusiongemma.model import quantize
from diffusiongemma.parallel import mesh as mesh_lib

GiB = 2**30


def _shard_elements(shape, spec, mesh_sizes) -> int:
  count = 1
  for i, dim in enumerate(shape):
    axis = spec[i] if i < len(spec) else None
    parts = math.prod(mesh_sizes[a] for a in (axis if isinstance(axis, tuple) else (axis,)) if a)
    count *= -(-dim // parts)
  return count


def memory_plan(cfg: ModelConfig, mesh_sizes: Mapping[str, int], *, batch_size: int, sequence_length: int,
                training: bool, param_dtype: str = "bfloat16", cache_dtype: str = "bfloat16",
                rules=mesh_lib.LOGICAL_RULES) -> dict[str, float]:
  """Bytes per device by category (see the module docstring), plus 'total'."""
  model = DiffusionGemma(cfg)
  tokens = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  canvas = jax.ShapeDtypeStruct((1, cfg.canvas_length), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.key(0), tokens, canvas)["params"]
  specs = mesh_lib.param_specs(boxed, mesh_sizes, rules)
  leaves = jax.tree_util.tree_flatten_with_path(nn.unbox(boxed))[0]
  paths = [tuple(k.key for k in path) for path, _ in leaves]
  shards = [_shard_elements(s.shape, p, mesh_sizes)
            for (_, s), p in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.P)))]
  elements = sum(shards)
  batch_shards = math.prod(mesh_sizes[a] for a in mesh_lib.BATCH_AXES)
  b = -(-batch_size // batch_shards)
  tensor = mesh_sizes["tensor"]
  f32 = 4
  act = jnp.dtype(cfg.dtype).itemsize
  plan: dict[str, float] = {}
  if training:  # float32 master parameters, their gradients and AdamW's two moments
    plan["parameters"] = elements * f32
    plan["gradients"] = elements * f32
    plan["optimizer_state"] = 2 * elements * f32
  elif cfg.quantize == "none":
    plan["parameters"] = elements * jnp.dtype(param_dtype).itemsize
  else:  # int8 weights and their float32 scales as stored; the rest in param_dtype
    int8 = {path for path, (_, s) in zip(paths, leaves) if s.dtype == jnp.int8}
    scales = {quantize.scale_path(path) for path in int8}
    size = lambda path: 1 if path in int8 else 4 if path in scales else jnp.dtype(param_dtype).itemsize
    plan["parameters"] = sum(n * size(path) for path, n in zip(paths, shards))
    # each weight is dequantised where it is used: the largest one, whole, in param_dtype
    plan["dequantized_weight"] = max(n for path, n in zip(paths, shards) if path in int8) * \
        jnp.dtype(param_dtype).itemsize
  cache = sum(2 * b * sequence_length * k * h for k, h in map(cfg.layer_dims, range(cfg.num_layers)))
  plan["kv_cache"] = cache * jnp.dtype(cache_dtype).itemsize

  length = sequence_length if training else cfg.canvas_length
  keys = sequence_length + (0 if training else cfg.canvas_length)
  tokens_per_device = b * length
  heads = -(-cfg.num_heads // tensor)
  tile = moe.tile_size(tokens_per_device, cfg.top_k, cfg.num_experts)
  dispatch_rows = tokens_per_device * cfg.top_k + cfg.num_experts * tile
  moe_bytes = dispatch_rows * (cfg.hidden_size + 3 * cfg.moe_intermediate_size // tensor) * act
  scores = b * heads * length * keys * f32
  vocab = -(-cfg.vocab_size // tensor)
  if training:
    plan["activations_saved"] = cfg.num_layers * tokens_per_device * cfg.hidden_size * act * 2
    plan["activations_layer"] = scores + moe_bytes
    plan["logits"] = 2 * 2 * tokens_per_device * vocab * f32  # encoder and denoiser, with gradients
  else:
    plan["activations_layer"] = scores + moe_bytes
    plan["logits"] = 3 * tokens_per_device * vocab * f32
  plan["total"] = sum(plan.values())
  return plan

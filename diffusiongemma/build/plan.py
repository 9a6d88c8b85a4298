"""Per-device memory of a config on a mesh, from `jax.eval_shape` and the sharding rules: nothing allocated.

Parameters, gradients and optimizer state are exact (every tensor's shard shape under `param_specs`, in the
dtypes the config trains with), and so is the KV cache for its shape. Activations are an estimate of the
largest live buffers of one step, by name, so that the reader can check them; docs/scale.md compares the
training estimate with what XLA allocates. `memory_plan` plans given shapes, `config_plan` a config's own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusiongemma.build import models
from diffusiongemma.build import tasks
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
                rules=mesh_lib.LOGICAL_RULES, mu_dtype: str = "", grad_accum_steps: int = 1,
                graded_tokens: int | None = None, self_conditioning: bool = True) -> dict[str, float]:
  """Bytes per device by category, plus 'total'.

  Inference (a denoiser pass over a canvas after `sequence_length` cached positions, batch B split over
  data x fsdp x expert = b per device): the weights in `param_dtype` (or as `cfg.quantize` stores them), the
  KV cache in `cache_dtype`, the float32 logits [b, C, V] (x3: logits, self-conditioning signal, sampler
  probabilities), the attention scores of the widest layer and the MoE dispatch buffer.

  Training (`cfg` as training builds it: master weights in `cfg.param_dtype`, compute in `cfg.dtype`,
  `cfg.remat`): the master weights, their gradients (twice with `grad_accum_steps` > 1: the sum and a
  micro-batch's), AdamW's moments (the first in `mu_dtype`, default the parameters' dtype); for a
  micro-batch of b rows of `sequence_length` tokens whose denoiser grades `graded_tokens` (default one
  canvas): the encoder's keys and values (the denoiser's cache), what the layers keep for the backward pass
  (with remat each layer's input; without, `_layer_internals`), one layer's working set, and the float32
  logits with their gradients (the encoder's over every token, the denoiser's over the graded ones, and with
  `self_conditioning` the first pass's logits).
  """
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
  heads = -(-cfg.num_heads // tensor)
  vocab = -(-cfg.vocab_size // tensor)
  kv = sum(2 * k * h for k, h in map(cfg.layer_dims, range(cfg.num_layers)))  # per position, all layers
  plan: dict[str, float] = {}
  if training:
    b = -(-b // grad_accum_steps)
    master = jnp.dtype(cfg.param_dtype).itemsize
    plan["parameters"] = elements * master
    plan["gradients"] = elements * master * (2 if grad_accum_steps > 1 else 1)
    plan["optimizer_state"] = elements * (jnp.dtype(mu_dtype or cfg.param_dtype).itemsize + master)
    graded = cfg.canvas_length if graded_tokens is None else graded_tokens
    plan["kv_cache"] = b * sequence_length * kv * act
    if cfg.remat:
      plan["activations_saved"] = cfg.num_layers * b * (sequence_length + graded) * cfg.hidden_size * act
    else:
      plan["activations_saved"] = sum(_layer_internals(cfg, i, b, sequence_length, graded, tensor, act)
                                      for i in range(cfg.num_layers))
    scores = b * heads * sequence_length * sequence_length * f32
    plan["activations_layer"] = _layer_working_set(cfg, b * sequence_length, scores, tensor, act)
    plan["logits"] = (2 * sequence_length + (3 if self_conditioning else 2) * graded) * b * vocab * f32
  else:
    if cfg.quantize == "none":
      plan["parameters"] = elements * jnp.dtype(param_dtype).itemsize
    else:  # int8 weights and their float32 scales as stored; the rest in param_dtype
      int8 = {path for path, (_, s) in zip(paths, leaves) if s.dtype == jnp.int8}
      scales = {quantize.scale_path(path) for path in int8}
      size = lambda path: 1 if path in int8 else 4 if path in scales else jnp.dtype(param_dtype).itemsize
      plan["parameters"] = sum(n * size(path) for path, n in zip(paths, shards))
      # each weight is dequantised where it is used: the largest one, whole, in param_dtype
      plan["dequantized_weight"] = max(n for path, n in zip(paths, shards) if path in int8) * \
          jnp.dtype(param_dtype).itemsize
    plan["kv_cache"] = b * sequence_length * kv * jnp.dtype(cache_dtype).itemsize
    length = cfg.canvas_length
    scores = b * heads * length * (sequence_length + length) * f32
    plan["activations_layer"] = _layer_working_set(cfg, b * length, scores, tensor, act)
    plan["logits"] = 3 * b * length * vocab * f32
  plan["total"] = sum(plan.values())
  return plan


def _layer_working_set(cfg: ModelConfig, tokens: int, scores: float, tensor: int, act: int) -> float:
  """One layer's largest live buffers: attention scores (`scores` bytes) and the MoE dispatch of `tokens`."""
  tile = moe.tile_size(tokens, cfg.top_k, cfg.num_experts)
  dispatch_rows = tokens * cfg.top_k + cfg.num_experts * tile
  return scores + dispatch_rows * (cfg.hidden_size + 3 * cfg.moe_intermediate_size // tensor) * act


def _layer_internals(cfg: ModelConfig, layer: int, b: int, length: int, graded: int, tensor: int,
                     act: int) -> float:
  """Bytes layer `layer` keeps for the backward pass without remat, for the encoder over `length` positions
  and the denoiser over `graded` ones (attending to the `length` cached positions and themselves): the
  inputs and outputs of its matmuls and norms, the MoE's dispatched rows, and the attention probabilities
  in float32."""
  d, heads = cfg.hidden_size, -(-cfg.num_heads // tensor)
  kv_heads, head_dim = cfg.layer_dims(layer)
  split = lambda n: -(-n // tensor)
  per_token = (4 * d + 2 * heads * head_dim + 2 * split(kv_heads) * head_dim + 3 * split(cfg.intermediate_size)
               + cfg.top_k * (2 * d + 3 * split(cfg.moe_intermediate_size))) * act
  window = cfg.sliding_window if cfg.layer_types[layer] != "full" else length + graded
  encoder_keys = sum(min(i + 1, window) for i in range(length))
  denoiser_keys = graded * (min(length, window - 1) + graded)
  return b * ((length + graded) * per_token + heads * (encoder_keys + denoiser_keys) * 4)


def config_plan(config, mesh_sizes: Mapping[str, int], *, training: bool, batch_size: int | None = None,
                sequence_length: int | None = None) -> dict[str, float]:
  """`memory_plan` of a config as it runs, on a mesh of `mesh_sizes` under the config's sharding rules.

  Training: the model as `build.training_model_config` builds it (master weights `train.param_dtype`,
  compute `train.compute_dtype`, `model.remat`), AdamW's first moment in `train.mu_dtype`,
  `train.grad_accum_steps` micro-batches of `train.batch_size` rows (or `batch_size`) of
  `data.prompt_length` + `data.num_canvases` canvases (or `sequence_length`) tokens, the denoiser grading one
  canvas per row or, with `diffusion.all_canvases`, every one, self-conditioning as `diffusion` says.
  A LoRA run is planned as full training (an upper bound). Inference: the model as sampling builds it; a batch
  of `batch_size` (default 1) after `sequence_length` (default 8192) cached positions.
  """
  rules = mesh_lib.logical_rules(config.mesh)
  if not training:
    return memory_plan(models.model_config(config), mesh_sizes, batch_size=batch_size or 1,
                       sequence_length=sequence_length or 8192, training=False, rules=rules)
  cfg = tasks.training_model_config(config)
  canvases = config.data.num_canvases
  graded = cfg.canvas_length * (canvases if config.diffusion.get("all_canvases", False) else 1)
  return memory_plan(cfg, mesh_sizes, batch_size=batch_size or config.train.batch_size,
                     sequence_length=sequence_length or config.data.prompt_length + canvases * cfg.canvas_length,
                     training=True, rules=rules, mu_dtype=config.train.get("mu_dtype", ""),
                     grad_accum_steps=config.train.get("grad_accum_steps", 1), graded_tokens=graded,
                     self_conditioning=config.diffusion.get("self_conditioning_prob", 0.0) > 0)

"""Int8 weight-only quantisation: float parameters into those of `config.replace(quantize="int8")`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma.model.config import ModelConfig
from diffusiongemma.model.transformer import abstract_params

SCALE_SUFFIX = "_scale"


def int8(weight, scale_shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """(values int8, scale float32) with weight ~= values * scale, one scale per entry of `scale_shape` (the
  weight's shape with 1 along the axes its matmul contracts): scale = max |w| / 127 over those axes, so
  every value is rounded to the nearest multiple of its scale (error <= scale / 2) and none clips."""
  w = np.asarray(jax.device_get(weight), np.float32)
  axes = tuple(i for i, (n, s) in enumerate(zip(w.shape, scale_shape)) if s == 1 and n != 1)
  if len(scale_shape) != w.ndim or any(s not in (1, n) for n, s in zip(w.shape, scale_shape)):
    raise ValueError(f"A scale of shape {tuple(scale_shape)} does not fit a weight of shape {w.shape}.")
  amax = np.max(np.abs(w), axis=axes, keepdims=True) if axes else np.abs(w)
  scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
  values = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
  return values, scale.reshape(scale_shape)


def scale_shapes(config: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Path of every quantised weight of `config` (with quantize='int8') -> the shape of its scale."""
  config = config.replace(quantize="int8")
  flat = flax.traverse_util.flatten_dict(abstract_params(config))
  return {path: flat[scale_path(path)].shape for path, leaf in flat.items() if leaf.dtype == jnp.int8}


def scale_path(path: tuple[str, ...]) -> tuple[str, ...]:
  """Where the scale of the int8 weight at `path` lives."""
  return path[:-1] + (path[-1] + SCALE_SUFFIX,)


def quantize_params(params: Mapping[str, Any], config: ModelConfig) -> dict[str, Any]:
  """The float `params` of a model of `config` as the params of `config.replace(quantize="int8")`:
  each attention, MLP and expert weight becomes int8 values plus its `_scale`; the rest is kept as is.
  Already-quantised params (int8 weights) are refused rather than quantised twice."""
  flat = flax.traverse_util.flatten_dict(dict(params))
  out = dict(flat)
  for path, scale_shape in scale_shapes(config).items():
    if path not in flat:
      raise KeyError(f"The params have no weight {'/'.join(path)}, which a model of this config has.")
    if flat[path].dtype == jnp.int8:
      raise ValueError(f"{'/'.join(path)} is already int8: these params are quantised.")
    out[path], out[scale_path(path)] = int8(flat[path], scale_shape)
  return flax.traverse_util.unflatten_dict(out)

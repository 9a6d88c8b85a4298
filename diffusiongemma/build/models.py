"""The model, its noise, the objective and the samplers of a config.

- `model_config(config)`: `config.model` with `config.train.compute_dtype` and `config.diffusion`'s noise
  applied (the noise a model is trained with is part of its config, so every sampler of it uses it);
- `noise(config)`, `loss(config)`: the noise process and the objective holding it;
- `sampler(config)`: `config.sampler` as a `Sampler`, its acceptance, stopping and schedule chosen by
  name in the registries (`build/registry.py`); `ar_sampler(config)` for token-by-token decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusiongemma.build import init_from
from diffusiongemma.build import registry
from diffusiongemma.diffusion import loss as loss_lib
from diffusiongemma.diffusion import noise as noise_lib
from diffusiongemma.model import DiffusionGemma, ModelConfig
from diffusiongemma.sampling.autoregressive import ARSampler
from diffusiongemma.sampling.config import SamplerConfig
from diffusiongemma.sampling.sampler import Sampler

COMPUTE_DTYPES = ("float32", "bfloat16")
_NOT_SAMPLER_CONFIG = ("max_new_tokens",) + tuple(registry.SAMPLER_COMPONENTS)


def _values(section) -> dict[str, Any]:
  return dict(section.to_dict() if hasattr(section, "to_dict") else section)


def model_config(config) -> ModelConfig:
  """`config.model` (with `init_from`: the weights' own config, `build.init_from`) with the compute dtype of
  `config.train` (parameters stay in param_dtype) and the noise process of `config.diffusion`
  (`ModelConfig.noise`, `mask_token_id`)."""
  config = init_from.resolve(config)
  values = _values(config.model)
  own = {field: values.pop(field) for field in ("noise", "mask_token_id") if field in values}
  cfg = ModelConfig.from_dict(values)
  train = config.get("train") if hasattr(config, "get") else None
  dtype = train.get("compute_dtype", cfg.dtype) if train is not None else cfg.dtype
  if dtype not in COMPUTE_DTYPES:
    raise ValueError(f"Unknown config.train.compute_dtype {dtype!r}; expected one of {COMPUTE_DTYPES}.")
  diffusion = config.get("diffusion") if hasattr(config, "get") else None
  if diffusion is None:  # a bare `{"model": ModelConfig.to_dict()}`: the model section says it all
    name, mask = own.get("noise", "uniform"), own.get("mask_token_id")
  else:
    name, mask = diffusion.get("noise", "uniform"), diffusion.get("mask_token_id", -1)
    mask = None if mask in (None, -1) else mask
    for field, value in (("noise", name), ("mask_token_id", mask)):
      if field in own and own[field] != value:
        raise ValueError(f"config.model.{field}={own[field]!r} contradicts config.diffusion.{field}="
                         f"{value!r} (the diffusion section sets it); drop one or make them equal.")
  registry.lookup(registry.NOISES, name, "config.diffusion.noise")
  return cfg.replace(dtype=dtype, noise=name, mask_token_id=mask)


def model(config) -> DiffusionGemma:
  return DiffusionGemma(model_config(config))


def noise(config) -> noise_lib.NoiseProcess:
  """The noise process `config.diffusion.noise` over the model vocabulary."""
  return noise_lib.for_model(model_config(config))


def loss(config) -> loss_lib.LossConfig:
  """`config.diffusion` as the objective, with `noise(config)` in it."""
  values = _values(config.diffusion)
  values.pop("noise", None)
  values.pop("mask_token_id", None)
  known = {f.name for f in dataclasses.fields(loss_lib.LossConfig)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f"Unknown config.diffusion fields {unknown}; known: {sorted(known | {'noise', 'mask_token_id'})}.")
  return loss_lib.LossConfig(noise=noise(config), **values)


def sampler_config(config, **overrides) -> SamplerConfig:
  """The `SamplerConfig` fields of `config.sampler` (with `overrides`)."""
  values = {**_values(config.sampler), **overrides}
  fields = {f.name for f in dataclasses.fields(SamplerConfig)}
  return SamplerConfig.from_dict({k: v for k, v in values.items() if k in fields})


def sampler_components(values: dict[str, Any]) -> dict[str, Any]:
  """The acceptance, stopping and schedule objects that `values` (a `config.sampler`) names, from the
  registries, with their parameters read from the same section."""
  defaults = registry.component_defaults()
  out = {}
  for kind, table in registry.SAMPLER_COMPONENTS.items():
    name = values.get(kind, registry.RELEASED[kind])
    entry = registry.lookup(table, name, f"config.sampler.{kind}")
    merged = {**defaults, **values}
    try:
      out[kind] = entry.build(merged)
    except (TypeError, ValueError) as e:
      given = ", ".join(f"config.sampler.{key}={merged[key]!r}" for key in entry.params)
      raise ValueError(f"config.sampler.{kind}={name!r} with {given}: {e}") from None
  return out


def sampler(config, model_cfg: ModelConfig | None = None, **overrides) -> Sampler:
  """The `Sampler` of `config` (its `config.sampler`, changed by `overrides`), sampling with the noise of
  the model's config. `model_cfg`: the model's config when it does not come from `config.model` (e.g. a
  transformers checkpoint's). Unknown `config.sampler` keys are an error naming them."""
  values = {**_values(config.sampler), **overrides}
  known = ({f.name for f in dataclasses.fields(SamplerConfig)} | set(_NOT_SAMPLER_CONFIG)
           | set(registry.component_defaults()))
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f"Unknown config.sampler fields {unknown}; known: {sorted(known)}.")
  model_cfg = model_cfg or model_config(config)
  return Sampler(DiffusionGemma(model_cfg), sampler_config(config, **overrides), **sampler_components(values))


def ar_sampler(config, model_cfg: ModelConfig | None = None) -> ARSampler:
  """Token-by-token decoding of the same model, with `config.sampler`'s stop tokens and prompt bucket."""
  settings = sampler_config(config)
  return ARSampler(DiffusionGemma(model_cfg or model_config(config)), stop_tokens=settings.stop_tokens,
                   prompt_bucket=settings.prompt_bucket)


def max_new_tokens(config) -> int:
  return int(config.sampler.get("max_new_tokens", 256))


def random_variables(model_cfg: ModelConfig, seed: int = 0):
  """Freshly initialised variables `{'params': ...}` (a jitted init: much faster than eager)."""
  model_ = DiffusionGemma(model_cfg)
  tokens = jnp.zeros((1, 1), jnp.int32)
  canvas = jnp.zeros((1, model_cfg.canvas_length), jnp.int32)
  return jax.jit(lambda rng: nn.unbox(model_.init(rng, tokens, canvas)))(jax.random.key(seed))

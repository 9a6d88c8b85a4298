"""A checkpoint's generation defaults (`generation_config.json`) and the model guide's task presets.

transformers' `DiffusionGemmaGenerationConfig` writes: `max_denoising_steps`, `t_min`, `t_max`,
`sampler_config` (`{"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": ...}`),
`stability_threshold`, `confidence_threshold`, `eos_token_id` (an id or a list) and `max_new_tokens`.
They map onto `SamplerConfig` fields of the same meaning (eos ids become `stop_tokens`);
`max_new_tokens` is an argument of `generate`, so it is returned apart. Unset fields (missing or null)
keep `SamplerConfig`'s defaults, which are transformers' own defaults for this model.

Presets (the model's usage guide) change a few fields on top of the checkpoint's defaults:
  default   the checkpoint's defaults
  code      t_min 0.3, confidence_threshold 0.001 (a stricter early stop)
  creative  t_max 1.0, entropy_bound 0.15
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

from diffusiongemma import _files
from diffusiongemma.sampling.config import SamplerConfig

GENERATION_CONFIG = "generation_config.json"
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "code": {"t_min": 0.3, "confidence_threshold": 0.001},
    "creative": {"t_max": 1.0, "entropy_bound": 0.15},
}
_SAME_NAME = ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold")
_ENTROPY_SAMPLER = "EntropyBoundSamplerConfig"


def read_generation_config(path: os.PathLike | str) -> tuple[dict[str, Any], int | None]:
  """(SamplerConfig overrides, max_new_tokens) from a checkpoint folder's generation_config.json (or the file).

  A folder without the file gives no overrides. Values are checked by building a SamplerConfig from them;
  a bad one is an error naming the file.
  """
  path = pathlib.Path(path)
  file = path / GENERATION_CONFIG if path.is_dir() else path
  if not _files.present(file):
    if path.is_dir():
      return {}, None
    raise FileNotFoundError(f"No generation config at {str(path)!r}.")
  values = _files.read_json(file)
  overrides = {k: values[k] for k in _SAME_NAME if values.get(k) is not None}
  sampler = values.get("sampler_config")
  if sampler is not None:
    name = sampler.get("_cls_name", _ENTROPY_SAMPLER) if isinstance(sampler, Mapping) else None
    if name != _ENTROPY_SAMPLER:
      raise ValueError(f"{file}: sampler_config={sampler!r} is not supported; expected an "
                       f"{_ENTROPY_SAMPLER} (a mapping with 'entropy_bound').")
    if sampler.get("entropy_bound") is not None:
      overrides["entropy_bound"] = sampler["entropy_bound"]
  eos = values.get("eos_token_id")
  if eos is not None:
    overrides["stop_tokens"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
  max_new_tokens = values.get("max_new_tokens")
  try:
    SamplerConfig(**overrides)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{file}: {e}") from e
  if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
    raise ValueError(f"{file}: max_new_tokens={max_new_tokens!r} must be a positive integer.")
  return overrides, max_new_tokens


def preset_overrides(name: str) -> dict[str, Any]:
  """The SamplerConfig changes of a named preset; an unknown name is an error listing the known ones."""
  if name not in PRESETS:
    raise ValueError(f"Unknown sampler preset {name!r}; known presets: {sorted(PRESETS)}.")
  return dict(PRESETS[name])


def sampler_config(checkpoint: os.PathLike | str | None = None, preset: str = "default",
                   base: SamplerConfig | None = None, **overrides) -> tuple[SamplerConfig, int | None]:
  """(SamplerConfig, max_new_tokens or None): `base` (default `SamplerConfig()`), then the checkpoint's
  generation_config.json, then the preset, then keyword `overrides` (e.g. from the command line: SamplerConfig
  fields or `max_new_tokens`; None values, such as unset flags, are ignored)."""
  changes, max_new_tokens = read_generation_config(checkpoint) if checkpoint is not None else ({}, None)
  changes.update(preset_overrides(preset))
  overrides = {k: v for k, v in overrides.items() if v is not None}
  max_new_tokens = overrides.pop("max_new_tokens", max_new_tokens)
  changes.update(overrides)
  base = SamplerConfig() if base is None else base
  return base.replace(**changes), max_new_tokens

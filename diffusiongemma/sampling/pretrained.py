"""A transformers checkpoint folder as what sampling it needs: weights, its tokenizer, and a sampler with
its generation defaults.

`load(folder)` reads `config.json` and the safetensors shards (`convert.load_hf`, cast as they are read and
placed over the local devices), `tokenizer.json` / `tokenizer.model` (`data.hf_tokenizer`), and
`generation_config.json` with a preset (`sampling.presets`); everything that can be checked without the
weights is checked before they are read.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax.numpy as jnp

from diffusiongemma import _files
from diffusiongemma import convert
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.model import DiffusionGemma, ModelConfig
from diffusiongemma.sampling import presets
from diffusiongemma.sampling.sampler import Sampler


@dataclasses.dataclass(frozen=True)
class Weights:
  """A model config, its variables `{'params': ...}`, and where they came from."""

  model_config: ModelConfig
  variables: Any
  source: str


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """What `load` returns: the weights, the checkpoint's tokenizer, a sampler with its generation
  defaults, the reply length they name (None when they name none) and the folder."""

  weights: Weights
  tokenizer: Any
  sampler: Sampler
  max_new_tokens: int | None
  folder: str


def load(folder, *, preset: str = "default", dtype: str | None = "bfloat16", shardings: Any = "local",
         model_overrides=None, **sampler_overrides) -> Pretrained:
  """A transformers checkpoint folder, with no config.

  sampler: `SamplerConfig()` changed by the folder's generation_config.json, then the named `preset`, then
  `sampler_overrides` (`presets.sampler_config`); the model's own noise (uniform, the released model's).
  weights: cast to `dtype` as they are read (None: the checkpoint's own), which is then also the compute
  dtype, and placed by `shardings` ("local": over every local device, `convert.mesh_shardings()`; None:
  not placed; or `load_hf`'s argument). `model_overrides`: ModelConfig fields for `load_hf`.
  """
  path = pathlib.Path(folder)
  if not path.is_dir():
    raise FileNotFoundError(f"Checkpoint folder {str(path)!r} does not exist.")
  tokenizer = hf_tokenizer.CheckpointTokenizer(path)
  sampler_cfg, max_new_tokens = presets.sampler_config(path, preset, **sampler_overrides)
  overrides = dict(model_overrides or {})
  config_file = path / "config.json"
  if _files.present(config_file):
    cfg = convert.config_from_hf(_files.read_json(config_file), source=config_file, **overrides)
    hf_tokenizer.check_fits(tokenizer, cfg.vocab_size, "config.json")
  if isinstance(shardings, str):
    if shardings != "local":
      raise ValueError(f"shardings={shardings!r}: use 'local', None, or load_hf's shardings argument.")
    shardings = convert.mesh_shardings()
  cfg, params = convert.load_hf(path, dtype=dtype, shardings=shardings, **overrides)
  if dtype is not None:
    cfg = cfg.replace(dtype=str(jnp.dtype(dtype)), param_dtype=str(jnp.dtype(dtype)))
  weights = Weights(cfg, {"params": params}, f"transformers checkpoint {path}")
  return Pretrained(weights, tokenizer, Sampler(DiffusionGemma(cfg), sampler_cfg), max_new_tokens, str(path))

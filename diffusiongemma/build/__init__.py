"""The one place where an ml_collections config becomes objects.

Every binary, the notebooks, the benchmarks and the evaluations build what they need here, so that they
all run the same model with the same diffusion process:

- `model_config(config)`: `config.model` with `config.train.compute_dtype` applied;
- `noise(config)`: `config.diffusion.noise` as a noise process over the model vocabulary;
- `loss(config)`: `config.diffusion` as the training objective, holding that noise process;
- `sampler(config)`: `config.sampler` as a `Sampler` of the model, handed the same noise process (a model
  is always sampled with the noise it was trained with); `ar_sampler(config)` for token-by-token decoding;
- `load(config, workdir=...)`: the weights to run (a training checkpoint, a transformers folder, or a
  random initialisation), with the model config that goes with them;
- `pretrained(folder)`: a transformers checkpoint folder alone (no config) as weights, its tokenizer and
  a sampler with its generation defaults and a preset.

Config strings map to the diffusion objects in the tables below: a new rule is a new class and a row here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from diffusiongemma.diffusion import acceptance as acceptance_lib
from diffusiongemma.diffusion import loss as loss_lib
from diffusiongemma.diffusion import noise as noise_lib
from diffusiongemma.diffusion import stopping as stopping_lib
from diffusiongemma.model import DiffusionGemma, ModelConfig
from diffusiongemma.sampling.config import SamplerConfig

COMPUTE_DTYPES = ("float32", "bfloat16")

# config.diffusion.noise -> the noise process, from the vocabulary size and config.diffusion.
NOISES: dict[str, Callable[[int, Any], noise_lib.NoiseProcess]] = {
    "uniform": lambda vocab_size, diffusion: noise_lib.UniformNoise(vocab_size),
    "masked": lambda vocab_size, diffusion: noise_lib.MaskedNoise(vocab_size, diffusion.get("mask_token_id", -1)),
}
# SamplerConfig.acceptance -> the acceptance rule, from the SamplerConfig.
ACCEPTANCE_RULES: dict[str, Callable[[SamplerConfig], acceptance_lib.AcceptanceRule]] = {
    "entropy": lambda s: acceptance_lib.EntropyBound(s.entropy_bound),
    "confidence": lambda s: acceptance_lib.Confidence(s.confidence_accept),
    "count": lambda s: acceptance_lib.TopCount(s.tokens_per_step),
}
# SamplerConfig.stopping -> the stopping rule, from the SamplerConfig.
STOPPING_RULES: dict[str, Callable[[SamplerConfig], stopping_lib.StoppingRule]] = {
    "stable": lambda s: stopping_lib.stable_and_confident(s.stability_threshold, s.confidence_threshold),
    "fixed": lambda s: stopping_lib.NoEarlyStop(),
}


def _lookup(table: dict, name: str, field: str):
  if name not in table:
    raise ValueError(f"Unknown {field} {name!r}; expected one of {tuple(table)}.")
  return table[name]


def model_config(config) -> ModelConfig:
  """`config.model` with the compute dtype of `config.train` (parameters stay in param_dtype)."""
  cfg = ModelConfig.from_dict(config.model)
  train = config.get("train") if hasattr(config, "get") else None
  dtype = train.get("compute_dtype", cfg.dtype) if train is not None else cfg.dtype
  if dtype not in COMPUTE_DTYPES:
    raise ValueError(f"Unknown config.train.compute_dtype {dtype!r}; expected one of {COMPUTE_DTYPES}.")
  return cfg.replace(dtype=dtype)


def model(config) -> DiffusionGemma:
  return DiffusionGemma(model_config(config))


def noise(config, vocab_size: int | None = None) -> noise_lib.NoiseProcess:
  """The noise process of `config.diffusion` over `vocab_size` (default: the model's) tokens."""
  vocab_size = vocab_size or config.model.vocab_size
  diffusion = config.diffusion
  return _lookup(NOISES, diffusion.noise, "config.diffusion.noise")(vocab_size, diffusion)


def loss(config) -> loss_lib.LossConfig:
  """`config.diffusion` as the objective, with `noise(config)` in it."""
  values = dict(config.diffusion.to_dict() if hasattr(config.diffusion, "to_dict") else config.diffusion)
  values.pop("noise", None)
  values.pop("mask_token_id", None)
  known = {f.name for f in dataclasses.fields(loss_lib.LossConfig)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f"Unknown config.diffusion fields {unknown}; known: {sorted(known | {'mask_token_id'})}.")
  return loss_lib.LossConfig(noise=noise(config), **values)


def sampler_config(config, **overrides) -> SamplerConfig:
  """`config.sampler` (with `overrides`) as a SamplerConfig; `max_new_tokens` is a `generate` argument."""
  values = dict(config.sampler.to_dict() if hasattr(config.sampler, "to_dict") else config.sampler)
  values.update(overrides)
  return SamplerConfig.from_dict(values)


def acceptance_rule(sampler_cfg: SamplerConfig) -> acceptance_lib.AcceptanceRule:
  return _lookup(ACCEPTANCE_RULES, sampler_cfg.acceptance, "SamplerConfig.acceptance")(sampler_cfg)


def stopping_rule(sampler_cfg: SamplerConfig) -> stopping_lib.StoppingRule:
  return _lookup(STOPPING_RULES, sampler_cfg.stopping, "SamplerConfig.stopping")(sampler_cfg)


def sampler(config, model_cfg: ModelConfig | None = None, **overrides):
  """The `Sampler` of `config` (its `config.sampler`, changed by `overrides`), sampling with the noise
  the model was trained with. `model_cfg`: the model's config when it does not come from `config.model`
  (e.g. a transformers checkpoint's)."""
  from diffusiongemma.sampling.sampler import Sampler  # pylint: disable=g-import-not-at-top

  model_cfg = model_cfg or model_config(config)
  return Sampler(DiffusionGemma(model_cfg), sampler_config(config, **overrides),
                 noise=noise(config, model_cfg.vocab_size))


def ar_sampler(config, model_cfg: ModelConfig | None = None):
  """Token-by-token decoding of the same model, with `config.sampler`'s stop tokens and prompt bucket."""
  from diffusiongemma.sampling.autoregressive import ARSampler  # pylint: disable=g-import-not-at-top

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


@dataclasses.dataclass(frozen=True)
class Weights:
  """What `load` returns: the model config, its variables `{'params': ...}`, and where they came from."""

  model_config: ModelConfig
  variables: Any
  source: str


def load(config=None, *, workdir=None, hf_checkpoint=None, random_init: bool = False, seed: int = 0,
         shardings=None) -> Weights:
  """The weights to run: a transformers checkpoint folder if given, else the latest checkpoint of the
  training `workdir` (a LoRA run's adapters merged into its `config.train.init_from` weights), else (only
  with `random_init`) a random initialisation of `config.model`."""
  if hf_checkpoint:
    from diffusiongemma import convert  # pylint: disable=g-import-not-at-top
    cfg, params = convert.load_hf(hf_checkpoint, shardings=shardings)
    return Weights(cfg, {"params": params}, f"transformers checkpoint {hf_checkpoint}")
  if config is None:
    raise ValueError("A config is needed to load a workdir checkpoint or to initialise randomly.")
  cfg = model_config(config)
  if workdir is not None and not random_init:
    from diffusiongemma.training import checkpoint  # pylint: disable=g-import-not-at-top
    from diffusiongemma.training import loop  # pylint: disable=g-import-not-at-top
    if checkpoint.latest_step(workdir) is not None:
      lora_cfg = loop.lora_config(config)
      if lora_cfg is None:
        variables, step = checkpoint.load_params(workdir, shardings=shardings)
        return Weights(cfg, variables, f"{workdir}/{checkpoint.CHECKPOINT_DIRNAME} step {step}")
      from diffusiongemma.training import lora  # pylint: disable=g-import-not-at-top
      adapters, step = checkpoint.load_params(workdir)
      base = checkpoint.load_weights(config.train.init_from, shardings=shardings)
      return Weights(cfg, lora.merge(base, adapters, lora_cfg),
                     f"{workdir}/{checkpoint.CHECKPOINT_DIRNAME} step {step}: LoRA adapters (rank "
                     f"{lora_cfg.rank}) merged into {config.train.init_from}")
  if not random_init:
    raise FileNotFoundError(f"No checkpoint in {workdir}/checkpoints: train first, or pass "
                            "--hf_checkpoint=<folder> or --random_init.")
  return Weights(cfg, random_variables(cfg, seed), f"random initialisation (seed {seed})")


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """What `pretrained` returns: the weights, the checkpoint's tokenizer, a sampler with its generation
  defaults, the reply length they name (None when they name none) and the folder."""

  weights: Weights
  tokenizer: Any
  sampler: Any
  max_new_tokens: int | None
  folder: str


def pretrained(folder, *, preset: str = "default", dtype: str | None = "bfloat16", shardings: Any = "local",
               model_overrides=None, **sampler_overrides) -> Pretrained:
  """A transformers checkpoint folder, with no config: what chatting with or sampling from it needs.

  tokenizer: `tokenizer.json` / `tokenizer.model` (`data.hf_tokenizer.CheckpointTokenizer`). sampler:
  `SamplerConfig()` changed by the folder's generation_config.json, then the named `preset`, then
  `sampler_overrides` (`sampling.presets.sampler_config`); uniform noise, the released model's. weights:
  `convert.load_hf` cast to `dtype` as they are read (None: the checkpoint's own), which is then also the
  compute dtype, and placed by `shardings` ("local": over every local device, `convert.mesh_shardings()`;
  None: not placed; or `load_hf`'s argument). `model_overrides`: ModelConfig fields for `load_hf`.
  The tokenizer, the preset and config.json are checked before any weight is read.
  """
  import json  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top

  from diffusiongemma import convert  # pylint: disable=g-import-not-at-top
  from diffusiongemma.data import hf_tokenizer  # pylint: disable=g-import-not-at-top
  from diffusiongemma.sampling import presets  # pylint: disable=g-import-not-at-top
  from diffusiongemma.sampling.sampler import Sampler  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(folder)
  if not path.is_dir():
    raise FileNotFoundError(f"Checkpoint folder {str(path)!r} does not exist.")
  tokenizer = hf_tokenizer.CheckpointTokenizer(path)
  sampler_cfg, max_new_tokens = presets.sampler_config(path, preset, **sampler_overrides)
  overrides = dict(model_overrides or {})
  if (path / "config.json").is_file():
    cfg = convert.config_from_hf(json.loads((path / "config.json").read_text()), **overrides)
    if tokenizer.vocab_size > cfg.vocab_size:
      raise ValueError(f"The tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, more than the "
                       f"model's vocabulary of {cfg.vocab_size} (config.json).")
  if isinstance(shardings, str):
    if shardings != "local":
      raise ValueError(f"shardings={shardings!r}: use 'local', None, or load_hf's shardings argument.")
    shardings = convert.mesh_shardings()
  cfg, params = convert.load_hf(path, dtype=dtype, shardings=shardings, **overrides)
  if dtype is not None:
    cfg = cfg.replace(dtype=str(jnp.dtype(dtype)), param_dtype=str(jnp.dtype(dtype)))
  weights = Weights(cfg, {"params": params}, f"transformers checkpoint {path}")
  return Pretrained(weights, tokenizer, Sampler(DiffusionGemma(cfg), sampler_cfg), max_new_tokens, str(path))


def workdir_config(workdir):
  """The config a training run saved in `workdir/config.json` (a ConfigDict), or None."""
  import json  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top

  import ml_collections  # pylint: disable=g-import-not-at-top
  from diffusiongemma.training import checkpoint  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(workdir) / checkpoint.CONFIG_FILENAME
  if not path.is_file():
    return None
  return ml_collections.ConfigDict(json.loads(path.read_text()))


def tokenizer(config, workdir):
  """The tokenizer of `config` and `workdir` (`config.data.tokenizer_path`, else `workdir/tokenizer.model`,
  trained on the corpus if missing), checked against the model vocabulary and the mask token."""
  from diffusiongemma.training import inputs  # pylint: disable=g-import-not-at-top
  return inputs.get_tokenizer(config, workdir, model_config(config), noise(config))

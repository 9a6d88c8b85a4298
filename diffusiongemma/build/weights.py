"""Which weights to run: a training workdir's checkpoint (with LoRA adapters merged), a released-weights
folder (`release.save`: projects/*/weights/*, loaded as a workdir), a transformers folder, or a random
initialisation; and a chat session of a training workdir."""

from __future__ import annotations

import json

import jax
import ml_collections

from diffusiongemma import _files
from diffusiongemma import convert
from diffusiongemma import training
from diffusiongemma.build import init_from
from diffusiongemma.build import models
from diffusiongemma.build import release
from diffusiongemma.build import tasks
from diffusiongemma.chat import ChatSampler
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.model import quantize as quantize_lib
from diffusiongemma.model import transformer
from diffusiongemma.sampling import presets
from diffusiongemma.sampling.pretrained import Pretrained, Weights, load as pretrained  # noqa: F401 (re-exported)
from diffusiongemma.training import checkpoint
from diffusiongemma.training import lora


def load(config=None, *, workdir=None, hf_checkpoint=None, random_init: bool = False, seed: int = 0,
         shardings=None, quantize: str | None = None, step: int | None = None) -> Weights:
  """The weights to run: a transformers checkpoint folder if given, else the checkpoint at `step` (default:
  the latest) of the training `workdir` (a LoRA run's adapters merged into its `config.train.init_from`
  weights), else (only with `random_init`) a random initialisation of `config.model`.

  quantize: 'int8' quantises the matmul weights as they are loaded (`model.quantize`); default
  `config.model.quantize` ('none' without a config).
  """
  config = None if config is None else init_from.resolve(config)
  if quantize is None:
    quantize = config.model.get("quantize", "none") if config is not None else "none"
  if hf_checkpoint:
    cfg, params = convert.load_hf(hf_checkpoint, shardings=shardings, quantize=quantize)
    return Weights(cfg, {"params": params}, f"transformers checkpoint {hf_checkpoint}")
  if config is None:
    raise ValueError("A config is needed to load a workdir checkpoint or to initialise randomly.")
  cfg = models.model_config(config).replace(quantize=quantize)
  if quantize == "none":
    return _load_float(config, cfg, workdir, random_init, seed, shardings, step)
  weights = _load_float(config, cfg.replace(quantize="none"), workdir, random_init, seed, None, step)
  params = quantize_lib.quantize_params(weights.variables["params"], weights.model_config)
  if shardings is not None:
    target = shardings(cfg) if callable(shardings) else shardings
    if isinstance(target, dict) and set(target) == {"params"}:
      target = target["params"]
    params = jax.device_put(params, target)
  return Weights(cfg, {**weights.variables, "params": params}, f"{weights.source}, {quantize} weights")


def _load_float(config, cfg, workdir, random_init, seed, shardings, step) -> Weights:
  if workdir is not None and not random_init and release.is_release(workdir):
    check_against_saved(config, workdir)
    _, variables, provenance = release.load(workdir)
    if step is not None and step != provenance.get("step"):
      raise ValueError(f"{str(workdir)!r} holds released weights of step {provenance.get('step')} alone; "
                       f"step={step} is not there.")
    if shardings is not None:
      variables = jax.device_put(variables, shardings(cfg) if callable(shardings) else shardings)
    return Weights(cfg, variables, f"released weights {workdir} (step {provenance.get('step')})")
  if workdir is not None and not random_init and checkpoint.latest_step(workdir) is not None:
    check_against_saved(config, workdir)
    lora_cfg = tasks.lora_config(config)
    if lora_cfg is None:
      variables, step = checkpoint.load_params(workdir, step=step, shardings=shardings)
      return Weights(cfg, variables, f"{workdir}/{checkpoint.CHECKPOINT_DIRNAME} step {step}")
    adapters, step = checkpoint.load_params(workdir, step=step)
    base = checkpoint.load_weights(config.train.init_from, shardings=shardings,  # as training read it
                                   expected={"params": transformer.abstract_params(cfg)})
    return Weights(cfg, lora.merge(base, adapters, lora_cfg),
                   f"{workdir}/{checkpoint.CHECKPOINT_DIRNAME} step {step}: LoRA adapters (rank "
                   f"{lora_cfg.rank}) merged into {config.train.init_from}")
  if not random_init:
    raise FileNotFoundError(f"No checkpoint in {workdir}/checkpoints: train first, or pass "
                            "--hf_checkpoint=<folder> or --random_init.")
  return Weights(cfg, models.random_variables(cfg, seed), f"random initialisation (seed {seed})")


# ModelConfig fields that are choices of the run reading the weights, not of the weights.
_RUNTIME_MODEL_FIELDS = frozenset({"dtype", "param_dtype", "moe_impl", "remat", "quantize", "max_positions",
                                   "canvas_length"})


def _weight_fields(config) -> dict:
  """What a checkpoint's weights depend on, by config field name: the model (but its runtime choices), the
  noise, and the LoRA adapters with the base they adapt."""
  cfg = models.model_config(config)
  fields = {f"model.{k}": v for k, v in cfg.to_dict().items() if k not in _RUNTIME_MODEL_FIELDS}
  rank = config.train.get("lora_rank", 0) if "train" in config else 0
  fields["train.lora_rank"] = rank
  if rank:
    fields["train.lora_alpha"] = config.train.get("lora_alpha", 16.0)
    fields["train.init_from"] = str(config.train.get("init_from", ""))
  return json.loads(json.dumps(fields))  # tuples and lists alike, as config.json holds them


def _tokenizer_file(config, workdir):
  """The tokenizer file a config runs with: `data.tokenizer_path`, else the one training wrote in the workdir."""
  path = config.data.get("tokenizer_path", "") if "data" in config else ""
  return _files.as_path(path or _files.as_path(workdir, "workdir") / release.TOKENIZER, "data.tokenizer_path")


def check_against_saved(config, workdir) -> None:
  """Refuses `config` by field name where it differs from the config `workdir`'s run saved in what the
  weights depend on (`_weight_fields`, and the tokenizer: another file with other contents). A workdir without
  a saved config is not checked."""
  saved = workdir_config(workdir)
  if saved is None or config is saved:
    return
  given, trained = _weight_fields(init_from.resolve(config)), _weight_fields(saved)
  differ = [f"{k}={given.get(k)!r} (trained with {trained.get(k)!r})" for k in sorted(set(given) | set(trained))
            if given.get(k) != trained.get(k)]
  ours, theirs = _tokenizer_file(config, workdir), _tokenizer_file(saved, workdir)
  if ours != theirs and _files.present(ours) and _files.present(theirs) and (
      _files.read_bytes(ours, _files.TOKENIZER_MAX_BYTES) != _files.read_bytes(theirs, _files.TOKENIZER_MAX_BYTES)):
    differ.append(f"data.tokenizer_path={str(ours)!r} (trained with another tokenizer, {str(theirs)!r})")
  if differ:
    raise ValueError(f"The config given does not match the run in {str(workdir)!r}: {'; '.join(differ)}. Pass "
                     "--workdir alone to load the run as trained (its config.json), or a config that matches it.")


def run_config(workdir, config=None):
  """The config to run `workdir`'s checkpoints with: its saved `config.json` (the run as trained) when
  `config` is None, else `config`, checked against the saved one (`check_against_saved`)."""
  saved = workdir_config(workdir)
  if config is None:
    if saved is None:
      raise FileNotFoundError(f"{str(workdir)!r} has no saved {training.checkpoint.CONFIG_FILENAME}: pass the "
                              "run's config (--config=configs/...).")
    return saved
  check_against_saved(config, workdir)
  return config


def workdir_config(workdir):
  """The config a training run saved in `workdir/config.json` (a ConfigDict), or None when there is none.
  It is only data: a task it names resolves as `tasks.task_kind` allows, nothing else is imported."""
  path = _files.as_path(workdir, "workdir") / training.checkpoint.CONFIG_FILENAME
  if not _files.present(path):
    return None
  config = ml_collections.ConfigDict(_files.read_json(path))
  if release.is_release(workdir) and _files.present(path.parent / release.TOKENIZER) and "data" in config:
    config.data.tokenizer_path = str(path.parent / release.TOKENIZER)  # its own copy, not the trainer's path
  return config


def chat_sampler(workdir, config=None, *, tokenizer=None, preset: str = "default",
                 max_new_tokens: int | None = None, seed: int = 0, **sampler_overrides) -> ChatSampler:
  """A conversation with the latest checkpoint of a training workdir.

  config: the run's ConfigDict (default: the one training saved in the workdir). tokenizer: a checkpoint
  folder (or its `CheckpointTokenizer`) whose tokenizer the model was fine-tuned with; default:
  `workdir/tokenizer.json` if there is one. Without one the workdir is refused: the project's own
  sentencepiece tokenizer has no Gemma 4 control tokens, and a model trained on its corpus has never seen a
  conversation. The sampler settings are `config.sampler`, then `preset`, then `sampler_overrides`.
  """
  workdir = _files.as_path(workdir, "workdir")
  config = config if config is not None else workdir_config(workdir)
  if config is None:
    raise FileNotFoundError(f"{workdir} has no saved config.json: pass the run's config.")
  if tokenizer is None:
    if not _files.present(workdir / hf_tokenizer.TOKENIZER_JSON):
      raise ValueError(
          f"Cannot chat with the workdir {str(workdir)!r}: its tokenizer is this project's sentencepiece model, "
          f"which has none of the Gemma 4 control tokens {list(hf_tokenizer.REQUIRED_CONTROL_TOKENS)}, and a "
          "model trained on the project's corpus has never seen a conversation. Sample a continuation with "
          "scripts/sample.py --prompt=...; for a model fine-tuned from the released weights, pass the "
          "checkpoint's tokenizer (tokenizer=<folder>, chat.py --tokenizer=<folder>).")
    tokenizer = workdir
  if not isinstance(tokenizer, hf_tokenizer.CheckpointTokenizer):
    tokenizer = hf_tokenizer.CheckpointTokenizer(tokenizer)
  changes = {**presets.preset_overrides(preset), **{k: v for k, v in sampler_overrides.items() if v is not None}}
  weights = load(config, workdir=workdir)
  sampler = models.sampler(config, weights.model_config, **changes)
  return ChatSampler(sampler, weights.variables, tokenizer,
                     max_new_tokens=max_new_tokens or models.max_new_tokens(config), seed=seed)

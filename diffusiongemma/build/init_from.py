"""Starting from weights you have: `config.model.init_from` names them (a transformers folder, a DiffusionGemma
or a Gemma 4 causal LM, or a training workdir), and the run's model config and tokenizer come from there, so a
config need not restate the model's dimensions (configs/adapt.py).

`resolve(config)` returns the config with that filled in:
- `model`: the source's ModelConfig fields, then every field the config's own `model` section gives (not None:
  e.g. `--config.model.canvas_length=64`, `remat`) on top; the noise stays `config.diffusion`'s, the compute
  dtype `config.train`'s and the MoE implementation the machine's (`auto`);
- `train.init_from`: the source, which fine-tuning starts from (`training.checkpoint.load_weights` reads either
  kind; with `train.lora_rank` it stays the frozen base);
- `data.tokenizer_path`, unless the config names one: the source's tokenizer (a workdir's, or a folder's
  `tokenizer.json`, else its `tokenizer.model`).
So `config.model.init_from` is an alias of `config.train.init_from` that also brings the model section. The
resolved config is what a run saves in its workdir, so that workdir describes its model by itself. A config
without `model.init_from` is returned unchanged.
"""

from __future__ import annotations

import ml_collections

from diffusiongemma import _files
from diffusiongemma import convert
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.data import tokenizer as sp_tokenizer
from diffusiongemma.model import ModelConfig
from diffusiongemma.training import checkpoint

KEY = "init_from"
# ModelConfig fields a source does not decide: the noise (config.diffusion), the compute dtype (config.train),
# the MoE implementation (the machine running it).
_NOT_FROM_SOURCE = ("noise", "mask_token_id", "dtype", "moe_impl")


def source(config) -> str:
  """`config.model.init_from` ('' when the config has none)."""
  model = config.get("model") if hasattr(config, "get") else None
  value = model.get(KEY, "") if model is not None and hasattr(model, "get") else ""
  return str(value or "")


def _saved_config(workdir) -> ml_collections.ConfigDict:
  path = workdir / checkpoint.CONFIG_FILENAME
  if not _files.present(path):
    raise FileNotFoundError(f"config.model.init_from={str(workdir)!r} is a training workdir without its "
                            f"{checkpoint.CONFIG_FILENAME}: its model config cannot be read.")
  return ml_collections.ConfigDict(_files.read_json(path))


def model_config(path) -> ModelConfig:
  """The ModelConfig of the weights at `path`: a training workdir's (its saved `config.json`'s model section)
  or a transformers folder's (`convert.config_from_hf`: DiffusionGemma or Gemma 4)."""
  if checkpoint.latest_step(path) is not None:
    values = dict(_saved_config(path).model.to_dict())
    for field in _NOT_FROM_SOURCE:
      values.pop(field, None)
    try:
      return ModelConfig.from_dict(values)
    except (TypeError, ValueError) as e:
      raise _files.BadFileError(f"{path / checkpoint.CONFIG_FILENAME}: model: {e}") from None
  config_file = path / "config.json"
  if not _files.present(config_file):
    raise FileNotFoundError(f"config.model.init_from={str(path)!r} is neither a training workdir with checkpoints "
                            "nor a transformers checkpoint folder (config.json + *.safetensors).")
  return convert.config_from_hf(_files.read_json(config_file), source=config_file)


def tokenizer_path(path) -> str:
  """The tokenizer the weights at `path` were trained with ('' when it has none): a training workdir's
  (`data.tokenizer_path`, else its `tokenizer.model`), or a transformers folder's `tokenizer.json` (read as
  `data.hf_tokenizer.CheckpointTokenizer`), else its `tokenizer.model` (sentencepiece)."""
  if checkpoint.latest_step(path) is not None:
    saved = _saved_config(path).get("data", {}).get("tokenizer_path", "")
    candidates = [_files.as_path(saved, "data.tokenizer_path")] if saved else [path / sp_tokenizer.TOKENIZER_FILENAME]
  else:
    candidates = [path / hf_tokenizer.TOKENIZER_JSON, path / hf_tokenizer.TOKENIZER_MODEL]
  return next((str(c) for c in candidates if _files.present(c)), "")


def resolve(config):
  """`config` with its model section, `train.init_from` and (if unset) `data.tokenizer_path` taken from
  `config.model.init_from` (see the module doc); unchanged without one."""
  path = source(config)
  if not path:
    model = config.get("model") if hasattr(config, "get") else None
    if model is not None and hasattr(model, "get") and KEY in model:
      raise ValueError("config.model.init_from is empty: name the weights to start from (a transformers folder, "
                       "DiffusionGemma or Gemma 4, or a training workdir), --config.model.init_from=FOLDER.")
    return config
  train_from = config.train.get(KEY, "") if "train" in config else ""
  if train_from and _files.as_path(train_from, "config.train.init_from") != _files.as_path(path, f"config.model.{KEY}"):
    raise ValueError(f"config.model.init_from={path!r} and config.train.init_from={train_from!r} name different "
                     "weights: set one (model.init_from also sets train.init_from).")
  folder = _files.as_path(path, f"config.model.{KEY}")
  given = {k: v for k, v in config.model.to_dict().items() if k != KEY and v is not None}
  values = {k: v for k, v in model_config(folder).to_dict().items() if k not in _NOT_FROM_SOURCE}
  resolved = ml_collections.ConfigDict(config.to_dict())
  resolved.model = ml_collections.ConfigDict({**values, **given})
  resolved.train[KEY] = path
  if not resolved.data.get("tokenizer_path", ""):
    resolved.data.tokenizer_path = tokenizer_path(folder)
  return resolved


def copy_tokenizer(source, folder):
  """Copies the tokenizer of `source` (a training workdir or a transformers folder, as `tokenizer_path` finds it;
  a `tokenizer.json` with its `tokenizer_config.json`) into the transformers folder `folder` written from it, so
  that the folder can be adapted or served as it is. Returns the copy (an `epath.Path`: either may be on gs://),
  or None when there is none to copy."""
  found = tokenizer_path(_files.as_path(source, "source"))
  if not found:
    return None
  found, folder = _files.as_path(found), _files.as_path(folder, "folder")
  is_json = found.name == hf_tokenizer.TOKENIZER_JSON
  copies = [(found, folder / (hf_tokenizer.TOKENIZER_JSON if is_json else hf_tokenizer.TOKENIZER_MODEL))]
  if is_json and _files.present(found.parent / hf_tokenizer.TOKENIZER_CONFIG):
    copies.append((found.parent / hf_tokenizer.TOKENIZER_CONFIG, folder / hf_tokenizer.TOKENIZER_CONFIG))
  for source_file, target in copies:
    _files.atomic_write(target, _files.read_bytes(source_file, _files.TOKENIZER_MAX_BYTES))
  return copies[0][1]

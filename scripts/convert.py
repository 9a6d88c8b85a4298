r"""Converts weights between transformers DiffusionGemma folders and our orbax checkpoints.

  # transformers folder -> orbax params checkpoint (OUT/params + OUT/model_config.json)
  python scripts/convert.py --from_hf=/ckpt/diffusiongemma --to_orbax=/tmp/dg_params
  # training workdir (its latest checkpoint, or --step) -> transformers folder
  python scripts/convert.py --from_workdir=/tmp/dg_tiny --to_hf=/tmp/dg_tiny_hf
  # orbax params checkpoint -> transformers folder
  python scripts/convert.py --from_orbax=/tmp/dg_params --to_hf=/tmp/dg_hf

The model config of an orbax or workdir source is the one saved next to it (`model_config.json`, or the
`model` section of `workdir/config.json`); `--config` (a configs/*.py file, its `config.model`) overrides
it, e.g. for a workdir whose config.json is gone. Only parameters are read from a training checkpoint
(`training.load_params`): the optimizer state is left behind. `--vision_from` copies the vision tower
of an original checkpoint into the exported folder (otherwise transformers initialises a placeholder).
"""

import json
import pathlib

from absl import app
from absl import flags
import jax
from ml_collections import config_flags
import orbax.checkpoint as ocp

from diffusiongemma import convert
from diffusiongemma import training
from diffusiongemma.training import checkpoint as ckpt_lib
from diffusiongemma.model import ModelConfig

PARAMS_DIRNAME = "params"
MODEL_CONFIG_FILENAME = "model_config.json"

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file whose config.model describes the "
                                          "weights of an orbax or workdir source (default: the saved one).")
_FROM_HF = flags.DEFINE_string("from_hf", None, "A transformers DiffusionGemma checkpoint folder.")
_FROM_WORKDIR = flags.DEFINE_string("from_workdir", None, "A training workdir (workdir/checkpoints).")
_FROM_ORBAX = flags.DEFINE_string("from_orbax", None, "An orbax params checkpoint written by --to_orbax.")
_TO_HF = flags.DEFINE_string("to_hf", None, "Write a transformers folder here.")
_TO_ORBAX = flags.DEFINE_string("to_orbax", None, "Write an orbax params checkpoint here.")
_STEP = flags.DEFINE_integer("step", None, "With --from_workdir: the checkpoint step (default: latest).")
_DTYPE = flags.DEFINE_string("dtype", None, "Cast the weights (e.g. bfloat16); default: keep each one's.")
_VISION_FROM = flags.DEFINE_string("vision_from", None, "With --to_hf: an original transformers folder "
                                   "whose vision tower and vision config are copied.")
_MAX_SHARD_BYTES = flags.DEFINE_integer("max_shard_bytes", 5 * 2**30, "With --to_hf: safetensors shard size.")


def hf_to_orbax(hf_dir, out_dir, *, dtype=None) -> ModelConfig:
  """A transformers folder as `out_dir/params` (orbax, the `{'params': ...}` variables) and
  `out_dir/model_config.json`; returns the model config."""
  cfg, params = convert.load_hf(hf_dir, dtype=dtype)
  out_dir = pathlib.Path(out_dir).absolute()
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(out_dir / PARAMS_DIRNAME, {"params": params})
  checkpointer.wait_until_finished()
  (out_dir / MODEL_CONFIG_FILENAME).write_text(json.dumps(cfg.to_dict(), indent=2), encoding="utf-8")
  return cfg


def load_orbax(orbax_dir, cfg: ModelConfig | None = None) -> tuple[ModelConfig, dict]:
  """(model config, variables) of an orbax params checkpoint, on the first local device."""
  orbax_dir = pathlib.Path(orbax_dir).absolute()
  if not (orbax_dir / PARAMS_DIRNAME).is_dir():
    raise FileNotFoundError(f"{str(orbax_dir)!r} is not an orbax params checkpoint: no {PARAMS_DIRNAME}/ "
                            "(write one with --to_orbax).")
  if cfg is None:
    cfg = _saved_config(orbax_dir / MODEL_CONFIG_FILENAME, lambda values: values)
  checkpointer = ocp.StandardCheckpointer()
  saved = checkpointer.metadata(orbax_dir / PARAMS_DIRNAME).item_metadata.tree
  target = ckpt_lib.abstract_with_sharding(saved, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  return cfg, checkpointer.restore(orbax_dir / PARAMS_DIRNAME, target)


def workdir_model_config(workdir) -> ModelConfig:
  """The `model` section of the config.json that training wrote into `workdir`."""
  return _saved_config(pathlib.Path(workdir) / ckpt_lib.CONFIG_FILENAME, lambda c: c["model"])


def _saved_config(path: pathlib.Path, select) -> ModelConfig:
  if not path.is_file():
    raise FileNotFoundError(f"No {str(path)!r} to read the model config from: pass --config.")
  return ModelConfig.from_dict(select(json.loads(path.read_text())))


def to_hf(cfg: ModelConfig, variables, hf_dir, *, dtype=None, vision_from=None,
          max_shard_bytes: int = 5 * 2**30) -> None:
  convert.save_hf(cfg, variables, hf_dir, dtype=dtype, vision_from=vision_from,
                  max_shard_bytes=max_shard_bytes)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  sources = {k: v for k, v in (("--from_hf", _FROM_HF.value), ("--from_workdir", _FROM_WORKDIR.value),
                               ("--from_orbax", _FROM_ORBAX.value)) if v}
  targets = {k: v for k, v in (("--to_hf", _TO_HF.value), ("--to_orbax", _TO_ORBAX.value)) if v}
  if len(sources) != 1 or len(targets) != 1:
    raise app.UsageError(f"Give one source (--from_hf, --from_workdir or --from_orbax) and one target "
                         f"(--to_hf or --to_orbax); got {sorted(sources) or 'no source'} and "
                         f"{sorted(targets) or 'no target'}.")
  (source, source_path), (target, target_path) = *sources.items(), *targets.items()
  if (source == "--from_hf") != (target == "--to_orbax"):
    raise app.UsageError(f"{source} converts to {'--to_orbax' if source == '--from_hf' else '--to_hf'}, "
                         f"not {target}.")
  if source == "--from_hf":
    hf_to_orbax(source_path, target_path, dtype=_DTYPE.value)
    return
  cfg = ModelConfig.from_dict(_CONFIG.value.model) if _CONFIG.value is not None else None
  if source == "--from_workdir":
    cfg = cfg or workdir_model_config(source_path)
    variables, _ = training.load_params(source_path, step=_STEP.value)
  else:
    cfg, variables = load_orbax(source_path, cfg)
  to_hf(cfg, variables, target_path, dtype=_DTYPE.value, vision_from=_VISION_FROM.value,
        max_shard_bytes=_MAX_SHARD_BYTES.value)


if __name__ == "__main__":
  app.run(main)

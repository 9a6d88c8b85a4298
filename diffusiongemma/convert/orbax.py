"""Our parameter checkpoints in orbax, and the model config saved beside them.

An orbax params checkpoint is a folder with `params/` (the `{'params': ...}` variables, any dtype) and
`model_config.json` (the `ModelConfig`); `scripts/convert.py` writes one from a transformers folder and
reads one back to export it.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp

from diffusiongemma import _files
from diffusiongemma.convert import hf
from diffusiongemma.model import ModelConfig
from diffusiongemma import parallel
from diffusiongemma.model.config import MOE_AUTO

PARAMS_DIRNAME = "params"
MODEL_CONFIG_FILENAME = "model_config.json"


def hf_to_orbax(hf_dir: os.PathLike | str, out_dir: os.PathLike | str, *, dtype=None) -> ModelConfig:
  """A transformers folder as `out_dir/params` and `out_dir/model_config.json`; returns the model config."""
  cfg, params = hf.load_hf(hf_dir, dtype=dtype)
  out_dir = _files.as_path(out_dir, "--to_orbax", absolute=True)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(out_dir / PARAMS_DIRNAME, {"params": params})
  checkpointer.wait_until_finished()
  # The MoE implementation is the running machine's choice, not the weights': "auto" resolves where it loads.
  values = {**cfg.to_dict(), "moe_impl": MOE_AUTO}
  _files.atomic_write(out_dir / MODEL_CONFIG_FILENAME, json.dumps(values, indent=2))
  return cfg


def load_orbax(orbax_dir: os.PathLike | str, cfg: ModelConfig | None = None) -> tuple[ModelConfig, dict]:
  """(model config, variables) of an orbax params checkpoint, on the first local device; `cfg`
  overrides the saved model config."""
  orbax_dir = _files.as_path(orbax_dir, "--from_orbax", absolute=True)
  if not (orbax_dir / PARAMS_DIRNAME).is_dir():
    raise FileNotFoundError(f"{str(orbax_dir)!r} is not an orbax params checkpoint: no {PARAMS_DIRNAME}/ "
                            "(write one with scripts/convert.py --to_orbax).")
  if cfg is None:
    path = orbax_dir / MODEL_CONFIG_FILENAME
    if not _files.present(path):
      raise FileNotFoundError(f"No {str(path)!r} to read the model config from: pass a config.")
    values = _files.read_json(path)
    try:
      cfg = ModelConfig.from_dict(values)
    except (TypeError, ValueError) as e:
      raise _files.BadFileError(f"{path}: {e}") from None
  checkpointer = ocp.StandardCheckpointer()
  with _files.reading(f"The orbax params checkpoint {str(orbax_dir)!r}, item {PARAMS_DIRNAME!r},",
                      "It is damaged or incomplete: write it again (scripts/convert.py --to_orbax)."):
    saved = checkpointer.metadata(orbax_dir / PARAMS_DIRNAME).item_metadata.tree
    target = parallel.abstract_with_sharding(saved, jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    return cfg, checkpointer.restore(orbax_dir / PARAMS_DIRNAME, target)

"""Released weights: a training run's parameters, its config and how they were made, as one small folder.

What a project ships in its repository (projects/*/weights/): `params.safetensors` (the parameters,
flattened by their path, stored in float32 or, to keep the folder small, rounded to bfloat16),
`config.json` (the run's config), `provenance.json` (the commands, steps, training time and the results
they were shipped with) and, for a run with a tokenizer, `tokenizer.model`. `save` writes one from a
training workdir's latest checkpoint; `load` reads one, always as float32 arrays (bfloat16-stored weights
are exactly representable), so every measurement of released weights is of those rounded values.
"""

from __future__ import annotations

import json
import pathlib

import jax
import ml_collections
import numpy as np
import safetensors.numpy

from diffusiongemma import _files
from diffusiongemma.training import checkpoint

STORAGE_DTYPES = ("float32", "bfloat16")
TOKENIZER = "tokenizer.model"


def _flatten(tree, prefix=()) -> dict[str, np.ndarray]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, prefix + (key,)))
    else:
      out["/".join(prefix + (key,))] = np.asarray(value)
  return out


def _unflatten(flat) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for key in parents:
      node = node.setdefault(key, {})
    node[leaf] = value
  return tree


def save(workdir, folder, provenance: dict, *, storage_dtype: str = "float32"):
  """The latest checkpoint of `workdir` as the shipped folder `folder` (an `epath.Path`; either may be on gs://),
  with its tokenizer (the workdir's, else the file its config's `data.tokenizer_path` names, if either exists)."""
  if storage_dtype not in STORAGE_DTYPES:
    raise ValueError(f"storage_dtype={storage_dtype!r} is invalid; expected one of {STORAGE_DTYPES}.")
  variables, step = checkpoint.load_params(workdir)
  folder = _files.as_path(folder, "folder")
  folder.mkdir(parents=True, exist_ok=True)
  flat = {k: v.astype(np.float32) for k, v in _flatten(jax.device_get(variables)).items()}
  if storage_dtype == "bfloat16":
    flat = {k: v.astype(jax.numpy.bfloat16) for k, v in flat.items()}
  _files.atomic_write(folder / "params.safetensors", safetensors.numpy.save(flat))
  workdir = _files.as_path(workdir, "workdir")
  config_text = _files.read_text(workdir / checkpoint.CONFIG_FILENAME)
  _files.atomic_write(folder / "config.json", config_text)
  tokenizer = workdir / TOKENIZER  # the run's own, else the one its config names (e.g. a fine-tune's)
  if not tokenizer.is_file():
    tokenizer = _files.as_path(json.loads(config_text).get("data", {}).get("tokenizer_path") or workdir / TOKENIZER)
  if tokenizer.is_file():
    _files.atomic_write(folder / TOKENIZER, _files.read_bytes(tokenizer, _files.TOKENIZER_MAX_BYTES))
  record = {"step": step, "storage_dtype": storage_dtype, **provenance}
  _files.atomic_write(folder / "provenance.json", json.dumps(record, indent=2) + "\n")
  return folder


def is_release(folder) -> bool:
  """Whether `folder` is one `save` wrote (its params.safetensors and config.json; no checkpoints/)."""
  folder = _files.as_path(folder, "folder")
  return (_files.present(folder / "params.safetensors") and _files.present(folder / "config.json")
          and not (folder / checkpoint.CHECKPOINT_DIRNAME).exists())


def load(folder, what: str = "released weights") -> tuple[ml_collections.ConfigDict, dict, dict]:
  """(the run's config, its variables `{'params': ...}` as float32, its provenance) of a shipped folder."""
  folder = pathlib.Path(folder)
  if not (folder / "params.safetensors").is_file():
    raise FileNotFoundError(f"No {what} in {folder}: train them (see the project's README) or pass --workdir.")
  config = ml_collections.ConfigDict(json.loads((folder / "config.json").read_text()))
  flat = safetensors.numpy.load_file(folder / "params.safetensors")
  variables = _unflatten({k: jax.numpy.asarray(v.astype(np.float32)) for k, v in flat.items()})
  return config, variables, json.loads((folder / "provenance.json").read_text())

"""The shipped weights: a trained run's parameters, its config and how they were made, in the repo.

`projects/sudoku/weights/<name>/` holds `params.safetensors` (the parameters, flattened by their path),
`config.json` (the run's config) and `provenance.json` (the command, seed, steps, training seconds and the
held-out results they were shipped with). `save` writes one from a training workdir; `load` reads one.
"""

from __future__ import annotations

import json
import pathlib

import jax
import ml_collections
import numpy as np
import safetensors.numpy

from diffusiongemma import training

ROOT = pathlib.Path(__file__).parent / "weights"
DIFFUSION, AUTOREGRESSIVE = "diffusion", "ar"


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


def save(workdir, name: str, provenance: dict, root=ROOT) -> pathlib.Path:
  """The latest checkpoint of `workdir` as shipped weights `root/name` (float32 parameters)."""
  variables, step = training.load_params(workdir)
  out = pathlib.Path(root) / name
  out.mkdir(parents=True, exist_ok=True)
  flat = _flatten(jax.device_get(variables))
  safetensors.numpy.save_file({k: v.astype(np.float32) for k, v in flat.items()}, out / "params.safetensors")
  (out / "config.json").write_text((pathlib.Path(workdir) / training.checkpoint.CONFIG_FILENAME).read_text())
  (out / "provenance.json").write_text(json.dumps({"step": step, **provenance}, indent=2) + "\n")
  return out


def load(name: str = DIFFUSION, root=ROOT) -> tuple[ml_collections.ConfigDict, dict, dict]:
  """(the run's config, its variables `{'params': ...}`, its provenance) of the shipped weights `name`."""
  folder = pathlib.Path(root) / name
  if not (folder / "params.safetensors").is_file():
    raise FileNotFoundError(f"No shipped Sudoku weights in {folder}: train them (projects/sudoku/README.md) "
                            "or pass --workdir.")
  config = ml_collections.ConfigDict(json.loads((folder / "config.json").read_text()))
  variables = _unflatten({k: jax.numpy.asarray(v) for k, v in
                          safetensors.numpy.load_file(folder / "params.safetensors").items()})
  return config, variables, json.loads((folder / "provenance.json").read_text())

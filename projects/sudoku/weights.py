"""The shipped Sudoku weights (`build.release` folders): `weights/diffusion` and `weights/ar`."""

from __future__ import annotations

import pathlib

import ml_collections

from diffusiongemma.build import release

ROOT = pathlib.Path(__file__).parent / "weights"
DIFFUSION, AUTOREGRESSIVE = "diffusion", "ar"


def save(workdir, name: str, provenance: dict, root=ROOT) -> pathlib.Path:
  """The latest checkpoint of `workdir` as shipped weights `root/name` (float32 parameters)."""
  return release.save(workdir, pathlib.Path(root) / name, provenance)


def load(name: str = DIFFUSION, root=ROOT) -> tuple[ml_collections.ConfigDict, dict, dict]:
  """(the run's config, its variables `{'params': ...}`, its provenance) of the shipped weights `name`."""
  return release.load(pathlib.Path(root) / name, "shipped Sudoku weights")

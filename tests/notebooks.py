"""Executing a notebook of colabs/ as CI does (the notebook tests share it)."""

import os
import pathlib
from unittest import mock

import pytest

ROOT = pathlib.Path(__file__).parent.parent


def run_notebook(name: str, env: dict[str, str], timeout: int = 900) -> str:
  """Runs colabs/`name` top to bottom with `env` set (and DG_ROOT, the repository) and returns the text
  of every code cell's outputs; skips when the notebook extras are missing."""
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  notebook = nbformat.read(ROOT / "colabs" / name, as_version=4)
  with mock.patch.dict(os.environ, {"DG_ROOT": str(ROOT), **env}):
    nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "colabs")}}).execute()
  return "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                 for o in cell.get("outputs", []))

"""The binaries' persistent compilation cache (`parallel.enable_compilation_cache`): where it goes, and that
a compiled program lands there; run in fresh processes, since jax reads its cache settings once."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent
_PROGRAM = r"""
import sys, jax, jax.numpy as jnp
from diffusiongemma import parallel
path = parallel.enable_compilation_cache(sys.argv[1] or None)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache even this tiny program
jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))))
print(path)
"""


def _run(workdir, **env):
  environ = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME")}
  result = subprocess.run([sys.executable, "-c", _PROGRAM, str(workdir or "")], capture_output=True, text=True,
                          timeout=300, check=True, cwd=ROOT, env={**environ, **env})
  return pathlib.Path(result.stdout.strip().splitlines()[-1])


def test_cache_goes_to_the_variable_else_the_workdir_else_the_user_cache(tmp_path):
  workdir = tmp_path / "workdir"
  assert _run(workdir) == workdir / "compilation_cache"
  assert any((workdir / "compilation_cache").iterdir())  # the program was written
  shared = tmp_path / "shared"
  assert _run(workdir, JAX_COMPILATION_CACHE_DIR=str(shared)) == shared and any(shared.iterdir())
  xdg = tmp_path / "xdg"
  assert _run(None, XDG_CACHE_HOME=str(xdg)) == xdg / "diffusiongemma" / "compilation_cache"
  assert any((xdg / "diffusiongemma" / "compilation_cache").iterdir())
  assert str(_run(workdir, JAX_ENABLE_COMPILATION_CACHE="false")) == "None"


def test_binaries_that_compile_enable_it():
  """Every binary that compiles a model program turns the cache on (convert.py and plan.py compile none;
  load_test.py is an HTTP client)."""
  for script in sorted((ROOT / "scripts").glob("*.py")):
    if script.stem not in ("convert", "plan", "load_test"):
      assert "enable_compilation_cache(" in script.read_text(), script.name

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
path = parallel.enable_compilation_cache(sys.argv[1] or None)  # as a binary passes --compilation_cache
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache even this tiny program
jax.block_until_ready(jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))))
print(path)
"""


def _run(named, **env):
  environ = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME")}
  result = subprocess.run([sys.executable, "-c", _PROGRAM, str(named or "")], capture_output=True, text=True,
                          timeout=300, check=True, cwd=ROOT, env={**environ, **env})
  return pathlib.Path(result.stdout.strip().splitlines()[-1])


def test_cache_goes_to_the_named_folder_else_the_variable_else_the_user_cache(tmp_path):
  """Never into a workdir: a cache is executable code, which a shared or downloaded workdir must not bring."""
  named = tmp_path / "named"
  assert _run(named) == named
  assert any(named.iterdir())  # the program was written
  shared = tmp_path / "shared"
  assert _run(named, JAX_COMPILATION_CACHE_DIR=str(shared)) == named
  assert _run(None, JAX_COMPILATION_CACHE_DIR=str(shared)) == shared and any(shared.iterdir())
  xdg = tmp_path / "xdg"
  assert _run(None, XDG_CACHE_HOME=str(xdg)) == xdg / "diffusiongemma" / "compilation_cache"
  assert any((xdg / "diffusiongemma" / "compilation_cache").iterdir())
  assert str(_run(named, JAX_ENABLE_COMPILATION_CACHE="false")) == "None"


def test_binaries_that_compile_enable_it_from_their_flag_never_their_workdir():
  """Every binary that compiles a model program turns the cache on, in the folder of its
  --compilation_cache flag (convert.py, plan.py and prepare_data.py compile none; load_test.py is an HTTP client;
  lm_eval_harness.py has lm-eval's command line, so the variable or the user cache)."""
  for script in sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "experiments").glob("*.py")):
    text = script.read_text()
    if (script.stem not in ("convert", "plan", "load_test", "lm_eval_harness", "prepare_data")
        and script.parent.name == "scripts"):
      assert "enable_compilation_cache(_COMPILATION_CACHE.value)" in text, script.name
    if "enable_compilation_cache(" in text and script.stem != "lm_eval_harness":
      assert "enable_compilation_cache(_COMPILATION_CACHE.value)" in text, script.name
      assert "define_compilation_cache_flag()" in text, script.name

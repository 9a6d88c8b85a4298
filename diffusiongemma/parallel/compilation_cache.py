"""The persistent XLA compilation cache, so that a program compiled by one run is read back by the next.

A sampler or train step of a real model compiles for tens of seconds (27-62 s per program for a 1.3B model
on an H200); with the cache a second run of the same binary, shapes and settings loads it from disk.
Binaries call `enable_compilation_cache(workdir)` at the top of `main` (after `initialize_distributed`,
before anything compiles). Where the cache lives, first match wins:
  1. `JAX_COMPILATION_CACHE_DIR`, jax's own setting (read by jax at import; tests set it once so that all
     their subprocesses share one folder);
  2. `<workdir>/compilation_cache` when the binary has a workdir;
  3. `$XDG_CACHE_HOME/diffusiongemma/compilation_cache` (default `~/.cache/...`) otherwise.
`JAX_ENABLE_COMPILATION_CACHE=false` (jax's switch) turns it off. jax caches only programs that took at
least `jax_persistent_cache_min_compile_time_secs` (1 s by default) to compile.
"""

from __future__ import annotations

import os
import pathlib

from absl import logging
import jax

ENV_VAR = "JAX_COMPILATION_CACHE_DIR"
SUBDIR = "compilation_cache"


def default_cache_dir(workdir: os.PathLike | str | None = None) -> pathlib.Path:
  """Where the cache goes without `JAX_COMPILATION_CACHE_DIR` (see the module docstring)."""
  if workdir:
    return pathlib.Path(workdir) / SUBDIR
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "diffusiongemma" / SUBDIR


def enable_compilation_cache(workdir: os.PathLike | str | None = None) -> pathlib.Path | None:
  """Points jax's persistent compilation cache at its folder (created); returns it, or None when disabled."""
  if not jax.config.jax_enable_compilation_cache:
    return None
  path = pathlib.Path(os.environ.get(ENV_VAR) or default_cache_dir(workdir))
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  logging.info("Persistent compilation cache: %s", path)
  return path

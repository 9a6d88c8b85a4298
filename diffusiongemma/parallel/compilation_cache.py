"""The persistent XLA compilation cache, so that a program compiled by one run is read back by the next.

A sampler or train step of a real model compiles for tens of seconds (27-62 s per program for a 1.3B model
on an H200); with the cache a second run of the same binary, shapes and settings loads it from disk.
Binaries call `enable_compilation_cache(_COMPILATION_CACHE.value)` at the top of `main` (after
`initialize_distributed`, before anything compiles), with the flag of `define_flag()`. Where the cache
lives, first match wins:
  1. the folder the user names (`--compilation_cache=DIR`);
  2. `JAX_COMPILATION_CACHE_DIR`, jax's own setting (tests set it once so that all their subprocesses share
     one folder);
  3. `$XDG_CACHE_HOME/diffusiongemma/compilation_cache` (default `~/.cache/...`): the user's own.
Never a folder of a checkpoint or a training workdir: jax finds a cached program by the name of its entry
and runs what it finds without checking it, so a cache is executable code, and a workdir someone shares
(or you download) must not bring its own. `JAX_ENABLE_COMPILATION_CACHE=false` (jax's switch) turns it off.
jax caches only programs that took at least `jax_persistent_cache_min_compile_time_secs` (1 s by default)
to compile.
"""

from __future__ import annotations

import os
import pathlib

from absl import flags
from absl import logging
import jax

ENV_VAR = "JAX_COMPILATION_CACHE_DIR"
SUBDIR = "compilation_cache"
FLAG = "compilation_cache"


def default_cache_dir() -> pathlib.Path:
  """The user's cache folder for compiled programs (see the module docstring)."""
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "diffusiongemma" / SUBDIR


def define_flag(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  """`--compilation_cache=DIR`, the one flag every binary that compiles defines (through this function)."""
  return flags.DEFINE_string(
      FLAG, None, f"Folder of the persistent XLA compilation cache (default: ${ENV_VAR}, else "
      f"$XDG_CACHE_HOME/diffusiongemma/{SUBDIR}, ~/.cache/... by default). Its programs run unchecked: name "
      "only a folder you trust.",
      flag_values=flag_values)


def enable_compilation_cache(directory: os.PathLike | str | None = None) -> pathlib.Path | None:
  """Points jax's persistent compilation cache at `directory` (the user's `--compilation_cache`), else
  `JAX_COMPILATION_CACHE_DIR`, else the user's cache folder (created); returns it, or None when disabled."""
  if not jax.config.jax_enable_compilation_cache:
    return None
  path = pathlib.Path(directory or os.environ.get(ENV_VAR) or default_cache_dir())
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  logging.info("Persistent compilation cache: %s", path)
  return path

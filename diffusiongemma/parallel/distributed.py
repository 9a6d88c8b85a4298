"""Multi-process runs: starting `jax.distributed`, and the few things only one process may do.

Every process runs the same program on its own devices; `jax.devices()` then lists all of them, and the
mesh of `make_mesh` spans every process. Each process feeds its own rows of every global batch
(`jax.make_array_from_process_local_data`) and writes its own shards of a checkpoint (orbax
coordinates that). Files that are whole, not sharded (the config, metrics, a trained tokenizer), are
written by process 0 alone, and the others wait at `sync` for them where they read them next.
"""

from __future__ import annotations

import os

from absl import logging
import jax
from jax.experimental import multihost_utils

# What jax.distributed.initialize reads by itself when given nothing (besides cluster detection).
ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
  """Starts `jax.distributed` when this is a multi-process run; returns whether it did.

  A run is multi-process when `coordinator_address` is given or `JAX_COORDINATOR_ADDRESS` is set
  (then `num_processes` and `process_id` come from the arguments or from `JAX_NUM_PROCESSES` and
  `JAX_PROCESS_ID`), or when a cluster that jax detects by itself (SLURM, Open MPI, TPU pods) says
  so through `JAX_DISTRIBUTED=1`. Otherwise nothing happens, so single-process runs need no flag.
  Call it before anything else touches jax devices.
  """
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not address and os.environ.get("JAX_DISTRIBUTED") != "1":
    if num_processes not in (None, 1) or process_id not in (None, 0):
      raise ValueError(f"num_processes={num_processes} and process_id={process_id} need a "
                       "coordinator address (--coordinator_address=host:port or JAX_COORDINATOR_ADDRESS).")
    return False
  if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
    num_processes = int(os.environ["JAX_NUM_PROCESSES"])
  if process_id is None and "JAX_PROCESS_ID" in os.environ:
    process_id = int(os.environ["JAX_PROCESS_ID"])
  if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes}).")
  jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                             process_id=process_id)
  logging.info("jax.distributed: process %d of %d, %d local and %d global devices.", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def is_main_process() -> bool:
  """Whether this process writes the files that exist once per run (config, metrics, tokenizer)."""
  return jax.process_index() == 0


def sync(name: str) -> None:
  """Waits until every process reaches the barrier `name` (nothing to wait for with one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)

r"""Trains a DiffusionGemma model, resuming from the latest checkpoint in --workdir.

  python scripts/train.py --config configs/tiny.py --workdir /tmp/dg_tiny \
      --config.train.num_steps=300 --config.diffusion.noise=masked

Several processes (hosts) train one model together when each runs the same command with
--coordinator_address=host:port --num_processes=N --process_id=i (or JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID in the environment); --workdir must be the same shared folder or bucket
(gs://bucket/run, with the `gcs` extra). docs/scale.md has the pod recipe.

SIGTERM saves a checkpoint and exits with status 0; with several processes, SIGTERM to any one of them stops
every one after the same step, in one save. Running the same command again resumes.
"""

from absl import app
from absl import flags

from diffusiongemma import build
from diffusiongemma import parallel
from diffusiongemma import training

_CONFIG = build.cli.define_config("config", None, "A config file (configs/*.py).",
                                lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics, tokenizer and caches go here: a folder "
                              "or gs://bucket/path.")
_COMPILATION_CACHE = parallel.define_compilation_cache_flag()
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0, for a multi-process run (jax.distributed).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  parallel.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
  training.quiet_orbax_logs()
  build.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  build.cli.run(main)

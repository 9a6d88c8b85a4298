r"""Trains a DiffusionGemma model, resuming from the latest checkpoint in --workdir.

  python scripts/train.py --config configs/tiny.py --workdir /tmp/dg_tiny \
      --config.train.num_steps=300 --config.diffusion.noise=masked

SIGTERM saves a checkpoint and exits with status 0; running the same command again resumes.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from diffusiongemma import training

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics, tokenizer and caches go here.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  training.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)

r"""Evaluates the latest (or --step) checkpoint in --workdir on the validation split.

  python scripts/evaluate.py --config configs/tiny.py --workdir /tmp/dg_tiny

Prints and writes to workdir/eval.json: the validation diffusion loss, the encoder's next-token
perplexity and, for masked noise, the perplexity bound.
"""

import json

from absl import app
from absl import flags
from ml_collections import config_flags

from diffusiongemma import training

_CONFIG = config_flags.DEFINE_config_file("config", None, "The config file the model was trained with.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The training workdir.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step (default: the latest).")
_NUM_BATCHES = flags.DEFINE_integer("num_batches", None,
                                    "Validation batches (default: config.train.eval_batches).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  results = training.evaluate(_CONFIG.value, _WORKDIR.value, step=_STEP.value,
                              num_batches=_NUM_BATCHES.value)
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  app.run(main)

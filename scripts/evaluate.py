r"""Evaluates the latest (or --step) checkpoint in --workdir on the validation split.

  python scripts/evaluate.py --workdir /tmp/dg_tiny
  python scripts/evaluate.py --config configs/small.py --workdir workdir/small --generative \
      --baseline_workdir workdir/small_ar --num_samples 32

Prints and writes to workdir/eval.json: the validation diffusion loss, the encoder's next-token
perplexity and, for masked noise, the perplexity bound. With --generative it also samples continuations
of --num_samples validation prompts with config.sampler (the latest checkpoint) and scores them
(diffusiongemma/evaluation/generative.py): their perplexity under the model's own encoder and, with
--baseline_workdir (a model trained by configs/small_ar.py on the same tokenizer), under that
autoregressive baseline, their unigram entropy, the same figures of the real validation continuations,
and the sampler's tokens per forward; those go to workdir/generative.json and are printed too.
"""

import json
import pathlib

from absl import app
from absl import flags

from diffusiongemma import build
from diffusiongemma import parallel
from diffusiongemma import training

_CONFIG = build.cli.define_config("config", None, "The config file the model was trained with (default: the "
                                "workdir's saved config.json; one given must match it in what the weights "
                                "depend on).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The training workdir.")
_COMPILATION_CACHE = parallel.define_compilation_cache_flag()
_STEP = flags.DEFINE_integer("step", None, "The checkpoint step (default: the latest).")
_NUM_BATCHES = flags.DEFINE_integer("num_batches", None,
                                    "Validation batches (default: config.train.eval_batches).")
_GENERATIVE = flags.DEFINE_bool("generative", False, "Also sample and score continuations (latest step).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 16, "Validation prompts to continue (--generative).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call (--generative).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 0, "New tokens; 0: config.sampler.max_new_tokens.")
_BASELINE = flags.DEFINE_string("baseline_workdir", None, "An AR baseline's workdir (configs/small_ar.py).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (--generative).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
  training.quiet_orbax_logs()
  config = build.run_config(_WORKDIR.value, _CONFIG.value)
  results = build.evaluate(config, _WORKDIR.value, step=_STEP.value, num_batches=_NUM_BATCHES.value)
  if _GENERATIVE.value:
    evaluation = build.generative_eval(config, _WORKDIR.value, baseline_workdir=_BASELINE.value,
                                       num_samples=_NUM_SAMPLES.value, batch_size=_BATCH_SIZE.value,
                                       seed=_SEED.value)
    results["generative"] = evaluation.run(_MAX_NEW.value or None)
    path = pathlib.Path(_WORKDIR.value) / "generative.json"
    path.write_text(json.dumps(results["generative"], indent=2), encoding="utf-8")
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  build.cli.run(main)

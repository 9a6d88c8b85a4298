r"""Does training every canvas in one block-causal pass (BD3-LM style) learn faster per second?

Trains the same config twice for the same time budget, once with one canvas per sequence (the
released objective) and once with `config.diffusion.all_canvases=True`, evaluating both on the same
fixed validation noise, and prints validation diffusion loss against training seconds (wall and
process CPU, evaluation and checkpointing excluded). Results go to workdir/compare.json.

  python experiments/compare_all_canvases.py --config configs/tiny.py --workdir /tmp/dg_compare \
      --budget_s 600 --config.train.eval_every=50
"""

import json
import pathlib

from absl import app
from absl import flags

from diffusiongemma import build
from diffusiongemma import parallel
from diffusiongemma import training

_CONFIG = build.cli.define_config("config", None, "A config file (configs/*.py).",
                                lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Each mode trains in a subfolder of this.")
_COMPILATION_CACHE = parallel.define_compilation_cache_flag()
_BUDGET = flags.DEFINE_float("budget_s", 600.0, "Training seconds per mode.")
flags.mark_flags_as_required(["config", "workdir"])

MODES = {"one_canvas": False, "all_canvases": True}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
  training.quiet_orbax_logs()
  root = pathlib.Path(_WORKDIR.value)
  results = {}
  for mode, all_canvases in MODES.items():
    config = _CONFIG.value.copy_and_resolve_references()
    config.diffusion.all_canvases = all_canvases
    config.train.time_budget_s = _BUDGET.value
    config.train.num_steps = max(config.train.num_steps, 10**6)  # the budget ends the run
    build.train(config, root / mode)
    records = training.read_metrics(root / mode)
    results[mode] = [{"step": r["step"], "train_s": r["time/train_s"], "cpu_s": r["time/cpu_s"],
                      "diffusion_loss": r["eval/diffusion_loss"], "loss": r["eval/loss"]}
                     for r in records if "eval/diffusion_loss" in r]
  (root / "compare.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
  print(f"{'mode':>13} {'step':>6} {'train_s':>8} {'cpu_s':>8} {'val diffusion':>13} {'val loss':>9}")
  for mode, rows in results.items():
    for r in rows:
      print(f"{mode:>13} {r['step']:>6} {r['train_s']:>8.1f} {r['cpu_s']:>8.1f} "
            f"{r['diffusion_loss']:>13.4f} {r['loss']:>9.4f}")


if __name__ == "__main__":
  app.run(main)

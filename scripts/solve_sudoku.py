r"""Solves Sudoku puzzles with a model of projects/sudoku (the shipped weights, or a training workdir).

  python scripts/solve_sudoku.py --puzzles=IN --output=OUT                   # the shipped weights
  python scripts/solve_sudoku.py --puzzles=IN --output=OUT --autoregressive  # the shipped AR model
  python scripts/solve_sudoku.py --workdir=W --puzzles=IN --output=OUT       # a training run, as trained
  python scripts/solve_sudoku.py --config=projects/sudoku/config.py --workdir=W --puzzles=IN --output=OUT \
      --config.sampler.acceptance=margin --config.sampler.margin_accept=0.9   # other sampler settings

IN holds one puzzle per line (81 characters, `0` or `.` for a blank); a line of another length, with other
characters, or whose clues break a row, column or box rule is refused with an error naming it. OUT gets one
81-digit line per puzzle, in order, also when the model fails (a cell where the model wrote no digit is `0`;
an unsolvable puzzle is simply unsolved). Without --workdir the shipped weights are used
(projects/sudoku/weights/: the diffusion model, or the AR model with --autoregressive). The last printed
line is the solved fraction, the mean forward passes per puzzle (diffusion: denoiser passes), tokens per
forward and puzzles/s (compilation excluded; it is in the JSON line before).
"""

import json

from absl import app
from absl import flags

from diffusiongemma import build
from diffusiongemma import parallel
from diffusiongemma import training
from projects.sudoku import data as sudoku
from projects.sudoku import solve
from projects.sudoku import weights as shipped

_CONFIG = build.cli.define_config("config", None, "projects/sudoku/config.py (':ar' for the AR model); default: "
                                "the saved config of --workdir or of the shipped weights.",
                                lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (its latest checkpoint); default: the "
                               "shipped weights.")
_COMPILATION_CACHE = parallel.define_compilation_cache_flag()
_PUZZLES = flags.DEFINE_string("puzzles", None, "Puzzles, one per line (81 chars, 0 or . blank).")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write one 81-digit solution per puzzle.")
_AUTOREGRESSIVE = flags.DEFINE_bool("autoregressive", False, "Decode token by token (greedy) instead.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Puzzles per batch.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.mark_flags_as_required(["puzzles", "output"])


def _weights(config, autoregressive: bool):
  """(config, variables, where they came from, model config) of --workdir or of the shipped weights; the
  config is the one given, else the run's own (the workdir's or the shipped weights' config.json)."""
  if _WORKDIR.value:
    config = build.run_config(_WORKDIR.value, config)  # a --config given must match the run
    weights = build.load(config, workdir=_WORKDIR.value)
    return config, weights.variables, weights.source, weights.model_config
  name = shipped.AUTOREGRESSIVE if autoregressive else shipped.DIFFUSION
  saved, variables, provenance = shipped.load(name)
  model_cfg = build.model_config(saved)
  if config is not None and build.model_config(config) != model_cfg:
    raise app.UsageError(f"--config describes another model than the shipped {name} weights "
                         f"({shipped.ROOT / name}); pass the config they were trained with or --workdir.")
  return config or saved, variables, f"shipped {name} weights (step {provenance['step']})", model_cfg


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
  training.quiet_orbax_logs()
  try:
    puzzles = sudoku.read_puzzles(_PUZZLES.value)
  except (OSError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  if not len(puzzles):
    raise app.UsageError(f"No puzzles in {_PUZZLES.value}.")
  autoregressive = _AUTOREGRESSIVE.value
  config, variables, source, model_cfg = _weights(_CONFIG.value, autoregressive)
  if not autoregressive and config.diffusion.get("diffusion_loss_weight", 1.0) == 0:
    raise app.UsageError("This config trains an AR model (diffusion_loss_weight=0): pass --autoregressive.")
  sampler = build.ar_sampler(config, model_cfg) if autoregressive else build.sampler(config, model_cfg)
  result = solve.solve(sampler, variables, puzzles, batch_size=_BATCH_SIZE.value, seed=_SEED.value)
  sudoku.write_puzzles(_OUTPUT.value, result.solutions)
  summary = result.summary()
  settings = {"stop_tokens": list(sampler.stop_tokens)} if autoregressive else sampler.settings()
  print(json.dumps({"weights": source, "decoder": "autoregressive" if autoregressive else "diffusion",
                    "sampler": settings, **summary, "by_clues": solve.by_clues(puzzles, result)}))
  print(f"solved {summary['solve_rate']:.4f} | passes/puzzle {summary['passes_per_puzzle']:.2f} | "
        f"tokens/forward {summary['tokens_per_forward']:.2f} | puzzles/s {summary['puzzles_per_s']:.2f}")


if __name__ == "__main__":
  build.cli.run(main)

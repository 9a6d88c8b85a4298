r"""Solves Sudoku puzzles with a model trained by configs/sudoku.py.

  python scripts/solve_sudoku.py --config=configs/sudoku.py --workdir=W --puzzles=IN --output=OUT \
      [--autoregressive] [--config.sampler.entropy_bound=0.1] [--config.sampler.max_denoising_steps=48]

IN holds one puzzle per line (81 characters, `0` or `.` for a blank); OUT gets one 81-digit line per
puzzle, in order, also when the model fails (a cell where the model wrote no digit is `0`). Block
diffusion by default; --autoregressive decodes the same weights token by token (greedy), which is also
how to run the AR model of configs/sudoku.py:ar. The last printed line is the solved fraction, the mean
forward passes per puzzle (diffusion: denoiser passes), tokens per forward and puzzles/s (compilation
excluded; it is printed on the line before).
"""

import json

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from diffusiongemma import build
from diffusiongemma import parallel
from diffusiongemma import training
from diffusiongemma.data import sudoku
from diffusiongemma.evaluation import sudoku as sudoku_eval

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file (configs/sudoku.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The training workdir (its latest checkpoint is used).")
_PUZZLES = flags.DEFINE_string("puzzles", None, "Puzzles, one per line (81 chars, 0 or . blank).")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write one 81-digit solution per puzzle.")
_AUTOREGRESSIVE = flags.DEFINE_bool("autoregressive", False, "Decode token by token (greedy) instead.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Puzzles per batch.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.mark_flags_as_required(["config", "workdir", "puzzles", "output"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  parallel.enable_compilation_cache(_WORKDIR.value)
  training.quiet_orbax_logs()
  config = _CONFIG.value
  puzzles = sudoku.read_puzzles(_PUZZLES.value)
  if not len(puzzles):
    raise app.UsageError(f"No puzzles in {_PUZZLES.value}.")
  weights = build.load(config, workdir=_WORKDIR.value)
  decoder = "autoregressive" if _AUTOREGRESSIVE.value else "diffusion"
  if decoder == "diffusion" and config.diffusion.get("diffusion_loss_weight", 1.0) == 0:
    logging.warning("This config trains an AR model (diffusion_loss_weight=0): pass --autoregressive.")
  sampler = (build.ar_sampler(config, weights.model_config) if _AUTOREGRESSIVE.value else
             build.sampler(config, weights.model_config))
  result = sudoku_eval.solve(sampler, weights.variables, puzzles, batch_size=_BATCH_SIZE.value,
                             seed=_SEED.value)
  sudoku.write_puzzles(_OUTPUT.value, result.solutions)
  summary = result.summary()
  settings = sampler.settings() if decoder == "diffusion" else {"stop_tokens": list(sampler.stop_tokens)}
  print(json.dumps({"weights": weights.source, "decoder": decoder, "sampler": settings, **summary,
                    "by_clues": sudoku_eval.by_clues(puzzles, result)}))
  print(f"solved {summary['solve_rate']:.4f} | passes/puzzle {summary['passes_per_puzzle']:.2f} | "
        f"tokens/forward {summary['tokens_per_forward']:.2f} | puzzles/s {summary['puzzles_per_s']:.2f}")


if __name__ == "__main__":
  app.run(main)

r"""Runs lm-evaluation-harness (0.4.x, `pip install -e '.[eval]'`) with the `diffusiongemma` model registered.

Every argument is the harness's own (`lm-eval run --help`); this script only registers the model class
(`diffusiongemma/build/harness.py`, where its --model_args are described) and hands over to the harness's
command line. Examples (from the repository root):

  # a transformers checkpoint on standard tasks (the hub must be reachable for their data)
  python scripts/lm_eval_harness.py --model diffusiongemma \
      --model_args hf_checkpoint=DIR,batch_size=8 --tasks arc_easy,hellaswag,gsm8k --output_path results/

  # offline: the local tasks shipped with the tests
  HF_DATASETS_OFFLINE=1 python scripts/lm_eval_harness.py --model diffusiongemma \
      --model_args hf_checkpoint=DIR,dtype=float32 --include_path tests/harness_tasks \
      --tasks dg_choice,dg_generate --output_path results/ --log_samples

  # the Sudoku model (the `sudoku` adapter of projects/sudoku/harness.py: clues held, 81 digits out)
  HF_DATASETS_OFFLINE=1 python scripts/lm_eval_harness.py --model diffusiongemma \
      --model_args workdir=W,batch_size=16 --include_path projects/sudoku/harness_task --tasks sudoku_solve
"""

from lm_eval.__main__ import cli_evaluate

import diffusiongemma.build.harness  # pylint: disable=unused-import  (registers the `diffusiongemma` model)
from diffusiongemma import parallel
import projects.sudoku.harness  # pylint: disable=unused-import  (registers the `sudoku` adapter)

if __name__ == "__main__":
  parallel.enable_compilation_cache()  # JAX_COMPILATION_CACHE_DIR, else the user cache (no flag: lm-eval parses argv)
  cli_evaluate()  # reads sys.argv; no subcommand means `run`

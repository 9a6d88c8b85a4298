"""Sudoku: a small DiffusionGemma trained from scratch on this 2-core CPU to solve held-out puzzles.

  python scripts/train.py --config=configs/sudoku.py --workdir=W        # block diffusion
  python scripts/train.py --config=configs/sudoku.py:ar --workdir=W_AR  # the AR model, same size/budget
  python scripts/solve_sudoku.py --config=configs/sudoku.py --workdir=W --puzzles=P --output=O

The prompt is BOS + the 81 cells (blank = token 3), the response the 81 digits: one canvas of 81
(data/sudoku.py says why 81 and not a padded 96). `get_config("ar")` is the autoregressive baseline: the
same model and data, trained on the next-token loss of the solution alone (`diffusion_loss_weight=0`).
`get_config("tiny")` shrinks everything for tests.
"""

from diffusiongemma.config_base import base_config
from diffusiongemma.data import sudoku

ARGS = ("diffusion", "ar", "tiny", "tiny_ar")


def get_config(arg=None):
  arg = arg or "diffusion"
  if arg not in ARGS:
    raise ValueError(f"Unknown configs/sudoku.py argument {arg!r}; expected one of {ARGS}.")
  config = base_config(
      vocab_size=sudoku.VOCAB_SIZE, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
      head_dim=32, num_full_kv_heads=2, full_head_dim=32, sliding_window=256, intermediate_size=256,
      num_experts=1, top_k=1, moe_intermediate_size=128, canvas_length=sudoku.NUM_CELLS,
      max_positions=256, moe_impl="dense")
  config.data.task = "sudoku"
  config.data.vocab_size = sudoku.VOCAB_SIZE
  config.data.prompt_length = sudoku.PROMPT_LENGTH
  config.data.num_canvases = 1
  config.data.sudoku = dict(pool_size=4096, pool_clues=30, min_clues=30, max_clues=45,
                            validation_size=256, validation_clues=(36, 37, 38, 39, 40))

  config.diffusion.noise = "masked"
  config.diffusion.ar_loss_weight = 1.0
  config.diffusion.ar_loss_on_prompt = False
  config.diffusion.self_conditioning_prob = 0.5

  config.train.num_steps = 4000
  config.train.batch_size = 64
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 100
  config.train.log_every = 50
  config.train.eval_every = 500
  config.train.eval_batches = 4
  config.train.checkpoint_every = 500
  config.train.keep_checkpoints = 20
  config.train.time_budget_s = 1680.0

  config.sampler.max_new_tokens = sudoku.NUM_CELLS
  config.sampler.stop_tokens = (sudoku.EOS,)
  config.sampler.prompt_bucket = 2  # the 82-token prompt is not padded to 128

  if arg in ("ar", "tiny_ar"):
    config.diffusion.diffusion_loss_weight = 0.0
    config.diffusion.self_conditioning_prob = 0.0
  if arg in ("tiny", "tiny_ar"):
    config.model.hidden_size = 32
    config.model.num_layers = 2
    config.model.num_heads = 2
    config.model.num_kv_heads = 1
    config.model.num_full_kv_heads = 1
    config.model.head_dim = 16
    config.model.full_head_dim = 16
    config.model.intermediate_size = 64
    config.model.moe_intermediate_size = 32
    config.data.sudoku = dict(pool_size=64, pool_clues=36, min_clues=36, max_clues=45,
                              validation_size=16, validation_clues=(36, 40))
    config.train.num_steps = 20
    config.train.batch_size = 8
    config.train.log_every = 10
    config.train.eval_every = 10
    config.train.eval_batches = 1
    config.train.checkpoint_every = 10
    config.train.time_budget_s = 0.0
  return config

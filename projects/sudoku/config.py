"""Sudoku: a small DiffusionGemma trained from scratch on a 2-core CPU to solve held-out puzzles.

  python scripts/train.py --config=projects/sudoku/config.py --workdir=W        # block diffusion
  python scripts/train.py --config=projects/sudoku/config.py:ar --workdir=W_AR  # AR, same model and data
  python scripts/solve_sudoku.py --config=projects/sudoku/config.py [--workdir=W] --puzzles=P --output=O

The prompt is BOS + the 81 cells; the canvas is the 81 digits, with the clues held as given positions.
`get_config("ar")`: the autoregressive baseline (the same model and data, next-token loss on the solution);
`"tiny"` / `"tiny_ar"`: the same recipe shrunk for tests. The recipe's reasons and the ablations that chose
it are in projects/sudoku/README.md.
"""

import math

from diffusiongemma.build.config import base_config
from projects.sudoku import data as sudoku

ARGS = ("diffusion", "ar", "tiny", "tiny_ar")
HEAD_DIM = 32


def grid_rope_theta(head_dim: int) -> float:
  """The rotary base whose second frequency is 2pi / 9 (one row of the grid) for this head dim."""
  return (9 / (2 * math.pi)) ** (head_dim / 2)


def get_config(arg=None):
  arg = arg or "diffusion"
  if arg not in ARGS:
    raise ValueError(f"Unknown projects/sudoku/config.py argument {arg!r}; expected one of {ARGS}.")
  theta = grid_rope_theta(HEAD_DIM)
  config = base_config(
      vocab_size=sudoku.VOCAB_SIZE, hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
      head_dim=HEAD_DIM, num_full_kv_heads=2, full_head_dim=HEAD_DIM, sliding_window=256,
      rope_theta=theta, full_rope_theta=theta, intermediate_size=256, num_experts=1, top_k=1,
      moe_intermediate_size=64, canvas_length=sudoku.NUM_CELLS, max_positions=256, moe_impl="dense")
  config.data.task = "projects.sudoku.task"
  config.data.vocab_size = sudoku.VOCAB_SIZE
  config.data.prompt_length = sudoku.PROMPT_LENGTH
  config.data.num_canvases = 1
  # Clues are noised in training like any cell (copying them from the prompt is the easy task that first
  # teaches the canvas where its cells are), and held when solving (this project's README: the ablation).
  config.data.sudoku = dict(pool_size=8192, pool_clues=30, min_clues=30, max_clues=45, validation_size=200,
                            validation_clues=(36, 37, 38, 39, 40), hold_clues=False)

  config.diffusion.noise = "masked"
  config.diffusion.ar_loss_weight = 0.0
  config.diffusion.ar_loss_on_prompt = False
  config.diffusion.self_conditioning_prob = 0.0
  config.diffusion.loss_weighting = "flat"

  config.train.num_steps = 2700
  config.train.batch_size = 64
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 100
  config.train.log_every = 50
  config.train.eval_every = 500
  config.train.eval_batches = 2
  config.train.checkpoint_every = 250
  config.train.keep_checkpoints = 20  # every checkpoint of the run: the solve rate against time
  config.train.time_budget_s = 7200.0  # at most 2 hours of steps, resumes included (the shipped run: README.md)

  config.sampler.max_new_tokens = sudoku.NUM_CELLS
  config.sampler.max_denoising_steps = 24
  # Chosen on 200 validation puzzles of seed 1 (the report uses seed 0): this project's README, Results.
  config.sampler.acceptance = "confidence"
  config.sampler.confidence_accept = 0.9999
  config.sampler.schedule = "constant"  # the model's own distribution: T < 1 accepts its confident mistakes
  config.sampler.temperature = 1.0
  config.sampler.stop_tokens = ()  # the canvas is exactly the grid: no stop token ends it early
  config.sampler.prompt_bucket = 2  # the 82-token prompt is not padded to 128

  if arg in ("ar", "tiny_ar"):
    config.diffusion.diffusion_loss_weight = 0.0
    config.diffusion.ar_loss_weight = 1.0
  if arg in ("tiny", "tiny_ar"):
    config.model.hidden_size = 32
    config.model.num_layers = 2
    config.model.num_heads = 2
    config.model.num_kv_heads = 1
    config.model.num_full_kv_heads = 1
    config.model.head_dim = 16
    config.model.full_head_dim = 16
    config.model.rope_theta = config.model.full_rope_theta = grid_rope_theta(16)
    config.model.intermediate_size = 64
    config.model.moe_intermediate_size = 32
    config.data.sudoku = dict(pool_size=64, pool_clues=36, min_clues=36, max_clues=45, validation_size=16,
                              validation_clues=(36, 40), hold_clues=False)
    config.train.num_steps = 20
    config.train.batch_size = 8
    config.train.log_every = 10
    config.train.eval_every = 10
    config.train.eval_batches = 1
    config.train.checkpoint_every = 10
    config.train.time_budget_s = 0.0
  return config

"""Text: a DiffusionGemma trained from scratch on the embedded corpus (Python's standard library), then
distilled from its own autoregressive greedy decoding so that its denoiser writes several tokens per pass.

  python scripts/train.py --config=projects/text/config.py --workdir=P                      # pretraining
  python -m projects.text.teacher --workdir=P --output=T                                    # AR targets
  python scripts/train.py --config=projects/text/config.py:distil --workdir=W \\
      --config.train.init_from=P --config.data.tokenizer_path=P/tokenizer.model --config.data.distil.teacher=T

`get_config("pretrain")` (default): both losses on the corpus, masked noise, 16-token canvases;
`"distil"`: the same model fine-tuned on the teacher's continuations (`projects/text/task.py`) with the AR
loss kept on real text; `"tiny"` / `"tiny_distil"`: the same recipe shrunk for tests. The reasons and the
measurements: projects/text/README.md.
"""

from diffusiongemma.build.config import base_config

ARGS = ("pretrain", "distil", "tiny", "tiny_distil")


def get_config(arg=None):
  arg = arg or "pretrain"
  if arg not in ARGS:
    raise ValueError(f"Unknown projects/text/config.py argument {arg!r}; expected one of {ARGS}.")
  config = base_config(
      vocab_size=4096, hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64,
      num_full_kv_heads=1, full_head_dim=128, sliding_window=128, intermediate_size=512, num_experts=8,
      top_k=2, moe_intermediate_size=128, canvas_length=16, max_positions=4096)
  config.data.prompt_length = 64
  config.data.num_canvases = 8
  config.diffusion.noise = "masked"
  config.diffusion.loss_weighting = "flat"
  config.diffusion.all_canvases = True
  config.train.num_steps = 1100
  config.train.batch_size = 16
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 200
  config.train.log_every = 50
  config.train.eval_every = 500
  config.train.eval_batches = 4
  config.train.checkpoint_every = 500
  config.train.time_budget_s = 7200.0  # at most 2 hours of steps
  config.sampler.max_new_tokens = 128
  config.sampler.stop_tokens = (1,)  # EOS: the end of a file
  # Greedy parallel decoding, left to right: each pass writes the next token and every following one whose
  # top probability reaches the threshold (their argmax); a canvas ends when none is masked. The threshold
  # is chosen on the dev prompts (README).
  config.sampler.acceptance = "prefix"
  config.sampler.prefix_accept = 0.9
  config.sampler.schedule = "constant"
  config.sampler.temperature = 1.0
  config.sampler.stopping = "fixed"
  config.sampler.draw = "argmax"
  config.sampler.max_denoising_steps = 16
  config.sampler.prompt_bucket = 16

  if arg in ("distil", "tiny_distil"):
    config.data.task = "projects.text.task"
    # Teacher rows only: their prompts (real text) keep the AR loss, their continuations teach the denoiser.
    config.data.distil = dict(teacher="", corpus_fraction=0.0 if arg == "distil" else 0.25)
    config.diffusion.certainty_weight = 0.5  # certainty forcing (dParallel)
    config.diffusion.suffix_fraction = 0.8  # mostly the canvases left-to-right decoding sees
    config.train.num_steps = 380
    config.train.learning_rate = 1e-3
    config.train.warmup_steps = 40
    config.train.eval_every = 190
    config.train.checkpoint_every = 95
    config.train.time_budget_s = 2400.0  # at most 40 minutes of steps (the recipe: 3 hours in all)
  if arg in ("tiny", "tiny_distil"):
    config.model.hidden_size = 32
    config.model.num_layers = 2
    config.model.num_heads = 2
    config.model.num_kv_heads = 1
    config.model.head_dim = 16
    config.model.full_head_dim = 16
    config.model.intermediate_size = 64
    config.model.num_experts = 4
    config.model.moe_intermediate_size = 32
    config.model.canvas_length = 8
    config.model.vocab_size = 512
    config.data.vocab_size = 512
    config.data.prompt_length = 16
    config.data.num_canvases = 2
    config.train.num_steps = 20
    config.train.batch_size = 8
    config.train.warmup_steps = 5
    config.train.log_every = 10
    config.train.eval_every = 10
    config.train.eval_batches = 1
    config.train.checkpoint_every = 10
    config.train.time_budget_s = 0.0
    config.sampler.max_new_tokens = 16
    config.sampler.max_denoising_steps = 8
  return config

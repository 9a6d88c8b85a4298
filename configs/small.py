"""A small DiffusionGemma (~24M parameters, 16 experts top-2) that learns on 2 CPU cores in tens of minutes."""

from diffusiongemma.build.config import base_config


def get_config(arg=None):
  del arg
  config = base_config(
      vocab_size=4096, hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64,
      num_full_kv_heads=1, full_head_dim=128, sliding_window=128, intermediate_size=512, num_experts=16,
      top_k=2, moe_intermediate_size=256, canvas_length=64, max_positions=8192)
  config.data.prompt_length = 64
  config.data.num_canvases = 2
  config.train.num_steps = 3000
  config.train.batch_size = 16
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 100
  config.train.eval_every = 500
  config.train.checkpoint_every = 500
  config.sampler.max_new_tokens = 128
  return config

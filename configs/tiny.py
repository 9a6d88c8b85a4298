"""A tiny DiffusionGemma (~0.7M parameters) that trains and samples in seconds on a CPU."""

from diffusiongemma.build.config import base_config


def get_config(arg=None):
  del arg
  config = base_config(
      vocab_size=4096, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
      num_full_kv_heads=1, full_head_dim=32, sliding_window=32, intermediate_size=128, num_experts=4,
      top_k=2, moe_intermediate_size=64, canvas_length=16, max_positions=4096)
  config.data.prompt_length = 32
  config.data.num_canvases = 2
  config.train.num_steps = 300
  config.train.batch_size = 16
  config.train.eval_every = 100
  config.train.checkpoint_every = 100
  config.sampler.max_new_tokens = 32
  return config

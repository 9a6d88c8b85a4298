"""The released DiffusionGemma 26B-A4B text model (Gemma 4 26B-A4B dimensions, canvas 256)."""

from diffusiongemma.build.config import base_config


def get_config(arg=None):
  del arg
  config = base_config(
      vocab_size=262_144, hidden_size=2816, num_layers=30, num_heads=16, num_kv_heads=8, head_dim=256,
      num_full_kv_heads=2, full_head_dim=512, full_k_eq_v=True, sliding_window=1024, rope_theta=10_000.0,
      full_rope_theta=1_000_000.0, full_partial_rotary_factor=0.25, intermediate_size=2112,
      num_experts=128, top_k=8, moe_intermediate_size=704, canvas_length=256, final_logit_softcap=30.0,
      max_positions=262_144, dtype="bfloat16", param_dtype="bfloat16")
  config.data.vocab_size = 262_144
  config.data.prompt_length = 1024
  config.data.num_canvases = 4
  config.train.batch_size = 256
  config.train.learning_rate = 1e-5
  config.train.compute_dtype = "bfloat16"
  config.sampler.max_new_tokens = 256
  config.sampler.stop_tokens = (1, 106)  # <eos>, <end_of_turn>
  config.mesh.fsdp = -1
  config.mesh.data = 1
  return config

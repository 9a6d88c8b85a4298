"""A tiny random transformers `Gemma4ForCausalLM` for the Gemma 4 cross-checks (tests/test_convert_gemma4.py,
tests/test_adapt.py), drawn as benchmarks/hf_reference.py draws a DiffusionGemma (`randomize_text`: linears
~ N(0, 1/fan_in), the router projection ~ N(0, 1), embeddings ~ N(0, 0.5^2) so the softcap of 30 is exercised,
every norm scale, router scale and `layer_scalar` ~ U(0.5, 1.5), the norms that end a branch times
`branch_scale`: deep random networks amplify float32 rounding layer after layer). Saved with `save_pretrained`
and reloaded, so the model returned is what the files define.

The features DiffusionGemma has are on (`enable_moe_block`, `attention_k_eq_v` unless told otherwise) and
those it lacks off (`hidden_size_per_layer_input=0`); keyword arguments override any config field.
"""

import numpy as np
import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from benchmarks import hf_reference

TINY = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            global_head_dim=16, num_global_key_value_heads=1, sliding_window=4, intermediate_size=16,
            moe_intermediate_size=8, num_experts=3, top_k_experts=2, final_logit_softcapping=30.0,
            enable_moe_block=True, attention_k_eq_v=True, hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=64)


def make_tiny_gemma4(path, *, seed=0, num_hidden_layers=3, layer_types=None, branch_scale=1.0, head="tied",
                     dtype=torch.float32, max_shard_size="50GB", **overrides):
  """Build, randomise, save to `path` (in `dtype`) and reload (float32, eager attention) a tiny Gemma4ForCausalLM.

  head: 'tied' (the embedding, not saved), 'copy' (untied, saved, equal to the embedding) or 'own' (untied and
  drawn apart: an output head DiffusionGemma lacks).
  """
  layer_types = list(layer_types or hf_reference.released_layer_types(num_hidden_layers))
  config = Gemma4TextConfig(**{**TINY, "num_hidden_layers": num_hidden_layers, "layer_types": layer_types,
                               "tie_word_embeddings": head == "tied", **overrides})
  torch.manual_seed(seed)
  model = Gemma4ForCausalLM(config).float().eval()
  hf_reference.randomize_text(model.named_parameters(), model.named_buffers(), seed, branch_scale)
  if head == "copy":
    with torch.no_grad():
      model.lm_head.weight.copy_(model.model.embed_tokens.weight)
  model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
  return load(path)


def load(path):
  return Gemma4ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def logits(model, tokens):
  """Next-token logits [B, L, V] (float32 numpy) of int tokens [B, L]."""
  return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.to(torch.float32).numpy()

"""Useful FLOPs of the model's passes, counted from its shapes (2 per multiply-add, the chosen experts only, no
padding, no rematerialisation): the denoiser, the encoder, a generation and a train step. The loop's
`perf/model_tflops_per_step` and MFU, and the benchmarks' throughput, are these counts over measured time."""

from __future__ import annotations

from diffusiongemma.model.config import ModelConfig


def _layer_flops(cfg: ModelConfig, layer: int, keys: float) -> float:
  """Useful FLOPs of one position through layer `layer` attending to `keys` keys (2 per multiply-add): the
  projections, attention (q k^T and p v), the dense MLP, the router and the chosen experts only."""
  d = cfg.hidden_size
  kv_heads, head_dim = cfg.layer_dims(layer)
  shares = cfg.layer_types[layer] == "full" and cfg.full_k_eq_v
  macs = d * cfg.num_heads * head_dim * 2 + d * kv_heads * head_dim * (1 if shares else 2)
  macs += 2 * cfg.num_heads * head_dim * keys
  macs += 3 * d * cfg.intermediate_size + d * cfg.num_experts + cfg.top_k * 3 * d * cfg.moe_intermediate_size
  return 2.0 * macs


def _keys(cfg: ModelConfig, layer: int, cache_length: float, extra: float) -> float:
  """Keys a position sees in `layer`: the cache (a sliding layer: its last W - 1 positions) plus `extra`."""
  full = cfg.layer_types[layer] == "full"
  return (cache_length if full else min(cache_length, cfg.sliding_window - 1)) + extra


def denoiser_flops(cfg: ModelConfig, batch_size: int, cache_length: int, self_conditioning: bool = True) -> float:
  """Useful FLOPs of one denoiser pass over a canvas after `cache_length` cached positions, counted from
  the model's shapes (2 per multiply-add): every projection, the chosen experts only (top-k), attention over
  the keys each layer sees (sliding: the last W - 1 cached ones; full: all) plus the canvas, the
  self-conditioning MLP, and the vocabulary head's two matmuls (the LM head and the soft embedding
  softmax(l / T) @ E); without `self_conditioning` (a first pass, or training's pass 1) the LM head alone.
  Padding, masked keys and unused expert tiles are not counted."""
  d, c = cfg.hidden_size, cfg.canvas_length
  per_token = 2.0 * (3 * d * cfg.intermediate_size + 2 * cfg.vocab_size * d) if self_conditioning else (
      2.0 * cfg.vocab_size * d)
  per_token += sum(_layer_flops(cfg, i, _keys(cfg, i, cache_length, c)) for i in range(cfg.num_layers))
  return per_token * batch_size * c


def encoder_flops(cfg: ModelConfig, batch_size: int, length: int, cache_length: int = 0) -> float:
  """Useful FLOPs of the causal encoder over `length` tokens after `cache_length` cached ones, its LM head
  on every token included (as training's AR loss and a decoding step compute it): position i sees the
  cache and positions 0..i, a sliding layer at most W of them."""
  flops = 2.0 * cfg.vocab_size * cfg.hidden_size * length
  for layer in range(cfg.num_layers):
    full = cfg.layer_types[layer] == "full"
    keys = sum(cache_length + i + 1 if full else min(cache_length + i + 1, cfg.sliding_window)
               for i in range(length))
    # A layer's FLOPs are affine in the keys: `length` positions' fixed part, then every key once.
    flops += (length - 1) * _layer_flops(cfg, layer, 0) + _layer_flops(cfg, layer, keys)
  return flops * batch_size


def generation_flops(cfg: ModelConfig, batch_size: int, prompt_length: int, canvas_passes) -> float:
  """Useful FLOPs of one block-diffusion generation: the prompt encoded, then for canvas j its passes (the
  row's most, as a batch runs them; the first without a self-conditioning signal) after the prompt and j
  canvases, and every canvas but the last committed (encoded)."""
  c, flops = cfg.canvas_length, encoder_flops(cfg, batch_size, prompt_length)
  for j, passes in enumerate(canvas_passes):
    cache = prompt_length + j * c
    if passes:
      flops += (denoiser_flops(cfg, batch_size, cache, self_conditioning=False)
                + (passes - 1) * denoiser_flops(cfg, batch_size, cache))
    if j < len(canvas_passes) - 1:
      flops += encoder_flops(cfg, batch_size, c, cache)
  return flops


def train_step_flops(cfg: ModelConfig, batch_size: int, prompt_length: int, num_canvases: int,
                     self_conditioning: bool = True, all_canvases: bool = False) -> float:
  """Useful FLOPs of one train step of `diffusion.loss` (one canvas per row, the mean over which canvas; with
  `all_canvases`, every canvas):
  forward and backward (3x forward) of the encoder over the whole sequence and of the denoiser's graded
  pass, plus the forward alone of the self-conditioning pass whose gradient is stopped. Rematerialisation's
  recomputation is not useful work (the convention of MFU); the optimizer's update is left out (per
  parameter, a few FLOPs)."""
  c = cfg.canvas_length
  encoder = encoder_flops(cfg, batch_size, prompt_length + num_canvases * c)
  graded = first = 0.0
  share = 1.0 if all_canvases else 1.0 / num_canvases
  for j in range(num_canvases):
    cache = prompt_length + j * c
    graded += denoiser_flops(cfg, batch_size, cache, self_conditioning=self_conditioning) * share
    first += denoiser_flops(cfg, batch_size, cache, self_conditioning=False) * share
  return 3.0 * (encoder + graded) + (first if self_conditioning else 0.0)

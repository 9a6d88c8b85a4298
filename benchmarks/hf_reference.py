"""Reference outputs from the Hugging Face transformers DiffusionGemma (torch, float32, CPU).

Shared by the tests' cross-checks and `benchmarks.vs_transformers` (it contains no test). `make_tiny_hf`
builds and saves a tiny random `DiffusionGemmaForBlockDiffusion`; the other helpers run it the way
`generate` does and return numpy (`generate` moves its inputs to the model's device: a CUDA model works).

Images (tests/test_vision.py): `make_tiny_hf(..., vision_config={...}, image_token_ids=(image, boi, eoi),
use_bidirectional_attention="vision")` gives a tiny vision tower whose weights are re-drawn too (a
separate seeded generator, so the text weights are those of the same call without it);
`encoder_logits` / `decoder_logits` take `pixel_values` and `image_position_ids` and encode the prompt
as `generate` does on its first canvas: masks from `create_masks_for_generate` with the processor's
`mm_token_type_ids` (1 on image tokens), then the encoder with the images. `image_features` is
`get_image_features(...).pooler_output` (the valid soft tokens of all images, concatenated).

Weights. Every text parameter is re-drawn from a seeded generator (projections ~ N(0, 1/fan_in), router
projection ~ N(0, 1) so top-k choices are not near-ties, embeddings ~ N(0, 0.5^2) so the 30*tanh(z/30)
softcap is exercised), and everything that would otherwise be constant -- all RMSNorm scales, router
`scale`/`per_expert_scale`, self-conditioning `pre_norm`, and the encoder AND decoder `layer_scalar`
buffers (drawn independently) -- becomes U(0.5, 1.5). The model is then saved and *reloaded* with
`from_pretrained`, so the returned model is exactly what the files on disk define (it has been checked to
give the same outputs as the in-memory model, i.e. nothing perturbed is lost on save).

What the checkpoint holds (checked on transformers 5.24.0):
  * The encoder's text weights are tied to the decoder's (`DiffusionGemmaModel._tied_weights_keys`) and
    `lm_head.weight` is tied to `model.decoder.embed_tokens.weight`; only the decoder copies are saved.
    There is no `lm_head.weight` and no `model.encoder.language_model.*` weight in the files.
  * Buffers are NOT tied: `model.encoder.language_model.layers.{i}.layer_scalar` and
    `model.decoder.layers.{i}.layer_scalar` are both saved, and they differ.
  * Also saved: the vision tower `model.encoder.vision_tower.*` and `model.encoder.embed_vision.*`.
  * Not saved (recomputed): rotary `*_inv_freq` buffers and `embed_tokens.embed_scale` (= sqrt(hidden)).
  * `final_logit_softcapping` is a class attribute (30.0) and is NOT written to config.json.

Behaviour of the reference worth knowing:
  * Attention scaling is 1.0 (q_norm/k_norm instead of 1/sqrt(d)); `v_norm` is a scale-free RMSNorm.
    Full-attention layers have no `v_proj`: values are the raw k_proj output (before k_norm/rope), then
    v_norm ("k_eq_v"). They use `per_layer_config` head_dim / num_key_value_heads.
  * Full layers use "proportional" rope: with head_dim D and factor p, the first int(p*D/2) frequencies
    are theta^(-2j/D) (denominator D, not the rotated dim) and the rest are 0; rotate_half pairs
    (j, j + D/2). Sliding layers use default rope over their own head_dim.
  * Encoder: causal; sliding layers see the current token and the W-1 previous ones. The DynamicCache's
    sliding layers keep only the last W-1 prompt positions; full layers keep all of them.
  * Decoder: NO mask at all (unpadded prompt) -- each canvas token attends to every cached key (so
    the last W-1 prompt tokens in sliding layers, the whole prompt in full layers) plus the whole canvas,
    even in sliding layers and even when the canvas is longer than W. Canvas positions are
    prompt_len + arange(C). The cache is read, never written.
  * Self-conditioning: soft = softmax(sc_logits) @ E * sqrt(hidden), zeroed per example where
    self_conditioning_mask is False (same as passing no logits for it); input embedding becomes
    post_norm(embed + down(gelu(gate(n)) * up(n))) with n = pre_norm(soft) and post_norm scale-free.
    With no logits the MLP of zeros is 0, so post_norm(embed) is still applied. In `generate` the logits
    fed back are the temperature-scaled ones and no mask is passed.

Checkpoint keys and shapes of the default tiny model (H=48, V=97, 4 layers: S S F F):
  model.decoder.embed_tokens.weight (97, 48)         model.decoder.norm.weight (48,)
  model.decoder.self_conditioning.{gate,up}_proj.weight (40, 48)
  model.decoder.self_conditioning.down_proj.weight (48, 40)
  model.decoder.self_conditioning.pre_norm.weight (48,)
  model.encoder.language_model.layers.{0..3}.layer_scalar (1,)
  model.encoder.embed_vision.embedding_projection.weight (48, 16)   model.encoder.vision_tower.* (unused)
  per layer i, prefix model.decoder.layers.{i}.  [sliding i=0 | full i=2]:
    self_attn.q_proj.weight (48, 48) | (64, 48)      self_attn.k_proj.weight (24, 48) | (16, 48)
    self_attn.v_proj.weight (24, 48) | absent        self_attn.o_proj.weight (48, 48) | (48, 64)
    self_attn.q_norm.weight, self_attn.k_norm.weight (12,) | (16,)
    layer_scalar (1,)
    input_layernorm / post_attention_layernorm / pre_feedforward_layernorm / post_feedforward_layernorm /
    post_feedforward_layernorm_1 / post_feedforward_layernorm_2 / pre_feedforward_layernorm_2 .weight (48,)
    mlp.gate_proj.weight, mlp.up_proj.weight (40, 48)   mlp.down_proj.weight (48, 40)
    router.proj.weight (5, 48)   router.scale (48,)   router.per_expert_scale (5,)
    experts.gate_up_proj (5, 48, 48) = [E, 2*moe_inter (gate rows, then up rows), H]
    experts.down_proj (5, 48, 24) = [E, H, moe_inter]

config.json "text_config" fields that matter (default tiny model):
  hidden_size 48, num_hidden_layers 4, num_attention_heads 4, num_key_value_heads 2, head_dim 12,
  intermediate_size 40, moe_intermediate_size 24, num_experts 5, top_k_experts 2, vocab_size 97,
  sliding_window 5, rms_norm_eps 1e-06, hidden_activation "gelu_pytorch_tanh", tie_word_embeddings true,
  use_bidirectional_attention null, pad/eos/bos 0/1/2,
  layer_types ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
  per_layer_config {"2": {"head_dim": 16, "num_key_value_heads": 1}, "3": {...same}}  (full layers only;
    `global_head_dim`/`num_global_key_value_heads` are consumed into it and not stored),
  rope_parameters {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
    "rope_theta": 1e6}, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}.
  No attention_k_eq_v field (k_eq_v is implied for full layers); no final_logit_softcapping (30.0).
  Top level: canvas_length 8, tie_word_embeddings true.
"""

import math

import numpy as np
import torch
from transformers import (
    DiffusionGemmaConfig,
    DiffusionGemmaForBlockDiffusion,
    DiffusionGemmaTextConfig,
    Gemma4VisionConfig,
)
from transformers.cache_utils import DynamicCache
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig


def default_layer_types(num_hidden_layers):
    """Every third layer full attention, the last one always full: S S F S S F ... F."""
    types = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_hidden_layers)]
    types[-1] = "full_attention"
    return types


def released_layer_types(num_hidden_layers):
    """The released model's pattern: five sliding layers then one full, repeated; the last one full."""
    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(num_hidden_layers)]
    types[-1] = "full_attention"
    return types


@torch.no_grad()
def _randomize(model, seed, branch_scale=1.0):
    # The decoder owns every text parameter; the encoder's and lm_head are tied to these tensors.
    randomize_text(model.model.decoder.named_parameters(), model.model.named_buffers(), seed, branch_scale)


@torch.no_grad()
def randomize_text(parameters, buffers, seed, branch_scale=1.0):
    """Seeded re-draw of text weights, given as (name, tensor) pairs (a DiffusionGemma's or a Gemma 4's);
    constants (norms, scales, `layer_scalar` buffers) become U(0.5, 1.5), the norms that end the attention and
    feed-forward branches then times `branch_scale`."""
    g = torch.Generator().manual_seed(seed)
    for name, p in parameters:
        if name.endswith("embed_tokens.weight"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        elif p.ndim == 1:  # RMSNorm weights, router.scale, router.per_expert_scale
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
            if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                p.mul_(branch_scale)
        elif name.endswith("router.proj.weight"):
            p.copy_(torch.randn(p.shape, generator=g))
        else:  # nn.Linear [out, in] and experts [E, out, in]
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    for name, b in buffers:
        if name.endswith("layer_scalar"):  # encoder and decoder each get their own draw
            b.copy_(0.5 + torch.rand(b.shape, generator=g))


@torch.no_grad()
def _randomize_vision(model, seed):
    """Seeded re-draw of the vision tower and its projection: linears ~ N(0, 1/fan_in), the position table
    ~ N(0, 1), norm scales and `std_scale` ~ U(0.5, 1.5), `std_bias` ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed + 1_000)
    encoder = model.model.encoder
    tensors = [*encoder.vision_tower.named_parameters(), *encoder.embed_vision.named_parameters(),
               *((n, b) for n, b in encoder.vision_tower.named_buffers() if n.startswith("std_"))]
    for name, p in tensors:
        if name.endswith("position_embedding_table") or name == "std_bias":
            p.copy_(torch.randn(p.shape, generator=g))
        elif p.ndim == 1:
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def make_tiny_hf(
    path,
    *,
    seed=0,
    hidden_size=48,
    num_hidden_layers=4,
    layer_types=None,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    global_head_dim=16,
    num_global_key_value_heads=1,
    sliding_window=5,
    intermediate_size=40,
    moe_intermediate_size=24,
    num_experts=5,
    top_k_experts=2,
    vocab_size=97,
    canvas_length=8,
    max_shards=None,
    attn_implementation="eager",
    vision_config=None,
    image_token_ids=None,
    use_bidirectional_attention=None,
    branch_scale=1.0,
):
    """Build, randomize, save to `path` and reload a tiny DiffusionGemmaForBlockDiffusion (float32, eval).

    `max_shards`: if given, the checkpoint is split into at most that many (for the default sizes, exactly
    that many for 2..5) `model-0000k-of-0000n.safetensors` files plus an index. `attn_implementation` of
    the returned model: "eager" (plain math) or "sdpa" (same within ~2e-5). Returns the reloaded model.
    `vision_config` (Gemma4VisionConfig fields): a real tiny vision tower, randomized as well (default: the
    untouched placeholder); `image_token_ids`: (image, begin, end) ids inside the vocabulary;
    `use_bidirectional_attention`: the text config's (None or "vision"). `branch_scale` < 1 shrinks what
    each layer adds to the residual stream: a random network amplifies float32 rounding layer after layer
    (~1.3x per layer at width 16), so deep models (12-30 layers) need it for a 1e-4 comparison.
    """
    text_config = DiffusionGemmaTextConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        layer_types=list(layer_types or default_layer_types(num_hidden_layers)),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        num_global_key_value_heads=num_global_key_value_heads,
        sliding_window=sliding_window,
        intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        top_k_experts=top_k_experts,
        vocab_size=vocab_size,
        use_bidirectional_attention=use_bidirectional_attention,
    )
    placeholder = dict(
        hidden_size=16,
        num_hidden_layers=1,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        position_embedding_size=32,  # the default (10240) would dominate the checkpoint size
    )
    vision = Gemma4VisionConfig(**(placeholder if vision_config is None else vision_config))
    ids = {}
    if image_token_ids is not None:
        ids = dict(zip(("image_token_id", "boi_token_id", "eoi_token_id"), image_token_ids))
    config = DiffusionGemmaConfig(text_config=text_config, vision_config=vision, canvas_length=canvas_length, **ids)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).float().eval()
    _randomize(model, seed, branch_scale)
    if vision_config is not None:
        _randomize_vision(model, seed)

    shard_size = "50GB"
    if max_shards:
        sizes = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}  # tied: once
        # Greedy packing only closes a shard holding > shard_size - largest tensor: <= max_shards shards.
        shard_size = sum(sizes.values()) // max_shards + max(sizes.values())
    model.save_pretrained(path, max_shard_size=shard_size)
    return load_hf(path, attn_implementation=attn_implementation)


def load_hf(path, attn_implementation="eager"):
    """Load a saved checkpoint as a float32 eval model."""
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def _long(x):
    return torch.as_tensor(np.asarray(x), dtype=torch.long)


def _logits(model, hidden):
    """lm_head + final softcap, exactly as DiffusionGemmaForBlockDiffusion.forward does."""
    logits = model.lm_head(hidden).to(torch.float32)
    cap = model.final_logit_softcapping
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _images(pixel_values, image_position_ids):
    if pixel_values is None:
        return {}
    return dict(pixel_values=torch.as_tensor(np.asarray(pixel_values), dtype=torch.float32),
                image_position_ids=_long(image_position_ids))


def _encode(model, input_ids, pixel_values=None, image_position_ids=None):
    """Prefill the prompt like `generate` (step 1.a): fresh DynamicCache, 4D masks built up front (with the
    processor's `mm_token_type_ids` when there are images)."""
    batch, length = input_ids.shape
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    position_ids = torch.arange(length).unsqueeze(0)
    images = _images(pixel_values, image_position_ids)
    mm_token_type_ids = (input_ids == model.config.image_token_id).long() if images else None
    mask_mapping = model.model.encoder.create_masks_for_generate(
        config=model.config,
        inputs_embeds=torch.empty((batch, length, 0), dtype=model.dtype),
        attention_mask=torch.ones((batch, length), dtype=torch.bool),
        cache=cache,
        position_ids=position_ids,
        mm_token_type_ids=mm_token_type_ids,
    )
    out = model.model.encoder(
        input_ids=input_ids, attention_mask=mask_mapping, cache=cache, position_ids=position_ids, **images
    )
    return out.last_hidden_state, out.cache


@torch.no_grad()
def image_features(model, pixel_values, image_position_ids):
    """The valid soft tokens of all images in the text embedding space [sum of soft tokens, D] float32."""
    out = model.model.encoder.get_image_features(**_images(pixel_values, image_position_ids))
    return out.pooler_output.numpy()


@torch.no_grad()
def encoder_logits(model, tokens, pixel_values=None, image_position_ids=None):
    """Causal encoder over int tokens [B, L] -> softcapped tied-lm_head logits [B, L, V] float32."""
    hidden, _ = _encode(model, _long(tokens), pixel_values, image_position_ids)
    return _logits(model, hidden).numpy()


@torch.no_grad()
def decoder_logits(
    model,
    prompt,
    canvas,
    self_conditioning_logits=None,
    self_conditioning_mask=None,
    pixel_values=None,
    image_position_ids=None,
):
    """Encode `prompt` [B, L] (with its images, if any) into the KV cache, then one denoiser pass over `canvas`.

    Optional `self_conditioning_logits` [B, C, V] float and `self_conditioning_mask` [B] bool.
    Returns the final (softcapped) logits [B, C, V] float32, as in one `generate` denoising step.
    """
    prompt, canvas = _long(prompt), _long(canvas)
    _, cache = _encode(model, prompt, pixel_values, image_position_ids)
    length = prompt.shape[1]
    mask_mapping = model.model.decoder.create_diffusion_decoder_attention_mask(
        config=model.config,
        inputs_embeds=canvas.unsqueeze(-1),
        cache=cache,
        decoder_attention_mask=torch.ones((canvas.shape[0], length + canvas.shape[1]), dtype=torch.bool),
    )
    if self_conditioning_logits is not None:
        self_conditioning_logits = torch.as_tensor(np.asarray(self_conditioning_logits), dtype=torch.float32)
    if self_conditioning_mask is not None:
        self_conditioning_mask = torch.as_tensor(np.asarray(self_conditioning_mask), dtype=torch.bool)
    out = model(
        decoder_input_ids=canvas,
        cache=cache,
        self_conditioning_logits=self_conditioning_logits,
        self_conditioning_mask=self_conditioning_mask,
        decoder_attention_mask=mask_mapping,
        decoder_position_ids=torch.arange(length, length + canvas.shape[1]).unsqueeze(0),
    )
    return out.logits.to(torch.float32).numpy()


@torch.no_grad()
def generate(model, prompt, decoder_input_ids=None, *, seed=0, entropy_bound=None, **kwargs):
    """Thin wrapper over `model.generate` -> (sequences [B, L + n*C] int64, tokens_per_forward [B] float).

    `decoder_input_ids` [B, C] replaces the random initial canvas of the FIRST block only. Other kwargs:
    max_new_tokens (256), max_denoising_steps (48), t_min (0.4), t_max (0.8), stability_threshold (1),
    confidence_threshold (0.005), eos_token_id / pad_token_id (unset in the tiny checkpoint), or
    `entropy_bound` (0.1; wrapped into `sampler_config`). Sampling draws from torch's global RNG, seeded here.
    """
    torch.manual_seed(seed)
    if entropy_bound is not None:
        kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=float(entropy_bound))
    if decoder_input_ids is not None:
        kwargs["decoder_input_ids"] = _long(decoder_input_ids).to(model.device)
    out = model.generate(_long(prompt).to(model.device), **kwargs)
    return out.sequences.cpu().numpy(), out.tokens_per_forward.cpu().numpy()

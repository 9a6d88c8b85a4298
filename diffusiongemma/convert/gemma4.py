"""Gemma 4 causal LMs read as the DiffusionGemma whose causal encoder they are, and that encoder written back.

transformers' DiffusionGemma text model is Gemma 4's (`Gemma4TextConfig`) with the MoE block on in every
layer, keys equal to values in full attention, no per-layer input embeddings and no KV sharing; its causal
encoder, on the denoiser's weights, is then exactly a `Gemma4ForCausalLM`. So a Gemma 4 folder loads by
renaming tensors (`rename`): the text model's `model.X` (`Gemma4ForCausalLM`, model_type 'gemma4_text') or
`model.language_model.X` (the text part of `Gemma4ForConditionalGeneration`, 'gemma4') is DiffusionGemma's
`model.decoder.X` / `model.encoder.language_model.X`; its vision tower (the same block: `model.vision_tower.*`,
`model.embed_vision.*`) is `model.encoder.vision_tower.*` / `model.encoder.embed_vision.*`; `lm_head.weight` is
the embedding (tied) or refused (`hf._check_head`).

What Gemma 4 lacks is decided here, as a fresh start for block-diffusion training:
- settings: the canvas is the released model's 256 tokens (a ModelConfig default), the noise the released
  uniform noise (the training config's `config.diffusion.noise` decides it anyway);
- the denoiser's layer scalars are the encoder's (`layer_scalar`, read twice): the denoiser starts as the same
  network attending both ways;
- self-conditioning (`fresh_self_conditioning`): the model's own initialisation (seed 0) with the output
  projection zero, so it adds exactly nothing until training teaches it what to add (gradients reach that
  projection at once, the others once it moves), and the first denoiser passes are not disturbed by noise.
Writing a DiffusionGemma as Gemma 4 (`config_to_hf`, `hf.save_hf(architecture=...)`) keeps the encoder: the
denoiser's own scalars and self-conditioning are left behind.

What DiffusionGemma lacks is refused by name (`check`): per-layer input embeddings, KV sharing (and the
double-wide MLP of shared layers), layers without the MoE block, attention biases, another activation, text
attending both ways, and audio; and, with a vision encoder, image tokens attending both ways
(`use_bidirectional_attention='vision'`, `check_vision`): Gemma 4 does it in its sliding-window layers only,
DiffusionGemma in every layer, so the same weights give other logits with images (the text model alone,
`load_hf(..., vision=None)`, is exact; writing such a DiffusionGemma as Gemma 4 is refused the same way). A separate V projection in full attention (`attention_k_eq_v` false) is kept:
`ModelConfig.full_k_eq_v=False` runs it exactly (such a model cannot be written as a transformers
DiffusionGemma, which fixes k = v; it can be written back as Gemma 4).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from diffusiongemma import _files
from diffusiongemma.convert import vision as _vision
from diffusiongemma.convert.layout import DECODER, ENCODER, _Entry
from diffusiongemma.model.config import ModelConfig
from diffusiongemma.model.transformer import SelfConditioning

# model_type -> the prefix of the text model's tensors.
MODEL_TYPES = {"gemma4_text": "model.", "gemma4": "model.language_model."}
# architecture -> model_type, for writing.
ARCHITECTURES = {"Gemma4ForCausalLM": "gemma4_text", "Gemma4ForConditionalGeneration": "gemma4"}
_VISION = ((_vision.TOWER, "model.vision_tower."), (_vision.EMBED, "model.embed_vision."))
VISION_PREFIXES = tuple(theirs for _, theirs in _VISION)
_SELF_CONDITIONING = "self_conditioning"


def model_type(hf_config: Any) -> str | None:
  """The Gemma 4 model_type of a config.json's dict, or None (a DiffusionGemma, or not a dict)."""
  kind = hf_config.get("model_type") if isinstance(hf_config, dict) else None
  return kind if kind in MODEL_TYPES else None


def check(top: _files.Fields, text: _files.Fields) -> None:
  """Refuses a Gemma 4 config (`top`, its text part `text`) with a feature DiffusionGemma lacks, naming every
  such config.json field at once: loading it anyway would drop that feature and change the model."""
  problems = []

  def refuse(fields: _files.Fields, name: str, value, what: str):
    problems.append(f"{fields.prefix}{name}={value!r} ({what})")

  per_layer = text.integer("hidden_size_per_layer_input", 256, minimum=0)  # transformers' default: 256
  if per_layer:
    refuse(text, "hidden_size_per_layer_input", per_layer, "per-layer input embeddings; DiffusionGemma has none: 0")
  shared = text.integer("num_kv_shared_layers", 0, minimum=0)
  if shared:
    refuse(text, "num_kv_shared_layers", shared, "layers reusing another layer's keys and values; DiffusionGemma: 0")
    if text.boolean("use_double_wide_mlp", False):  # widens the MLP of the shared layers only
      refuse(text, "use_double_wide_mlp", True, "a double-wide MLP in the KV-shared layers")
  if not text.boolean("enable_moe_block", False):
    refuse(text, "enable_moe_block", text.get("enable_moe_block", False),
           "layers without the expert block; every DiffusionGemma layer has it: true")
  if text.boolean("attention_bias", False):
    refuse(text, "attention_bias", True, "biases in the attention projections; DiffusionGemma has none")
  activation = text.string("hidden_activation", "gelu_pytorch_tanh")
  if activation != "gelu_pytorch_tanh":
    refuse(text, "hidden_activation", activation, "DiffusionGemma's feed-forward layers use gelu_pytorch_tanh")
  bidirectional = text.get("use_bidirectional_attention", None)
  if bidirectional not in (None, "vision"):
    refuse(text, "use_bidirectional_attention", bidirectional, "the encoder is causal; supported: null, 'vision'")
  if top.get("audio_config", None) is not None:
    problems.append(f"{top.prefix}audio_config (an audio encoder, which DiffusionGemma lacks)")
  if problems:
    raise _files.BadFileError(f"{top.source}: this Gemma 4 has what DiffusionGemma lacks, so it cannot be loaded "
                              f"without dropping it: {'; '.join(problems)}.")


_BIDIRECTIONAL_VISION = ("Gemma 4 lets an image's soft tokens attend to each other both ways in its sliding-window "
                         "layers only, within the window; DiffusionGemma in every layer")


def check_vision(top: _files.Fields, text: _files.Fields, vision) -> None:
  """Refuses a Gemma 4 whose vision encoder would load (`vision`, a VisionConfig or None) with
  `use_bidirectional_attention='vision'`: transformers' Gemma 4 and DiffusionGemma mean different masks by it
  (`_BIDIRECTIONAL_VISION`), so the images' logits would change. Text alone loads exactly (`vision=None`)."""
  if vision is not None and vision.bidirectional_attention:
    raise _files.BadFileError(
        f"{top.source}: this Gemma 4 has what DiffusionGemma lacks, so it cannot be loaded without changing it: "
        f"{text.prefix}use_bidirectional_attention='vision' ({_BIDIRECTIONAL_VISION}). Load its text model "
        "alone with vision=None (exact without images).")


def rename(key: str, kind: str) -> str | None:
  """The Gemma 4 (`kind`: a model_type) name of a DiffusionGemma checkpoint key; None for the denoiser's
  self-conditioning, which Gemma 4 lacks. Keys of neither model (e.g. `lm_head.weight`) are kept."""
  for ours, theirs in ((DECODER, MODEL_TYPES[kind]), (ENCODER, MODEL_TYPES[kind])) + _VISION:
    if key.startswith(ours):
      rest = key[len(ours):]
      return None if rest.startswith(_SELF_CONDITIONING + ".") else theirs + rest
  return key


def layout(entries: Iterable[_Entry], kind: str) -> Iterator[_Entry]:
  """DiffusionGemma's parameter table with Gemma 4's names: the encoder's and the decoder's copy of a weight
  (and of each layer scalar) read the same tensor; self-conditioning entries have no key (made here)."""
  for entry in entries:
    keys = tuple(dict.fromkeys(k for k in (rename(k, kind) for k in entry.keys) if k is not None))
    yield _Entry(entry.path, keys, entry.to_ours, entry.to_hf)


def denoiser_only(path: tuple[str, ...]) -> bool:
  """Whether a parameter belongs to the denoiser alone (left out of a Gemma 4 export)."""
  return path[0] == _SELF_CONDITIONING or path[-1] == "decoder_scalar"


def fresh_self_conditioning(cfg: ModelConfig) -> dict[str, Any]:
  """`{'self_conditioning': ...}` for a model made from Gemma 4: the module's own initialisation (seed 0,
  float32) with its output projection `mlp/linear` zero, so that it adds nothing yet (see the module doc)."""
  module = SelfConditioning(cfg.replace(quantize="none", param_dtype="float32"))
  x = jnp.zeros((1, 1, cfg.hidden_size), jnp.float32)
  params = jax.jit(lambda key: nn.unbox(module.init(key, x, None)))(jax.random.key(0))["params"]
  params = jax.tree.map(np.asarray, traverse_util.flatten_dict(params))
  params[("mlp", "linear")] = np.zeros_like(params[("mlp", "linear")])
  return {_SELF_CONDITIONING: traverse_util.unflatten_dict(params)}


def config_to_hf(cfg: ModelConfig, text: dict[str, Any], architecture: str) -> dict[str, Any]:
  """The config.json of `cfg`'s encoder as `architecture` (a key of `ARCHITECTURES`); `text` holds the text
  fields Gemma 4 shares with DiffusionGemma (`hf._text_config`)."""
  kind = ARCHITECTURES[architecture]
  text = dict(text, model_type="gemma4_text", attention_k_eq_v=cfg.full_k_eq_v, enable_moe_block=True,
              hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
              attention_bias=False, final_logit_softcapping=cfg.final_logit_softcap,
              vocab_size_per_layer_input=cfg.vocab_size)
  if kind == "gemma4_text":
    if cfg.vision is not None:
      raise ValueError("This model has a vision encoder, which Gemma4ForCausalLM cannot hold: write it with "
                       "architecture='Gemma4ForConditionalGeneration' to keep it.")
    return dict(text, architectures=[architecture])
  if cfg.vision is not None and cfg.vision.bidirectional_attention:
    raise ValueError(f"This model's vision has bidirectional_attention=True, which Gemma 4 cannot hold "
                     f"({_BIDIRECTIONAL_VISION}): write it as Gemma4ForCausalLM without "
                     "its vision encoder (cfg.replace(vision=None)), or as a DiffusionGemma.")
  return dict(architectures=[architecture], model_type=kind, text_config=text, tie_word_embeddings=True,
              vision_config=None if cfg.vision is None else _vision.config_to_hf(cfg.vision), audio_config=None,
              image_token_id=cfg.image_id, boi_token_id=cfg.begin_image_id, eoi_token_id=cfg.end_image_id)

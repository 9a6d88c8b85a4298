"""The Gemma 4 vision encoder in transformers DiffusionGemma checkpoints: config and parameter layout.

`hf.py` calls these when a model has a vision encoder (`ModelConfig.vision`): `config_from_hf` /
`config_to_hf` for `vision_config` (plus the image token ids and the text config's
`use_bidirectional_attention`), and `layout` for the tensors `model.encoder.vision_tower.*` and
`model.encoder.embed_vision.*`, in the same `_Entry` form as the text model, so loading stays streamed
tensor by tensor. The `std_bias` / `std_scale` buffers of a standardising tower are parameters here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from absl import logging

from diffusiongemma import _files
from diffusiongemma.convert.layout import _Entry, _identity, _linear, _mlp, _output_projection
from diffusiongemma.model.config import VisionConfig

TOWER = "model.encoder.vision_tower."
EMBED = "model.encoder.embed_vision."
PREFIXES = (TOWER, EMBED)
_NORMS = (("pre_attention_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
          ("pre_ffw_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"))
# (transformers field, required value): what our vision encoder implements.
_FIXED = (("hidden_activation", "gelu_pytorch_tanh"), ("use_clipped_linears", False), ("attention_bias", False))


def layout(vision: VisionConfig) -> Iterator[_Entry]:
  """Our vision parameter paths (under `vision_tower` and `embed_vision`) and their checkpoint keys."""
  tower = ("vision_tower",)
  linear = _linear()
  yield _Entry(tower + ("patch_embedder", "input_proj"), (TOWER + "patch_embedder.input_proj.weight",),
               *linear)
  yield _Entry(tower + ("patch_embedder", "position_embedding_table"),
               (TOWER + "patch_embedder.position_embedding_table",), _identity, _identity)
  for i in range(vision.num_layers):
    prefix = f"{TOWER}encoder.layers.{i}."
    ours = tower + (f"layer_{i}",)
    attn = ours + ("attn",)
    for name, heads in (("q", vision.num_heads), ("k", vision.num_kv_heads), ("v", vision.num_kv_heads)):
      yield _Entry(attn + (f"{name}_einsum",), (f"{prefix}self_attn.{name}_proj.linear.weight",),
                   *_linear(heads))
    yield _Entry(attn + ("attn_vec_einsum",), (f"{prefix}self_attn.o_proj.linear.weight",),
                 *_output_projection(vision.num_heads))
    for ours_norm, hf_norm in (("_query_norm", "self_attn.q_norm"), ("_key_norm", "self_attn.k_norm")):
      yield _Entry(attn + (ours_norm, "scale"), (f"{prefix}{hf_norm}.weight",), _identity, _identity)
    for ours_norm, hf_norm in _NORMS:
      yield _Entry(ours + (ours_norm, "scale"), (f"{prefix}{hf_norm}.weight",), _identity, _identity)
    # transformers' vision linears sit in a ClippableLinear: `mlp.gate_proj.linear.weight`.
    yield from _mlp(ours + ("mlp",), lambda name: (prefix + "mlp." + name.replace(".weight", ".linear.weight"),))
  if vision.standardize:
    for name in ("std_bias", "std_scale"):
      yield _Entry(tower + (name,), (TOWER + name,), _identity, _identity)
  yield _Entry(("embed_vision", "embedding_projection"), (EMBED + "embedding_projection.weight",), *linear)


def config_from_hf(hf_config: _files.Fields, vocab_size: int) -> dict[str, Any]:
  """ModelConfig fields for the vision encoder of a transformers config.json (its `Fields`, so that an error
  names the file and the field): `vision` and the image token ids. `vision` is None (text only, with a log
  line) when there is no `vision_config`, or when the image tokens lie outside the vocabulary (e.g. a tiny
  test model whose vision tower is a placeholder)."""
  token_id = lambda name, default: hf_config.integer(name, default, minimum=0)
  ids = dict(image_id=token_id("image_token_id", 258_880), begin_image_id=token_id("boi_token_id", 255_999),
             end_image_id=token_id("eoi_token_id", 258_882))
  if not hf_config.get("vision_config", None):
    return dict(vision=None, **ids)
  values = hf_config.mapping("vision_config")
  outside = {k: v for k, v in ids.items() if not 0 <= v < vocab_size}
  if outside:
    logging.info("config.json has a vision_config, but image tokens %s lie outside the vocabulary (%d): "
                 "loading the text model only.", outside, vocab_size)
    return dict(vision=None, **ids)
  for field, want in _FIXED:
    if values.get(field, want) != want:
      raise values.error(field, f"is {values.values[field]!r}: the vision encoder implements {field}={want!r}.")
  rope = values.mapping("rope_parameters")
  if rope.string("rope_type", "axial") != "axial":
    raise rope.error("rope_type", f"is {rope.values['rope_type']!r}; supported: 'axial'.")
  text = hf_config.mapping("text_config")
  bidirectional = text.get("use_bidirectional_attention", None)
  if bidirectional not in (None, "vision"):
    raise text.error("use_bidirectional_attention", f"is {bidirectional!r}; supported: None, 'vision'.")
  heads = values.integer("num_attention_heads", 12)
  hidden = values.integer("hidden_size", 768)
  fields = dict(
      hidden_size=hidden,
      intermediate_size=values.integer("intermediate_size", 3072),
      num_layers=values.integer("num_hidden_layers", 16),
      num_heads=heads,
      num_kv_heads=values.integer("num_key_value_heads", heads),
      head_dim=values.integer("head_dim", hidden // heads),
      patch_size=values.integer("patch_size", 16),
      pooling_kernel_size=values.integer("pooling_kernel_size", 3),
      position_embedding_size=values.integer("position_embedding_size", 10_240),
      rope_theta=rope.number("rope_theta", 100.0),
      rms_norm_eps=values.number("rms_norm_eps", 1e-6),
      standardize=values.boolean("standardize", False),
      bidirectional_attention=bidirectional == "vision",
  )
  try:
    vision = VisionConfig(**fields)
  except ValueError as e:
    raise _files.BadFileError(f"{hf_config.source}: vision_config: {e}") from None
  return dict(vision=vision, **ids)


def config_to_hf(vision: VisionConfig) -> dict[str, Any]:
  """The transformers `vision_config` (a dict) of a VisionConfig."""
  return dict(
      model_type="gemma4_vision", hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
      num_hidden_layers=vision.num_layers, num_attention_heads=vision.num_heads,
      num_key_value_heads=vision.num_kv_heads, head_dim=vision.head_dim, patch_size=vision.patch_size,
      pooling_kernel_size=vision.pooling_kernel_size, position_embedding_size=vision.position_embedding_size,
      rope_parameters={"rope_type": "axial", "rope_theta": vision.rope_theta}, rms_norm_eps=vision.rms_norm_eps,
      standardize=vision.standardize, **dict(_FIXED))

"""Transformers checkpoints (config.json + safetensors) <-> `(ModelConfig, params)`: DiffusionGemma folders, and
Gemma 4 causal LMs read as the DiffusionGemma whose encoder they are (`convert/gemma4.py`).

One table, `_layout`, names every parameter of ours with its checkpoint key and the reshape between the
torch layout ([out, in] linears, fused expert weights) and ours; loading and saving both read it (a Gemma 4
folder through `gemma4.layout`, the same table under Gemma 4's names).

transformers ties the encoder's and the decoder's weights and saves them once, under `model.decoder.`;
only the encoder's `layer_scalar` buffers are stored under `model.encoder.language_model.`. For the
shared weights we accept either prefix. The Gemma 4 vision encoder (`model.encoder.vision_tower.*`,
`model.encoder.embed_vision.*`) is read and written when the config has one (`ModelConfig.vision`; its
table is in `convert/vision.py`), and skipped otherwise (e.g. `load_hf(path, vision=None)`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from absl import logging
from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from safetensors.numpy import save_file

from diffusiongemma import _files
from diffusiongemma import parallel
from diffusiongemma.convert import gemma4
from diffusiongemma.convert import shards
from diffusiongemma.convert import vision as _vision
from diffusiongemma.convert.layout import DECODER as _DECODER
from diffusiongemma.convert.layout import ENCODER as _ENCODER
from diffusiongemma.convert.layout import _Entry, _identity, _linear, _mlp, _output_projection
from diffusiongemma.model import quantize
from diffusiongemma.model import transformer
from diffusiongemma.model.config import FULL, SLIDING, ModelConfig
from diffusiongemma.model.transformer import DiffusionGemma

_LAYER_TYPES = {"sliding_attention": SLIDING, "full_attention": FULL}
_SKIPPED_PREFIXES = (_vision.TOWER, _vision.EMBED, "lm_head.") + gemma4.VISION_PREFIXES
DIFFUSION_GEMMA = "DiffusionGemmaForBlockDiffusion"
_MODEL_TYPES = (None, "diffusion_gemma", "diffusion_gemma_text")  # a DiffusionGemma's (None: not stated)


def _layout(cfg: ModelConfig) -> Iterator[_Entry]:
  shared = lambda name: (_DECODER + name, _ENCODER + name)
  yield _Entry(("embedder", "input_embedding"), shared("embed_tokens.weight"), _identity, _identity)
  yield _Entry(("final_norm", "scale"), shared("norm.weight"), _identity, _identity)
  sc = "self_conditioning."
  yield _Entry(("self_conditioning", "pre_norm", "scale"), (_DECODER + sc + "pre_norm.weight",), _identity,
               _identity)
  yield from _mlp(("self_conditioning", "mlp"), lambda name: (_DECODER + sc + name,))
  for i in range(cfg.num_layers):
    layer = f"layers.{i}."
    ours = (f"layer_{i}",)
    key = lambda name: shared(layer + name)
    heads_in, heads_out = _linear(cfg.num_heads)
    kv_in, kv_out = _linear(cfg.layer_dims(i)[0])
    attn = ours + ("attn",)
    yield _Entry(attn + ("q_einsum",), key("self_attn.q_proj.weight"), heads_in, heads_out)
    yield _Entry(attn + ("k_einsum",), key("self_attn.k_proj.weight"), kv_in, kv_out)
    if not (cfg.layer_types[i] == FULL and cfg.full_k_eq_v):
      yield _Entry(attn + ("v_einsum",), key("self_attn.v_proj.weight"), kv_in, kv_out)
    yield _Entry(attn + ("attn_vec_einsum",), key("self_attn.o_proj.weight"), *_output_projection(cfg.num_heads))
    yield _Entry(attn + ("_query_norm", "scale"), key("self_attn.q_norm.weight"), _identity, _identity)
    yield _Entry(attn + ("_key_norm", "scale"), key("self_attn.k_norm.weight"), _identity, _identity)
    for ours_norm, hf_norm in (("pre_attention_norm", "input_layernorm"),
                               ("post_attention_norm", "post_attention_layernorm"),
                               ("pre_ffw_norm", "pre_feedforward_layernorm"),
                               ("post_ffw_norm", "post_feedforward_layernorm"),
                               ("post_ffw1_norm", "post_feedforward_layernorm_1"),
                               ("pre_ffw2_norm", "pre_feedforward_layernorm_2"),
                               ("post_ffw2_norm", "post_feedforward_layernorm_2")):
      yield _Entry(ours + (ours_norm, "scale"), key(hf_norm + ".weight"), _identity, _identity)
    yield from _mlp(ours + ("mlp",), lambda name: key("mlp." + name))
    yield _Entry(ours + ("router", "router_logits"), key("router.proj.weight"), *_linear())
    yield _Entry(ours + ("router", "router_scale"), key("router.scale"), _identity, _identity)
    yield _Entry(ours + ("router", "per_expert_scale"), key("router.per_expert_scale"), _identity, _identity)
    # gate_up_proj [E, 2F, D] (gate rows first) <-> gating_einsum [E, 2, F, D]
    yield _Entry(ours + ("experts", "gating_einsum"), key("experts.gate_up_proj"),
                 lambda w: w.reshape(w.shape[0], 2, -1, w.shape[-1]),
                 lambda w: w.reshape(w.shape[0], -1, w.shape[-1]))
    # down_proj [E, D, F] <-> linear [E, F, D]
    swap = lambda w: w.transpose(0, 2, 1)
    yield _Entry(ours + ("experts", "linear"), key("experts.down_proj"), swap, swap)
    scalar_in, scalar_out = (lambda w: w.reshape(())), (lambda w: w.reshape(1))
    yield _Entry(ours + ("decoder_scalar",), (_DECODER + layer + "layer_scalar",), scalar_in, scalar_out)
    yield _Entry(ours + ("encoder_scalar",), (_ENCODER + layer + "layer_scalar",), scalar_in, scalar_out)
  if cfg.vision is not None:
    yield from _vision.layout(cfg.vision)


_FULL_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # what a full layer's entry may change


def _per_layer_config(text: _files.Fields, layer_types: list[str]) -> dict[int, dict[str, Any]]:
  """`text_config.per_layer_config` keyed by layer index (int), validated.

  transformers writes the keys as strings zero-padded to the widest index ("05", "11" once a model has 10
  or more layers; the released 30-layer model: "05" ... "29"), and reads them back with `int()`; so do we.
  A key that is not a non-negative integer, is out of range, or names a layer twice ("5" and "05") is
  refused, and so is an override this converter would otherwise drop: on a full-attention layer anything
  but `_FULL_LAYER_OVERRIDES`, on a sliding layer anything, unless it equals the global value.
  """
  num_layers = len(layer_types)
  allowed = f"layer indices are integers in [0, {num_layers}) (num_hidden_layers={num_layers})"
  table = text.mapping("per_layer_config")
  parsed: dict[int, dict[str, Any]] = {}
  for key in table.values:
    text_key = str(key)
    if isinstance(key, bool) or not (isinstance(key, int) or text_key.isascii() and text_key.isdigit()):
      raise text.error("per_layer_config", f"key {key!r} is not a layer index; {allowed}.")
    index = int(key)
    if not 0 <= index < num_layers:
      raise text.error("per_layer_config", f"key {key!r} is out of range; {allowed}.")
    if index in parsed:
      raise text.error("per_layer_config", f"key {key!r} names layer {index} twice; {allowed}.")
    overrides = table.mapping(key)
    kept = _FULL_LAYER_OVERRIDES if layer_types[index] == FULL else ()
    for name, value in overrides.values.items():
      if name not in kept and (name not in text or value != text.values[name]):
        raise _files.BadFileError(
            f"{text.source}: per_layer_config[{key!r}] sets {name}={value!r} on a {layer_types[index]} layer, "
            f"which this converter cannot represent (a full layer may override {list(_FULL_LAYER_OVERRIDES)}; "
            "a sliding layer nothing).")
    parsed[index] = {k: overrides.integer(k) for k in overrides.values if k in kept}
  return parsed


# ModelConfig fields under their config.json names, for errors found once the ModelConfig is built.
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "top_k": "top_k_experts",
             "max_positions": "max_position_embeddings",
             "pad_id": "pad_token_id", "eos_id": "eos_token_id", "bos_id": "bos_token_id",
             "num_full_kv_heads": "per_layer_config (num_key_value_heads of the full layers)",
             "full_head_dim": "per_layer_config (head_dim of the full layers)", "image_id": "image_token_id",
             "begin_image_id": "boi_token_id", "end_image_id": "eoi_token_id"}


def _full_layer_config(text: _files.Fields, layer_types: list[str], k_eq_v: bool) -> dict[str, Any]:
  """The head_dim / num_key_value_heads overrides the full-attention layers share: from `per_layer_config`, or,
  in a config without one, from `global_head_dim` (default 512) and `num_global_key_value_heads` (read only
  with k = v), as transformers' configs build it."""
  full_layers = [i for i, t in enumerate(layer_types) if t == FULL]
  if text.get("per_layer_config", None) is None:
    full = {"head_dim": text.integer("global_head_dim", 512)}
    if k_eq_v and text.get("num_global_key_value_heads", None) is not None:
      full["num_key_value_heads"] = text.integer("num_global_key_value_heads")
    return full
  per_layer = _per_layer_config(text, layer_types)
  full = per_layer.get(full_layers[0], {}) if full_layers else {}
  for i in full_layers[1:]:
    if per_layer.get(i, {}) != full:
      raise _files.BadFileError(f"{text.source}: full-attention layers must share one shape; per_layer_config[{i}]="
                                f"{per_layer.get(i)} differs from layer {full_layers[0]}'s {full}.")
  return full


def config_from_hf(hf_config: dict[str, Any], *, source: os.PathLike | str = "config.json",
                   **overrides) -> ModelConfig:
  """Our ModelConfig from a transformers config.json (its dict, read from `source`): a DiffusionGemma's, or a
  Gemma 4 causal LM's (model_type 'gemma4_text', or 'gemma4' for the text and vision parts of a
  `Gemma4ForConditionalGeneration`), whose features DiffusionGemma lacks are refused by name (`gemma4.check`)
  and whose missing settings take the released model's values (canvas 256).

  Every field is checked for its type and range before it is used (sizes and counts are positive int32s,
  token ids non-negative ones), and the ModelConfig checks how they fit together (one layer type per layer,
  heads divisible by key/value heads, ...): every error names `source` and the config.json field.
  """
  if isinstance(hf_config.get("model"), dict) and isinstance(hf_config.get("data"), dict):
    raise _files.BadFileError(f"{source} is a training run's config, not a transformers one: its folder is a "
                              "training workdir or released weights (pass it as --workdir).")
  top = _files.Fields(hf_config, source)
  text = top.mapping("text_config") if top.get("text_config", None) is not None else top
  is_gemma4 = gemma4.model_type(hf_config) is not None
  if is_gemma4:
    gemma4.check(top, text)
  elif top.get("model_type", None) not in _MODEL_TYPES:
    raise top.error("model_type", f"is {top.values['model_type']!r}; supported: DiffusionGemma "
                    f"('diffusion_gemma') and Gemma 4 ({', '.join(map(repr, gemma4.MODEL_TYPES))}).")
  k_eq_v = text.boolean("attention_k_eq_v", False) if is_gemma4 else True  # DiffusionGemma's full layers: k = v
  layer_types = []
  for t in text.strings("layer_types"):
    if t not in _LAYER_TYPES:
      raise text.error("layer_types", f"holds {t!r}; supported: {sorted(_LAYER_TYPES)}.")
    layer_types.append(_LAYER_TYPES[t])
  full = _full_layer_config(text, layer_types, k_eq_v)
  rope = text.mapping("rope_parameters")
  sliding_rope = rope.mapping("sliding_attention")
  full_rope = rope.mapping("full_attention")
  for params, allowed in ((sliding_rope, ("default",)), (full_rope, ("proportional", "default"))):
    if params.string("rope_type", "default") not in allowed:
      raise params.error("rope_type", f"is {params.values['rope_type']!r}; supported: {allowed}.")
  eos = text.get("eos_token_id", 1)
  eos = eos[0] if isinstance(eos, list) and eos else eos  # several stop ids: the first is the model's eos
  token_id = lambda fields, name, default: fields.integer(name, default, minimum=0)
  default_softcap = None if is_gemma4 else 30.0  # Gemma4TextConfig's default; DiffusionGemma fixes 30
  softcap = text.values.get("final_logit_softcapping", default_softcap)
  values = dict(
      vocab_size=text.integer("vocab_size"),
      hidden_size=text.integer("hidden_size"),
      num_layers=text.integer("num_hidden_layers"),
      layer_types=tuple(layer_types),
      num_heads=text.integer("num_attention_heads"),
      num_kv_heads=text.integer("num_key_value_heads"),
      head_dim=text.integer("head_dim"),
      num_full_kv_heads=full.get("num_key_value_heads", text.integer("num_key_value_heads")),
      full_head_dim=full.get("head_dim", text.integer("head_dim")),
      full_k_eq_v=k_eq_v,
      sliding_window=text.integer("sliding_window"),
      rope_theta=sliding_rope.number("rope_theta", 10_000.0),
      full_rope_theta=full_rope.number("rope_theta", 1_000_000.0),
      full_partial_rotary_factor=full_rope.number("partial_rotary_factor", 1.0),
      intermediate_size=text.integer("intermediate_size"),
      num_experts=text.integer("num_experts"),
      top_k=text.integer("top_k_experts"),
      moe_intermediate_size=text.integer("moe_intermediate_size"),
      canvas_length=top.integer("canvas_length", 256),
      final_logit_softcap=None if softcap is None else text.number("final_logit_softcapping", default_softcap),
      max_positions=text.integer("max_position_embeddings", 131_072),
      rms_norm_eps=text.number("rms_norm_eps", 1e-6),
      pad_id=token_id(text, "pad_token_id", 0),
      eos_id=token_id(_files.Fields({"eos_token_id": eos}, source, text.prefix), "eos_token_id", 1),
      bos_id=token_id(text, "bos_token_id", 2),
  )
  values.update(_vision.config_from_hf(top, values["vocab_size"]))
  values.update(overrides)
  if is_gemma4:
    gemma4.check_vision(top, text, values["vision"])
  try:
    return ModelConfig(**values)
  except ValueError as e:
    field = str(e).split("=", 1)[0].removeprefix("ModelConfig.")
    if field in overrides:  # the caller's value, not the file's
      raise
    name = _HF_NAMES.get(field, field)
    raise _files.BadFileError(f"{source}: {e} (config.json field: {text.prefix}{name})") from None


def _our_shapes(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Every float parameter's shape in our layout (`transformer.abstract_params`: no model of `cfg`'s depth is
  built, so a config is checked in a second whatever its number of layers)."""
  params = transformer.abstract_params(cfg.replace(quantize="none"))
  return {path: leaf.shape for path, leaf in traverse_util.flatten_dict(params).items()}


def _checkpoint_shape(entry: _Entry, shapes) -> tuple[int, ...]:
  """The shape the checkpoint must give `entry` (its `to_hf` applied to a stand-in of no memory)."""
  path = entry.path
  shape = shapes[path[:-1]][1:] if path[-1] in ("0", "1") else shapes[path]  # a half of gating_einsum
  return entry.to_hf(np.broadcast_to(np.zeros((), np.int8), shape)).shape


def _checked_tensors(cfg: ModelConfig, ckpt: shards.Shards, config_file, entries: Iterable[_Entry]
                     ) -> list[tuple[_Entry, str | None]]:
  """(entry, checkpoint key) of every parameter of `cfg` (`entries`: its table under the folder's names), after
  checking from the shards' headers alone (no tensor read) that each is present, a float, and of the shape
  `cfg` gives it: a checkpoint that does not fit its config.json fails here, in seconds, with the key, its
  shard and the expected shape named. An entry without keys (Gemma 4 has no self-conditioning) gets None."""
  shapes = _our_shapes(cfg)
  found = []
  for entry in entries:
    if not entry.keys:
      found.append((entry, None))
      continue
    key = next((k for k in entry.keys if k in ckpt.weight_map), None)
    if key is None:
      raise KeyError(f"Checkpoint {ckpt.path} has no tensor {' or '.join(entry.keys)} (for {'/'.join(entry.path)}).")
    shape, dtype = ckpt.header(key)
    if dtype not in shards.FLOAT_DTYPES:
      raise _files.BadFileError(f"{ckpt.file(key)}: tensor {key} is {dtype}; the weights of this model are floats "
                                f"({', '.join(shards.FLOAT_DTYPES)}).")
    want = _checkpoint_shape(entry, shapes)
    if shape != want:
      raise _files.BadFileError(f"{ckpt.file(key)}: tensor {key} has shape {list(shape)}; {config_file} makes it "
                                f"{list(want)} (for {'/'.join(entry.path)}).")
    found.append((entry, key))
  return found


def _memory(placed: bool) -> tuple[int, str]:
  """(bytes, what they are) of the memory the loaded parameters go to: the local devices' when placed on
  accelerators that report a limit, else the host's (its physical memory, or its cgroup's limit if lower)."""
  if placed:
    devices = jax.local_devices()
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if all(limits):
      return sum(limits), f"the {len(devices)} local {devices[0].platform} devices' memory"
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  try:
    total = min(total, int(pathlib.Path("/sys/fs/cgroup/memory.max").read_text()))
  except (OSError, ValueError):  # no cgroup v2 limit ("max"), or not Linux
    pass
  return total, "this host's memory"


def _check_memory(cfg: ModelConfig, tensors, ckpt: shards.Shards, dtype, placed: bool) -> None:
  """Refuses a model whose parameters (at `dtype`, else as stored; int8 where quantised) exceed the memory
  they go to, before anything is allocated."""
  scales = quantize.scale_shapes(cfg) if cfg.quantize == "int8" else {}
  sizes = {}
  for entry, key in tensors:
    if key is None:  # made, not read (a Gemma 4's self-conditioning): small beside the model
      continue
    shape, stored = ckpt.header(key)
    target = entry.path[:-1] if entry.path[-1] in ("0", "1") else entry.path
    itemsize = 1 if target in scales else (dtype.itemsize if dtype is not None else _ITEMSIZE[stored])
    sizes[key] = math.prod(shape) * itemsize
  need = sum(sizes.values())
  have, where = _memory(placed)
  if need > have:
    largest = max(sizes, key=sizes.get)
    raise MemoryError(f"The checkpoint {ckpt.path} needs {need / 2**30:.1f} GiB for its parameters"
                      f"{'' if dtype is None else f' in {dtype}'}, more than {where} ({have / 2**30:.1f} GiB); the "
                      f"largest tensor is {largest} ({sizes[largest] / 2**30:.2f} GiB). Load it in a smaller dtype, "
                      "quantised (quantize='int8'), or sharded over more devices.")


_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_NUMPY_DTYPES = {"F16": np.float16, "BF16": jnp.bfloat16, "F32": np.float32, "F64": np.float64}
_HEAD = "lm_head.weight"


def _check_head(hf_config: dict[str, Any], ckpt: shards.Shards, tensors, config_file) -> None:
  """Refuses an untied output head that differs from the embedding: DiffusionGemma's head is its embedding, so
  loading would silently drop it. transformers ties the head when `tie_word_embeddings` is true (its default),
  ignoring any stored copy; when false, `lm_head.weight` must be there and equal the embedding (read once
  each, here, before anything is built)."""
  if _files.Fields(hf_config, config_file).boolean("tie_word_embeddings", True):
    return
  embed = next(key for entry, key in tensors if entry.path == ("embedder", "input_embedding"))
  if _HEAD not in ckpt.weight_map:
    raise _files.BadFileError(f"{config_file}: tie_word_embeddings is false, but the checkpoint {ckpt.path} has no "
                              f"{_HEAD} (an untied output head) to read.")
  head, table = ckpt.get(_HEAD), ckpt.get(embed)
  if head.shape != table.shape or not np.array_equal(head, table):
    difference = (f"max |difference| {np.abs(head.astype(np.float32) - table.astype(np.float32)).max():.3g}"
                  if head.shape == table.shape else f"shape {list(head.shape)} against {list(table.shape)}")
    raise _files.BadFileError(
        f"{config_file}: tie_word_embeddings is false and {ckpt.file(_HEAD)}: {_HEAD} differs from {embed} "
        f"({difference}): an output head of its own, which DiffusionGemma lacks (its head is the embedding); "
        "loading this checkpoint would drop it.")


def load_hf(path: os.PathLike | str, *, dtype: str | None = None, shardings=None, **config_overrides):
  """Reads a transformers DiffusionGemma checkpoint folder into `(ModelConfig, params)`; or a Gemma 4 causal LM
  folder (`Gemma4ForCausalLM`, or the text and vision parts of `Gemma4ForConditionalGeneration`) as the
  DiffusionGemma whose causal encoder it is, exactly: the denoiser shares its weights, and what Gemma 4 lacks
  is made as `convert/gemma4.py` says (the denoiser's layer scalars are the encoder's, self-conditioning
  starts adding nothing); a Gemma 4 feature DiffusionGemma lacks is refused, naming its config.json field.

  Tensors are streamed one at a time: each is read once, cast to `dtype` (default: the checkpoint's own)
  and, with `shardings`, placed at once into its sharding (each device receives only its slice), so the
  checkpoint is never whole in host memory, let alone in float32: host staging peaks at about one tensor
  in the checkpoint's dtype plus its cast copy. `shardings`: a tree of `jax.sharding.Sharding`s shaped
  like the params (e.g. `dg.parallel.param_shardings`), or a callable `(cfg) -> tree` such as
  `mesh_shardings()` (every local device); without it the params are numpy arrays.
  `config_overrides` (e.g. `moe_impl='dense'`) apply to the ModelConfig built from config.json; with
  `quantize='int8'` each attention, MLP and expert weight is quantised as it is read (`model.quantize`),
  so the float model is never whole in memory either.

  Nothing is built before the folder is checked: config.json's fields (types, ranges, how they fit), then
  every tensor's presence, dtype (a float) and shape against the config, from the shard headers alone, and
  the memory the parameters need against what they go to. As it streams, each tensor is checked to be
  finite. Files are read as `_files` and `convert.shards` allow (regular files under a size cap, shards
  named by the index only inside the folder); every error names the file and the field or tensor.
  """
  if not _files.is_local(path):
    raise ValueError(f"load_hf({str(path)!r}): a transformers folder is read from the local disk (its shards are "
                     "memory-mapped); copy it from object storage first.")
  path = pathlib.Path(path)
  config_file = path / "config.json"
  if not _files.present(config_file):
    raise FileNotFoundError(f"{path} is not a transformers checkpoint folder: no config.json.")
  hf_config = _files.read_json(config_file)
  cfg = config_from_hf(hf_config, source=config_file, **config_overrides)
  kind = gemma4.model_type(hf_config)
  dtype = None if dtype is None else np.dtype(jnp.dtype(dtype))
  ckpt = shards.Shards(path)
  tensors = _checked_tensors(cfg, ckpt, config_file, _layout(cfg) if kind is None else
                             gemma4.layout(_layout(cfg), kind))
  _check_head(hf_config, ckpt, tensors, config_file)
  _check_memory(cfg, tensors, ckpt, dtype, shardings is not None)
  made = None  # what Gemma 4 lacks, in the dtype of its embedding unless `dtype` says otherwise
  if any(key is None for _, key in tensors):
    made = gemma4.fresh_self_conditioning(cfg)
    made_dtype = _NUMPY_DTYPES[ckpt.header(tensors[0][1])[1]]  # tensors[0]: the embedding
  if callable(shardings):
    shardings = shardings(cfg)
  scales = quantize.scale_shapes(cfg) if cfg.quantize == "int8" else {}
  params: dict[str, Any] = {}
  halves: dict[tuple[str, ...], dict[str, np.ndarray]] = {}  # a GeGLU's gate and up, until both are read
  used = {k for entry, _ in tensors for k in entry.keys if k in ckpt.weight_map}  # a tied copy counts as read
  for entry, key in tensors:
    value = ckpt.get(key) if key is not None else entry.to_hf(_get(made, entry.path)).astype(made_dtype)
    if dtype is not None:
      value = value.astype(dtype, copy=False)  # before the layout change, so any copy is the smaller one
    value = entry.to_ours(value)
    target = entry.path
    if target[-1] in ("0", "1"):  # gating_einsum [2, F, D] = stack(gate, up)
      target, pair = target[:-1], halves.setdefault(target[:-1], {})
      pair[entry.path[-1]] = value
      if len(pair) < 2:
        continue
      value = np.stack([halves.pop(target)["0"], pair["1"]])
    pieces = {target: value}
    if target in scales:
      pieces[target], pieces[quantize.scale_path(target)] = quantize.int8(value, scales[target])
    for piece, value in pieces.items():
      if shardings is not None:
        value = _place(value, _get(shardings, piece, leaf=True))
      _set(params, piece, value)
  skipped = sorted(k for k in ckpt.weight_map if k not in used)
  vision = [k for k in skipped if k.startswith(_SKIPPED_PREFIXES)]
  if vision:
    logging.info("load_hf: skipped %d vision-tower / lm_head tensors (text model only).", len(vision))
  unknown = [k for k in skipped if not k.startswith(_SKIPPED_PREFIXES) and k.startswith("model.")]
  if unknown:
    logging.warning("load_hf: %d checkpoint tensors not used, e.g. %s", len(unknown), unknown[:5])
  return cfg, params


def _place(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A host array as a jax.Array in `sharding`: each addressable device gets its slice (works multi-process)."""
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def mesh_shardings(mesh: jax.sharding.Mesh | None = None, *, mesh_config: Mapping[str, int] | None = None,
                   rules=None) -> Callable[[ModelConfig], Any]:
  """A `shardings` argument for `load_hf`: `(cfg) -> NamedShardings` of cfg's parameters on a mesh.

  The mesh is `mesh`, else `parallel.make_mesh(mesh_config)` over every local device (default
  `{"tensor": -1}`: heads, feed-forward, expert feed-forward and vocabulary split over all of them); the
  logical-axis `rules` default to `parallel.LOGICAL_RULES`. A dimension the mesh does not divide is
  replicated (`parallel.param_specs`).
  """
  rules = parallel.LOGICAL_RULES if rules is None else rules

  def build(cfg: ModelConfig):
    target = mesh if mesh is not None else parallel.make_mesh(mesh_config or {"tensor": -1}, jax.local_devices())
    model = DiffusionGemma(cfg)
    boxed = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 2), np.int32),
                           jax.ShapeDtypeStruct((1, cfg.canvas_length), np.int32))["params"]
    return parallel.param_shardings(boxed, target, rules)

  return build


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for name in path[:-1]:
    tree = tree.setdefault(name, {})
  tree[path[-1]] = value


_HF_SOFTCAP = 30.0  # transformers' DiffusionGemmaForBlockDiffusion.final_logit_softcapping (not in config.json)
# transformers always builds a Gemma 4 vision tower; with no original to copy, a minimal one is declared
# (transformers initialises its weights at random; the text model does not read them).
_PLACEHOLDER_VISION = dict(model_type="gemma4_vision", hidden_size=16, num_hidden_layers=1,
                           intermediate_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                           position_embedding_size=32)


def _text_config(cfg: ModelConfig) -> dict[str, Any]:
  """The text config fields DiffusionGemma shares with Gemma 4 (`per_layer_config` keys zero-padded as
  transformers writes them)."""
  names = {v: k for k, v in _LAYER_TYPES.items()}
  full = {"head_dim": cfg.full_head_dim, "num_key_value_heads": cfg.num_full_kv_heads}
  fulls = [i for i, t in enumerate(cfg.layer_types) if t == FULL]
  width = len(str(max(fulls)))
  return dict(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      num_hidden_layers=cfg.num_layers, layer_types=[names[t] for t in cfg.layer_types],
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      per_layer_config={str(i).zfill(width): dict(full) for i in fulls},
      sliding_window=cfg.sliding_window,
      rope_parameters={
          "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
          "full_attention": {"rope_type": "proportional", "rope_theta": cfg.full_rope_theta,
                             "partial_rotary_factor": cfg.full_partial_rotary_factor}},
      intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts, top_k_experts=cfg.top_k,
      moe_intermediate_size=cfg.moe_intermediate_size, max_position_embeddings=cfg.max_positions,
      rms_norm_eps=cfg.rms_norm_eps, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
      pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id, bos_token_id=cfg.bos_id)


ARCHITECTURES = (DIFFUSION_GEMMA, *gemma4.ARCHITECTURES)


def config_to_hf(cfg: ModelConfig, architecture: str = DIFFUSION_GEMMA) -> dict[str, Any]:
  """The transformers config.json (a dict) of `cfg` as `architecture` (one of `ARCHITECTURES`: the whole
  DiffusionGemma, or its encoder as a Gemma 4 causal LM); inverse of `config_from_hf` on the text fields."""
  if architecture not in ARCHITECTURES:
    raise ValueError(f"Unknown architecture {architecture!r}; supported: {list(ARCHITECTURES)}.")
  if cfg.quantize != "none":
    raise ValueError(f"This model has quantize={cfg.quantize!r}: transformers' {architecture} has no int8 "
                     "weights. Export the float weights the int8 ones were made from.")
  text = _text_config(cfg)
  if architecture in gemma4.ARCHITECTURES:
    return gemma4.config_to_hf(cfg, text, architecture)
  for name, value, want in (("final_logit_softcap", cfg.final_logit_softcap, _HF_SOFTCAP),
                            ("full_k_eq_v", cfg.full_k_eq_v, True)):
    if value != want:
      raise ValueError(f"transformers' DiffusionGemma fixes {name}={want!r}; this model has "
                       f"{name}={value!r} and cannot be exported faithfully.")
  text["model_type"] = "diffusion_gemma_text"
  hf_config = dict(architectures=[DIFFUSION_GEMMA], model_type="diffusion_gemma",
                   canvas_length=cfg.canvas_length, tie_word_embeddings=True, text_config=text,
                   vision_config=dict(_PLACEHOLDER_VISION), image_token_id=cfg.image_id,
                   boi_token_id=cfg.begin_image_id, eoi_token_id=cfg.end_image_id)
  if cfg.vision is not None:
    text["use_bidirectional_attention"] = "vision" if cfg.vision.bidirectional_attention else None
    hf_config["vision_config"] = _vision.config_to_hf(cfg.vision)
  return hf_config


def save_hf(cfg: ModelConfig, params, path: os.PathLike | str, *, dtype: str | None = None,
            max_shard_bytes: int = 5 * 2**30, vision_from: os.PathLike | str | None = None,
            architecture: str = DIFFUSION_GEMMA) -> None:
  """Writes `(cfg, params)` as a transformers checkpoint folder (`from_pretrained` loads it): a DiffusionGemma
  (`architecture='DiffusionGemmaForBlockDiffusion'`), or its causal encoder alone as a Gemma 4 causal LM
  ('Gemma4ForCausalLM'; 'Gemma4ForConditionalGeneration' keeps a vision encoder), which leaves the denoiser's
  own parameters (its layer scalars, self-conditioning) behind.

  Tensors are fetched to the host one at a time and written in safetensors shards of at most
  `max_shard_bytes` (plus `model.safetensors.index.json` when there are several), so at most one shard
  is ever held in host memory. `dtype` casts on the way (default: each parameter's own). A model with a
  vision encoder (`cfg.vision`) writes it from `params`; for a text-only one, `vision_from`, an original
  checkpoint folder, copies its vision tower and vision config (else transformers makes a placeholder).
  `path` may be a gs:// URI (`_files.as_path`): each shard is then serialized in memory and uploaded whole.
  """
  params = nn.unbox(params)
  params = params.get("params", params) if set(params) == {"params"} else params
  path = _files.as_path(path, "save_hf path")
  local = _files.is_local(path)
  hf_config = config_to_hf(cfg, architecture)
  kind = gemma4.ARCHITECTURES.get(architecture)
  entries = [(entry.keys[0] if kind is None else gemma4.rename(entry.keys[0], kind), entry)
             for entry in _layout(cfg) if kind is None or not gemma4.denoiser_only(entry.path)]
  seen = set()
  for key, entry in entries:  # two parameters under one name: the file would keep one of them, silently
    if key in seen:
      raise ValueError(f"save_hf: two parameters would be written as {key} (the second: {'/'.join(entry.path)}).")
    seen.add(key)
  tensors = ((key, entry.to_hf(_get(params, entry.path))) for key, entry in entries)
  if vision_from is not None and kind is not None:
    raise ValueError(f"save_hf: vision_from is for architecture={DIFFUSION_GEMMA!r}; a Gemma 4 export writes the "
                     "vision encoder of the model itself (load the original with its vision tower).")
  if vision_from is not None and cfg.vision is not None:
    raise ValueError(f"save_hf: vision_from={str(vision_from)!r} is for a text-only model; this one has its own "
                     "vision encoder (cfg.vision), which is written from params.")
  if vision_from is not None:
    vision_from = pathlib.Path(vision_from)
    hf_config["vision_config"] = _files.Fields(_files.read_json(vision_from / "config.json"),
                                               vision_from / "config.json").get("vision_config")
    source = shards.Shards(vision_from)
    vision = ((k, source.get(k)) for k in sorted(source.weight_map)
              if k.startswith(_SKIPPED_PREFIXES[:2]))
    tensors = itertools.chain(tensors, vision)
  path.mkdir(parents=True, exist_ok=True)

  shard_keys, shard, total_bytes = [], {}, 0  # keys of the shards written so far; the one being filled

  def flush():
    tmp = path / f".shard-{len(shard_keys)}.tmp"
    if local:
      save_file(shard, str(tmp), metadata={"format": "pt"})
    else:
      tmp.write_bytes(safetensors.numpy.save(shard, metadata={"format": "pt"}))
    shard_keys.append(list(shard))
    shard.clear()

  for key, value in tensors:
    value = np.ascontiguousarray(value if dtype is None else value.astype(dtype))
    if shard and sum(v.nbytes for v in shard.values()) + value.nbytes > max_shard_bytes:
      flush()
    shard[key] = value
    total_bytes += value.nbytes
  flush()
  names = [_shard_name(i, len(shard_keys)) for i in range(len(shard_keys))]
  for i, name in enumerate(names):
    (path / f".shard-{i}.tmp").replace(path / name)  # on gs:// a copy and a delete: the name appears whole
  if len(names) > 1:
    index = {"metadata": {"total_size": total_bytes},
             "weight_map": {k: name for keys, name in zip(shard_keys, names) for k in keys}}
    _files.atomic_write(path / "model.safetensors.index.json", json.dumps(index, indent=2))
  _files.atomic_write(path / "config.json", json.dumps(hf_config, indent=2))


def _shard_name(i: int, count: int) -> str:
  return "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def _get(tree, path: tuple[str, ...], leaf: bool = False):
  """A parameter on the host (or, with `leaf`, the tree's leaf itself, e.g. a sharding).

  Path (..., 'gating_einsum', '0') is the gate half of a stacked [2, F, D] GeGLU.
  """
  for name in path:
    if name in ("0", "1") and not isinstance(tree, Mapping):
      return np.asarray(jax.device_get(tree[int(name)]))
    tree = tree[name]
  return tree if leaf else np.asarray(jax.device_get(tree))


"""`ModelConfig`: every dimension of a DiffusionGemma transformer, validated once."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax

SLIDING = "sliding"
FULL = "full"
MOE_IMPLEMENTATIONS = ("grouped", "ragged", "dense")
MOE_AUTO = "auto"  # ModelConfig.moe_impl: chosen by the backend, see `default_moe_impl`
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8")  # ModelConfig.quantize


INT32_MAX = 2**31 - 1  # sizes index int32 arrays (token ids, positions, shapes inside XLA programs)


def _positive_ints(config, fields) -> None:
  for field in fields:
    value = getattr(config, field)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= INT32_MAX:
      raise ValueError(f"{type(config).__name__}.{field}={value!r} is invalid: must be a positive integer "
                       f"below 2**31.")


def default_moe_impl(backend: str | None = None) -> str:
  """What `moe_impl="auto"` becomes on `backend` (default: jax's default backend, which this initialises):
  `ragged` where `lax.ragged_dot` has real kernels (GPU, TPU), `grouped` elsewhere (docs/sampler.md)."""
  backend = jax.default_backend() if backend is None else backend
  return "ragged" if backend in ("gpu", "cuda", "rocm", "tpu") else "grouped"


def _from_dict(cls, values):
  values = dict(values.to_dict() if hasattr(values, "to_dict") else values)
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f"Unknown {cls.__name__} fields {unknown}; known fields are {sorted(known)}.")
  return cls(**values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
  """Dimensions of the Gemma 4 vision encoder (`model/vision.py`); defaults are the released 26B-A4B's.

  Images are cut into `patch_size` squares (at most `budget * pooling_kernel_size**2` of them), embedded
  with a 2-D position table of `position_embedding_size` rows per axis, run through a bidirectional
  transformer with 2-D RoPE, average-pooled over `pooling_kernel_size`^2 neighbourhoods into soft tokens,
  optionally standardised, and projected into the text embedding space.

  `bidirectional_attention` is how the *text* encoder treats those soft tokens: with it (transformers'
  `text_config.use_bidirectional_attention == "vision"`, the released model), the soft tokens of one
  image attend to each other in both directions, in every layer, beyond the sliding window; without it,
  they are causal like text.
  """

  hidden_size: int = 1152
  intermediate_size: int = 4304
  num_layers: int = 27
  num_heads: int = 16
  num_kv_heads: int = 16
  head_dim: int = 72
  patch_size: int = 16
  pooling_kernel_size: int = 3
  position_embedding_size: int = 10_240
  rope_theta: float = 100.0
  rms_norm_eps: float = 1e-6
  standardize: bool = True
  bidirectional_attention: bool = True

  def __post_init__(self):
    _positive_ints(self, ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                          "head_dim", "patch_size", "pooling_kernel_size", "position_embedding_size"))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"VisionConfig.num_kv_heads={self.num_kv_heads} is invalid: must divide "
                       f"num_heads={self.num_heads}.")
    if self.head_dim % 4:
      raise ValueError(f"VisionConfig.head_dim={self.head_dim} is invalid: must be a multiple of 4 (2-D RoPE "
                       "rotates pairs within each half).")
    for field in ("rope_theta", "rms_norm_eps"):
      if not getattr(self, field) > 0:
        raise ValueError(f"VisionConfig.{field}={getattr(self, field)!r} is invalid: must be positive.")

  @property
  def patch_pixels(self) -> int:
    """Values per patch: 3 channels x patch_size^2."""
    return 3 * self.patch_size**2

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "VisionConfig":
    return _from_dict(cls, values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Dimensions and numerics of a DiffusionGemma text transformer.

  One set of weights serves two modes: a causal encoder (prompt and committed canvases into a KV cache)
  and a bidirectional denoiser (a canvas attending to `[cache ; canvas]`). Layers are either `sliding`
  (window attention, full RoPE) or `full` (global attention with their own head dim and KV heads,
  proportional partial RoPE and optionally V = v_norm(k_proj(x))). Defaults are the released
  26B-A4B text model; `configs/` holds smaller variants.
  """

  vocab_size: int = 262_144
  hidden_size: int = 2816
  num_layers: int = 30
  # One entry per layer; None means five sliding layers then one full layer, repeated.
  layer_types: tuple[str, ...] | None = None
  num_heads: int = 16
  num_kv_heads: int = 8
  head_dim: int = 256
  num_full_kv_heads: int = 2
  full_head_dim: int = 512
  full_k_eq_v: bool = True
  sliding_window: int = 1024
  rope_theta: float = 10_000.0
  full_rope_theta: float = 1_000_000.0
  full_partial_rotary_factor: float = 0.25
  intermediate_size: int = 2112
  num_experts: int = 128
  top_k: int = 8
  moe_intermediate_size: int = 704
  canvas_length: int = 256
  final_logit_softcap: float | None = 30.0
  max_positions: int = 262_144
  rms_norm_eps: float = 1e-6
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  # grouped (sort + tiled einsum) | ragged (lax.ragged_dot) | dense (reference) | auto: resolved once, when
  # the config is built, to `default_moe_impl()` (ragged on GPU/TPU, grouped on CPU); the config then holds
  # the concrete choice, so hashing, `to_dict` and every result's settings record what ran.
  moe_impl: str = MOE_AUTO
  remat: bool = False  # rematerialise each layer in the backward pass
  # Weight-only quantisation of the matmul weights (attention, MLP, experts) for inference: 'none' or 'int8'
  # (int8 values and a float32 scale per output channel, dequantised where each weight is used;
  # `model.quantize`). The embedding (also the LM head), norms and router stay in `param_dtype`.
  quantize: str = "none"
  pad_id: int = 0
  eos_id: int = 1
  bos_id: int = 2
  # The noise process these weights were trained with, which every sampler of them uses
  # (`diffusion.noise.for_model`): 'uniform' (released) or 'masked' (absorbing, with `mask_token_id`,
  # None meaning the last id of the vocabulary).
  noise: str = "uniform"
  mask_token_id: int | None = None
  # The Gemma 4 vision encoder (None: a text-only model) and the ids of its tokens: each image is
  # `begin_image_id`, one `image_id` per soft token (replaced by the image's embeddings), `end_image_id`.
  vision: VisionConfig | None = None
  image_id: int = 258_880
  begin_image_id: int = 255_999
  end_image_id: int = 258_882

  def __post_init__(self):
    if self.layer_types is None:
      types = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_layers))
      if types:
        types = types[:-1] + (FULL,)
      object.__setattr__(self, "layer_types", types)
    else:
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if self.moe_impl == MOE_AUTO:
      object.__setattr__(self, "moe_impl", default_moe_impl())
    if isinstance(self.vision, Mapping) or hasattr(self.vision, "to_dict"):  # e.g. read back from JSON
      object.__setattr__(self, "vision", VisionConfig.from_dict(self.vision))
    self._validate()

  def _validate(self):
    def fail(field, allowed):
      raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r} is invalid: {allowed}.")

    _positive_ints(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                          "num_full_kv_heads", "full_head_dim", "sliding_window", "intermediate_size",
                          "num_experts", "top_k", "moe_intermediate_size", "canvas_length", "max_positions"))
    if len(self.layer_types) != self.num_layers:
      fail("layer_types", f"needs one entry per layer (num_layers={self.num_layers}), got "
           f"{len(self.layer_types)}")
    bad = sorted({t for t in self.layer_types if t not in (SLIDING, FULL)})
    if bad:
      fail("layer_types", f"entries must be {SLIDING!r} or {FULL!r}, not {bad}")
    if self.layer_types[-1] != FULL:
      fail("layer_types", f"the last layer must be {FULL!r} attention")
    if self.num_heads % self.num_kv_heads:
      fail("num_kv_heads", f"must divide num_heads={self.num_heads}")
    if self.num_heads % self.num_full_kv_heads:
      fail("num_full_kv_heads", f"must divide num_heads={self.num_heads}")
    if self.top_k > self.num_experts:
      fail("top_k", f"must be at most num_experts={self.num_experts}")
    for field in ("head_dim", "full_head_dim"):
      if getattr(self, field) % 2:
        fail(field, "must be even (rotary embeddings rotate pairs of dimensions)")
    if not 0.0 <= self.full_partial_rotary_factor <= 1.0:
      fail("full_partial_rotary_factor", "must lie in [0, 1]")
    for field in ("rope_theta", "full_rope_theta", "rms_norm_eps"):
      if not getattr(self, field) > 0:
        fail(field, "must be positive")
    if self.final_logit_softcap is not None and not self.final_logit_softcap > 0:
      fail("final_logit_softcap", "must be positive or None")
    if self.canvas_length > self.max_positions:
      fail("canvas_length", f"must be at most max_positions={self.max_positions}")
    for field in ("dtype", "param_dtype"):
      if getattr(self, field) not in DTYPES:
        fail(field, f"must be one of {DTYPES}")
    if self.quantize not in QUANTIZATIONS:
      fail("quantize", f"must be one of {QUANTIZATIONS}")
    if self.moe_impl not in MOE_IMPLEMENTATIONS:
      fail("moe_impl", f"must be one of {MOE_IMPLEMENTATIONS + (MOE_AUTO,)}")
    if not isinstance(self.noise, str):
      fail("noise", "must be the name of a noise process (e.g. 'uniform' or 'masked')")
    if self.mask_token_id is not None and not (isinstance(self.mask_token_id, int) and
                                               0 <= self.mask_token_id < self.vocab_size):
      fail("mask_token_id", f"must be None (the last id) or a token id in [0, vocab_size={self.vocab_size})")
    for field in ("pad_id", "eos_id", "bos_id"):
      if not isinstance(getattr(self, field), int) or not 0 <= getattr(self, field) < self.vocab_size:
        fail(field, f"must be a token id in [0, vocab_size={self.vocab_size})")
    if self.vision is not None:
      if not isinstance(self.vision, VisionConfig):
        fail("vision", "must be a VisionConfig, a mapping of its fields, or None")
      for field in ("image_id", "begin_image_id", "end_image_id"):
        if not 0 <= getattr(self, field) < self.vocab_size:
          fail(field, f"must be a token id in [0, vocab_size={self.vocab_size}) in a model with a vision "
               "encoder")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
    """Builds a config from a mapping (e.g. `config.model` of an ml_collections file), naming unknown keys."""
    return _from_dict(cls, values)

  def to_dict(self) -> dict[str, Any]:
    values = dataclasses.asdict(self)
    values["layer_types"] = list(self.layer_types)
    return values

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def layer_dims(self, layer: int) -> tuple[int, int]:
    """(kv heads, head dim) of a layer."""
    if self.layer_types[layer] == FULL:
      return self.num_full_kv_heads, self.full_head_dim
    return self.num_kv_heads, self.head_dim

  @property
  def embed_scale(self) -> float:
    return math.sqrt(self.hidden_size)

"""Flax linen modules of the DiffusionGemma transformer."""

from diffusiongemma.model.attention import KVCache
from diffusiongemma.model.config import FULL, SLIDING, ModelConfig, VisionConfig
from diffusiongemma.model.transformer import DiffusionGemma, count_parameters

__all__ = ["DiffusionGemma", "FULL", "count_parameters", "KVCache", "ModelConfig", "SLIDING", "VisionConfig"]

"""Flax linen modules of the DiffusionGemma transformer."""

from diffusiongemma.model.attention import KVCache
from diffusiongemma.model.config import FULL, SLIDING, ModelConfig
from diffusiongemma.model.transformer import DiffusionGemma

__all__ = ["DiffusionGemma", "FULL", "KVCache", "ModelConfig", "SLIDING"]

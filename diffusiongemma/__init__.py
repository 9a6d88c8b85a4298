"""diffusiongemma: DiffusionGemma block diffusion in JAX/Flax."""

from diffusiongemma import convert, data
from diffusiongemma import model
from diffusiongemma.model import DiffusionGemma, KVCache, ModelConfig

__all__ = ["DiffusionGemma", "KVCache", "ModelConfig", "convert", "data", "model"]

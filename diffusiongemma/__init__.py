"""diffusiongemma: DiffusionGemma block diffusion in JAX/Flax."""

from diffusiongemma import chat, convert, data
from diffusiongemma import model
from diffusiongemma.model import DiffusionGemma, KVCache, ModelConfig
from diffusiongemma import sampling
from diffusiongemma import diffusion
from diffusiongemma import training
from diffusiongemma import parallel
from diffusiongemma.sampling import Sampler, SamplerConfig

__all__ = [
    "DiffusionGemma", "KVCache", "ModelConfig", "Sampler", "SamplerConfig", "chat", "convert", "data", "model",
    "sampling",
    "diffusion",
    "training",
    "parallel",
]

"""diffusiongemma: DiffusionGemma block diffusion in JAX/Flax."""

from diffusiongemma import build
from diffusiongemma import chat
from diffusiongemma import convert
from diffusiongemma import data
from diffusiongemma import diffusion
from diffusiongemma import evaluation
from diffusiongemma import model
from diffusiongemma import parallel
from diffusiongemma import sampling
from diffusiongemma import training
from diffusiongemma.chat import ChatSampler
from diffusiongemma.model import DiffusionGemma, KVCache, ModelConfig
from diffusiongemma.sampling import ARSampler, Sampler, SamplerConfig

__all__ = [
    "ARSampler", "ChatSampler", "DiffusionGemma", "KVCache", "ModelConfig", "Sampler", "SamplerConfig", "build", "chat",
    "convert", "data", "diffusion", "evaluation", "model", "parallel", "sampling", "training",
]

"""Diffusion: noise processes (uniform-state, masked) and the block-diffusion training loss."""

from diffusiongemma.diffusion.loss import diffusion_loss
from diffusiongemma.diffusion.loss import LossConfig
from diffusiongemma.diffusion.noise import make_noise
from diffusiongemma.diffusion.noise import mask_token_id
from diffusiongemma.diffusion.noise import MaskedNoise
from diffusiongemma.diffusion.noise import NOISES
from diffusiongemma.diffusion.noise import sample_time
from diffusiongemma.diffusion.noise import UniformNoise

__all__ = [
    "LossConfig",
    "MaskedNoise",
    "NOISES",
    "UniformNoise",
    "diffusion_loss",
    "make_noise",
    "mask_token_id",
    "sample_time",
]

"""diffusiongemma: DiffusionGemma block diffusion in JAX/Flax."""

from diffusiongemma import data

__all__ = ["data"]

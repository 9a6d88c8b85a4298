"""Conversion between transformers DiffusionGemma checkpoints and our parameter trees."""

from diffusiongemma.convert.hf import config_from_hf, load_hf

__all__ = ["config_from_hf", "load_hf"]

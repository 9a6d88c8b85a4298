"""Conversion between transformers DiffusionGemma checkpoints and our parameter trees."""

from diffusiongemma.convert.hf import config_from_hf, config_to_hf, load_hf, mesh_shardings, save_hf

__all__ = ["config_from_hf", "config_to_hf", "load_hf", "mesh_shardings", "save_hf"]

"""Conversion between transformers checkpoints (DiffusionGemma, Gemma 4 causal LMs) and our parameter trees."""

from diffusiongemma.convert.hf import (ARCHITECTURES, DIFFUSION_GEMMA, config_from_hf, config_to_hf, load_hf,
                                       mesh_shardings, save_hf)

__all__ = ["ARCHITECTURES", "DIFFUSION_GEMMA", "config_from_hf", "config_to_hf", "load_hf", "mesh_shardings",
           "save_hf"]

"""Evaluation: validation loss and perplexity (`validation`), and the generative quality of samples
(`evaluation.generative`, imported on its own: it loads data, checkpoints and samplers)."""

from diffusiongemma.evaluation import validation

__all__ = ["validation"]

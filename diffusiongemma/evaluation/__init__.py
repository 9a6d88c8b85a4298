"""Evaluation: validation loss and perplexity (`validation`); imported on their own, since they load data,
checkpoints and samplers: the generative quality of samples (`evaluation.generative`) and task
evaluations (`evaluation.sudoku`)."""

from diffusiongemma.evaluation import validation

__all__ = ["validation"]

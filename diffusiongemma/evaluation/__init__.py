"""Evaluation: validation loss and perplexity (`validation`); imported on their own, since they load data,
checkpoints and samplers: the generative quality of samples (`evaluation.generative`), task evaluations
(`evaluation.sudoku`), and lm-evaluation-harness requests (`evaluation.harness`, with the likelihoods of
`evaluation.likelihood`; the harness's model class is `build/harness.py`)."""

from diffusiongemma.evaluation import validation

__all__ = ["validation"]

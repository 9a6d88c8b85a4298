"""Task evaluations of trained models (Sudoku)."""

from diffusiongemma.evaluation import sudoku

__all__ = ["sudoku"]

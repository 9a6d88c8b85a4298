"""Benchmarks of diffusiongemma, installed next to it (setup.py) and run as modules or files:

  python -m benchmarks.vs_transformers --size=small      # ours against transformers' generate, side by side
  python -m benchmarks.suite --config=configs/tiny.py    # diffusion vs AR, MFU, step breakdown, MoE, training
  python -m benchmarks.moe                               # the MoE layer: grouped vs ragged vs dense
  python -m benchmarks.constraints                       # constrained decoding's cost
  python -m benchmarks.accelerator --output=results/accelerator_h100.json   # everything a lent GPU can measure
  (or `python benchmarks/<name>.py ...`)

Shared helpers: `measure` (XLA costs, the step taken apart; the timer, in-run machine peaks and provenance
of `diffusiongemma.timing`, which projects/ uses too) and
`hf_reference` (a tiny random transformers DiffusionGemma and its outputs, run as `generate` does; the
tests' cross-checks use it too; needs the `hf` extra: torch and transformers). Importing the package
imports nothing.
"""

"""The autoregressive baseline of configs/small.py: the same model, trained on the next-token loss alone.

The encoder is the whole model here (the denoiser passes are skipped, `diffusion_loss_weight=0`), so its
perplexity on diffusion samples is an independent judge of their quality (scripts/evaluate.py
--generative --baseline_workdir=...). Train it on the same corpus and tokenizer as the diffusion model
(`--config.data.tokenizer_path=<diffusion workdir>/tokenizer.model`) so that their ids mean the same.

`get_config("tiny")` is the same baseline of configs/tiny.py (tests).
"""

import pathlib

from diffusiongemma.build.config import load_config_file

SIZES = ("small", "tiny")


def get_config(arg=None):
  size = arg or "small"
  if size not in SIZES:
    raise ValueError(f"Unknown configs/small_ar.py argument {size!r}; expected one of {SIZES}.")
  config = load_config_file(pathlib.Path(__file__).parent / f"{size}.py")
  config.diffusion.diffusion_loss_weight = 0.0
  config.diffusion.self_conditioning_prob = 0.0  # no denoiser pass to condition
  return config

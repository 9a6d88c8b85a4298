"""Evaluation on the validation split: diffusion loss, next-token perplexity, masked-noise bound.

The diffusion loss is measured on every canvas of each sequence at once (the block-causal pass of
`all_canvases=True`): its expectation equals the one-canvas training objective's, with less variance
per second. Noise levels, corruptions and self-conditioning draws come from a fixed seed, so two
evaluations of the same parameters give the same numbers, and two checkpoints see the same noise.

- `ar_perplexity`: exp of the encoder's next-token cross-entropy on the clean sequences.
- `perplexity_bound` (masked noise only): exp of the per-token diffusion loss, which for absorbing
  noise with the 1/t weighting is the continuous-time ELBO: an upper bound on the perplexity of the
  canvas tokens given the prompt and the earlier canvases.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import jax
import numpy as np

from diffusiongemma.diffusion import loss as loss_lib

EVAL_SEED = 1234


def eval_loss_config(loss_config: loss_lib.LossConfig) -> loss_lib.LossConfig:
  return loss_config.replace(all_canvases=True)


def evaluate_params(eval_step: Callable, params, batches: Iterable, *, num_batches: int,
                    elbo: bool, to_global: Callable = lambda b: b, seed: int = EVAL_SEED) -> dict:
  """Mean metrics of `eval_step(params, batch, rng)` over the first `num_batches` batches.

  Returns `diffusion_loss`, `ar_loss`, `ar_perplexity`, `loss`, `num_batches`, and
  `perplexity_bound` when the loss is an ELBO (`elbo`: masked noise, `NoiseProcess.loss_is_elbo`).
  """
  sums, count = {}, 0
  base = jax.random.PRNGKey(seed)
  for i, batch in enumerate(batches):
    if i >= num_batches:
      break
    rng = np.asarray(jax.random.fold_in(base, i))  # host data: the same on every process
    metrics = jax.device_get(eval_step(params, to_global(batch), rng))
    for k, v in metrics.items():
      sums[k] = sums.get(k, 0.0) + float(v)
    count += 1
  if not count:
    raise ValueError("The validation split yields no batch: it needs at least batch_size sequences.")
  means = {k: v / count for k, v in sums.items()}
  out = {k: means[k] for k in ("loss", "diffusion_loss", "diffusion_ce", "ar_loss")}
  out["ar_perplexity"] = float(np.exp(min(means["ar_loss"], 700.0)))
  if elbo:
    out["perplexity_bound"] = float(np.exp(min(means["diffusion_loss"], 700.0)))
  out["num_batches"] = count
  return {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}

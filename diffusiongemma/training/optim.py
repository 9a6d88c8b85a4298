"""The optimizer: AdamW with linear warmup, cosine decay and global-norm gradient clipping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax

# The config.train fields that define the optimizer and its schedule.
OPTIMIZER_FIELDS = ("learning_rate", "warmup_steps", "num_steps", "final_learning_rate_ratio",
                    "adam_b1", "adam_b2", "weight_decay", "grad_clip")


def learning_rate_schedule(train: Mapping[str, Any]) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate` over `warmup_steps`, then cosine decay to
  `learning_rate * final_learning_rate_ratio` at `num_steps`."""
  peak = float(train["learning_rate"])
  warmup = int(train["warmup_steps"])
  total = max(int(train["num_steps"]), warmup + 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup, decay_steps=total,
      end_value=peak * float(train["final_learning_rate_ratio"]))


def _decay_mask(params):
  """Weight decay on matrices and embeddings only, not on norms, scalars and router scales."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(train: Mapping[str, Any]) -> optax.GradientTransformation:
  """`config.train` -> clip_by_global_norm (if grad_clip > 0) then AdamW on the schedule above."""
  transforms = []
  if float(train["grad_clip"]) > 0:
    transforms.append(optax.clip_by_global_norm(float(train["grad_clip"])))
  transforms.append(optax.adamw(learning_rate_schedule(train), b1=float(train["adam_b1"]),
                                b2=float(train["adam_b2"]), weight_decay=float(train["weight_decay"]),
                                mask=_decay_mask))
  return optax.chain(*transforms)

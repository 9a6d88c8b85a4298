"""The optimizer: AdamW with linear warmup, cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import optax


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
  """What defines the optimizer and its schedule (`config.train`'s fields of the same names)."""

  learning_rate: float
  warmup_steps: int
  num_steps: int
  final_learning_rate_ratio: float = 0.1
  adam_b1: float = 0.9
  adam_b2: float = 0.95
  weight_decay: float = 0.01
  grad_clip: float = 1.0
  mu_dtype: str = ""  # Adam's first moment: '' the parameters' dtype, or 'bfloat16'

  def __post_init__(self):
    for field in ("learning_rate", "final_learning_rate_ratio", "weight_decay", "grad_clip"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"config.train.{field}={value!r} is invalid: must be a finite number >= 0.")
    for field in ("adam_b1", "adam_b2"):
      if not 0 <= getattr(self, field) < 1:
        raise ValueError(f"config.train.{field}={getattr(self, field)!r} is invalid: must be in [0, 1).")
    if self.mu_dtype not in MU_DTYPES:
      raise ValueError(f"config.train.mu_dtype={self.mu_dtype!r} is invalid; expected one of {MU_DTYPES}.")

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> "OptimizerSettings":
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


MU_DTYPES = ("", "float32", "bfloat16")
OPTIMIZER_FIELDS = tuple(f.name for f in dataclasses.fields(OptimizerSettings))


def _settings(train) -> OptimizerSettings:
  return train if isinstance(train, OptimizerSettings) else OptimizerSettings.from_mapping(train)


def learning_rate_schedule(train: Mapping[str, Any] | OptimizerSettings) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate` over `warmup_steps`, then cosine decay to
  `learning_rate * final_learning_rate_ratio` at `num_steps`."""
  train = _settings(train)
  peak = float(train.learning_rate)
  warmup = int(train.warmup_steps)
  total = max(int(train.num_steps), warmup + 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup, decay_steps=total,
      end_value=peak * float(train.final_learning_rate_ratio))


def _decay_mask(params):
  """Weight decay on matrices and embeddings only, not on norms, scalars and router scales."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(train: Mapping[str, Any] | OptimizerSettings) -> optax.GradientTransformation:
  """Settings (or `config.train`) -> clip_by_global_norm (if grad_clip > 0) then AdamW on the schedule
  above."""
  train = _settings(train)
  transforms = []
  if float(train.grad_clip) > 0:
    transforms.append(optax.clip_by_global_norm(float(train.grad_clip)))
  transforms.append(optax.adamw(learning_rate_schedule(train), b1=float(train.adam_b1),
                                b2=float(train.adam_b2), weight_decay=float(train.weight_decay),
                                mask=_decay_mask, mu_dtype=train.mu_dtype or None))
  return optax.chain(*transforms)

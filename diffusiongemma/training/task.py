"""`Task`: everything `train(task, workdir)` needs, as objects (`build.train_task(config, workdir)` makes one).

Training never reads a config: the model, the objective, the optimizer, the data and the loop's settings
arrive here already built and validated. `description` is the run's identity (the JSON of the config that
made it): it is saved in the workdir and in every checkpoint, and a checkpoint is only resumed by a task
whose description agrees on everything that changes what is trained (`checkpoint.config_mismatches`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from diffusiongemma.diffusion import loss as loss_lib
from diffusiongemma.model import ModelConfig
from diffusiongemma.training import lora as lora_lib
from diffusiongemma.training import optim

NAN_POLICIES = ("error", "skip")


def _steps_range(value) -> tuple[int, int] | None:
  """`config.train.profile_steps` ('a,b', 'a', (a, b), '' or None) as (first, last) steps, 1 <= a <= b."""
  if value in (None, "", ()):
    return None
  parts = [p.strip() for p in value.split(",")] if isinstance(value, str) else list(value)
  try:
    steps = [int(p) for p in parts]
  except (TypeError, ValueError):
    steps = []
  if len(steps) == 1:
    steps *= 2
  if len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
    raise ValueError(f"config.train.profile_steps must be 'first,last' steps with 1 <= first <= last (or one "
                     f"step), got {value!r}.")
  return steps[0], steps[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSettings:
  """How the loop runs: steps, batch, intervals, budget, seed (`config.train`'s fields of these names)."""

  num_steps: int
  batch_size: int  # global: split over every device and process
  log_every: int = 10
  eval_every: int = 200  # also at step 0 of a fresh run; 0 disables
  eval_batches: int = 8
  checkpoint_every: int = 200
  keep_checkpoints: int = 3
  async_checkpointing: bool = True
  time_budget_s: float = 0.0  # stop (and save) once the whole run (resumes included) trained this long; 0: none
  nan_policy: str = "error"  # 'error' (stop, naming step and metric) | 'skip' (drop the update)
  seed: int = 0
  grad_accum_steps: int = 1  # micro-batches per update (the same update as the whole batch)
  profile_steps: Any = None  # 'a,b' (or (a, b)): a jax.profiler trace of steps a..b into workdir/profile

  def __post_init__(self):
    for name in ("batch_size", "log_every", "checkpoint_every", "keep_checkpoints", "grad_accum_steps"):
      if _int(getattr(self, name)) < 1:
        raise ValueError(f"config.train.{name} must be an integer >= 1, got {getattr(self, name)!r}.")
    for name in ("num_steps", "eval_every", "eval_batches"):
      if _int(getattr(self, name)) < 0:
        raise ValueError(f"config.train.{name} must be an integer >= 0, got {getattr(self, name)!r}.")
    if not (isinstance(self.time_budget_s, (int, float)) and 0 <= self.time_budget_s < math.inf):
      raise ValueError(f"config.train.time_budget_s must be a finite number >= 0, got {self.time_budget_s!r}.")
    if self.nan_policy not in NAN_POLICIES:
      raise ValueError(f"Unknown config.train.nan_policy {self.nan_policy!r}; expected one of {NAN_POLICIES}.")
    object.__setattr__(self, "profile_steps", _steps_range(self.profile_steps))

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> "LoopSettings":
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


def _int(value) -> int:
  if isinstance(value, bool) or not isinstance(value, int):
    return -1
  return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
  """A training run as objects.

  datasets: `split -> grain.IterDataset` of this process's rows of every batch ('train': shuffled and
    repeated, 'validation': one pass), called once the workdir is ready (it may write there, e.g. a
    tokenizer trained on the corpus).
  sequence_length: tokens per example (for tokens/s).
  num_canvases: canvas slots per example after the prompt (the loss's n).
  mesh: the `config.mesh` axis sizes; the loop builds the mesh and the logical rules from it.
  lora: train LoRA adapters of the `init_from` weights (which stay frozen); None: full training.
  init_from: start from these weights (a training workdir or a transformers folder); '' : random.
  description / description_defaults: the run's identity as JSON and the defaults a missing field reads as.
  """

  model_config: ModelConfig
  loss: loss_lib.LossConfig
  optimizer: optim.OptimizerSettings
  loop: LoopSettings
  datasets: Callable[[str], Any]
  sequence_length: int
  num_canvases: int
  mesh: Mapping[str, int]
  lora: lora_lib.LoraConfig | None = None
  init_from: str = ""
  description: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  description_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.lora is not None and not self.init_from:
      raise ValueError(f"LoRA (rank {self.lora.rank}) trains adapters on frozen weights: set "
                       "config.train.init_from to a training workdir or a transformers checkpoint folder.")
    if self.sequence_length > self.model_config.max_positions:
      raise ValueError(f"A sequence of {self.sequence_length} tokens exceeds model.max_positions="
                       f"{self.model_config.max_positions}.")

"""The registries: which name in a config means which object. One table per kind of component.

An entry is the class (or factory) and the config keys that set its arguments: `config.sampler.acceptance
= 'margin'` with `config.sampler.margin_accept = 0.9` builds `Margin(threshold=0.9)`. Every key of every
entry is declared in the base config (`build/config.py` derives the sampler section from these tables, with
each argument's default), so any registered rule and its parameters can be chosen from flags, e.g.
`--config.sampler.acceptance=margin --config.sampler.margin_accept=0.8`.

A new acceptance rule, stopping rule or schedule is one class in `diffusion/` and one line here; a new noise
process is one class and one line in `diffusion/noise.PROCESSES`; a new training task is an entry of
`TASKS` or, for a project outside the package, a module path (`build/tasks.py`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from diffusiongemma.diffusion import acceptance
from diffusiongemma.diffusion import noise
from diffusiongemma.diffusion import schedules
from diffusiongemma.diffusion import stopping


@dataclasses.dataclass(frozen=True)
class Entry:
  """A registered component: `make(**{argument: config[key] for key, argument in params.items()})`."""

  make: Callable[..., Any]
  params: Mapping[str, str] = dataclasses.field(default_factory=dict)  # config key -> argument name

  def defaults(self) -> dict[str, Any]:
    """The config keys with the default values of the arguments they set."""
    signature = inspect.signature(self.make)
    return {key: signature.parameters[arg].default for key, arg in self.params.items()}

  def build(self, values: Mapping[str, Any]) -> Any:
    return self.make(**{arg: values[key] for key, arg in self.params.items()})


ACCEPTANCE: dict[str, Entry] = {
    "entropy": Entry(acceptance.EntropyBound, {"entropy_bound": "bound"}),  # released
    "confidence": Entry(acceptance.Confidence, {"confidence_accept": "threshold"}),
    "count": Entry(acceptance.TopCount, {"tokens_per_step": "count"}),
    "margin": Entry(acceptance.Margin, {"margin_accept": "threshold"}),
    "prefix": Entry(acceptance.ConfidentPrefix, {"prefix_accept": "threshold"}),
}
STOPPING: dict[str, Entry] = {
    "stable": Entry(stopping.stable_and_confident, {"stability_threshold": "stability_threshold",
                                                    "confidence_threshold": "confidence_threshold"}),  # released
    "fixed": Entry(stopping.NoEarlyStop),
}
SCHEDULES: dict[str, Entry] = {
    "linear": Entry(schedules.Linear, {"t_max": "t_max", "t_min": "t_min"}),  # released
    "cosine": Entry(schedules.Cosine, {"t_max": "t_max", "t_min": "t_min"}),
    "constant": Entry(schedules.Constant, {"temperature": "temperature"}),
}
NOISES = noise.PROCESSES  # config.diffusion.noise -> (vocab_size, mask_token_id) -> process

# config.sampler's key naming each component, and its table.
SAMPLER_COMPONENTS: dict[str, dict[str, Entry]] = {
    "acceptance": ACCEPTANCE, "stopping": STOPPING, "schedule": SCHEDULES}
RELEASED = {"acceptance": "entropy", "stopping": "stable", "schedule": "linear"}


def lookup(table: Mapping[str, Any], name: str, field: str) -> Any:
  if name not in table:
    raise ValueError(f"Unknown {field} {name!r}; expected one of {tuple(table)}.")
  return table[name]


def component_defaults() -> dict[str, Any]:
  """Every key the sampler components read, with its default (the argument's), for the base config."""
  values: dict[str, Any] = {}
  for table in SAMPLER_COMPONENTS.values():
    for entry in table.values():
      for key, default in entry.defaults().items():
        if values.setdefault(key, default) != default:
          raise ValueError(f"Registry entries disagree on the default of config.sampler.{key}.")
  return values

"""LoRA: low-rank adapters on the attention and feed-forward projections, with the base frozen.

Design. The adapters are a parameter tree of their own, shaped like the part of the base they adapt
(`{'layer_0': {'attn': {'q_einsum': {'lora_a': A, 'lora_b': B}}}, ...}`), and are merged into the base
functionally before each apply:

    W' = W + (alpha / r) * A @ B      A: [in..., r] (fan-in init), B: [r, out...] (zeros)

over each weight's input axes (e.g. D of `q_einsum [N, D, H]`, F of `mlp/linear [F, D]`), and per
expert for expert weights (`experts/linear [E, F, D]`: A [E, F, r], B [E, r, D]). B starts at zero, so
an untrained adapter leaves the model unchanged. The model code does not know about LoRA: the merged
tree is an ordinary parameter tree, so every apply (training, sampling, `convert.save_hf`) runs as is.

Training (`make_train_step`): the train state holds the adapters and their optimizer state only; the
base is an argument of the jitted step, neither updated nor donated, so it stays bit-identical and the
optimizer (AdamW) never sees it: no moments, no copies, nothing to mask. Checkpoints hold the adapters
(`save_adapters` / `load_adapters`, or the train `Checkpointer` on the adapter state); the base is
loaded from its own source. `merge` (or `save_hf`) folds the adapters in for export.

Cost. Memory: the adapters and 2x their size of Adam moments, plus, during a step, one merged copy of
the targeted weights and their gradient (as full fine-tuning has), instead of 2x the whole model of
moments. Compute per step: the forward and backward of the merged model as in full fine-tuning
(including the weight gradient dW' of each targeted weight, from which dA = dW' B^T and dB = A^T dW'
cost 2 x in x out x r per weight), plus the merge itself (in x out x r per weight): for r much
smaller than the tokens per batch, a few percent over full fine-tuning. Applying x A B beside x W
inside the modules would skip dW' but change every module; merging keeps the model untouched.

Axes in the layouts: N query heads, K kv heads, D model, H head dim, G gate/up, F feed-forward,
E experts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

from diffusiongemma import _files
from diffusiongemma.diffusion import loss as loss_lib
from diffusiongemma.model import layers
from diffusiongemma.training import step as step_lib
from diffusiongemma.training.state import TrainState

Array = jax.Array

# '<module>/<parameter>' -> (the weight's axes, its input axes, its batch axes).
LAYOUTS = {
    "attn/q_einsum": ("NDH", "D", ""),
    "attn/k_einsum": ("KDH", "D", ""),
    "attn/v_einsum": ("KDH", "D", ""),
    "attn/attn_vec_einsum": ("NHD", "NH", ""),
    "mlp/gating_einsum": ("GFD", "D", ""),
    "mlp/linear": ("FD", "F", ""),
    "experts/gating_einsum": ("EGFD", "D", "E"),
    "experts/linear": ("EFD", "F", "E"),
}
DEFAULT_TARGETS = (r"attn/(q|k|v|attn_vec)_einsum$", r"(mlp|experts)/(gating_einsum|linear)$")
ADAPTER_KEYS = ("lora_a", "lora_b")
LORA_CONFIG_FILENAME = "lora.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """Rank r, scale alpha (the update is alpha / r x A @ B) and which weights get adapters: regexes
  searched in each weight's path (e.g. 'layer_3/attn/q_einsum'); only the projections in `LAYOUTS`
  can be adapted (self-conditioning's MLP matches 'mlp/...' too)."""

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = DEFAULT_TARGETS

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
      raise ValueError(f"LoraConfig.rank={self.rank!r} is invalid: must be a positive integer.")
    if not self.alpha > 0:
      raise ValueError(f"LoraConfig.alpha={self.alpha!r} is invalid: must be positive.")
    for pattern in self.targets:
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"LoraConfig.targets has an invalid regex {pattern!r}: {e}.") from None

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def to_dict(self) -> dict[str, Any]:
    return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "LoraConfig":
    values = dict(values)
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"Unknown LoraConfig fields {unknown}.")
    return cls(**values)


def _bare(params):
  """(the parameter tree, a function re-wrapping a tree like `params`): accepts `{'params': ...}`."""
  params = nn.unbox(params)
  if isinstance(params, Mapping) and set(params) == {"params"}:
    return params["params"], lambda tree: {"params": tree}
  return params, lambda tree: tree


def _targets(tree, config: LoraConfig) -> dict[tuple[str, ...], str]:
  """{path: layout name} of the weights of `tree` that get adapters."""
  found = {}
  for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    layout = "/".join(keys[-2:])
    if layout in LAYOUTS and any(re.search(p, "/".join(keys)) for p in config.targets):
      found[keys] = layout
  return found


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _factor_shapes(layout: str, shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  axes, inputs, batch = LAYOUTS[layout]
  size = dict(zip(axes, shape))
  outputs = [a for a in axes if a not in inputs and a not in batch]
  a_shape = tuple(size[x] for x in batch + inputs) + (rank,)
  b_shape = tuple(size[x] for x in batch) + (rank,) + tuple(size[x] for x in outputs)
  return a_shape, b_shape


def delta(layout: str, a: Array, b: Array) -> Array:
  """A @ B of one adapter, in the axis order of the weight it adapts."""
  axes, inputs, batch = LAYOUTS[layout]
  outputs = "".join(x for x in axes if x not in inputs and x not in batch)
  return jnp.einsum(f"{batch}{inputs}r,{batch}r{outputs}->{axes}", a, b)


def init_adapters(params, config: LoraConfig, rng: Array) -> dict:
  """Adapters for the targeted weights of `params`: A fan-in normal, B zero, in float32 whatever the base's
  dtype (they are the master weights of a LoRA run; `merge` casts their update to the base's dtype)."""
  tree, _ = _bare(params)
  targets = _targets(tree, config)
  if not targets:
    raise ValueError(f"LoraConfig.targets {config.targets} match no adaptable weight; adaptable: "
                     f"{sorted(LAYOUTS)}.")
  adapters: dict = {}
  for i, (path, layout) in enumerate(sorted(targets.items())):
    weight = _get(tree, path)
    a_shape, b_shape = _factor_shapes(layout, weight.shape, config.rank)
    _, inputs, batch = LAYOUTS[layout]
    fan_in_axes = list(range(len(batch), len(batch) + len(inputs)))
    a = layers.fan_in_init(fan_in_axes)(jax.random.fold_in(rng, i), a_shape, jnp.float32)
    _set(adapters, path, {"lora_a": a, "lora_b": jnp.zeros(b_shape, jnp.float32)})
  return adapters


def merge(params, adapters, config: LoraConfig):
  """`params` with W + (alpha / r) A @ B for every adapted weight (same structure and dtypes)."""
  tree, wrap = _bare(params)
  merged = jax.tree.map(lambda x: x, tree)  # a fresh container: the input is not mutated
  flat = jax.tree_util.tree_flatten_with_path(adapters, is_leaf=lambda x: isinstance(x, Mapping)
                                              and set(x) == set(ADAPTER_KEYS))[0]
  for path, adapter in flat:
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    layout = "/".join(keys[-2:])
    if layout not in LAYOUTS:
      raise ValueError(f"No LoRA layout for {'/'.join(keys)}; adaptable: {sorted(LAYOUTS)}.")
    weight = _get(merged, keys)
    update = config.scale * delta(layout, adapter["lora_a"], adapter["lora_b"])
    _set(merged, keys, (weight + update.astype(weight.dtype)).astype(weight.dtype))
  return wrap(merged)


def merge_fn(config: LoraConfig) -> Callable:
  """`(base, adapters) -> merged variables`, for `make_train_step`."""
  return lambda base, adapters: merge(base, adapters, config)


def num_parameters(tree) -> int:
  return sum(x.size for x in jax.tree.leaves(tree))


def create_train_state(base, optimizer: optax.GradientTransformation, config: LoraConfig, *,
                       seed: int) -> TrainState:
  """A TrainState whose params are fresh adapters for `base` and whose optimizer state covers them
  alone."""
  init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
  adapters = init_adapters(base, config, init_rng)
  return TrainState(step=jnp.zeros((), jnp.int32), params=adapters, opt_state=optimizer.init(adapters),
                    rng=train_rng)


def make_train_step(model, optimizer: optax.GradientTransformation, loss_config: loss_lib.LossConfig,
                    config: LoraConfig, *, num_canvases: int, schedule: optax.Schedule | None = None
                    ) -> Callable:
  """`step(state, batch, base) -> (state, metrics)`: one update of the adapters in `state` through
  the objective of the merged model; `base` is read only (see the module docstring)."""
  return step_lib.make_train_step(model, optimizer, loss_config, num_canvases=num_canvases,
                                  schedule=schedule, merge=merge_fn(config))


def save_adapters(path: os.PathLike | str, adapters, config: LoraConfig) -> None:
  """Writes the adapters (orbax, exact dtypes) and `lora.json` (their LoraConfig) to folder `path` (local or
  gs://)."""
  path = _files.as_path(path, "path", absolute=True)
  path.mkdir(parents=True, exist_ok=True)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path / "adapters", adapters, force=True)
  checkpointer.wait_until_finished()
  _files.atomic_write(path / LORA_CONFIG_FILENAME, json.dumps(config.to_dict(), indent=2))


def load_adapters(path: os.PathLike | str) -> tuple[dict, LoraConfig]:
  """(adapters, LoraConfig) written by `save_adapters`."""
  path = _files.as_path(path, "path", absolute=True)
  config_file = path / LORA_CONFIG_FILENAME
  if not _files.present(config_file):
    raise FileNotFoundError(f"{str(path)!r} holds no LoRA adapters (no {LORA_CONFIG_FILENAME}).")
  values = _files.read_json(config_file)
  try:
    config = LoraConfig.from_dict(values)
  except (TypeError, ValueError) as e:
    raise _files.BadFileError(f"{config_file}: {e}") from None
  with _files.reading(f"The LoRA adapters {str(path)!r}, item 'adapters',", "They are damaged or incomplete."):
    adapters = ocp.StandardCheckpointer().restore(path / "adapters")
  return adapters, config


def save_hf(model_config, base, adapters, config: LoraConfig, path: os.PathLike | str, **kwargs) -> None:
  """The merged model as a transformers checkpoint folder (`convert.save_hf`)."""
  from diffusiongemma import convert  # pylint: disable=g-import-not-at-top
  convert.save_hf(model_config, merge(base, adapters, config), path, **kwargs)

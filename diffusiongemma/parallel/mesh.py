"""The device mesh and the logical-axis rules that place parameters and activations on it.

The mesh has four named axes, always in this order: `data` (batch), `fsdp` (batch, and parameters split
along their model dimension), `expert` (MoE experts, and batch elsewhere), `tensor` (heads, feed-forward
and vocabulary). Sizes come from `config.mesh`; one of them may be -1, meaning every device the others
leave. Modules only name logical axes (`nn.with_logical_partitioning`); `LOGICAL_RULES` (overridable in
`config.mesh.rules`) maps them to mesh axes, and this module is the one place that builds the mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the batch is split over every axis but `tensor`

# (logical axis, mesh axis or axes or None). Parameters: embed is split by fsdp (ZeRO-3 style: gathered
# per layer inside the step), experts by expert, heads / ffn / vocab by tensor. Activations: batch.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", None),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
)


def mesh_shape(mesh_config: Mapping[str, int], num_devices: int | None = None) -> dict[str, int]:
  """Axis sizes from `config.mesh` (one may be -1: the rest), checked against the device count."""
  num_devices = jax.device_count() if num_devices is None else num_devices
  sizes = {}
  for axis in MESH_AXES:
    size = mesh_config.get(axis, 1)
    if not isinstance(size, int) or (size < 1 and size != -1):
      raise ValueError(f"config.mesh.{axis}={size!r}: expected a positive int, or -1 for the rest.")
    sizes[axis] = size
  unknown = sorted(set(mesh_config) - set(MESH_AXES) - {"rules"})
  if unknown:
    raise ValueError(f"Unknown config.mesh axes {unknown}; the mesh axes are {MESH_AXES}.")
  rest = [axis for axis, size in sizes.items() if size == -1]
  if len(rest) > 1:
    raise ValueError(f"Only one config.mesh axis may be -1, got {rest}.")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if rest:
    if num_devices % fixed:
      raise ValueError(f"config.mesh {sizes}: the fixed axes use {fixed} devices, which does not divide "
                       f"the {num_devices} devices.")
    sizes[rest[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(f"config.mesh {sizes} has {fixed} devices in all, but there are {num_devices}.")
  return sizes


def make_mesh(mesh_config: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The (data, fsdp, expert, tensor) mesh of `config.mesh` over `devices` (default: all of them)."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = mesh_shape(mesh_config, len(devices))
  return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_rules(mesh_config: Mapping[str, Any] | None = None) -> tuple[tuple[str, Any], ...]:
  """`config.mesh.rules` if the config names any (a sequence of (logical, mesh) pairs), else the default."""
  rules = (mesh_config or {}).get("rules")
  if not rules:
    return LOGICAL_RULES
  rules = tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)
  for name, axes in rules:
    for axis in (axes if isinstance(axes, tuple) else (axes,)):
      if axis is not None and axis not in MESH_AXES:
        raise ValueError(f"config.mesh.rules maps {name!r} to {axis!r}, which is not a mesh axis "
                         f"{MESH_AXES}.")
  return rules


def param_specs(boxed_params, mesh_sizes: Mapping[str, int], rules=LOGICAL_RULES):
  """PartitionSpecs of a tree of `nn.Partitioned` parameters (e.g. from `jax.eval_shape(model.init)`).

  `mesh_sizes` maps mesh axes to sizes (a `Mesh.shape`). A dimension that the chosen mesh axes do not
  divide is replicated instead (e.g. 2 KV heads on a tensor axis of 4), so every mesh runs.
  """
  specs = nn.get_partition_spec(boxed_params)
  shapes = nn.unbox(boxed_params)

  def place(spec, shape):
    logical = tuple(nn.logical_to_mesh_axes(spec, rules))
    axes = []
    for dim, axis in zip(shape.shape, logical + (None,) * (len(shape.shape) - len(logical))):
      size = math.prod(mesh_sizes[a] for a in (axis if isinstance(axis, tuple) else (axis,)) if a)
      axes.append(axis if axis and dim % size == 0 else None)
    return PartitionSpec(*axes)

  return jax.tree.map(place, specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_shardings(boxed_params, mesh: Mesh, rules=LOGICAL_RULES):
  """NamedShardings of a tree of `nn.Partitioned` parameters on `mesh` (see `param_specs`)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(boxed_params, mesh.shape, rules),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Arrays [B, ...] split along the batch over (data, fsdp, expert)."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def init_params(model: nn.Module, rng: jax.Array, mesh: Mesh, *init_args, rules=LOGICAL_RULES):
  """(params, shardings): `model.init(rng, *init_args)['params']` created directly in its sharding.

  The shapes come from `jax.eval_shape`, and `init` runs under `jit` with `out_shardings`, so no device
  ever holds a parameter whole unless its sharding says so.
  """
  boxed = jax.eval_shape(model.init, rng, *init_args)["params"]
  shardings = param_shardings(boxed, mesh, rules)
  init = jax.jit(lambda r: nn.unbox(model.init(r, *init_args)["params"]), out_shardings=shardings)
  return init(rng), shardings


def abstract_with_sharding(tree, sharding):
  """`tree` as ShapeDtypeStructs placed by `sharding`: one sharding for every leaf, or a matching tree."""
  if isinstance(sharding, jax.sharding.Sharding):
    sharding = jax.tree.map(lambda _: sharding, tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding)

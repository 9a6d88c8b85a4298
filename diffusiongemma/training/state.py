"""The train state, its shardings, and its initialisation (abstractly first, with `jax.eval_shape`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from diffusiongemma import parallel

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  """Everything a training step reads and writes, and everything a checkpoint must hold.

  `rng` is a raw uint32 key [2], never split in place: step s uses `fold_in(rng, s)`, so the
  randomness of a step depends only on the seed and the step (exact resume needs nothing else).
  """

  step: Array  # int32 scalar: updates done so far
  params: Any  # model variables {'params': ...}, unboxed
  opt_state: Any
  rng: Array

  def to_dict(self) -> dict[str, Any]:
    return {"step": self.step, "params": self.params, "opt_state": self.opt_state, "rng": self.rng}


def _init(model: nn.Module, optimizer: optax.GradientTransformation, seed: int, prompt_length: int,
          canvas_length: int) -> TrainState:
  init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
  prompt = jnp.zeros((1, prompt_length), jnp.int32)
  canvas = jnp.zeros((1, canvas_length), jnp.int32)
  params = nn.unbox(model.init(init_rng, prompt, canvas))
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                    rng=train_rng)


def abstract_train_state(model, optimizer, *, seed: int, prompt_length: int = 1) -> TrainState:
  """The shapes and dtypes of the train state, with no memory allocated."""
  return jax.eval_shape(lambda: _init(model, optimizer, seed, prompt_length, model.config.canvas_length))


def state_shardings(model, optimizer, mesh: Mesh, *, seed: int, prompt_length: int = 1,
                    rules=parallel.LOGICAL_RULES) -> TrainState:
  """A TrainState of NamedShardings: parameters by the logical rules, optimizer state like them.

  An optimizer-state leaf whose key path ends in a parameter's path with that parameter's shape (Adam's
  moments, at any depth of the optax chain) is sharded like the parameter; everything else (step
  counts, the rng, the step) is replicated. So the moments never cost more memory than the parameters.
  """
  prompt = jax.ShapeDtypeStruct((1, prompt_length), jnp.int32)
  canvas = jax.ShapeDtypeStruct((1, model.config.canvas_length), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), prompt, canvas)
  params = {"params": parallel.param_shardings(boxed["params"], mesh, rules)}
  shapes = {"params": jax.tree.map(lambda x: x.shape, nn.unbox(boxed["params"]))}
  by_path = {}
  for (path, sharding), shape in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(
      shapes, is_leaf=lambda x: isinstance(x, tuple)), strict=True):
    by_path[tuple(_key(k) for k in path)] = (sharding, shape)
  replicated = parallel.replicated(mesh)

  def place(path, leaf):
    keys = tuple(_key(k) for k in path)
    for start in range(len(keys)):
      sharding, shape = by_path.get(keys[start:], (None, None))
      if sharding is not None and shape == leaf.shape:
        return sharding
    return replicated

  abstract = abstract_train_state(model, optimizer, seed=seed, prompt_length=prompt_length)
  return TrainState(step=replicated, params=params, rng=replicated,
                    opt_state=jax.tree_util.tree_map_with_path(place, abstract.opt_state))


def _key(entry) -> str:
  for name in ("key", "name", "idx"):
    if hasattr(entry, name):
      return str(getattr(entry, name))
  return str(entry)


def make_init_fn(model, optimizer, *, seed: int, prompt_length: int = 1, sharding=None):
  """A jitted `() -> TrainState` that builds the state straight into `sharding`: one sharding for
  every leaf, or a TrainState of them (`state_shardings`); default unplaced."""
  fn = lambda: _init(model, optimizer, seed, prompt_length, model.config.canvas_length)
  out_shardings = sharding
  if isinstance(sharding, jax.sharding.Sharding):
    out_shardings = jax.tree.map(lambda _: sharding, jax.eval_shape(fn))
  return jax.jit(fn, out_shardings=out_shardings)


def create_train_state(model, optimizer, *, seed: int, prompt_length: int = 1, sharding=None) -> TrainState:
  """A freshly initialised state (see `make_init_fn`)."""
  return make_init_fn(model, optimizer, seed=seed, prompt_length=prompt_length, sharding=sharding)()

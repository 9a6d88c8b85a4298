"""The train state and its initialisation (abstractly first, with `jax.eval_shape`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

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


def make_init_fn(model, optimizer, *, seed: int, prompt_length: int = 1,
                 sharding: jax.sharding.Sharding | None = None):
  """A jitted `() -> TrainState` that builds the state straight into `sharding` (default: unplaced)."""
  fn = lambda: _init(model, optimizer, seed, prompt_length, model.config.canvas_length)
  abstract = jax.eval_shape(fn)
  out_shardings = None if sharding is None else jax.tree.map(lambda _: sharding, abstract)
  return jax.jit(fn, out_shardings=out_shardings)


def create_train_state(model, optimizer, *, seed: int, prompt_length: int = 1,
                       sharding: jax.sharding.Sharding | None = None) -> TrainState:
  """A freshly initialised state (see `make_init_fn`)."""
  return make_init_fn(model, optimizer, seed=seed, prompt_length=prompt_length, sharding=sharding)()

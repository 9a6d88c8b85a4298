"""The jitted train and eval steps, and the host-side guard against non-finite metrics."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from diffusiongemma.diffusion import loss as loss_lib
from diffusiongemma.training.state import TrainState

Array = jax.Array
NAN_POLICIES = ("error", "skip")
GUARDED_METRICS = ("loss", "diffusion_loss", "ar_loss", "grad_norm")


class NonFiniteError(FloatingPointError):
  """A training step produced NaN or Inf; the update was not applied."""


def make_train_step(model, optimizer: optax.GradientTransformation, loss_config: loss_lib.LossConfig, *,
                    num_canvases: int, schedule: optax.Schedule | None = None,
                    state_sharding=None, batch_sharding=None, merge: Callable | None = None,
                    frozen_sharding=None, grad_accum_steps: int = 1) -> Callable:
  """`step(state, batch) -> (state, metrics)`, jitted with the state donated.

  With `merge` (LoRA, `training.lora`) the step is `step(state, batch, frozen)`: the loss sees the
  variables `merge(frozen, state.params)` and only `state.params` (the adapters) are trained; `frozen`
  (the base) is read only, never donated or updated; with `state_sharding`, `frozen_sharding` places it.

  With `state_sharding` (a TrainState of shardings, `state_shardings`) and `batch_sharding` (one
  NamedSharding for every batch array), the step keeps the state in those shardings, takes the batch
  split over the batch axes and returns replicated metrics; it is traced and run under
  `jax.set_mesh(mesh)` so that code inside it (e.g. expert-parallel `shard_map`) finds the mesh.

  `grad_accum_steps` k > 1 runs the model on k micro-batches in turn (a `lax.scan`; micro-batch j holds rows
  j, j + k, ... so that each spans every device's rows) and sums their gradients: the loss terms of a
  micro-batch are its sums over the whole batch's denominators, with the whole batch's random draws
  (`loss.prepare`), so the update equals the whole batch's while only one micro-batch's activations live.

  The loss randomness is `fold_in(state.rng, state.step)`. A step whose loss, AR loss, diffusion loss
  or gradient norm is not finite leaves params and optimizer state unchanged (the step counter still
  advances, so the data and the randomness move on) and reports `finite = 0`; the caller decides
  whether that is an error (`check_finite`).
  """
  if grad_accum_steps > 1 and loss_config.certainty_weight > 0:
    raise ValueError(f"config.train.grad_accum_steps={grad_accum_steps} with config.diffusion.certainty_weight="
                     f"{loss_config.certainty_weight}: certainty forcing averages over the positions a batch already "
                     "predicts right, which micro-batches cannot share; use grad_accum_steps=1.")

  def step(state: TrainState, batch: Mapping[str, Array], frozen=None):
    rng = jax.random.fold_in(state.rng, state.step)
    examples = loss_lib.prepare(model, batch, rng, loss_config, num_canvases=num_canvases)
    norms = loss_lib.normalizers(examples, loss_config)

    def loss_fn(params, rows):
      variables = params if merge is None else merge(frozen, params)
      return loss_lib.loss_terms(model, variables, rows, norms, loss_config)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if grad_accum_steps == 1:
      (_, metrics), grads = grad_fn(state.params, examples)
    else:
      micro = jax.tree.map(lambda x: _micro_batches(x, grad_accum_steps), examples)

      def accumulate(total, rows):
        (_, metrics), grads = grad_fn(state.params, rows)
        return jax.tree.map(jnp.add, total, (grads, metrics)), None

      shapes = jax.eval_shape(grad_fn, state.params, jax.tree.map(lambda x: x[0], micro))
      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (shapes[1], shapes[0][1]))
      (grads, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
    metrics["grad_norm"] = optax.tree.norm(grads)
    finite = jnp.all(jnp.stack([jnp.isfinite(metrics[k]) for k in GUARDED_METRICS]))
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)
    params = jax.tree.map(keep, params, state.params)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    if schedule is not None:
      metrics["learning_rate"] = schedule(state.step)
    metrics["finite"] = finite.astype(jnp.float32)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  if state_sharding is None:
    return jax.jit(step, donate_argnums=0)
  replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.P())
  in_shardings = (state_sharding, batch_sharding) + ((frozen_sharding,) if merge is not None else ())
  jitted = jax.jit(step, donate_argnums=0, in_shardings=in_shardings,
                   out_shardings=(state_sharding, replicated))
  return under_mesh(jitted, batch_sharding.mesh)


def _micro_batches(x: Array, k: int) -> Array:
  """[B, ...] -> [k, B/k, ...], micro-batch j holding rows j, j + k, ...: every device's share of the batch
  is split alike, so each micro-batch keeps the batch's sharding."""
  if x.shape[0] % k:
    raise ValueError(f"The batch of {x.shape[0]} rows does not split into config.train.grad_accum_steps={k} "
                     "equal micro-batches.")
  return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)


def make_eval_step(model, loss_config: loss_lib.LossConfig, *, num_canvases: int, params_sharding=None,
                   batch_sharding=None) -> Callable:
  """`eval_step(params, batch, rng) -> metrics` of the objective (no gradient); with shardings (see
  `make_train_step`) it takes the parameters in `params_sharding` and runs under their mesh."""

  def eval_step(params, batch, rng):
    _, metrics = loss_lib.diffusion_loss(model, params, batch, rng, loss_config,
                                         num_canvases=num_canvases)
    return metrics

  if params_sharding is None:
    return jax.jit(eval_step)
  replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.P())
  jitted = jax.jit(eval_step, in_shardings=(params_sharding, batch_sharding, replicated),
                   out_shardings=replicated)
  return under_mesh(jitted, batch_sharding.mesh)


def under_mesh(fn: Callable, mesh: jax.sharding.Mesh) -> Callable:
  """`fn` called (and so traced) inside `jax.set_mesh(mesh)`; `.jitted` is `fn` itself (to lower it)."""

  @functools.wraps(fn)
  def call(*args, **kwargs):
    with jax.set_mesh(mesh):
      return fn(*args, **kwargs)

  call.jitted = fn
  return call


def check_finite(metrics: Mapping[str, float], step: int, policy: str) -> bool:
  """True if the step at `step` (1-based: the update that produced state.step == step) was finite.

  With `policy='error'` a non-finite step raises `NonFiniteError` naming the step and the offending
  metrics; with 'skip' it returns False (the update was already dropped by the step).
  """
  if policy not in NAN_POLICIES:
    raise ValueError(f"Unknown config.train.nan_policy {policy!r}; expected one of {NAN_POLICIES}.")
  if metrics["finite"]:
    return True
  bad = [k for k in GUARDED_METRICS if not math.isfinite(float(metrics[k]))]
  if policy == "error":
    values = ", ".join(f"{k}={float(metrics[k])}" for k in bad)
    raise NonFiniteError(f"Non-finite {', '.join(bad)} at step {step} ({values}); the update was not "
                         "applied. Set config.train.nan_policy='skip' to skip such updates instead.")
  return False

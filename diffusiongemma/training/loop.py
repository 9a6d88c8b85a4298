"""`train(task, workdir)` and `evaluate(task, workdir)`: the library behind scripts/train.py and
scripts/evaluate.py (a `Task` is built from a config by `build.train_task`).

Training resumes from the latest checkpoint in `workdir/checkpoints` (after checking the task's
description against the config that wrote it), restoring the parameters, optimizer state, step, rng, the data
iterator's position and the partial window of logged metrics, and dropping metric records of steps
after that checkpoint. The randomness of step s is `fold_in(rng, s)` and the data of step s is the
s-th batch of the seeded pipeline, so an interrupted run ends bit-identical to an uninterrupted one.
SIGTERM (preemption) saves a checkpoint after the current step and returns cleanly; with several processes,
SIGTERM to any one of them, or the time budget, stops all of them after the same step (`stopping.StopRule`).

Order of work per step: one batch, one jitted update, the NaN/Inf guard, then (at their intervals)
the log line, evaluation and the checkpoint; metrics are flushed before a checkpoint is written.

The state lives on the (data, fsdp, expert, tensor) mesh of `task.mesh`: parameters and optimizer
moments sharded by the logical rules, batches split over the batch axes. With several processes
(`parallel.initialize_distributed`) every process runs this same loop on its rows of each batch;
checkpoints are written by all of them together, the config and metrics by process 0 alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable

from absl import logging
import jax
import optax

import numpy as np

from diffusiongemma import _files
from diffusiongemma import parallel
from diffusiongemma import timing
from diffusiongemma.model import DiffusionGemma
from diffusiongemma.model import flops as flops_lib
from diffusiongemma.training import checkpoint as ckpt_lib
from diffusiongemma.training import lora as lora_lib
from diffusiongemma.training import metrics as metrics_lib
from diffusiongemma.training import optim
from diffusiongemma.training import state as state_lib
from diffusiongemma.training import step as step_lib
from diffusiongemma.training import stopping
from diffusiongemma.training import validation
from diffusiongemma.training.state import TrainState
from diffusiongemma.training.task import Task


def _write_config(workdir, config_json: dict) -> None:
  if not parallel.is_main_process():
    return
  _files.atomic_write(workdir / ckpt_lib.CONFIG_FILENAME, json.dumps(config_json, indent=2, sort_keys=True))


@dataclasses.dataclass(frozen=True)
class _Programs:
  """The model, optimizer and jitted programs of one training setup (see `_programs`)."""

  model: DiffusionGemma
  optimizer: optax.GradientTransformation
  abstract_state: TrainState  # of what is trained: the model, or LoRA adapters
  state_shardings: TrainState
  params_shardings: dict  # of the model's variables (the frozen base with LoRA)
  abstract_params: dict  # the model's variables' shapes
  init_fn: Callable  # () -> TrainState; with LoRA (base) -> TrainState
  train_step: Callable  # (state, batch) -> (state, metrics); with LoRA (state, batch, base)
  eval_step: Callable  # (model variables, batch, rng) -> metrics
  merge: Callable | None  # LoRA: (base, adapters) -> model variables, placed like the base


@functools.lru_cache(maxsize=4)
def _programs(model_cfg, loss_cfg, optimizer_settings, num_canvases, seed, mesh, rules, lora_cfg,
              grad_accum_steps=1) -> _Programs:
  """Model, optimizer, abstract state, shardings and the jitted steps, cached so that a process calling
  `train` or `evaluate` again with the same configs (resuming, notebooks, tests) compiles once.

  With `lora_cfg` what is trained is a state of LoRA adapters (replicated: they are small) on a frozen base
  placed by the model's parameter shardings; evaluation runs on the merged model."""
  model = DiffusionGemma(model_cfg)
  optimizer = optim.make_optimizer(optimizer_settings)
  schedule = optim.learning_rate_schedule(optimizer_settings)
  batch_sharding = parallel.batch_sharding(mesh, ndim=1)
  full_abstract = state_lib.abstract_train_state(model, optimizer, seed=seed)
  full_shardings = state_lib.state_shardings(model, optimizer, mesh, seed=seed, rules=rules)
  params_shardings = full_shardings.params
  eval_step = step_lib.make_eval_step(model, validation.eval_loss_config(loss_cfg), num_canvases=num_canvases,
                                      params_sharding=params_shardings, batch_sharding=batch_sharding)
  if lora_cfg is None:
    init_fn = state_lib.make_init_fn(model, optimizer, seed=seed, sharding=full_shardings)
    train_step = step_lib.make_train_step(model, optimizer, loss_cfg, num_canvases=num_canvases,
                                          schedule=schedule, state_sharding=full_shardings,
                                          batch_sharding=batch_sharding, grad_accum_steps=grad_accum_steps)
    return _Programs(model, optimizer, full_abstract, full_shardings, params_shardings, full_abstract.params,
                     init_fn, train_step, eval_step, None)
  create = lambda base: lora_lib.create_train_state(base, optimizer, lora_cfg, seed=seed)
  abstract = jax.eval_shape(create, full_abstract.params)
  shardings = jax.tree.map(lambda _: parallel.replicated(mesh), abstract)
  init_fn = jax.jit(create, in_shardings=(params_shardings,), out_shardings=shardings)
  train_step = step_lib.make_train_step(model, optimizer, loss_cfg, num_canvases=num_canvases,
                                        schedule=schedule, state_sharding=shardings,
                                        batch_sharding=batch_sharding, merge=lora_lib.merge_fn(lora_cfg),
                                        frozen_sharding=params_shardings, grad_accum_steps=grad_accum_steps)
  merge = jax.jit(lora_lib.merge_fn(lora_cfg), out_shardings=params_shardings)
  return _Programs(model, optimizer, abstract, shardings, params_shardings, full_abstract.params, init_fn,
                   train_step, eval_step, merge)


class _Setup:
  """What both train and evaluate need of a task: the mesh, the jitted programs, and the weights
  fine-tuning starts from (`task.init_from`)."""

  def __init__(self, task: Task, workdir):
    if not isinstance(task, Task):
      raise TypeError(f"train/evaluate take a training.Task (build.train_task(config, workdir)), got "
                      f"{type(task).__name__}.")
    self.task = task
    self.workdir = workdir_path(workdir)
    self.config_json = dict(task.description)
    self.model_cfg, self.loss_cfg, self.lora_cfg = task.model_config, task.loss, task.lora
    self.num_canvases = task.num_canvases
    self.mesh = parallel.make_mesh(task.mesh)
    self.batch_sharding = parallel.batch_sharding(self.mesh, ndim=1)
    self.programs = _programs(self.model_cfg, self.loss_cfg, task.optimizer, self.num_canvases,
                              task.loop.seed, self.mesh, parallel.logical_rules(task.mesh), self.lora_cfg,
                              task.loop.grad_accum_steps)
    self.init_from = task.init_from
    self._base = None

  @property
  def base(self):
    """The `init_from` weights, placed by the model's shardings (read once, when first needed)."""
    if self._base is None and self.init_from:
      self._base = ckpt_lib.load_weights(self.init_from, shardings=self.programs.params_shardings,
                                         expected=self.programs.abstract_params)
    return self._base

  def init_state(self) -> TrainState:
    """A fresh state: random, the `init_from` weights (with fresh optimizer moments), or LoRA adapters."""
    if self.lora_cfg is not None:
      return self.programs.init_fn(self.base)
    state = self.programs.init_fn()
    return state if self.base is None else state.replace(params=self.base)

  def train_step(self, state, batch):
    if self.lora_cfg is not None:
      return self.programs.train_step(state, batch, self.base)
    return self.programs.train_step(state, batch)

  def model_variables(self, params):
    """The variables of the model being trained: `params`, or with LoRA the base merged with them."""
    return params if self.lora_cfg is None else self.programs.merge(self.base, params)

  def restore(self, checkpointer: ckpt_lib.Checkpointer, step: int):
    """The state of `step`, restored straight into its shardings (each process reads its shards)."""
    abstract = parallel.abstract_with_sharding(self.programs.abstract_state.to_dict(),
                                               self.programs.state_shardings.to_dict())
    state, data_state, meta = checkpointer.restore(step, abstract)
    return TrainState(**state), data_state, meta

  def evaluate(self, params, val_dataset, num_batches: int) -> dict:
    return validation.evaluate_params(
        self.programs.eval_step, self.model_variables(params), iter(val_dataset),
        num_batches=num_batches, elbo=self.loss_cfg.is_elbo,
        to_global=lambda b: to_global(b, self.batch_sharding))


def to_global(batch, sharding: jax.sharding.NamedSharding):
  """A process-local numpy batch (this process's rows) as global jax arrays in `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


def workdir_path(workdir):
  """`workdir` as an `etils.epath.Path` (a local folder or a gs:// URI, `_files.as_path`), checked."""
  path = _files.as_path(workdir, "--workdir")
  if path.exists() and not path.is_dir():
    raise ValueError(f"--workdir {str(path)!r} exists and is not a directory.")
  return path


def _topology(mesh: jax.sharding.Mesh) -> dict:
  """Where a checkpoint was written (its `meta` item records it): the mesh's axis sizes, devices, processes."""
  return {"mesh": {axis: int(size) for axis, size in mesh.shape.items()}, "num_devices": int(mesh.size),
          "num_processes": jax.process_count()}


def _check_topology(saved: dict | None, current: dict, step: int, data_state: dict | None = None) -> None:
  """Logs that the checkpoint of `step` is resharded onto another mesh, device or process count (the restore
  places every array by this run's shardings, exactly; a data position counted in global batches,
  `data.batching`, is the same for any slicing of them), or refuses another process count by name when the
  data position is a per-process one (a project's own pipeline). A checkpoint older than the record (`saved`
  None) is restored as it is."""
  if saved is None or saved == current:
    return
  if saved["num_processes"] != current["num_processes"] and "global_batch" not in (data_state or {}):
    raise ValueError(
        f"The checkpoint at step {step} was written by {saved['num_processes']} processes; this run has "
        f"{current['num_processes']}. Each process reads its own slice of every batch, so the data position "
        f"would not carry over exactly: resume with {saved['num_processes']} processes, or start a new --workdir.")
  plural = lambda n, word, suffix: f"{n} {word}{suffix if n > 1 else ''}"
  describe = lambda t: (" ".join(f"{a}={n}" for a, n in t["mesh"].items()) +
                        f" ({plural(t['num_devices'], 'device', 's')} in "
                        f"{plural(t['num_processes'], 'process', 'es')})")
  logging.info("Resharding the checkpoint of step %d, written on mesh %s, onto mesh %s.", step, describe(saved),
               describe(current))


def train(task: Task, workdir) -> TrainState:
  """Trains (or resumes training) for `task.loop.num_steps` steps; returns the final state.

  Returns early, after saving, on SIGTERM or when `task.loop.time_budget_s` is spent: the budget counts the
  training time of the whole run, earlier runs it resumes included (`time/train_s` in the metrics, the
  seconds of steps: compiling, evaluating and saving excluded), so a resumed run stops where an uninterrupted
  one would. Raises
  `NonFiniteError` (with `nan_policy='error'`) naming the step and metric of a NaN/Inf, and
  `ConfigMismatchError` if the workdir holds a checkpoint of another config.
  """
  started = time.perf_counter()
  tc = task.loop
  setup = _Setup(task, workdir)
  workdir = setup.workdir
  workdir.mkdir(parents=True, exist_ok=True)
  checkpointer = ckpt_lib.Checkpointer(workdir, max_to_keep=tc.keep_checkpoints,
                                       async_save=tc.async_checkpointing)
  failed = False
  try:
    start_step = checkpointer.check_config(setup.config_json, task.description_defaults)
    train_ds = task.datasets("train")
    val_ds = task.datasets("validation")
    train_iter = iter(train_ds)
    accumulator = metrics_lib.MeanAccumulator()
    elapsed = {"train_s": 0.0, "cpu_s": 0.0}
    main = parallel.is_main_process()
    if start_step is None:
      state = setup.init_state()
      if main:
        metrics_lib.truncate_metrics(workdir, -1)
    else:
      state, data_state, meta = setup.restore(checkpointer, start_step)  # resharded onto this run's mesh
      _check_topology(meta.get("topology"), _topology(setup.mesh), start_step, data_state)
      train_iter.set_state(data_state)
      accumulator = metrics_lib.MeanAccumulator(meta.get("metric_window"))
      elapsed.update(meta.get("elapsed", {}))
      if main:
        metrics_lib.truncate_metrics(workdir, start_step)
      logging.info("Resumed from the checkpoint at step %d in %s.", start_step, checkpointer.directory)
      saved_steps = meta.get("config", {}).get("train", {}).get("num_steps", tc.num_steps)
      if saved_steps != tc.num_steps:  # allowed (extend or shorten a run), but it moves the schedule
        logging.warning("config.train.num_steps is %d, the checkpoint's run had %d: the cosine learning-"
                        "rate schedule now ends at step %d.", tc.num_steps, saved_steps, tc.num_steps)
    _write_config(workdir, setup.config_json)
    return _loop(setup, checkpointer, state, train_iter, val_ds, accumulator, elapsed,
                 fresh=start_step is None, started=started)
  except BaseException:
    failed = True
    raise
  finally:
    checkpointer.wait()
    if failed and parallel.is_main_process():
      checkpointer.discard_if_empty()
    checkpointer.close()


def step_flops(task: Task) -> float:
  """Useful FLOPs of one update of `task` (the whole global batch; `model.flops.train_step_flops`)."""
  cfg, loss = task.model_config, task.loss
  prompt = task.sequence_length - task.num_canvases * cfg.canvas_length
  return flops_lib.train_step_flops(cfg, task.loop.batch_size, prompt, task.num_canvases,
                                    self_conditioning=loss.self_conditioning_prob > 0,
                                    all_canvases=loss.all_canvases)


def _loop(setup: _Setup, checkpointer, state, train_iter, val_ds, accumulator, elapsed, *,
          fresh: bool, started: float) -> TrainState:
  tc = setup.task.loop
  step = first_step = int(state.step)
  tokens_per_step = tc.batch_size * setup.task.sequence_length
  peak, peak_source = timing.peak_flops_per_device(setup.model_cfg.dtype)
  meter = metrics_lib.StepMeter(tokens_per_step, jax.device_count(), step_flops(setup.task), peak)
  logging.info("MFU is counted against a %s peak of %.1f GFLOP/s per device (%s).", peak_source, peak / 1e9,
               jax.devices()[0].device_kind)
  clock = metrics_lib.Stopwatch(elapsed)  # training time: compiling, evaluating and saving excluded
  clock.add("startup", time.perf_counter() - started)
  progress = metrics_lib.Progress(tc.num_steps, tokens_per_step, step, clock)
  writer = metrics_lib.create_writer(setup.workdir, enabled=parallel.is_main_process())
  profile = _Profile(tc.profile_steps, setup.workdir)

  def run_eval():
    with clock.excluded("eval"):
      results = setup.evaluate(state.params, val_ds, tc.eval_batches)
    writer.write_scalars(step, {f"eval/{k}": v for k, v in results.items()} |
                         {f"time/{k}": v for k, v in clock.totals().items()})
    logging.info("eval at step %d: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in results.items()))

  def save():
    with clock.excluded("checkpoint"):
      writer.flush()
      meta = {"config": setup.config_json, "metric_window": accumulator.state(), "elapsed": clock.totals(),
              "topology": _topology(setup.mesh)}
      checkpointer.save(step, state, train_iter.get_state(), meta)

  try:
    with stopping.StopRule(tc.time_budget_s, checkpointer.reached_preemption) as stop_rule:
      if fresh and tc.eval_every:
        run_eval()
      if step >= tc.num_steps and checkpointer.latest_step() != step:
        save()
      # Spent by the runs this one resumes (the same saved number in every process).
      already_spent = step < tc.num_steps and 0 < tc.time_budget_s <= elapsed["train_s"]
      if already_spent:
        logging.info("Time budget of %.0f s already spent (%.0f s of training up to step %d): no step to run.",
                     tc.time_budget_s, elapsed["train_s"], step)
      while step < tc.num_steps and not already_spent:
        profile.before(step + 1)
        waited = time.perf_counter()
        batch = to_global(next(train_iter), setup.batch_sharding)
        computed = time.perf_counter()
        if step == first_step:  # the first step compiles: left out of times and tokens/s
          with clock.excluded("compile"):
            state, metrics = setup.train_step(state, batch)
            metrics = jax.device_get(metrics)
          progress.restart(step + 1)
        else:
          state, metrics = setup.train_step(state, batch)
          metrics = jax.device_get(metrics)
          meter.add(computed - waited, time.perf_counter() - computed)
        step += 1
        profile.after(step)
        if not step_lib.check_finite(metrics, step, tc.nan_policy):
          logging.warning("Skipped the update of step %d: non-finite metrics.", step)
        accumulator.add(metrics)
        last = step == tc.num_steps
        if step % tc.log_every == 0 or last:
          means = accumulator.means()
          means["skipped"] = round((1.0 - means.pop("finite", 1.0)) * accumulator.count)
          accumulator.reset()
          writer.write_scalars(step, {f"train/{k}": v for k, v in means.items()} | meter.scalars() |
                               {f"time/{k}": v for k, v in clock.totals().items()})
          meter.reset()
          logging.info("%s", progress.line(step, means))
        if tc.eval_every and (step % tc.eval_every == 0 or last):
          run_eval()
        stop = None if last else stop_rule.reason(step, clock.totals()["train_s"])  # one answer in all processes
        if step % tc.checkpoint_every == 0 or last or stop:
          save()
        if stop == stopping.SIGTERM:
          logging.warning("SIGTERM: saved the checkpoint of step %d; exiting.", step)
          break
        if stop == stopping.TIME_BUDGET:
          logging.info("Time budget of %.0f s spent at step %d; saved and stopping.", tc.time_budget_s, step)
          break
    # Every span of the run, the last evaluation and checkpoint included: with startup they sum to its wall time.
    writer.write_scalars(step, {f"time/{k}": v for k, v in clock.totals().items()})
  finally:
    profile.close()
    writer.close()
  return state


class _Profile:
  """A `jax.profiler` trace of steps first..last (`config.train.profile_steps`) into `workdir/profile`."""

  def __init__(self, steps: tuple[int, int] | None, workdir):
    self.steps, self.directory, self.active = steps, workdir / "profile", False

  def before(self, step: int) -> None:
    if self.steps and step == self.steps[0]:
      jax.profiler.start_trace(str(self.directory))
      self.active = True

  def after(self, step: int) -> None:
    if self.active and step == self.steps[1]:
      self.close()
      logging.info("Wrote a profile of steps %d-%d to %s.", *self.steps, self.directory)

  def close(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False


def evaluate(task: Task, workdir, *, step: int | None = None, num_batches: int | None = None) -> dict:
  """Evaluates the checkpoint at `step` (default: the latest) in `workdir` on the validation split
  (`num_batches` batches, default `task.loop.eval_batches`).

  Returns the metrics of `evaluate_params` plus `step`, and writes them to `workdir/eval.json` and
  as `eval/...` records to `workdir/metrics.jsonl`.
  """
  setup = _Setup(task, workdir)
  workdir = setup.workdir
  if not (workdir / ckpt_lib.CHECKPOINT_DIRNAME).is_dir():
    raise FileNotFoundError(f"No checkpoints in {str(workdir)!r}: train first (scripts/train.py).")
  checkpointer = ckpt_lib.Checkpointer(workdir, async_save=False)
  try:
    latest = checkpointer.check_config(setup.config_json, task.description_defaults)
    if latest is None:
      raise FileNotFoundError(f"No checkpoints in {str(checkpointer.directory)!r}: train first.")
    step = latest if step is None else step
    if step not in checkpointer.all_steps():
      raise ValueError(f"No checkpoint at step {step}; available: {checkpointer.all_steps()}.")
    state, _, _ = setup.restore(checkpointer, step)
  finally:
    checkpointer.close()
  val_ds = task.datasets("validation")
  results = setup.evaluate(state.params, val_ds, task.loop.eval_batches if num_batches is None else num_batches)
  results = {"step": step, **results}
  if parallel.is_main_process():
    _files.atomic_write(workdir / "eval.json", json.dumps(results, indent=2))
    writer = metrics_lib.JsonlWriter(workdir / metrics_lib.METRICS_FILENAME)
    writer.write_scalars(step, {f"eval/{k}": v for k, v in results.items() if k != "step"})
    writer.close()
  logging.info("evaluation of step %d: %s", step,
               ", ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "step"))
  return results

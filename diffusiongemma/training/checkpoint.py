"""Checkpoints with orbax: the train state, the data-iterator state and the config, per step.

`workdir/checkpoints/<step>/` holds three items: `state` (params, optimizer state, step, rng; exact
dtypes), `data` (the grain iterator state, JSON) and `meta` (the config that wrote it, the partial
window of logged metrics, the training time, and the mesh, device and process counts it was written on,
JSON). `state` restores onto any mesh: each array is read into the shardings it is asked for. Saves are asynchronous and atomic (orbax writes a temporary directory
and renames it), so a process killed at any moment leaves the previous checkpoints intact.

A checkpoint is only resumed by a config that agrees with the one that wrote it on everything that
changes what is being trained (`config_mismatches`): the model, the data layout and tokenizer, the
objective and the optimisation. Operational settings (how many steps, how often to log, evaluate or
save) may change between runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from diffusiongemma import _files
from diffusiongemma import convert
from diffusiongemma import parallel
from diffusiongemma.model import transformer

CHECKPOINT_DIRNAME = "checkpoints"
CONFIG_FILENAME = "config.json"
# config.train fields that may differ between a checkpoint and the run resuming it.
OPERATIONAL_TRAIN_FIELDS = ("num_steps", "log_every", "eval_every", "eval_batches",
                            "checkpoint_every", "keep_checkpoints", "async_checkpointing",
                            "time_budget_s", "nan_policy", "profile_steps")
CHECKED_SECTIONS = ("model", "data", "diffusion", "train")


class ConfigMismatchError(ValueError):
  """The config differs from the one that wrote the checkpoint in the workdir."""


def config_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any],
                      defaults: Mapping[str, Any] | None = None) -> list[str]:
  """'section.field: checkpoint X, config Y' for every field that must match and does not; a field one
  side lacks reads as its value in `defaults` (the base config's JSON)."""
  out = []
  defaults = defaults or {}
  for section in CHECKED_SECTIONS:
    a, b = dict(saved.get(section, {})), dict(current.get(section, {}))
    for key in sorted(set(a) | set(b)):
      if section == "train" and key in OPERATIONAL_TRAIN_FIELDS:
        continue
      # A field one side lacks (a checkpoint older than the field) reads as its base_config default.
      missing = defaults.get(section, {}).get(key, "<missing>")
      if a.get(key, missing) != b.get(key, missing):
        out.append(f"{section}.{key}: checkpoint {a.get(key, missing)!r}, config {b.get(key, missing)!r}")
  return out


class Checkpointer:
  """An orbax `CheckpointManager` over `workdir/checkpoints` with the three items above."""

  def __init__(self, workdir: os.PathLike | str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = _files.as_path(workdir, "workdir", absolute=True) / CHECKPOINT_DIRNAME
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def discard_if_empty(self) -> None:
    """Removes `workdir/checkpoints` if nothing was ever saved in it (a run that failed before its first save
    leaves no empty folder behind to look like a run)."""
    if self.directory.is_dir() and not any(self.directory.iterdir()):
      self.directory.rmdir()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def reached_preemption(self, step: int) -> bool:
    """Whether every process stops after `step` on a SIGTERM one of them got (jax's preemption sync point,
    through orbax); a collective check of a multi-process run, see `training.stopping`."""
    return self.manager.reached_preemption(step)

  def save(self, step: int, state, data_state: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """Starts an asynchronous save of `step` (forced: the caller decides when to save)."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state.to_dict() if hasattr(state, "to_dict") else state),
        data=ocp.args.JsonSave(dict(data_state)),
        meta=ocp.args.JsonSave(dict(meta))), force=True)

  def _item(self, step: int, item: str) -> str:
    return f"Checkpoint step {step} of {self.directory}, item {item!r},"

  def restore_meta(self, step: int) -> dict[str, Any]:
    with _files.reading(self._item(step, "meta"), _DAMAGED):
      return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, abstract_state: Mapping[str, Any]) -> tuple[dict, dict, dict]:
    """(state dict, data-iterator state, meta) of `step`, the state laid out as `abstract_state`
    (a tree of `jax.ShapeDtypeStruct`, with shardings)."""
    with _files.reading(self._item(step, "state, data or meta"), _DAMAGED):
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
          meta=ocp.args.JsonRestore()))
    return restored["state"], restored["data"], restored["meta"]

  def check_config(self, current: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> int | None:
    """The latest step, after checking that its config agrees with `current` (JSON form; `defaults`: what
    a field one side lacks reads as)."""
    step = self.latest_step()
    if step is None:
      return None
    saved = self.restore_meta(step)["config"]
    problems = config_mismatches(saved, current, defaults)
    if problems:
      raise ConfigMismatchError(
          f"The checkpoint at step {step} in {self.directory} was written by another config; "
          "mismatched fields:\n  " + "\n  ".join(problems) +
          "\nUse a new --workdir, or the config that wrote the checkpoint.")
    return step

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def saved_steps(workdir: os.PathLike | str) -> list[int]:
  """The steps of the checkpoints in `workdir/checkpoints`, ascending (empty when there are none)."""
  directory = _files.as_path(workdir, "workdir", absolute=True) / CHECKPOINT_DIRNAME
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def latest_step(workdir: os.PathLike | str) -> int | None:
  """The newest checkpoint's step in `workdir/checkpoints`, or None."""
  steps = saved_steps(workdir)
  return steps[-1] if steps else None


def load_params(workdir: os.PathLike | str, *, step: int | None = None, shardings=None) -> tuple[Any, int]:
  """(variables `{'params': ...}`, step) of the checkpoint at `step` (default: the latest) in
  `workdir/checkpoints`, reading only the parameters: no optimizer or config is rebuilt, so any code
  that has the model (sampling, conversion, evaluation elsewhere) can use a training run's weights.

  `shardings` places them: one sharding for every array, or a tree of shardings matching the
  variables or their `'params'` subtree (e.g. `parallel.param_shardings`); default: the first local
  device. Dtypes are those saved (float32 master weights unless the config says otherwise).
  """
  directory = _files.as_path(workdir, "workdir", absolute=True) / CHECKPOINT_DIRNAME
  steps = saved_steps(workdir)
  if not steps:
    raise FileNotFoundError(f"No checkpoints in {str(directory)!r}: train first (scripts/train.py).")
  step = steps[-1] if step is None else int(step)
  if step not in steps:
    raise ValueError(f"No checkpoint at step {step} in {str(directory)!r}; available: {steps}.")
  path = directory / str(step) / "state"
  checkpointer = ocp.PyTreeCheckpointer()
  saved = _saved_params(directory, step)
  if shardings is None:
    shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  if isinstance(shardings, Mapping) and "params" not in shardings and "params" in saved:
    shardings = {"params": shardings}
  try:
    target = parallel.abstract_with_sharding(saved, shardings)
  except ValueError as e:
    raise ValueError(f"The shardings do not match the parameters saved at step {step} in "
                     f"{str(directory)!r}: {e}") from e
  restore_args = jax.tree.map(
      lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype), target)
  with _files.reading(f"Checkpoint step {step} of {str(directory)!r}, item 'state' (its params),", _DAMAGED):
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        item={"params": target}, restore_args={"params": restore_args}, partial_restore=True))
  return restored["params"], step


_DAMAGED = ("It is damaged or incomplete (a copy cut short, a file missing): use another step, or copy the "
            "checkpoint again.")


def _saved_params(directory, step: int):
  """The params' tree of shapes and dtypes in the checkpoint at `step`, from its metadata alone."""
  with _files.reading(f"Checkpoint step {step} of {str(directory)!r}, item 'state' (its metadata),", _DAMAGED):
    metadata = ocp.PyTreeCheckpointer().metadata(directory / str(step) / "state").item_metadata
    if metadata is None:
      raise ValueError("no readable metadata")
    tree = metadata.tree
    if not isinstance(tree, Mapping) or "params" not in tree:
      raise ValueError(f"its state holds no 'params' (it holds {sorted(tree) if isinstance(tree, Mapping) else tree})")
    return tree["params"]


def load_weights(source: os.PathLike | str, *, shardings=None, expected=None) -> Any:
  """Variables `{'params': ...}` to start from (`config.train.init_from`): the latest checkpoint of a
  training workdir, or a transformers checkpoint folder (`convert.load_hf`). `shardings`: a tree of
  shardings like the variables; `expected`: their abstract shapes (e.g. of the configured model), checked
  before anything is read, so that a checkpoint of another model fails with the first differing parameter
  named. A workdir may be on object storage (gs://); a transformers folder is read from the local disk."""
  path = _files.as_path(source, "config.train.init_from")
  if latest_step(path) is not None:
    saved = _saved_params(_files.as_path(path, absolute=True) / CHECKPOINT_DIRNAME, latest_step(path))
    _check_fits(saved, expected, source)
    return load_params(path, shardings=shardings)[0]
  if _files.present(path / "config.json") and any(path.glob("*.safetensors")):
    if not _files.is_local(path):
      raise ValueError(f"config.train.init_from={str(source)!r} is a transformers folder on object storage: "
                       "copy it to a local folder (only training workdirs are read from gs://).")
    cfg = convert.config_from_hf(_files.read_json(path / "config.json"), source=path / "config.json")
    _check_fits({"params": transformer.abstract_params(cfg)}, expected, source)
    # In the dtype of the parameters they start (e.g. float32 master weights from a bfloat16 checkpoint).
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(expected)} if expected is not None else set()
    _, params = convert.load_hf(path, shardings=None if shardings is None else shardings["params"],
                                dtype=dtypes.pop() if len(dtypes) == 1 else None)
    return {"params": params}
  raise FileNotFoundError(f"config.train.init_from={str(source)!r} is neither a training workdir with "
                          "checkpoints nor a transformers checkpoint folder (config.json + *.safetensors).")


def _check_fits(have, want, source) -> None:
  if want is None:
    return
  have = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(have)}
  want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(want)}
  for key in sorted(set(have) | set(want)):
    if have.get(key) != want.get(key):
      raise ValueError(f"The weights in {str(source)!r} do not fit config.model: {key} is "
                       f"{have.get(key, 'missing')} there, {want.get(key, 'absent')} in the model.")

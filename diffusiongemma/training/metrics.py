"""Metric writers: JSONL (`workdir/metrics.jsonl`), TensorBoard event files, and a progress line.

The writers follow clu's `MetricWriter` interface (`write_scalars(step, scalars)`, `flush`, `close`)
without importing clu, whose `metric_writers` package needs TensorFlow at import time. TensorBoard
files are written with tensorboardX when it is installed (a warning otherwise). A workdir may be a
`gs://` URI (`_files.as_path`): objects cannot be appended to, so there the JSONL file is rewritten whole
at each flush (the loop flushes before every checkpoint), and tensorboardX writes its event file through
google-cloud-storage the same way.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence

from absl import logging

from diffusiongemma import _files

METRICS_FILENAME = "metrics.jsonl"


class JsonlWriter:
  """Appends one JSON object per `write_scalars` call: {"step": s, **scalars}. A local file is appended to
  (and synced at each flush); an object (gs://) keeps the whole file in memory and is rewritten at each
  flush that has new records."""

  def __init__(self, path: os.PathLike | str):
    self.path = _files.as_path(path)
    self._file = self._text = None
    self._pending = []  # an object's records since the last flush
    if _files.is_local(self.path):
      self.path.parent.mkdir(parents=True, exist_ok=True)
      self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
    else:
      self._text = self.path.read_text() if self.path.exists() else ""

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    record = {"step": int(step), **{k: _jsonable(v) for k, v in scalars.items()}}
    if self._file is None:
      self._pending.append(json.dumps(record) + "\n")
    else:
      self._file.write(json.dumps(record) + "\n")

  def flush(self) -> None:
    if self._file is None:
      if self._pending:
        self._text += "".join(self._pending)
        self._pending = []
        self.path.write_text(self._text)
      return
    self._file.flush()
    os.fsync(self._file.fileno())

  def close(self) -> None:
    self.flush()
    if self._file is not None:
      self._file.close()


class TensorBoardWriter:
  """TensorBoard event files in `logdir` (via tensorboardX)."""

  def __init__(self, logdir: os.PathLike | str):
    import tensorboardX  # pylint: disable=g-import-not-at-top
    self._writer = tensorboardX.SummaryWriter(str(logdir), flush_secs=30)

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    for key, value in scalars.items():
      if isinstance(value, (int, float)):
        self._writer.add_scalar(key, value, int(step))

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class MultiWriter:
  """Writes to several writers."""

  def __init__(self, writers: Sequence):
    self.writers = list(writers)

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    for writer in self.writers:
      writer.write_scalars(step, scalars)

  def flush(self) -> None:
    for writer in self.writers:
      writer.flush()

  def close(self) -> None:
    for writer in self.writers:
      writer.close()


def create_writer(workdir: os.PathLike | str, tensorboard: bool = True, enabled: bool = True) -> MultiWriter:
  """JSONL in `workdir/metrics.jsonl` and TensorBoard in `workdir/tensorboard`; with `enabled=False`
  (every process but the first of a multi-process run) a writer that writes nothing."""
  if not enabled:
    return MultiWriter([])
  workdir = _files.as_path(workdir, "workdir")
  writers = [JsonlWriter(workdir / METRICS_FILENAME)]
  if tensorboard:
    try:
      writers.append(TensorBoardWriter(workdir / "tensorboard"))
    except ImportError as e:  # tensorboardX itself, or for gs:// its google-cloud-storage
      logging.warning("No TensorBoard event files are written (%s); metrics still go to %s.", e,
                      workdir / METRICS_FILENAME)
  return MultiWriter(writers)


def read_metrics(workdir: os.PathLike | str) -> list[dict]:
  """Every record of `workdir/metrics.jsonl` (an empty list if there is none)."""
  path = _files.as_path(workdir, "workdir") / METRICS_FILENAME
  if not path.is_file():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(workdir: os.PathLike | str, step: int) -> None:
  """Drops the records after `step`: on resume, steps that ran after the checkpoint are redone."""
  path = _files.as_path(workdir, "workdir") / METRICS_FILENAME
  if not path.is_file():
    return
  records = read_metrics(workdir)
  kept = [r for r in records if r["step"] <= step]
  if len(kept) != len(records):
    _files.atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept))


class MeanAccumulator:
  """Running sums of per-step metrics between two log lines; its state is saved in checkpoints."""

  def __init__(self, state: Mapping | None = None):
    state = state or {}
    self.sums = dict(state.get("sums", {}))
    self.count = int(state.get("count", 0))

  def add(self, metrics: Mapping[str, float]) -> None:
    for k, v in metrics.items():
      self.sums[k] = self.sums.get(k, 0.0) + float(v)
    self.count += 1

  def means(self) -> dict[str, float]:
    return {k: v / max(self.count, 1) for k, v in self.sums.items()}

  def reset(self) -> None:
    self.sums, self.count = {}, 0

  def state(self) -> dict:
    return {"sums": dict(self.sums), "count": self.count}


class Stopwatch:
  """Training time: wall and process-CPU seconds since the start, less the spans run `excluded(kind)`
  (compilation, evaluation, checkpointing), plus what earlier runs of the same training reported. The
  excluded spans are summed per kind (`{kind}_s` in `totals()`, earlier runs included too)."""

  KINDS = ("startup", "compile", "eval", "checkpoint")

  def __init__(self, earlier: Mapping[str, float] | None = None):
    self._earlier = {"train_s": 0.0, "cpu_s": 0.0, **{f"{k}_s": 0.0 for k in self.KINDS}, **(earlier or {})}
    self._wall, self._cpu = time.perf_counter(), time.process_time()
    self._excluded_wall = self._excluded_cpu = 0.0
    self._spans = dict.fromkeys(self.KINDS, 0.0)

  @contextlib.contextmanager
  def excluded(self, kind: str):
    if kind not in self._spans:
      raise ValueError(f"Unknown span kind {kind!r}; expected one of {self.KINDS}.")
    wall, cpu = time.perf_counter(), time.process_time()
    try:
      yield
    finally:
      self._excluded_wall += time.perf_counter() - wall
      self._excluded_cpu += time.process_time() - cpu
      self._spans[kind] += time.perf_counter() - wall

  def add(self, kind: str, seconds: float) -> None:
    """Counts `seconds` spent before this stopwatch started (e.g. start-up) as an excluded span."""
    self._spans[kind] += seconds

  def seconds(self) -> float:
    """Training seconds of this run."""
    return time.perf_counter() - self._wall - self._excluded_wall

  def totals(self) -> dict[str, float]:
    """Training wall seconds, process CPU seconds and each kind of excluded span's wall seconds, of the whole
    training, earlier runs included."""
    return {"train_s": self._earlier["train_s"] + self.seconds(),
            "cpu_s": self._earlier["cpu_s"] + time.process_time() - self._cpu - self._excluded_cpu,
            **{f"{k}_s": self._earlier[f"{k}_s"] + v for k, v in self._spans.items()}}


class StepMeter:
  """Per logging interval: a step's mean seconds waiting for its batch (`perf/data_wait_s`) and computing
  (`perf/step_s`: from the batch in hand to the step's metrics on the host), and what they give: tokens/s
  per device, and with the step's useful FLOPs (`model.flops`) and a per-device peak, MFU."""

  def __init__(self, tokens_per_step: int, num_devices: int, flops_per_step: float | None = None,
               peak_flops_per_device: float | None = None):
    self.tokens_per_step, self.num_devices = tokens_per_step, num_devices
    self.flops_per_step, self.peak = flops_per_step, peak_flops_per_device
    self.reset()

  def reset(self) -> None:
    self.steps, self.data_s, self.step_s = 0, 0.0, 0.0

  def add(self, data_s: float, step_s: float) -> None:
    self.steps += 1
    self.data_s += data_s
    self.step_s += step_s

  def scalars(self) -> dict[str, float]:
    """`perf/*` of the steps added since the last reset ({} when none)."""
    if not self.steps:
      return {}
    wait, step = self.data_s / self.steps, self.step_s / self.steps
    out = {"perf/step_s": step, "perf/data_wait_s": wait,
           "perf/tokens_per_s_per_device": self.tokens_per_step / max(wait + step, 1e-12) / self.num_devices}
    if self.flops_per_step:
      out["perf/model_tflops_per_step"] = self.flops_per_step / 1e12
      if self.peak:
        out["perf/mfu"] = self.flops_per_step / max(wait + step, 1e-12) / (self.peak * self.num_devices)
    return out


class Progress:
  """The progress line: step, loss, tokens/s and ETA, over the training seconds of a `Stopwatch`."""

  def __init__(self, num_steps: int, tokens_per_step: int, start_step: int, stopwatch: Stopwatch):
    self.num_steps, self.tokens_per_step, self.stopwatch = num_steps, tokens_per_step, stopwatch
    self._step, self._seconds = start_step, stopwatch.seconds()
    self.tokens_per_second = 0.0

  def restart(self, step: int) -> None:
    """Measures from now (e.g. after the first step, so that compilation is not counted)."""
    self._step, self._seconds = step, self.stopwatch.seconds()

  def line(self, step: int, means: Mapping[str, float]) -> str:
    now = self.stopwatch.seconds()
    steps = step - self._step
    elapsed = max(now - self._seconds, 1e-9)
    if steps > 0:
      self.tokens_per_second = steps * self.tokens_per_step / elapsed
      self._step, self._seconds = step, now
    seconds_per_step = self.tokens_per_step / max(self.tokens_per_second, 1e-9)
    eta = (self.num_steps - step) * seconds_per_step if self.tokens_per_second else math.nan
    parts = [f"step {step}/{self.num_steps}", f"loss {means.get('loss', math.nan):.4f}",
             f"diffusion {means.get('diffusion_loss', math.nan):.4f}",
             f"ar {means.get('ar_loss', math.nan):.4f}",
             f"{self.tokens_per_second:,.0f} tok/s", f"ETA {_duration(eta)}"]
    return " | ".join(parts)


def quiet_orbax_logs() -> None:
  """Hides orbax's INFO chatter (several lines per save) from absl's log; warnings still show, but for
  the one `load_params` always triggers (it reads the `state` item alone, whose folder has no
  checkpoint-level metadata file)."""
  import logging as std_logging  # pylint: disable=g-import-not-at-top

  def keep(record) -> bool:
    if "orbax" not in record.pathname:
      return True
    return record.levelno >= std_logging.WARNING and "_CHECKPOINT_METADATA" not in record.getMessage()

  logging.get_absl_handler().addFilter(keep)


def _duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  seconds = int(round(seconds))
  h, rest = divmod(seconds, 3600)
  m, s = divmod(rest, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _jsonable(value):
  if isinstance(value, (str, bool, int)) or value is None:
    return value
  value = float(value)
  return value if math.isfinite(value) else str(value)

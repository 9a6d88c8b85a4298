"""Global batches sliced by process: one order of the items for the whole run, whatever the process count.

Global batch s holds the items at global positions s*B .. s*B + B - 1 (B the global batch size). Training
reads position g as item `index_shuffle(g mod N)` of the permutation of epoch g // N (a lazy seeded
permutation of the N items, new each epoch: nothing the size of the corpus is materialised); validation
reads item g, in order, for N // B batches. Process i of n reads rows i*B/n .. (i+1)*B/n - 1 of every
global batch and fetches only those items. The position in the data is the number of global batches read,
so a run resumes from the same global position with any process count (`get_state` / `set_state`), and
a state of another global batch size or item count is refused naming both.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from absl import logging
import grain
import numpy as np

_ROUNDS = 4
_DEFAULT_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)


class DataStateError(ValueError):
  """A saved data position that this dataset cannot continue."""


class GlobalBatches:
  """This process's rows of each global batch of `num_items` items, as `fetch(items) -> batch dict`.

  Iterate it for the batches (an iterator with `get_state` / `set_state`); `items(step)` says which items
  this process reads at global batch `step` (what `data.peek` shows).
  """

  def __init__(self, num_items: int, fetch: Callable[[np.ndarray], dict], *, global_batch_size: int,
               process_index: int = 0, process_count: int = 1, seed: int = 0, train: bool = True,
               read_options: grain.ReadOptions | None = None, what: str = "items"):
    if process_count < 1 or not 0 <= process_index < process_count:
      raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}.")
    if global_batch_size < 1 or global_batch_size % process_count:
      raise ValueError(f"The global batch size {global_batch_size} is not a positive multiple of the "
                       f"{process_count} processes.")
    if num_items < global_batch_size:
      split, more = ("training", "") if train else ("validation", ", or raise config.data.validation_fraction")
      raise ValueError(f"The {split} split has {num_items} {what}: fewer than one global batch of "
                       f"{global_batch_size} (config.train.batch_size): lower it{more}.")
    self.num_items, self.fetch, self.seed, self.train = int(num_items), fetch, int(seed), train
    self.global_batch_size, self.process_index, self.process_count = global_batch_size, process_index, process_count
    self.rows = global_batch_size // process_count
    self.num_batches = sys.maxsize if train else num_items // global_batch_size
    self.read_options = read_options or _DEFAULT_READ_OPTIONS

  def items(self, step: int) -> np.ndarray:
    """int64 [rows]: the items of this process's rows of global batch `step`."""
    start = step * self.global_batch_size + self.process_index * self.rows
    positions = np.arange(start, start + self.rows, dtype=np.int64)
    if not self.train:
      return positions
    epochs, offsets = np.divmod(positions, self.num_items)
    return np.array([grain.experimental.index_shuffle(int(k), max_index=self.num_items - 1,
                                                       seed=_epoch_seed(self.seed, int(e)), rounds=_ROUNDS)
                     for e, k in zip(epochs, offsets)], np.int64)

  def __iter__(self) -> "BatchIterator":
    dataset = grain.MapDataset.range(self.num_batches).map(_Batch(self))
    return BatchIterator(self, iter(dataset.to_iter_dataset(self.read_options)))

  def __len__(self) -> int:
    return self.num_batches


class _Batch:
  """Global batch index -> this process's batch (a class, so that it pickles)."""

  def __init__(self, batches: GlobalBatches):
    self.batches = batches

  def __call__(self, step: int) -> dict:
    return self.batches.fetch(self.batches.items(int(step)))


def _epoch_seed(seed: int, epoch: int) -> int:
  return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0] >> 1)


class BatchIterator:
  """The batches of a `GlobalBatches`; its state is the global position (batches read) and what it means."""

  def __init__(self, batches: GlobalBatches, inner):
    self.batches, self._inner = batches, inner

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return next(self._inner)

  def get_state(self) -> dict:
    b = self.batches
    return {"global_batch": int(self._inner.get_state()["next_index"]), "global_batch_size": b.global_batch_size,
            "num_items": b.num_items, "seed": b.seed, "process_count": b.process_count}

  def set_state(self, state: dict) -> None:
    b = self.batches
    if "global_batch" not in state:
      raise DataStateError(f"The saved data position {state} was written by an older data pipeline (before global "
                           "batches): this run cannot continue its data order; start a new workdir.")
    for name, have in (("global_batch_size", b.global_batch_size), ("num_items", b.num_items), ("seed", b.seed)):
      if state[name] != have:
        raise DataStateError(f"The checkpoint's data position is of {name}={state[name]}, this run's is {have}: "
                             "the same global batches cannot be continued (keep config.train.batch_size, the "
                             "corpus and config.train.seed of the run, or start a new workdir).")
    if state["process_count"] != b.process_count:
      logging.info("Resuming at global batch %d with %d processes (the checkpoint's run had %d): the same "
                   "global batches, sliced anew.", state["global_batch"], b.process_count, state["process_count"])
    inner = dict(self._inner.get_state())
    inner["next_index"] = int(state["global_batch"])
    self._inner.set_state(inner)

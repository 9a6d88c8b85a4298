"""A folder of safetensors shards, read one tensor at a time, and nothing outside the folder.

`model.safetensors.index.json`, when there is one, maps each tensor to its shard: every entry must be a plain
file name of the folder (no separator, no `..`, not absolute), so a checkpoint cannot make us open a file
elsewhere. Without an index, every `*.safetensors` file of the folder is a shard. A shard may be a symlink (the
hugging-face hub cache is made of them) but only to a regular file, never a FIFO or a device. Opening one reads
its header only; the safetensors library checks there that the tensors it declares exactly cover the file, so
a truncated or padded shard is refused before any tensor is read. Every error names the shard (and the
tensor): `BadFileError` for a malformed file, `FileNotFoundError` for a missing one.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from diffusiongemma import _files

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a weight may have
_MAX_SHARD_BYTES = 2**50  # no cap of its own: its header says what it holds, checked against its size


def _plain_name(name: Any) -> bool:
  return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
          and "\0" not in name and not os.path.isabs(name))


class Shards:
  """The tensors of the safetensors shards of folder `path`: `keys`, `header(key)` (shape and dtype, read
  from the header alone), `get(key)` (the array, refused when not finite) and `file(key)`."""

  def __init__(self, path: os.PathLike | str):
    self.path = pathlib.Path(path)
    self._handles: dict[str, Any] = {}
    index = self.path / INDEX
    if _files.present(index):
      self.weight_map = self._read_index(index)
      return
    files = sorted(p.name for p in self.path.glob("*.safetensors"))
    if not files:
      others = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt*"))
      raise FileNotFoundError(f"{self.path} holds no weights: no *.safetensors files"
                              + (f" (only {others}; convert them to safetensors)." if others else "."))
    self.weight_map = {}
    for name in files:
      self.weight_map.update({k: name for k in self._open(name).keys()})

  def _read_index(self, index: pathlib.Path) -> dict[str, str]:
    fields = _files.Fields(_files.read_json(index, _files.INDEX_MAX_BYTES), index)
    weight_map = fields.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise fields.error("weight_map", f"is {weight_map!r}; expected an object mapping each tensor name to the "
                         "shard file that holds it.")
    for key, name in weight_map.items():
      if not _plain_name(name):
        raise _files.BadFileError(f"{index}: weight_map[{key!r}] = {name!r} is not the name of a file in "
                                  f"{self.path} (a plain file name: no folder, no '..', not absolute).")
    return weight_map

  @property
  def keys(self):
    return self.weight_map.keys()

  def file(self, key: str) -> pathlib.Path:
    """The shard that holds tensor `key`."""
    return self.path / self.weight_map[key]

  def _open(self, name: str):
    if name not in self._handles:
      file = self.path / name
      if not _files.present(file):
        raise FileNotFoundError(f"{self.path / INDEX} puts tensors in {name}, which is missing.")
      _files.regular_file_size(file, _MAX_SHARD_BYTES)
      try:
        self._handles[name] = safe_open(str(file), "numpy")
      except (SafetensorError, OSError) as e:
        raise _files.BadFileError(f"{file} is not a readable safetensors file: {e}.") from None
    return self._handles[name]

  def _read(self, key: str, read):
    handle = self._open(self.weight_map[key])
    try:
      return read(handle)
    except (SafetensorError, OSError, TypeError, ValueError) as e:
      where = f"{self.path / INDEX} puts tensor {key} in {self.file(key)}" if key not in handle.keys() else (
          f"{self.file(key)}: tensor {key}")
      raise _files.BadFileError(f"{where}, which cannot be read: {e}.") from None

  def header(self, key: str) -> tuple[tuple[int, ...], str]:
    """(shape, safetensors dtype name such as 'BF16') of tensor `key`, from its shard's header alone."""
    view = self._read(key, lambda handle: handle.get_slice(key))
    return tuple(view.get_shape()), view.get_dtype()

  def get(self, key: str) -> np.ndarray:
    """Tensor `key`, refused (naming it and its shard) when it holds a NaN or an infinity: a sum in float64
    is finite exactly when every value is (a NaN or an infinity propagates; float32 values cannot overflow
    it), and costs one pass with no array allocated."""
    value = self._read(key, lambda handle: handle.get_tensor(key))
    if not np.isfinite(value.sum(dtype=np.float64)):
      bad = np.flatnonzero(~np.isfinite(value.astype(np.float64)))  # only on the way to the error
      detail = (f"{bad.size} of {value.size} values, the first {value.reshape(-1)[bad[0]]} at index "
                f"{tuple(int(i) for i in np.unravel_index(bad[0], value.shape))}" if bad.size else
                "values so large that their sum overflows float64")
      raise _files.BadFileError(f"{self.file(key)}: tensor {key} is not finite ({detail}).")
    return value

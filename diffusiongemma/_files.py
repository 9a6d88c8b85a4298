"""File helpers shared across the package: atomic writes, and bounded reads of the files a checkpoint folder
or a training workdir holds.

A folder someone handed you may hold anything under a familiar name: a FIFO (opening it would block), a
symlink to `/dev/zero` (reading it never ends), a sparse 20 GB file, bytes that are not JSON. Every read of
such a file goes through `read_bytes`: it follows symlinks (the hugging-face hub cache is made of them) but
only to a regular file, no larger than a cap suited to the file's kind, and opens it without blocking.
`read_json` adds the parse, with the file and the position of the first error; `Fields` reads typed fields
of a JSON object, naming the file and the field. All raise `BadFileError` (a ValueError) naming the file;
a missing file stays `FileNotFoundError`.

Workdirs, and what is read from or exported to them, may live on object storage: `as_path` turns a flag's
value into an `etils.epath.Path` (a local path, or `gs://bucket/...`), refusing by name a scheme it has no
backend for, where `pathlib.Path('gs://b/run')` would silently be the local folder `gs:/b/run`.
`atomic_write`, `present` and `read_bytes` (so `read_text` and `read_json`) take either kind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import pathlib
import re
import stat
from collections.abc import Mapping
from typing import Any

JSON_MAX_BYTES = 8 * 2**20  # a config: config.json, generation_config.json, tokenizer_config.json, ...
INDEX_MAX_BYTES = 64 * 2**20  # model.safetensors.index.json of a model with very many tensors
TOKENIZER_MAX_BYTES = 512 * 2**20  # tokenizer.json / tokenizer.model (Gemma's tokenizer.json: ~30 MB)
INT32_MAX = 2**31 - 1


# URI schemes a path may have: the module etils.epath reads them through, and how to install it.
URI_BACKENDS = {"gs": ("gcsfs", "pip install 'diffusiongemma[gcs]'")}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class BadFileError(ValueError):
  """A file that cannot be read as what it should be (not a regular file, too large, malformed); the
  message names the file and, where there is one, the field or key."""


def as_path(value: os.PathLike | str, what: str = "path", *, absolute: bool = False):
  """`value` (a str, an os.PathLike or an epath.Path) as an `etils.epath.Path`: a local path (`file://`
  stripped; made absolute with `absolute`), or a `gs://bucket/...` URI once its backend is importable. Any
  other scheme, or a missing backend, raises a ValueError naming `what` (e.g. '--workdir') and the value."""
  from etils import epath  # pylint: disable=g-import-not-at-top  (~0.15 s: only where paths are used)
  text = os.fspath(value)
  match = _SCHEME.match(text)
  if match is None or match.group(1).lower() == "file":
    local = epath.Path(text[len("file://"):] if match else text)
    return local.absolute() if absolute else local
  scheme = match.group(1).lower()
  if scheme not in URI_BACKENDS:
    allowed = ", ".join(f"{s}://" for s in URI_BACKENDS)
    raise ValueError(f"{what}={text!r}: the scheme {scheme}:// is not supported; expected a local path or {allowed}.")
  module, install = URI_BACKENDS[scheme]
  if importlib.util.find_spec(module) is None:
    raise ValueError(f"{what}={text!r}: {scheme}:// paths need the {module} package, which is not installed "
                     f"({install}).")
  _fresh_listings(scheme)
  return epath.Path(text)


def _fresh_listings(scheme: str) -> None:
  """Folder listings of `scheme` are read afresh each time. fsspec (under epath) caches them for the life of
  its filesystem object by default, so a process reading a workdir that another one writes (the latest
  checkpoint step, new metrics) would never see what was added after its first look."""
  import fsspec.config  # pylint: disable=g-import-not-at-top
  fsspec.config.conf.setdefault(scheme, {}).setdefault("use_listings_cache", False)


def is_local(path: os.PathLike | str) -> bool:
  """Whether `path` names the local file system (no URI scheme, or `file://`)."""
  match = _SCHEME.match(os.fspath(path))
  return match is None or match.group(1).lower() == "file"


def _local(path: os.PathLike | str) -> pathlib.Path:
  text = os.fspath(path)
  return pathlib.Path(text[len("file://"):] if _SCHEME.match(text) else text)


def atomic_write(path: os.PathLike | str, data: bytes | str) -> None:
  """Writes via a temporary file and a rename, so readers never see a partial file (text as UTF-8). On object
  storage one upload is atomic already (readers see the old object or the new one): it is written in place."""
  if not is_local(path):
    as_path(path).write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return
  path = _local(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
  os.replace(tmp, path)


def present(path: os.PathLike | str) -> bool:
  """Whether anything is at `path`, a broken symlink or a FIFO included: such a file is then read (and
  refused by `read_bytes`) instead of being skipped as absent."""
  if not is_local(path):
    return as_path(path).exists()
  return os.path.lexists(_local(path))


def _kind(mode: int) -> str:
  for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                     (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
    if test(mode):
      return name
  return "not a regular file"


def regular_file_size(path: os.PathLike | str, max_bytes: int) -> int:
  """The size of `path` (symlinks followed), after checking it is a regular file of at most `max_bytes`."""
  path = pathlib.Path(path)
  try:
    info = os.stat(path)
  except FileNotFoundError:
    if os.path.lexists(path):
      raise BadFileError(f"{path} is a broken symlink (to {os.readlink(path)!r}).") from None
    raise FileNotFoundError(f"{path} does not exist.") from None
  _check_stat(path, info, max_bytes)
  return info.st_size


def _check_stat(path: pathlib.Path, info: os.stat_result, max_bytes: int) -> None:
  if not stat.S_ISREG(info.st_mode):
    link = f" (a symlink to {os.readlink(path)!r})" if os.path.islink(path) else ""
    raise BadFileError(f"{path} is {_kind(info.st_mode)}{link}, not a regular file.")
  if info.st_size > max_bytes:
    raise BadFileError(f"{path} is {info.st_size:,} bytes, more than the {max_bytes:,} a file of its kind may "
                       "hold.")


def read_bytes(path: os.PathLike | str, max_bytes: int) -> bytes:
  """The bytes of the regular file `path` (symlinks followed), refused when it is anything else or larger
  than `max_bytes`. It is opened without blocking and checked again once open, so a FIFO or a device put
  there in between is refused too. An object (gs://) is refused when it is a folder or larger than
  `max_bytes`, and read up to one byte past the cap."""
  if not is_local(path):
    return _read_object(as_path(path), max_bytes)
  path = _local(path)
  regular_file_size(path, max_bytes)
  fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
  with os.fdopen(fd, "rb") as f:
    info = os.fstat(fd)
    _check_stat(path, info, max_bytes)
    data = f.read(info.st_size + 1)  # read(n) allocates n bytes: the size, not the cap
    if len(data) > info.st_size or not data:  # it grew, or its size is unknown (a /proc file reads as 0)
      grown = bytearray(data)
      while len(grown) <= max_bytes and (chunk := f.read(2**20)):
        grown += chunk
      data = bytes(grown)
  if len(data) > max_bytes:
    raise BadFileError(f"{path} grew past {max_bytes:,} bytes while it was read.")
  return data


def _read_object(path, max_bytes: int) -> bytes:
  try:
    info = path.stat()
  except FileNotFoundError:
    raise FileNotFoundError(f"{path} does not exist.") from None
  if info.is_directory:
    raise BadFileError(f"{path} is a folder, not a file.")
  if info.length > max_bytes:
    raise BadFileError(f"{path} is {info.length:,} bytes, more than the {max_bytes:,} a file of its kind may hold.")
  with path.open("rb") as f:
    data = f.read(max_bytes + 1)
  if len(data) > max_bytes:
    raise BadFileError(f"{path} grew past {max_bytes:,} bytes while it was read.")
  return data


def read_text(path: os.PathLike | str, max_bytes: int = JSON_MAX_BYTES) -> str:
  """`read_bytes` decoded as UTF-8 (an error naming the file and the byte offset otherwise)."""
  data = read_bytes(path, max_bytes)
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise BadFileError(f"{path} is not UTF-8 text: byte {e.start} is {data[e.start:e.start + 1]!r}.") from None


def read_json(path: os.PathLike | str, max_bytes: int = JSON_MAX_BYTES, *, kind: type | None = dict) -> Any:
  """The JSON value of the file `path` (bounded as `read_bytes`), which must be a `kind` (default an object;
  None: anything). A parse error names the file, the line and the column."""
  text = read_text(path, max_bytes)
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise BadFileError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
                       f"(character {e.pos}).") from None
  except (ValueError, RecursionError) as e:  # e.g. an integer of 10,000 digits, or 100,000 nested lists
    raise BadFileError(f"{path} is not JSON this reader accepts: {str(e) or type(e).__name__}.") from None
  if kind is not None and not isinstance(value, kind):
    want = "an object" if kind is dict else kind.__name__
    raise BadFileError(f"{path} holds a JSON {_json_type(value)}; expected {want}.")
  return value


def _json_type(value) -> str:
  names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
  return "null" if value is None else names.get(type(value), type(value).__name__)


@contextlib.contextmanager
def reading(what: str, hint: str = ""):
  """Any error raised inside becomes a `BadFileError` that starts with `what` (e.g. "checkpoint step 5 of
  W/checkpoints, item 'state'") and quotes only the first line of the original: orbax and TensorStore
  errors about a damaged checkpoint run to dozens of lines that name neither the step nor the item."""
  try:
    yield
  except BadFileError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (orbax and TensorStore raise many kinds)
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    first = first if len(first) <= 300 else first[:300] + " ..."
    raise BadFileError(f"{what} cannot be read ({type(e).__name__}: {first}).{' ' + hint if hint else ''}") from None


_REQUIRED = object()


class Fields:
  """Typed reads of the fields of a JSON object from `source` (a file name), for configs read from a folder:
  every error names the file and the field's dotted path, and what was expected (`BadFileError`).

    text = Fields(values, "ckpt/config.json").mapping("text_config")
    text.integer("vocab_size")            # a positive integer below 2**31, else an error naming the field
    text.number("rms_norm_eps", 1e-6)     # a finite number; the default when missing or null
  """

  def __init__(self, values: Any, source: os.PathLike | str, prefix: str = ""):
    if not isinstance(values, Mapping):
      where = f"{prefix.rstrip('.')} is" if prefix else "it holds"
      raise BadFileError(f"{source}: {where} a JSON {_json_type(values)}; expected an object.")
    self.values, self.source, self.prefix = values, str(source), prefix

  def error(self, name: str, problem: str) -> BadFileError:
    """An error naming the file and the field `name`."""
    return BadFileError(f"{self.source}: {self.prefix}{name} {problem}")

  def __contains__(self, name: str) -> bool:
    return name in self.values

  def get(self, name: str, default: Any = _REQUIRED) -> Any:
    """The raw value (`default` when missing or null; an error when missing without a default)."""
    value = self.values.get(name)
    if value is None:
      if default is _REQUIRED:
        raise self.error(name, "is missing.")
      return default
    return value

  def _typed(self, name, default, ok, expected):
    if self.values.get(name) is None:
      return self.get(name, default)
    value = self.values[name]
    if not ok(value):
      raise self.error(name, f"is {value!r} (a JSON {_json_type(value)}); expected {expected}.")
    return value

  def integer(self, name: str, default: Any = _REQUIRED, *, minimum: int = 1, maximum: int = INT32_MAX) -> int:
    """An integer in [minimum, maximum] (by default a positive int32: a size, a count); not a bool."""
    ok = lambda v: isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= maximum
    return self._typed(name, default, ok, f"an integer in [{minimum}, {maximum}]")

  def number(self, name: str, default: Any = _REQUIRED) -> float:
    """A finite number (an integer or a float; not a bool)."""
    ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return self._typed(name, default, ok, "a finite number")

  def string(self, name: str, default: Any = _REQUIRED) -> str:
    return self._typed(name, default, lambda v: isinstance(v, str), "a string")

  def boolean(self, name: str, default: Any = _REQUIRED) -> bool:
    return self._typed(name, default, lambda v: isinstance(v, bool), "true or false")

  def strings(self, name: str, default: Any = _REQUIRED) -> list[str]:
    return self._typed(name, default, lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                       "a list of strings")

  def mapping(self, name: str) -> Fields:
    """The object at `name` as Fields (an empty one when missing or null)."""
    return Fields(self.get(name, {}), self.source, f"{self.prefix}{name}.")

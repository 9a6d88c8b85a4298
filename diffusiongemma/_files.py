"""File helpers shared across the package."""

import os
import pathlib


def atomic_write(path: os.PathLike | str, data: bytes | str) -> None:
  """Writes via a temporary file and a rename, so readers never see a partial file (text as UTF-8)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
  os.replace(tmp, path)

"""File helpers shared by the data modules."""

import os
import pathlib


def atomic_write(path: os.PathLike | str, data: bytes) -> None:
  """Writes via a temporary file and a rename, so readers never see a partial file."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_bytes(data)
  os.replace(tmp, path)

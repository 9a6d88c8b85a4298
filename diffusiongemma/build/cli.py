"""How the binaries run: `run(main)` is absl's `app.run`, except that a mistake in what the user gave (a bad
value, a missing or damaged file, a config that does not fit, a usage error: `ValueError`, `OSError`,
`app.UsageError`) ends in one line on stderr naming it, not in a traceback or the help text;
`DG_TRACEBACK=1` shows the traceback. `define_config` is the `--config` flag of every binary: a config file
(`FILE.py[:ARG]`) or a run's saved `config.json`, with `--config.a.b=v` overrides whose typos are one line."""

from __future__ import annotations

import os
import re
import sys
import traceback

from absl import app
from absl import flags
import ml_collections
from ml_collections.config_flags import config_flags

from diffusiongemma import _files

TRACEBACK_VARIABLE = "DG_TRACEBACK"


def run(main) -> None:
  """`app.run(main)`; a `ValueError`, `OSError` or `app.UsageError` from `main` prints `error: <message>` and
  exits 1."""

  def guarded(argv):
    try:
      return main(argv)
    except (ValueError, OSError, app.UsageError) as error:
      if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
        raise
      hint = ("--help lists the flags" if isinstance(error, app.UsageError)
              else f"set {TRACEBACK_VARIABLE}=1 for the traceback")
      print(f"error: {error}\n({hint})", file=sys.stderr, flush=True)
      sys.exit(1)

  app.run(guarded)


class _ConfigParser(config_flags.ConfigFileFlagParser):
  """`FILE.py[:ARG]` (its `get_config(ARG)`), or a `config.json` a training run saved (the run as trained)."""

  def parse(self, path):
    file, colon, _ = str(path).partition(":")
    try:
      if not file.endswith(".json"):
        _files.regular_file_size(file, 2**24)  # missing or not a file: one line, not a deferred traceback
        try:
          return super().parse(path)
        except (AttributeError, KeyError, NameError, ImportError, SyntaxError) as error:
          # A bug in the config file, not an override naming no field (which _ConfigFlag reports): config_flags
          # itself passes TypeError and ValueError on with the traceback, and so do we for these.
          raise ValueError(f"Error whilst parsing config file {path}: {type(error).__name__}: {error}\n\n"
                           + traceback.format_exc()) from None
      if colon:
        raise ValueError("a saved config.json takes no ':ARG'")
      config = ml_collections.ConfigDict(_files.read_json(file))
    except OSError as error:
      raise ValueError(str(error)) from None
    if self._lock_config:
      config.lock()
    return config


class _ConfigFlag(config_flags._ConfigFlag):  # pylint: disable=protected-access  (ml-collections is pinned)
  """config_flags' flag; an override naming no field of the config is a flags error naming it, in one line."""

  def _parse(self, argument):
    try:
      return super()._parse(argument)
    except (KeyError, AttributeError) as error:
      detail = error.args[0] if error.args else ""
      while isinstance(detail, BaseException):  # ConfigDict wraps the KeyError in an AttributeError
        detail = detail.args[0] if detail.args else ""
      detail = " ".join(str(detail).split())
      key = re.match(r"'([^']+)'", detail)
      named = [o for o in self._GetOverrides(self._GetArgv()) if key and key.group(1) in o.split(".")]
      where = f"--{self.name}.{named[-1]}" if named else f"an override of --{self.name}"
      raise flags.IllegalFlagValueError(f"{where}: {argument} has no such field ({detail}).") from None


def define_config(name: str = "config", default: str | None = None, help_string: str = "A config file "
                  "(configs/*.py[:ARG]) or a run's saved config.json.", *, lock_config: bool = True,
                  flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  """`config_flags.DEFINE_config_file`, also taking a saved `config.json`; see the module docstring."""
  flag = _ConfigFlag(parser=_ConfigParser(name=name, lock_config=lock_config), serializer=flags.ArgumentSerializer(),
                     name=name, default=default, help_string=help_string, flag_values=flag_values)
  return flags.DEFINE_flag(flag, flag_values)

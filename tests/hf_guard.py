"""Cross-checks against transformers fail instead of skip when the `hf` extra is installed.

The parity tests import the reference with `pytest.importorskip`, so that a machine without torch and
transformers skips them. With the extra installed, the same skip would hide a broken reference (an
incompatible transformers release, a renamed module, a bug in `benchmarks/hf_reference.py`): the whole
parity layer would turn into skips and the suite would stay green. These hooks (imported by
`tests/conftest.py`; `-p hf_guard` in `tests/test_hf_guard.py`'s inner runs) turn such a skip into a
failure that names the module and the import error, wherever it happens: at module level (collection), in a
fixture (setup) or in a test. Skips of anything else, and every skip without the extra, stay skips.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

import pytest

EXTRA = ("torch", "transformers")  # what `pip install -e '.[hf]'` brings
# The reference: the extra's packages (any submodule) and our wrapper around them.
_REFERENCE = re.compile(r"(torch|transformers)(\.[\w.]+)?|benchmarks\.hf_reference")
_SKIP = re.compile(r"could not import '([\w.]+)'|module '([\w.]+)' has __version__")


ASSUME = "DG_ASSUME_HF_EXTRA"  # "1" or "0": taken as the answer (for tests/test_hf_guard.py's inner runs)


@functools.cache
def hf_installed() -> bool:
  """Whether the `hf` extra's packages are installed (found, whether or not they import)."""
  if os.environ.get(ASSUME) in ("0", "1"):
    return os.environ[ASSUME] == "1"
  return all(importlib.util.find_spec(name) is not None for name in EXTRA)


def hidden_reference(reason: str) -> str | None:
  """The reference module an `importorskip` skip reason names, else None."""
  match = _SKIP.search(reason)
  name = match and (match[1] or match[2])
  return name if name and _REFERENCE.fullmatch(name) else None


def _fail_if_hidden(report) -> None:
  if not report.skipped or not hf_installed():
    return
  reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
  module = hidden_reference(reason)
  if module is not None:
    report.outcome = "failed"
    report.longrepr = (f"The `hf` extra is installed ({', '.join(EXTRA)}) but the transformers reference "
                       f"{module!r} cannot be imported, so this cross-check would have been skipped: {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):  # pylint: disable=unused-argument
  report = yield
  _fail_if_hidden(report)
  return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):  # pylint: disable=unused-argument
  report = yield
  _fail_if_hidden(report)
  return report

"""tests/hf_guard.py: with the `hf` extra installed, a transformers cross-check that cannot import its
reference fails (at collection, in a fixture, in a test); other skips, and every skip without the extra,
stay skips. Checked on inner pytest runs (subprocesses) of small test files, next to stand-in `torch` and
`transformers` packages that import in no time and lack the modules asked for."""

import os
import pathlib

import pytest

import hf_guard

FILES = {
    "test_module_level": "import pytest\npytest.importorskip('transformers.no_such_module')\n"
                         "def test_never_collected():\n  pass\n",
    "test_inside": """
import pytest

@pytest.fixture
def reference():
  return pytest.importorskip('transformers.models.no_such_model')

@pytest.fixture
def lookalike():
  return pytest.importorskip('benchmarks.hf_reference_that_is_not')

def test_in_a_test():
  pytest.importorskip('torch.no_such_module')

def test_in_a_fixture(reference):
  pass

def test_a_name_that_only_looks_like_the_reference(lookalike):
  pass

def test_another_package():
  pytest.importorskip('no_such_package_at_all')

def test_a_plain_skip():
  pytest.skip('transformers is slow today')
""",
}


def _run(pytester, monkeypatch, installed):
  for package in ("torch", "transformers"):
    pytester.mkpydir(package)
  monkeypatch.setenv(hf_guard.ASSUME, "1" if installed else "0")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pathlib.Path(__file__).parent),
                                                    os.environ.get("PYTHONPATH", "")]))
  pytester.makepyfile(**FILES)
  return pytester.runpytest_subprocess("-p", "hf_guard", "-rfEs", "--continue-on-collection-errors")


def test_reference_import_skips_fail_when_the_extra_is_installed(pytester, monkeypatch):
  result = _run(pytester, monkeypatch, installed=True)
  result.assert_outcomes(failed=1, errors=2, skipped=3)
  output = result.stdout.str()
  result.stdout.fnmatch_lines(["FAILED test_inside.py::test_in_a_test*", "ERROR test_module_level.py*",
                               "ERROR test_inside.py::test_in_a_fixture*"])
  for module in ("transformers.no_such_module", "transformers.models.no_such_model", "torch.no_such_module"):
    assert (f"The `hf` extra is installed (torch, transformers) but the transformers reference {module!r} cannot "
            "be imported") in output.replace("\n", ""), module
  # Another package, a name that only looks like the reference, and a skip that is no import stay skips.
  for reason in ("could not import 'no_such_package_at_all'", "could not import 'benchmarks.hf_reference_that",
                 "transformers is slow today"):
    assert reason in output, reason


def test_without_the_extra_everything_stays_a_skip(pytester, monkeypatch):
  _run(pytester, monkeypatch, installed=False).assert_outcomes(skipped=6)


@pytest.mark.parametrize("reason,module", [
    ("could not import 'torch': No module named 'torch'", "torch"),
    ("could not import 'transformers.models.diffusion_gemma': cannot import name 'X'",
     "transformers.models.diffusion_gemma"),
    ("could not import 'benchmarks.hf_reference': No module named 'transformers'", "benchmarks.hf_reference"),
    ("module 'transformers' has __version__ '4.0', required is: '5.0'", "transformers"),
    ("could not import 'torchvision': No module named 'torchvision'", None),
    ("could not import 'lm_eval.utils': No module named 'lm_eval'", None),
    ("transformers is slow today", None),
])
def test_which_skips_name_the_reference(reason, module):
  assert hf_guard.hidden_reference(reason) == module

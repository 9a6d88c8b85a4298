"""Session-wide test setup."""

import os

import pytest

from diffusiongemma.parallel import compilation_cache


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
  """One persistent compilation cache for every binary the tests start (subprocesses inherit the variable;
  `parallel.enable_compilation_cache` prefers it to their workdir), so a program compiled by one test's
  subprocess is read back by the next. A cache dir already set outside pytest is kept."""
  if not os.environ.get(compilation_cache.ENV_VAR):
    os.environ[compilation_cache.ENV_VAR] = str(tmp_path_factory.mktemp("compilation_cache"))
  yield os.environ[compilation_cache.ENV_VAR]

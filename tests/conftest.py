"""Session-scoped fixtures shared by test modules (each built once per run, on first use)."""

import os

import jax
import pytest

import chat_fixtures
from diffusiongemma.parallel import compilation_cache
from hf_guard import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (hooks)


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
  """One persistent compilation cache for every binary the tests start (subprocesses inherit the variable;
  `parallel.enable_compilation_cache` prefers it to their workdir), so a program compiled by one test's
  subprocess is read back by the next. A cache dir already set outside pytest is kept."""
  if not os.environ.get(compilation_cache.ENV_VAR):
    os.environ[compilation_cache.ENV_VAR] = str(tmp_path_factory.mktemp("compilation_cache"))
  # JAX reads the variable lazily, so it would also turn the persistent cache on in this process, which
  # compiles everything once anyway: only the binaries it starts share the cache.
  jax.config.update("jax_enable_compilation_cache", False)
  yield os.environ[compilation_cache.ENV_VAR]


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
  """A tiny complete transformers checkpoint folder with a chat tokenizer (tests/chat_fixtures.py;
  written by transformers, so it needs torch): random weights, canvas 8, 12 denoising steps, replies of
  16 tokens (2 canvases) by default."""
  pytest.importorskip("torch")
  folder = tmp_path_factory.mktemp("chat_checkpoint")
  chat_fixtures.write_chat_checkpoint(folder)
  return folder


@pytest.fixture(scope="session")
def server(chat_checkpoint, tmp_path_factory):
  """One server process (scripts/serve.py) over `chat_checkpoint` for every test that talks to it: batches
  of up to 8 (one compiled size), prompts up to 64 tokens (one bucket), so its grid is two programs (one
  and two canvases; the second compiles in the background once it is ready), 50 ms admission window,
  max_tokens up to 10^6 (so that the model's context, not the server's limit, refuses the largest)."""
  import serving_helpers  # pylint: disable=import-outside-toplevel
  process = serving_helpers.ServerProcess(chat_checkpoint, tmp_path_factory.mktemp("server") / "server.log",
                                          "--batch_sizes=8", "--admission_ms=50", "--max_prompt_tokens=64",
                                          "--max_tokens_limit=1000000")
  try:
    process.wait()
    yield process
  finally:
    process.stop()

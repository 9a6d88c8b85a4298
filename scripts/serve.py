r"""Serve a DiffusionGemma model over an OpenAI-compatible HTTP API, with a web page at `/`.

  python scripts/serve.py --hf_checkpoint=DIR [--host=127.0.0.1] [--port=8000]
  python scripts/serve.py --config=configs/tiny.py --workdir=W [--tokenizer=DIR]   # a training run

Routes: /v1/chat/completions, /v1/completions, /v1/models, /health, and the page at /. Requests that
arrive together run as one batch (`--admission_ms` is how long the scheduler waits for company) on a
compiled program: start-up compiles the grid the flags declare (`--batch_sizes` x prompt buckets 64,
256, ... up to `--max_prompt_tokens` x reply canvases up to `--max_tokens`; /health says "warming" until
the programs that cover all of it are ready, the rest compiles in the background), and a batch is padded
up to the cheapest compiled program (`--max_padding`, docs/serving.md). More than `--max_queue` waiting
requests get 429; a request not done within `--request_timeout` seconds of its arrival gets 504.
Constraint builds (`response_format`) run in a separate process within `--constraint_seconds`,
`--constraint_states` and `--constraint_memory_mib` (past one: a 400 naming it). On SIGTERM (or Ctrl-C)
the server stops accepting, stops constraint builds, lets what is queued or running finish for
`--shutdown_grace` seconds, answers the rest with 503, and exits 0. Logs are JSON lines on stderr, one per
request (tokens, passes, batch size, queue and total time), per batch (its program, whether it compiled)
and per compiled program.
"""

import dataclasses
import logging
import os
import pathlib
import signal
import sys

from absl import app
from absl import flags
import uvicorn

from diffusiongemma import build
from diffusiongemma import parallel
from diffusiongemma import serving
from diffusiongemma.chat import format as chat_format
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.sampling import presets

_HF = flags.DEFINE_string("hf_checkpoint", None, "A transformers DiffusionGemma checkpoint folder.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir (instead of --hf_checkpoint).")
_COMPILATION_CACHE = parallel.define_compilation_cache_flag()
_CONFIG = build.cli.define_config("config", None, "With --workdir: the run's config (default: the "
                                "one it saved).", lock_config=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "With --workdir: a checkpoint folder whose tokenizer to use "
                                 "(default: the workdir's tokenizer.json, else its sentencepiece model, which "
                                 "serves /v1/completions only).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Interface to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_MODEL_NAME = flags.DEFINE_string("model_name", None, "The model id clients send (default: the folder's name).")
_PRESET = flags.DEFINE_string("preset", "default", "Sampler preset: default, code or creative.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "With --hf_checkpoint: weight and compute dtype.")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "With --hf_checkpoint: int8 attention, MLP "
                               "and expert weights, quantised as they are read (docs/quantization.md).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 0, "Default reply length, and the longest reply of the compiled "
                                   "grid; 0: the checkpoint's, else 256, in whole canvases, halved while the "
                                   "model's context cannot hold it.")
_MAX_TOKENS_LIMIT = flags.DEFINE_integer("max_tokens_limit", 4096, "The most tokens a request may ask for "
                                         "(beyond --max_tokens, programs compile on demand).")
_MAX_PROMPT_TOKENS = flags.DEFINE_integer("max_prompt_tokens", 0, "The longest prompt served, and the longest "
                                          "prompt bucket of the compiled grid; 0: the longest bucket up to 1024 "
                                          "that the model's context holds beside --max_tokens.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Compiled batch sizes (the largest is the "
                                 "most requests per batch).")
_MAX_PADDING = flags.DEFINE_float("max_padding", 4.0, "A batch joins requests, and runs on a compiled program, "
                                  "up to this many times its own positions; beyond, its own program compiles "
                                  "in the background.")
_SEEDED_ALONE = flags.DEFINE_bool("seeded_alone", False, "Run each request that has a seed alone on its own "
                                  "program, so that its answer does not depend on the load (docs/serving.md).")
_CONSTRAINT_SECONDS = flags.DEFINE_float("constraint_seconds", 10.0, "Time limit of one constraint build.")
_CONSTRAINT_STATES = flags.DEFINE_integer("constraint_states", 10_000, "Most automaton states of a constraint.")
_CONSTRAINT_MEMORY = flags.DEFINE_float("constraint_memory_mib", 1024, "Memory limit of one constraint build's "
                                        "process (resident MiB).")
_MAX_IMAGE_PIXELS = flags.DEFINE_integer("max_image_pixels", 4096 * 4096, "Most pixels of one image (checked "
                                         "from its header, before decoding).")
_ADMISSION_MS = flags.DEFINE_float("admission_ms", 10.0, "How long a free device waits for requests to batch.")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 256, "Waiting requests beyond this get 429.")
_TIMEOUT = flags.DEFINE_float("request_timeout", 600.0, "Seconds a request may take in all (queue included).")
_GRACE = flags.DEFINE_float("shutdown_grace", 30.0, "Seconds in-flight requests get to finish on SIGTERM.")
_WARM_UP = flags.DEFINE_integer("warm_up", 1, "1: compile the declared grid at start-up (/health says warming "
                                 "until the programs covering it are ready); 0: compile on demand.")


def _model():
  """(sampler, variables, tokenizer, default reply length, empty-thought prefill, name) of the flags."""
  if _HF.value:
    loaded = build.pretrained(_HF.value, preset=_PRESET.value, dtype=_DTYPE.value,
                              model_overrides={"quantize": _QUANTIZE.value})
    return (loaded.sampler, loaded.weights.variables, loaded.tokenizer, loaded.max_new_tokens,
            chat_format.template_prefills_empty_thought(_HF.value), pathlib.Path(_HF.value).resolve().name)
  if _WORKDIR.value:
    workdir = pathlib.Path(_WORKDIR.value)
    config = build.run_config(workdir, _CONFIG.value)  # the run as trained; a --config given must match it
    weights = build.load(config, workdir=workdir)
    sampler = build.sampler(config, weights.model_config, **presets.preset_overrides(_PRESET.value))
    if _TOKENIZER.value or (workdir / hf_tokenizer.TOKENIZER_JSON).is_file():
      tokenizer = hf_tokenizer.CheckpointTokenizer(_TOKENIZER.value or workdir)
      hf_tokenizer.check_fits(tokenizer, weights.model_config.vocab_size, "model.vocab_size",
                              f"it is not the tokenizer {workdir} was trained with")
    else:
      tokenizer = build.tokenizer(config, workdir)
    return (sampler, weights.variables, tokenizer, build.max_new_tokens(config), False, workdir.resolve().name)
  raise app.UsageError("Pass --hf_checkpoint=DIR (a transformers checkpoint folder), or --workdir=DIR.")


class _Server(uvicorn.Server):
  """uvicorn, telling the app to drain when a shutdown signal arrives."""

  def __init__(self, config, application, grace: float):
    super().__init__(config)
    self.application, self.grace = application, grace

  def handle_exit(self, sig, frame):
    loop = getattr(self.application.state.scheduler, "loop", None)
    if not self.should_exit and loop is not None:
      loop.call_soon_threadsafe(self.application.state.begin_shutdown, self.grace)
    super().handle_exit(sig, frame)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(message)s"))
  log = logging.getLogger("diffusiongemma.serving")
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False  # plain JSON lines, not absl's prefixed format
  # Only partly useful here: jax 0.10 does not store programs with host callbacks (compiler._cache_write),
  # and every sampler program of the server streams its passes (`on_pass`), so the grid compiles again in
  # each process (docs/serving.md, "Restarts").
  parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
  sampler, variables, tokenizer, max_new, empty_thought, name = _model()
  engine = serving.Engine(sampler, variables, tokenizer, model_name=_MODEL_NAME.value or name,
                          max_tokens=_MAX_TOKENS.value or None,
                          default_max_tokens=max_new or serving.DEFAULT_MAX_TOKENS,
                          max_tokens_limit=_MAX_TOKENS_LIMIT.value,
                          max_prompt_tokens=_MAX_PROMPT_TOKENS.value or None, empty_thought=empty_thought,
                          batch_sizes=[int(b) for b in _BATCH_SIZES.value], max_image_pixels=_MAX_IMAGE_PIXELS.value)
  budget = dataclasses.replace(serving.app.DEFAULT_CONSTRAINT_BUDGET, seconds=_CONSTRAINT_SECONDS.value,
                               max_states=_CONSTRAINT_STATES.value, max_dfa_states=_CONSTRAINT_STATES.value)
  application = serving.create_app(engine, admission_window=_ADMISSION_MS.value / 1000, max_queue=_MAX_QUEUE.value,
                                   request_timeout=_TIMEOUT.value, warm_up=_WARM_UP.value,
                                   max_padding=_MAX_PADDING.value, seeded_alone=_SEEDED_ALONE.value,
                                   constraint_budget=budget,
                                   constraint_memory_mib=_CONSTRAINT_MEMORY.value)
  config = uvicorn.Config(application, host=_HOST.value, port=_PORT.value, access_log=False, log_level="warning",
                          timeout_graceful_shutdown=int(_GRACE.value) + 5)
  # uvicorn re-raises the signal it shut down on once it is done: end with status 0 then.
  signal.signal(signal.SIGTERM, lambda *_: _exit())
  _Server(config, application, _GRACE.value).run()
  _exit()


def _exit() -> None:
  """Exits 0 at once: a program may still be compiling on a background thread, and the interpreter's own
  exit would wait for it or abort inside XLA."""
  logging.shutdown()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  build.cli.run(main)

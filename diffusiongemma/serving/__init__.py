"""An OpenAI-compatible server for a DiffusionGemma model: batching across requests, the canvas streamed as
it denoises, JSON-schema and regex constraints, and a web page that shows it (`scripts/serve.py`).

- `requests`: OpenAI request bodies checked into a `Request` (a 400 names the field), within `Limits`;
- `engine`: the model side: prompts, images, the program grid, one compiled call per batch;
- `programs`: program shapes, which compiled program serves a batch, the background compiler;
- `constraints`: constraint builds, bounded in time and memory, in their own processes;
- `rows`: one request's row of a batch: per-pass events -> canvas events, text deltas, its result;
- `scheduler`: admission window, batches and their programs, queue limit, cancellation, graceful shutdown;
- `responses`: OpenAI bodies and SSE chunks; `errors`: OpenAI-shaped errors;
- `app`: the Starlette app (`create_app(engine, ...)`), its routes, logs and the static page.
"""

from diffusiongemma.serving.app import create_app
from diffusiongemma.serving.engine import DEFAULT_MAX_TOKENS, Engine
from diffusiongemma.serving.errors import APIError
from diffusiongemma.serving.scheduler import Scheduler

__all__ = ["APIError", "DEFAULT_MAX_TOKENS", "Engine", "Scheduler", "create_app"]

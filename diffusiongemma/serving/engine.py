"""`Engine`: the model side of the server. A checked `Request` becomes a `Prepared` job (prompt ids, its own
prompt bucket and reply canvases, temperature, seed; its constraint is added by `with_constraint` once
`serving.constraints` has built it), and a batch of jobs runs as one call of a compiled program
(`programs.Shape`) whose per-pass stream is routed to each job's `rows.Row`.

Bounded before it costs: `limits()` gives `requests.parse` the prompt's byte cap (a longer text could only
be more tokens than `max_prompt_tokens`) and the message and image counts; an image's size is read from
its header and refused above `max_image_pixels` before it is decoded; a prompt longer than
`max_prompt_tokens` tokens, or one whose reply does not fit the context, is a 400 before any constraint
is built or program compiled.

Programs: the prompt is padded to `prompt_bucket * 4**k` tokens (the sampler's bucket, 64 by default),
the reply to a power of two of canvases, the batch to the next of `batch_sizes`; `grid()` is every
(batch size, prompt bucket up to `max_prompt_tokens`, canvases up to the default reply length) program,
compiled at start-up, the `covering()` ones (each batch size with the largest prompt bucket and reply)
first. Temperature (the checkpoint's schedule times the request's `temperature`; 0 means 0.05) and the
seed are per-row inputs of every program.

Randomness: one key per row from the request's seed. Whether a request's tokens depend on its batch:
docs/serving.md ("Batch invariance").
"""

from __future__ import annotations

import dataclasses
import io
import math
import secrets
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image

from diffusiongemma.chat import format as fmt
from diffusiongemma.data import images as images_lib
from diffusiongemma.sampling import constrained
from diffusiongemma.sampling import sampler as sampler_lib
from diffusiongemma.serving import programs
from diffusiongemma.serving import rows as rows_lib
from diffusiongemma.serving.errors import APIError, invalid
from diffusiongemma.serving.requests import Limits, Request

IMAGE_PLACEHOLDER = "<|image|>"
PROMPT_BUCKET_GROWTH = 4
DEFAULT_MAX_PROMPT_TOKENS = 1024  # the longest prompt served by default, where the context holds it
DEFAULT_MAX_TOKENS = 256  # the default reply length, where the context holds it
MIN_TEMPERATURE = 0.05  # what temperature 0 means (nearly greedy; the schedule divides by it)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A request ready to run: its prompt ids, images, limits, seed, temperature, its own prompt bucket and
  reply canvases, and its constraint (None until `Engine.with_constraint`, or without one)."""

  request: Request
  ids: tuple[int, ...]
  images: tuple[images_lib.ProcessedImage, ...]
  max_tokens: int
  seed: int
  temperature: float
  canvases: int
  prompt_bucket: int
  constraint: constrained.Constraint | None = None


def temperature_scale(temperature: float) -> float:
  return max(float(temperature), MIN_TEMPERATURE)


def row_keys(seeds: Sequence[int]) -> jax.Array:
  """One PRNG key per row from 64-bit seeds (low and high words), the same alone or in any batch."""
  seeds = [int(s) % 2**64 for s in seeds]
  low = jnp.asarray([s & 0xFFFFFFFF for s in seeds], jnp.uint32)
  high = jnp.asarray([s >> 32 for s in seeds], jnp.uint32)
  return jax.vmap(lambda lo, hi: jax.random.fold_in(jax.random.key(lo), hi))(low, high)


class _Compiles:
  """Counts XLA compilations of the sampler's program per thread (jax.monitoring's compile event), so that
  a batch's log can say whether its call compiled."""

  _local = threading.local()
  _registered = False
  _lock = threading.Lock()

  @classmethod
  def register(cls) -> None:
    with cls._lock:
      if not cls._registered:
        jax.monitoring.register_event_duration_secs_listener(cls._listen)
        cls._registered = True

  @classmethod
  def _listen(cls, event: str, seconds: float, **kwargs) -> None:
    del seconds
    if event.endswith("backend_compile_duration") and "_program" in str(kwargs.get("fun_name", "")):
      cls._local.count = cls.count() + 1

  @classmethod
  def count(cls) -> int:
    return getattr(cls._local, "count", 0)


class Engine:
  """The model, its tokenizer and the batching geometry (see the module docstring).

  sampler, variables, tokenizer: the model to serve; model_name: the name clients ask for;
  max_tokens: the default reply length (the grid's longest reply; None: `default_max_tokens`, halved while
  the context cannot hold it beside the shortest prompt bucket); max_tokens_limit: the most a request
  may ask for; max_prompt_tokens: the longest prompt served (default: the longest prompt bucket up to
  `DEFAULT_MAX_PROMPT_TOKENS` that the context holds beside the longest reply); empty_thought: prefill an
  empty thought when thinking is off (the checkpoint's template does); batch_sizes: the compiled batch
  sizes; image_budget: soft tokens per image; max_image_pixels: width x height an image may have;
  max_messages, max_images: per request.
  """

  def __init__(self, sampler: sampler_lib.Sampler, variables, tokenizer, *, model_name: str,
               max_tokens: int | None = None, max_tokens_limit: int = 4096, max_prompt_tokens: int | None = None,
               default_max_tokens: int = DEFAULT_MAX_TOKENS,
               empty_thought: bool = False, batch_sizes: Sequence[int] = (1, 4, 16), image_budget: int = 280,
               max_image_pixels: int = 4096 * 4096, max_messages: int = 1024, max_images: int = 8):
    self.tokenizer, self.variables, self.model_name = tokenizer, variables, model_name
    self.chat = all(t in getattr(tokenizer, "control_ids", {}) for t in (fmt.TURN_OPEN, fmt.TURN_CLOSE))
    stops = list(sampler.stop_tokens)
    extra = [tokenizer.eos_id] + ([tokenizer.control_ids[fmt.TURN_CLOSE]] if self.chat else [])
    stops += [t for t in extra if t not in stops]
    self.sampler = sampler.replace(config=sampler.config.replace(stop_tokens=tuple(stops)))
    special = getattr(tokenizer, "special_tokens", {})
    self.stop_ids = tuple(t for t in self.sampler.stop_tokens if not self.chat or t in special)
    self.config = self.sampler.model.config
    self.canvas = self.config.canvas_length
    if max_tokens is None:  # the default, in whole canvases, shrunk to what the context holds
      max_tokens = default_max_tokens
      while max_tokens > self.canvas and (self.canvas_bucket(max_tokens) * self.canvas
                                          + self.sampler.config.prompt_bucket > self.config.max_positions):
        max_tokens = (self.canvas_bucket(max_tokens) // 2) * self.canvas
    self.max_tokens, self.empty_thought, self.image_budget = max_tokens, empty_thought, image_budget
    self.max_tokens_limit, self.max_image_pixels = max_tokens_limit, max_image_pixels
    self.batch_sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
    if not self.batch_sizes or self.batch_sizes[0] < 1:
      raise ValueError(f"batch_sizes={batch_sizes!r}: positive sizes are needed.")
    reply = self.canvas_bucket(max_tokens) * self.canvas
    if max_prompt_tokens is None:  # the longest prompt bucket up to the default that fits beside the reply
      max_prompt_tokens = self.sampler.config.prompt_bucket
      while (max_prompt_tokens * PROMPT_BUCKET_GROWTH <= DEFAULT_MAX_PROMPT_TOKENS
             and max_prompt_tokens * PROMPT_BUCKET_GROWTH + reply <= self.config.max_positions):
        max_prompt_tokens *= PROMPT_BUCKET_GROWTH
    self.max_prompt_tokens = max_prompt_tokens
    bucket = self.prompt_bucket(max_prompt_tokens)
    if bucket + reply > self.config.max_positions:
      raise ValueError(f"max_prompt_tokens={max_prompt_tokens} (padded to the prompt bucket {bucket}) and "
                       f"max_tokens={max_tokens} ({reply} positions) exceed the model's context of "
                       f"{self.config.max_positions}.")
    self._vocabulary = constrained.token_bytes(tokenizer)
    longest = max([len(b) for b in self._vocabulary.values()] + [len(t.encode()) for t in special.values()] + [1])
    # Twice the bound, for normalizers that shrink text; past it a prompt is certainly too long.
    self._limits = Limits(messages=max_messages, images=max_images,
                          prompt_bytes=2 * longest * self.max_prompt_tokens)
    self._pieces: dict[int, str] = {}
    self.mismatches = 0  # rows whose streamed tokens differ from the program's output (must stay 0)
    _Compiles.register()

  # ------------------------------------------------------------------------------------------ shapes
  @property
  def max_batch(self) -> int:
    return self.batch_sizes[-1]

  def limits(self) -> Limits:
    return self._limits

  def vocabulary(self) -> dict[int, bytes]:
    """The tokenizer's text tokens as bytes (what constraints are built over)."""
    return self._vocabulary

  def batch_bucket(self, n: int) -> int:
    return next(b for b in self.batch_sizes if b >= n)

  def canvas_bucket(self, max_tokens: int) -> int:
    return 1 << (math.ceil(max_tokens / self.canvas) - 1).bit_length()

  def prompt_bucket(self, length: int) -> int:
    bucket = self.sampler.config.prompt_bucket
    while bucket < length:
      bucket *= PROMPT_BUCKET_GROWTH
    return bucket

  def grid(self) -> list[programs.Shape]:
    """The programs the flags declare, the `covering()` ones first, then the others smallest first."""
    prompts = [self.prompt_bucket(1)]
    while prompts[-1] < self.max_prompt_tokens:
      prompts.append(prompts[-1] * PROMPT_BUCKET_GROWTH)
    canvases = [1 << k for k in range(self.canvas_bucket(self.max_tokens).bit_length())]
    shapes = [programs.Shape(b, p, k) for b in self.batch_sizes for p in prompts for k in canvases]
    first = self.covering()
    return first + sorted((s for s in shapes if s not in first), key=lambda s: (s.positions(self.canvas), s))

  def covering(self) -> list[programs.Shape]:
    """The smallest set of programs that serves every request of the grid: each batch size with the
    longest prompt bucket and reply."""
    return [programs.Shape(b, self.prompt_bucket(self.max_prompt_tokens), self.canvas_bucket(self.max_tokens))
            for b in self.batch_sizes]

  # ------------------------------------------------------------------------------------------ requests
  def _image(self, data: bytes, param: str) -> images_lib.ProcessedImage:
    """An image decoded and preprocessed, its size checked from its header before it is decoded."""
    vision = self.config.vision
    try:
      with PIL.Image.open(io.BytesIO(data)) as opened:  # reads the header only
        width, height = opened.size
        if width * height > self.max_image_pixels:
          raise invalid(param, f"The image is {width} x {height} pixels; this server takes at most "
                        f"{self.max_image_pixels} pixels per image.", "image_too_large")
        opened.load()
        image = opened.copy()
    except APIError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (any undecodable image is the client's)
      raise invalid(param, f"Cannot read the image: {e}") from None
    return images_lib.preprocess(image, self.image_budget, patch_size=vision.patch_size,
                                 pooling_kernel_size=vision.pooling_kernel_size)

  def _chat_ids(self, request: Request) -> tuple[list[int], list[images_lib.ProcessedImage]]:
    if not self.chat:
      raise invalid("messages", "This model's tokenizer has no Gemma 4 chat tokens: use /v1/completions.")
    vision = self.config.vision
    messages, images = [], []
    for i, message in enumerate(request.messages):
      if message.images and vision is None:
        raise invalid(f"messages.{i}.content", "This model has no vision encoder: it cannot take images.")
      images += [self._image(image, f"messages.{i}.content") for image in message.images]
      media = {"media": IMAGE_PLACEHOLDER * len(message.images)} if message.images else {}
      messages.append({"role": message.role, "content": message.content, **media})
    try:
      ids = fmt.render_ids(messages, self.tokenizer, thinking=request.thinking, empty_thought=self.empty_thought)
    except ValueError as e:
      raise invalid("messages", str(e)) from None
    if vision is not None:
      try:
        ids = images_lib.expand_image_placeholders(ids, [im.num_soft_tokens for im in images], self.config)
      except ValueError as e:
        raise invalid("messages", str(e)) from None
    return ids, images

  def prepare(self, request: Request) -> Prepared:
    """Tokenizes and checks a request against the model (prompt length, context); a 400 names the field.
    Blocking (tokenizing, images): call it off the event loop."""
    if request.kind == "chat":
      ids, images = self._chat_ids(request)
    else:
      ids, images = [self.tokenizer.bos_id] + self.tokenizer.encode(request.prompt), []
    max_tokens = request.max_tokens or self.max_tokens
    canvases = self.canvas_bucket(max_tokens)
    prompt_param = "messages" if request.kind == "chat" else "prompt"
    if len(ids) > self.max_prompt_tokens:
      raise invalid(prompt_param, f"The prompt has {len(ids)} tokens; this server takes at most "
                    f"{self.max_prompt_tokens} (its --max_prompt_tokens).", "context_length_exceeded")
    param = "max_tokens" if request.max_tokens else prompt_param
    if self.prompt_bucket(len(ids)) + canvases * self.canvas > self.config.max_positions:
      raise invalid(param, f"The prompt has {len(ids)} tokens and the reply needs {canvases * self.canvas} "
                    f"positions ({canvases} canvas(es) of {self.canvas}): more than the model's context of "
                    f"{self.config.max_positions}.", "context_length_exceeded")
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    return Prepared(request, tuple(ids), tuple(images), max_tokens, seed, temperature_scale(request.temperature),
                    canvases, self.prompt_bucket(len(ids)))

  def with_constraint(self, prepared: Prepared, constraint: constrained.Constraint) -> Prepared:
    """`prepared` under `constraint` (built by `serving.constraints`); a 400 when it cannot fit."""
    try:
      constraint.check(self.sampler, prepared.max_tokens)
    except ValueError as e:
      raise invalid("response_format", f"Unsatisfiable within max_tokens={prepared.max_tokens}: {e}") from None
    return dataclasses.replace(prepared, constraint=constraint)

  def piece(self, token: int) -> str:
    """A token's text for the canvas view (control tokens by name)."""
    if token not in self._pieces:
      special = getattr(self.tokenizer, "special_tokens", {}).get(token)
      self._pieces[token] = special if special is not None else self.tokenizer.decode([token])
    return self._pieces[token]

  def _stream(self):
    if self.chat:
      return fmt.ReplyStream(self.tokenizer, stop_ids=self.stop_ids)
    return rows_lib.PlainStream(self.tokenizer, self.stop_ids)

  # ------------------------------------------------------------------------------------------ running
  def _call(self, preps: Sequence[Prepared], shape: programs.Shape, constraint, on_pass, compile_only=False):
    """`Sampler.generate` of `preps` (the rows; fewer than `shape.batch`: copies of the first) on `shape`."""
    rows = list(preps) + [preps[0]] * (shape.batch - len(preps))
    prompt = np.full((shape.batch, shape.prompt), self.config.pad_id, np.int32)
    for i, p in enumerate(rows):
      prompt[i, :len(p.ids)] = p.ids
    images = [im for p in rows for im in p.images]
    return self.sampler.generate(
        self.variables, prompt, row_keys([p.seed for p in rows]), shape.canvases * self.canvas,
        prompt_lengths=np.array([len(p.ids) for p in rows], np.int32),
        images=images_lib.stack(images)[:2] if images else None, constraint=constraint, on_pass=on_pass,
        temperature_scale=np.array([p.temperature for p in rows], np.float32), compile_only=compile_only)

  def compile(self, shape: programs.Shape, constraint=None) -> None:
    """Compiles the program of `shape` (text only) without running it."""
    prepared = Prepared(Request(kind="completion", model=self.model_name), (self.tokenizer.bos_id,), (),
                        shape.canvases * self.canvas, 0, 1.0, shape.canvases, shape.prompt, constraint)
    self._call([prepared], shape, constraint, on_pass=_ignore, compile_only=True)

  def run(self, jobs: Sequence, shape: programs.Shape) -> dict:
    """Runs `jobs` (objects with `.prepared`, `.send(event)`, `.cancelled`; one group, covered by `shape`)
    in one call of the program `shape`; each job gets its events through `send` while it runs. Returns
    the batch's report (`compiled`: whether the call compiled its program)."""
    steps = self.sampler.config.max_denoising_steps
    stops = self.sampler.stop_tokens
    rows = [rows_lib.Row(self._stream(), stop_ids=stops, max_tokens=job.prepared.max_tokens,
                         stop=job.prepared.request.stop, steps=steps, send=job.send,
                         pieces=self.piece if job.prepared.request.stream_canvas else None) for job in jobs]

    def on_pass(event: sampler_lib.PassEvent) -> None:
      for i, (job, row) in enumerate(zip(jobs, rows)):
        if job.cancelled or row.finished:
          continue
        try:
          row.on_pass(event.canvas_index, event.step, event.argmax[i], event.accepted[i], event.fixed[i],
                      bool(event.active[i]), bool(event.done[i]))
        except Exception as e:  # pylint: disable=broad-except  (one row's failure must not stop the batch)
          row.result = rows_lib.Result("", "", "error", (), 0, 0, 0)
          job.send(("error", APIError(500, f"Internal error while streaming: {e!r}")))

    compiles = _Compiles.count()
    start = time.perf_counter()
    out = self._call([job.prepared for job in jobs], shape, jobs[0].prepared.constraint, on_pass)
    tokens = np.asarray(out.tokens)
    seconds = time.perf_counter() - start
    for i, (job, row) in enumerate(zip(jobs, rows)):
      if job.cancelled:
        continue
      if not row.finished:  # every row ends inside the program (stop token or max_tokens): never expected
        self.mismatches += 1
        row.finish_unended()
      own = rows_lib.Row(self._stream(), stop_ids=stops, max_tokens=job.prepared.max_tokens, stop=(),
                         steps=steps, send=lambda _: None)
      for k in range(row.canvases):
        own.commit(tokens[i, k * self.canvas:(k + 1) * self.canvas])
      if row.result.finish_reason != "error" and list(row.tokens) != own.tokens[:len(row.tokens)]:
        self.mismatches += 1
    return {"size": len(jobs), **shape.describe(), "seconds": round(seconds, 4),
            "compiled": _Compiles.count() > compiles,
            "padding": round(shape.positions(self.canvas) / sum(
                j.prepared.prompt_bucket + j.prepared.canvases * self.canvas for j in jobs), 3)}


def _ignore(event) -> None:
  del event

"""`Engine`: the model side of the server. A checked `Request` becomes a `Prepared` job (prompt ids, the
compiled-program key it runs under, its constraint), and a batch of jobs becomes one `Sampler.generate`
call whose per-pass stream is routed to each job's `rows.Row`.

What one compiled program serves (the batch key; jobs batch together only under equal keys):
- the sampler: the checkpoint's, with its temperature schedule scaled by the request's `temperature`
  (rounded to 0.1; 0 means 0.05, nearly greedy); 1.0 is the checkpoint's own schedule;
- the constraint (`response_format`): each distinct schema or regex is one cached `Constraint` object and
  compiles its own program on first use;
- canvases: ceil(max_tokens / canvas) rounded up to a power of two;
- the prompt bucket: the prompt is padded to `prompt_bucket * 4**k` tokens;
- the batch size: padded up to the next of `batch_sizes` with copies of the first row (discarded).
`warm_up` compiles the default (sampler, canvases, smallest prompt bucket) for every batch size.

Randomness: one key per row from the request's seed, so a request's output does not depend on the batch it
ran in. Every program streams (`on_pass`), so there is one program per key, not two.
"""

from __future__ import annotations

import collections
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
from diffusiongemma.serving import rows as rows_lib
from diffusiongemma.serving.errors import APIError, invalid
from diffusiongemma.serving.requests import Request, ResponseFormat

IMAGE_PLACEHOLDER = "<|image|>"
PROMPT_BUCKET_GROWTH = 4


@dataclasses.dataclass(frozen=True)
class Scaled:
  """A temperature schedule times `factor` (the request's temperature)."""

  schedule: object
  factor: float

  def __call__(self, remaining, total):
    return self.schedule(remaining, total) * jnp.float32(self.factor)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A request ready to run: its prompt ids, images, limits, seed and the key of its batch."""

  request: Request
  ids: tuple[int, ...]
  images: tuple[images_lib.ProcessedImage, ...]
  max_tokens: int
  seed: int
  constraint: constrained.Constraint | None
  scale: float
  canvases: int
  prompt_bucket: int

  @property
  def key(self) -> tuple:
    return (self.scale, id(self.constraint), self.canvases, self.prompt_bucket, len(self.images))


def temperature_scale(temperature: float) -> float:
  return max(round(float(temperature), 1), 0.05)


def row_keys(seeds: Sequence[int]) -> jax.Array:
  """One PRNG key per row from 64-bit seeds (low and high words), the same alone or in any batch."""
  seeds = [int(s) % 2**64 for s in seeds]
  low = jnp.asarray([s & 0xFFFFFFFF for s in seeds], jnp.uint32)
  high = jnp.asarray([s >> 32 for s in seeds], jnp.uint32)
  return jax.vmap(lambda lo, hi: jax.random.fold_in(jax.random.key(lo), hi))(low, high)


class Engine:
  """The model, its tokenizer and the batching geometry (see the module docstring).

  sampler, variables, tokenizer: the model to serve; model_name: the name clients ask for;
  max_tokens: the default reply length; max_tokens_limit: the most a request may ask for;
  empty_thought: prefill an empty thought when thinking is off (the checkpoint's template does);
  batch_sizes: the compiled batch sizes; image_budget: soft tokens per image; constraint_cache: how many
  distinct constraints (and their programs) are kept.
  """

  def __init__(self, sampler: sampler_lib.Sampler, variables, tokenizer, *, model_name: str,
               max_tokens: int = 256, max_tokens_limit: int = 4096, empty_thought: bool = False,
               batch_sizes: Sequence[int] = (1, 4, 16), image_budget: int = 280, constraint_cache: int = 16):
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
    self.max_tokens, self.empty_thought, self.image_budget = max_tokens, empty_thought, image_budget
    self.max_tokens_limit, self.constraint_cache = max_tokens_limit, constraint_cache
    self.batch_sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
    if not self.batch_sizes or self.batch_sizes[0] < 1:
      raise ValueError(f"batch_sizes={batch_sizes!r}: positive sizes are needed.")
    self._samplers: dict[float, sampler_lib.Sampler] = {1.0: self.sampler}
    self._constraints: collections.OrderedDict = collections.OrderedDict()
    self._lock, self._build_lock = threading.Lock(), threading.Lock()
    self._pieces: dict[int, str] = {}
    self.mismatches = 0  # rows whose streamed tokens differ from the program's output (must stay 0)

  # ------------------------------------------------------------------------------------------ shapes
  @property
  def max_batch(self) -> int:
    return self.batch_sizes[-1]

  def batch_bucket(self, n: int) -> int:
    return next(b for b in self.batch_sizes if b >= n)

  def canvas_bucket(self, max_tokens: int) -> int:
    return 1 << (math.ceil(max_tokens / self.canvas) - 1).bit_length()

  def prompt_bucket(self, length: int) -> int:
    bucket = self.sampler.config.prompt_bucket
    while bucket < length:
      bucket *= PROMPT_BUCKET_GROWTH
    return bucket

  def sampler_for(self, scale: float) -> sampler_lib.Sampler:
    with self._lock:
      if scale not in self._samplers:
        self._samplers[scale] = dataclasses.replace(self.sampler, schedule=Scaled(self.sampler.schedule, scale))
      return self._samplers[scale]

  # ------------------------------------------------------------------------------------------ requests
  def _chat_ids(self, request: Request) -> tuple[list[int], list[images_lib.ProcessedImage]]:
    if not self.chat:
      raise invalid("messages", "This model's tokenizer has no Gemma 4 chat tokens: use /v1/completions.")
    vision = self.config.vision
    messages, images = [], []
    for i, message in enumerate(request.messages):
      if message.images and vision is None:
        raise invalid(f"messages.{i}.content", "This model has no vision encoder: it cannot take images.")
      for image in message.images:
        try:
          with PIL.Image.open(io.BytesIO(image)) as opened:
            opened.load()
            images.append(images_lib.preprocess(opened.copy(), self.image_budget, patch_size=vision.patch_size,
                                                pooling_kernel_size=vision.pooling_kernel_size))
        except Exception as e:  # pylint: disable=broad-except  (any undecodable image is the client's)
          raise invalid(f"messages.{i}.content", f"Cannot read the image: {e}") from None
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

  def constraint(self, response_format: ResponseFormat) -> constrained.Constraint | None:
    """The constraint of a response format, one object per distinct format (each compiles its own program,
    so concurrent requests for a new format wait for one build); a bad or unsatisfiable one is a 400."""
    if response_format.kind == "text":
      return None
    key = response_format.key()
    with self._build_lock:
      if key in self._constraints:
        self._constraints.move_to_end(key)
        return self._constraints[key]
      param = "response_format.regex" if response_format.kind == "regex" else "response_format"
      try:
        if response_format.kind == "regex":
          made = constrained.Constraint.regex(response_format.value, self.tokenizer, self.sampler)
        else:
          made = constrained.Constraint.json_schema(response_format.value, self.tokenizer, self.sampler)
      except Exception as e:  # pylint: disable=broad-except  (any failure to build it is the schema's or regex's)
        raise invalid(param, f"Invalid {response_format.kind.replace('_', ' ')}: {e}") from None
      self._constraints[key] = made
      while len(self._constraints) > self.constraint_cache:
        self._constraints.popitem(last=False)
      return made

  def prepare(self, request: Request) -> Prepared:
    """Tokenizes and checks a request against the model (context, constraint); a 400 names the field."""
    if request.kind == "chat":
      ids, images = self._chat_ids(request)
    else:
      ids, images = [self.tokenizer.bos_id] + self.tokenizer.encode(request.prompt), []
    max_tokens = request.max_tokens or self.max_tokens
    canvases = self.canvas_bucket(max_tokens)
    param = "max_tokens" if request.max_tokens else ("messages" if request.kind == "chat" else "prompt")
    if len(ids) + canvases * self.canvas > self.config.max_positions:
      raise invalid(param, f"The prompt has {len(ids)} tokens and the reply needs {canvases * self.canvas} "
                    f"positions ({canvases} canvas(es) of {self.canvas}): more than the model's context of "
                    f"{self.config.max_positions}.", "context_length_exceeded")
    constraint = self.constraint(request.response_format)
    if constraint is not None:
      try:
        constraint.check(self.sampler, max_tokens)
      except ValueError as e:
        raise invalid("response_format", f"Unsatisfiable within max_tokens={max_tokens}: {e}") from None
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    return Prepared(request, tuple(ids), tuple(images), max_tokens, seed, constraint,
                    temperature_scale(request.temperature), canvases, self.prompt_bucket(len(ids)))

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
  def run(self, jobs: Sequence) -> dict:
    """Runs `jobs` (objects with `.prepared`, `.send(event)`, `.cancelled`; one batch key) in one
    compiled call; each job gets its events through `send` while it runs. Returns the batch's report."""
    first = jobs[0].prepared
    size = self.batch_bucket(len(jobs))
    padded = list(jobs) + [jobs[0]] * (size - len(jobs))
    prompt = np.full((size, first.prompt_bucket), self.config.pad_id, np.int32)
    for i, job in enumerate(padded):
      prompt[i, :len(job.prepared.ids)] = job.prepared.ids
    lengths = np.array([len(job.prepared.ids) for job in padded], np.int32)
    images = [im for job in padded for im in job.prepared.images]
    sampler = self.sampler_for(first.scale)
    steps = sampler.config.max_denoising_steps
    rows = [rows_lib.Row(self._stream(), stop_ids=sampler.stop_tokens, max_tokens=job.prepared.max_tokens,
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

    compiled = sampler_lib.compiled_programs()
    start = time.perf_counter()
    out = sampler.generate(self.variables, prompt, row_keys([job.prepared.seed for job in padded]),
                           first.canvases * self.canvas, prompt_lengths=lengths,
                           images=images_lib.stack(images)[:2] if images else None,
                           constraint=first.constraint, on_pass=on_pass)
    tokens = np.asarray(out.tokens)
    seconds = time.perf_counter() - start
    for i, (job, row) in enumerate(zip(jobs, rows)):
      if job.cancelled:
        continue
      if not row.finished:  # every row ends inside the program (stop token or max_tokens): never expected
        self.mismatches += 1
        row.finish_unended()
      own = rows_lib.Row(self._stream(), stop_ids=sampler.stop_tokens, max_tokens=job.prepared.max_tokens,
                         stop=(), steps=steps, send=lambda _: None)
      for k in range(row.canvases):
        own.commit(tokens[i, k * self.canvas:(k + 1) * self.canvas])
      if row.result.finish_reason != "error" and list(row.tokens) != own.tokens[:len(row.tokens)]:
        self.mismatches += 1
    return {"size": len(jobs), "bucket": size, "prompt_bucket": first.prompt_bucket, "canvases": first.canvases,
            "temperature_scale": first.scale, "constrained": first.constraint is not None,
            "seconds": round(seconds, 4), "compiled": sampler_lib.compiled_programs() > compiled}

  def warm_up(self, log=None, prompt_buckets: int = 1) -> list[dict]:
    """Compiles the default program (default reply length, temperature 1, no constraint) for every batch
    size and each of the `prompt_buckets` smallest prompt buckets."""
    reports = []
    request = Request(kind="completion", model=self.model_name, prompt="", max_tokens=self.max_tokens)
    prepared = dataclasses.replace(self.prepare(request), seed=0)
    for k in range(prompt_buckets):
      bucket = prepared.prompt_bucket * PROMPT_BUCKET_GROWTH**k
      if bucket + prepared.canvases * self.canvas > self.config.max_positions:
        break
      for size in self.batch_sizes:
        report = self.run([_Silent(dataclasses.replace(prepared, prompt_bucket=bucket))] * size)
        reports.append(report)
        if log is not None:
          log(event="warm_up", **report)
    return reports


class _Silent:
  """A warm-up job: its events go nowhere."""

  cancelled = False

  def __init__(self, prepared: Prepared):
    self.prepared = prepared

  def send(self, event) -> None:
    del event

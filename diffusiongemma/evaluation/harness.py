"""lm-evaluation-harness requests answered by a DiffusionGemma model, on objects (no lm-eval import here).

`Harness(model, variables, tokenizer, sampler, settings)` answers the harness's three request types with
its own text conventions (lm-eval 0.4.13's HF model, `lm_eval/models/huggingface.py`); the lm-eval
`LM` class registered as `diffusiongemma` (`build/harness.py`) builds these objects from `--model_args`
and hands requests over.

loglikelihood (context, continuation) -> (log p(continuation | context), is_greedy):
  - tokens as the HF model splits them: trailing whitespace of the context moves to the continuation;
    whole = enc(context + continuation), ctx = enc(context), cont = whole[len(ctx):], where enc adds
    BOS (not when the text already starts with it, e.g. a chat-templated context); an empty context is
    scored as [BOS] + enc(continuation) (without BOS) unless that already starts with BOS.
  - the model reads (ctx + cont)[:-1]; when that is longer than `max_length` (default: the model's
    positions) it is left-truncated, with a warning, as the HF model does.
  - `settings.likelihood='exact'`: the causal encoder's next-token log-probabilities (the head and the
    soft-cap of the AR loss), summed; 'elbo': the diffusion bound under the trained noise (estimated
    with `elbo_samples` draws; `evaluation.likelihood`). Requests are sorted by length, batched.
  - an empty continuation (or one that adds no token) is a ValueError: its log-probability would be 0
    and a multiple-choice task would always pick it.
loglikelihood_rolling text -> log p(text): enc(text) without BOS, scored in disjoint windows of at most
  `max_length` tokens with BOS as the first window's context (lm-eval's rolling windows, context 1).
  Unlike the HF model on a Gemma tokenizer, BOS itself is not scored. An empty text scores 0.
generate_until (context, gen_kwargs) -> text: the block-diffusion sampler, canvas by canvas.
  - the prompt is enc(context), left-truncated with a warning to max_length minus the canvases.
  - gen_kwargs: `until` (stop strings), `max_gen_toks` (or max_new_tokens / max_tokens /
    max_completion_tokens; default `settings.max_gen_toks`), `preset` and any SamplerConfig field by
    name (a sampler with those changes, from `make_sampler`), `adapter` (a project's mapping, below).
    do_sample / temperature / top_p / top_k / min_p / num_beams / repetition_penalty are ignored with a
    warning: the sampler's own temperature schedule (t_max -> t_min, its preset) decides. Anything else
    is a ValueError.
  - ceil(max_gen_toks / C) canvases at most, one `Sampler.generate` call each, continuing the KV cache
    of the call before (`cache=`, `return_cache=`). After each canvas every row is checked: a stop
    token (the sampler's) ends it, and so does a stop string in the text decoded so far (an incomplete
    trailing character held back): no further canvas is generated for that row, and a batch stops
    when all its rows have. The output is the decoded text of the tokens up to the first stop token
    (at most max_gen_toks), cut before the earliest stop string: the check and the cut read the same
    text, so stopping early never changes it where decoding a longer token list only appends text (any
    text tokenizer, up to an incomplete trailing character, which the check holds back). The one case
    where later tokens re-decode earlier ones: a byte-fallback run that turns out not to be UTF-8 decodes
    to U+FFFD as a whole, so its valid bytes can read differently once more bytes follow; then the output
    is that of the tokens up to the canvas with the stop string. `generation_stats` records per request
    the denoiser passes and canvases it took.
  - one key per request, from the seed, its prompt tokens and its occurrence (repeats differ), folded
    with the canvas index: a result depends neither on batch size nor on the request's neighbours.
    Batches are padded to `batch_size` rows, so each prompt bucket compiles one program.

Adapters (`GenerationAdapter`): a project whose model reads its own token layout (e.g. Sudoku cells, no
tokenizer) gives an object with `prompt_tokens(context) -> ids` and `answer(context, ids) -> str`
(ids: the new tokens before the first stop token, at most max_gen_toks), and optionally
`generate_kwargs(contexts) -> dict` of extra `Sampler.generate` arguments for a batch's first canvas
(e.g. a `constraint`, `initial_canvas`/`given`). Tasks pick one with `adapter: NAME` in their
generation_kwargs; the stop strings then cut the answer text, the rest is as above.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma.evaluation import likelihood
from diffusiongemma.model import KVCache
from diffusiongemma.sampling import presets

logger = logging.getLogger(__name__)

LIKELIHOODS = ("exact", "elbo")
MAX_TOKENS_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # by priority
IGNORED_GEN_KWARGS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "num_beams", "repetition_penalty")
CACHE_BUCKET = 1024  # the generation cache's capacity grows in these steps (one program per bucket)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HarnessSettings:
  """batch_size: requests per model call. max_length: positions the model reads (None: the model's
  max_positions). max_gen_toks: new tokens when a request names none. seed: of every random draw.
  likelihood: 'exact' | 'elbo'; elbo_samples, elbo_eps: the bound's draws and t range. bucket: inputs
  are padded to a multiple of this many tokens (programs are shared within a bucket)."""

  batch_size: int = 1
  max_length: int | None = None
  max_gen_toks: int = 256
  seed: int = 0
  likelihood: str = "exact"
  elbo_samples: int = 32
  elbo_eps: float = 1e-4
  bucket: int = 64

  def __post_init__(self):
    for field in ("batch_size", "max_gen_toks", "elbo_samples", "bucket"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field}={value!r} is invalid: must be a positive integer.")
    if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 2):
      raise ValueError(f"max_length={self.max_length!r} is invalid: must be an integer >= 2 (or None).")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"seed={self.seed!r} is invalid: must be an integer.")
    if self.likelihood not in LIKELIHOODS:
      raise ValueError(f"likelihood={self.likelihood!r} is invalid: one of {LIKELIHOODS}.")
    if not 0.0 <= self.elbo_eps < 0.5:
      raise ValueError(f"elbo_eps={self.elbo_eps!r} is invalid: must be in [0, 0.5).")


@runtime_checkable
class GenerationAdapter(Protocol):
  """A project's own request -> tokens -> answer mapping for generate_until (module docstring)."""

  def prompt_tokens(self, context: str) -> Sequence[int]: ...

  def answer(self, context: str, tokens: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class GenerationStats:
  """One generate_until request: denoiser passes, canvases generated, and what ended it ('stop token',
  'stop string' or 'length')."""

  passes: int
  canvases: int
  ended_by: str


@dataclasses.dataclass(frozen=True)
class _Generation:
  """A generate_until request's parsed gen_kwargs."""

  until: tuple[str, ...]
  max_tokens: int
  adapter: str | None
  sampler_changes: tuple[tuple[str, Any], ...]


def rolling_windows(tokens: Sequence[int], prefix: int, max_length: int) -> list[tuple[list[int], list[int]]]:
  """(context, targets) windows covering `tokens` once each, disjoint (lm-eval's
  `get_rolling_token_windows` with context_len=1, then `make_disjoint_window`)."""
  tokens = list(tokens)
  if not tokens:
    return []
  first = min(max_length, len(tokens))
  windows = [([prefix] + tokens[:first - 1], tokens[:first])]
  done = first
  while done < len(tokens):
    n = min(len(tokens) - done, max_length)
    end = done + n
    windows.append((tokens[end - max_length - 1:end - 1], tokens[end - n:end]))
    done = end
  return [(context[:len(context) - (len(targets) - 1)], targets) for context, targets in windows]


def cut_at_stop(text: str, until: Sequence[str]) -> tuple[str, bool]:
  """`text` before the earliest occurrence of any non-empty stop string, and whether there was one."""
  found = [i for i in (text.find(s) for s in until if s) if i >= 0]
  return (text[:min(found)], True) if found else (text, False)


def _frozen(value):
  return tuple(value) if isinstance(value, list) else value


class Harness:
  """Answers harness requests with `model` (a `DiffusionGemma`) and its `variables`, `tokenizer` (encode,
  decode, bos_id; None for a token-level model: adapter requests only) and `sampler` (a `Sampler` of the
  same model, with its trained noise).

  make_sampler(**SamplerConfig changes) -> Sampler: for requests that name sampler settings or a preset.
  adapters: name -> `GenerationAdapter`, for tasks that name one.
  """

  def __init__(self, model, variables, tokenizer, sampler, settings: HarnessSettings | None = None, *,
               make_sampler: Callable[..., Any] | None = None,
               adapters: Mapping[str, GenerationAdapter] | None = None):
    self.model, self.variables, self.tokenizer, self.sampler = model, variables, tokenizer, sampler
    self.settings = settings = settings or HarnessSettings()
    positions = model.config.max_positions
    if settings.max_length is not None and settings.max_length > positions:
      raise ValueError(f"max_length={settings.max_length} exceeds the model's max_positions={positions}.")
    self.max_length = settings.max_length or positions
    self.make_sampler = make_sampler
    self.adapters = dict(adapters or {})
    for name, adapter in self.adapters.items():
      if not isinstance(adapter, GenerationAdapter):
        raise ValueError(f"Adapter {name!r} ({type(adapter).__name__}) lacks prompt_tokens/answer.")
    self.bos_id = int(model.config.bos_id if tokenizer is None else tokenizer.bos_id)
    self._bos_text = getattr(tokenizer, "special_tokens", {}).get(self.bos_id)
    self._samplers: dict[tuple, Any] = {}
    self._warned: set[str] = set()
    self.generation_stats: list[GenerationStats] = []  # of the last generate_until call, request order

  # ------------------------------------------------------------------------------------ tokenization
  def encode(self, text: str, *, bos: bool = True) -> list[int]:
    """Token ids of `text`, after BOS when `bos` (unless the text already starts with BOS)."""
    if not isinstance(text, str):
      raise TypeError(f"Expected text (str), got {type(text).__name__}.")
    if self.tokenizer is None:
      raise ValueError("This model has no tokenizer (a token-level task such as Sudoku): only requests of "
                       "tasks that name an adapter can be answered.")
    if bos and self._bos_text and text.startswith(self._bos_text):
      bos = False
    ids = [int(i) for i in self.tokenizer.encode(text)]
    return [self.bos_id] + ids if bos else ids

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) split as the harness's HF model splits them (module docstring)."""
    if not isinstance(context, str) or not isinstance(continuation, str):
      raise TypeError("loglikelihood requests are (context, continuation) strings.")
    if not continuation:
      raise ValueError(f"Empty continuation after context {context[-60:]!r}: there is nothing to score.")
    if not context:
      cont = self.encode(continuation, bos=False)
      ctx, cont = ([self.bos_id], cont) if cont[:1] != [self.bos_id] else (cont[:1], cont[1:])
    else:
      spaces = len(context) - len(context.rstrip())
      if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
      whole, ctx = self.encode(context + continuation), self.encode(context)
      cont = whole[len(ctx):]
    if not cont:
      raise ValueError(f"The continuation {continuation!r} adds no token after its context "
                       f"{context[-60:]!r}: there is nothing to score.")
    return ctx, cont

  # ------------------------------------------------------------------------------------ likelihood
  def _scored(self, context: Sequence[int], continuation: Sequence[int]) -> likelihood.Request:
    if len(continuation) > self.max_length:
      raise ValueError(f"The continuation has {len(continuation)} tokens, more than max_length="
                       f"{self.max_length}: it cannot be scored in one pass.")
    tokens = list(context) + list(continuation)
    if len(tokens) > self.max_length + 1:
      logger.warning("Context (%d tokens) and continuation (%d) exceed max_length=%d: the %d oldest tokens "
                     "are left out (left truncation, as the harness's HF model does).", len(context),
                     len(continuation), self.max_length, len(tokens) - self.max_length - 1)
    return tokens[-(self.max_length + 1):][:-1], list(continuation)

  def _batches(self, items: Sequence, size_of: Callable[[Any], int]):
    """(items, the same padded to batch_size by repeating the last) per batch, by decreasing size."""
    order = sorted(items, key=lambda item: -size_of(item))
    size = self.settings.batch_size
    for start in range(0, len(order), size):
      chunk = order[start:start + size]
      yield chunk, chunk + [chunk[-1]] * (size - len(chunk))

  def loglikelihood_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
    """(log p(continuation | context), is_greedy) for (context ids, continuation ids) pairs."""
    rows = [self._scored(context, continuation) for context, continuation in pairs]
    results: list[tuple[float, bool] | None] = [None] * len(rows)
    s = self.settings
    for chunk, padded in self._batches(range(len(rows)), lambda i: len(rows[i][0])):
      batch = [rows[i] for i in padded]
      scores = likelihood.exact(self.model, self.variables, batch, bucket=s.bucket)
      if s.likelihood == "elbo":
        bounds = likelihood.elbo(self.model, self.variables, self.sampler.noise, batch,
                                 jax.random.key(s.seed), samples=s.elbo_samples, eps=s.elbo_eps,
                                 bucket=s.bucket)
        scores = [(bound, greedy) for bound, (_, greedy) in zip(bounds, scores)]
      for i, score in zip(chunk, scores):
        results[i] = score
    return results

  def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
    return self.loglikelihood_tokens([self.encode_pair(context, cont) for context, cont in requests])

  def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
    windows = [rolling_windows(self.encode(text, bos=False), self.bos_id, self.max_length) for text in texts]
    flat = [w for row in windows for w in row]
    scores = iter(self.loglikelihood_tokens(flat))
    return [sum((next(scores)[0] for _ in row), 0.0) for row in windows]

  # ------------------------------------------------------------------------------------ generation
  def _warn_once(self, message: str) -> None:
    if message not in self._warned:
      self._warned.add(message)
      logger.warning(message)

  def _parse(self, gen_kwargs: Mapping[str, Any] | None) -> _Generation:
    kwargs = dict(gen_kwargs or {})
    until = kwargs.pop("until", None)
    until = [until] if isinstance(until, str) else list(until or ())
    if not all(isinstance(s, str) for s in until):
      raise ValueError(f"until={until!r} must be a string or a list of strings.")
    given = [(key, kwargs.pop(key)) for key in MAX_TOKENS_KEYS if key in kwargs]
    given = [(key, value) for key, value in given if value is not None]
    max_tokens = given[0][1] if given else self.settings.max_gen_toks
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
      raise ValueError(f"{given[0][0] if given else 'max_gen_toks'}={max_tokens!r} must be a positive integer.")
    adapter = kwargs.pop("adapter", None)
    if adapter is not None and adapter not in self.adapters:
      raise ValueError(f"Unknown adapter {adapter!r}; this harness has {sorted(self.adapters)}.")
    changes = presets.preset_overrides(kwargs.pop("preset")) if "preset" in kwargs else {}
    fields = {f.name for f in dataclasses.fields(self.sampler.config)}
    changes.update({key: _frozen(kwargs.pop(key)) for key in list(kwargs) if key in fields})
    ignored = sorted(key for key in kwargs if key in IGNORED_GEN_KWARGS)
    if ignored:
      self._warn_once(f"generate_until ignores {ignored}: the diffusion sampler's own temperature schedule "
                      "applies (t_max, t_min, preset: set them in --model_args or by name in gen_kwargs).")
    unknown = sorted(set(kwargs) - set(IGNORED_GEN_KWARGS))
    if unknown:
      raise ValueError(f"Unknown generation arguments {unknown}; known: until, {', '.join(MAX_TOKENS_KEYS)}, "
                       f"adapter, preset, the SamplerConfig fields {sorted(fields)}, and ignored "
                       f"{list(IGNORED_GEN_KWARGS)}.")
    return _Generation(tuple(until), max_tokens, adapter, tuple(sorted(changes.items())))

  def _sampler_for(self, changes: tuple[tuple[str, Any], ...]):
    if not changes:
      return self.sampler
    if changes not in self._samplers:
      if self.make_sampler is None:
        raise ValueError(f"Requests name sampler settings {dict(changes)} but this harness was built "
                         "without make_sampler.")
      self._samplers[changes] = self.make_sampler(**dict(changes))
    return self._samplers[changes]

  def _prompt(self, context: str, request: _Generation, canvas: int) -> list[int]:
    if request.adapter is not None:
      return [int(i) for i in self.adapters[request.adapter].prompt_tokens(context)]
    ids = self.encode(context)
    room = self.max_length - math.ceil(request.max_tokens / canvas) * canvas
    if room < 1:
      raise ValueError(f"max_gen_toks={request.max_tokens} ({math.ceil(request.max_tokens / canvas)} canvases "
                       f"of {canvas}) leaves no room for a prompt within max_length={self.max_length}.")
    if len(ids) > room:
      logger.warning("A prompt of %d tokens is left-truncated to %d (max_length=%d minus the %d-token "
                     "canvases), as the harness's HF model does.", len(ids), room, self.max_length,
                     self.max_length - room)
    return ids[-room:]

  def _text(self, request: _Generation, context: str, ids: list[int], final: bool) -> str:
    if request.adapter is not None:
      return self.adapters[request.adapter].answer(context, ids)
    text = self.tokenizer.decode(ids)
    return text if final else text.rstrip("\ufffd")  # an incomplete character may still complete

  def generate_until(self, requests: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """Generated text per (context, gen_kwargs) request; `generation_stats` per request (docstring)."""
    parsed = [self._parse(kwargs) for _, kwargs in requests]
    seen: collections.Counter = collections.Counter()
    keys, prompts = [], []
    base = jax.random.key(self.settings.seed)
    for (context, _), request in zip(requests, parsed):
      sampler = self._sampler_for(request.sampler_changes)
      prompts.append(self._prompt(context, request, sampler.canvas_length))
      identity = json.dumps([context, dataclasses.astuple(request)], sort_keys=True, default=str)
      keys.append(likelihood.request_key(base, prompts[-1], seen[identity]))
      seen[identity] += 1
    groups = collections.defaultdict(list)
    for i, request in enumerate(parsed):
      groups[request].append(i)
    outputs: list[str | None] = [None] * len(requests)
    self.generation_stats = [None] * len(requests)
    for request, members in groups.items():
      for chunk, rows in self._batches(members, lambda i: len(prompts[i])):
        texts, stats = self._generate_batch(request, [requests[i][0] for i in rows], [prompts[i] for i in rows],
                                            jnp.stack([keys[i] for i in rows]), len(chunk))
        for i, text, stat in zip(chunk, texts, stats):
          outputs[i], self.generation_stats[i] = text, stat
    return outputs

  def _generate_batch(self, request: _Generation, contexts, prompts, keys, real: int):
    """Texts and stats of the first `real` rows, generated canvas by canvas (module docstring)."""
    sampler = self._sampler_for(request.sampler_changes)
    c, mc = sampler.canvas_length, sampler.model.config
    stops = set(int(t) for t in sampler.stop_tokens)
    num_canvases = math.ceil(request.max_tokens / c)
    needed = max(map(len, prompts)) + self.settings.bucket + (num_canvases + 1) * c
    cache = KVCache.empty(mc, len(prompts), min(-(-needed // CACHE_BUCKET) * CACHE_BUCKET, mc.max_positions))
    adapter = self.adapters.get(request.adapter)
    extra = dict(adapter.generate_kwargs(contexts)) if hasattr(adapter, "generate_kwargs") else {}
    tokens = [[] for _ in range(real)]
    passes, canvases = [0] * real, [0] * real
    ended: list[str | None] = [None] * real  # None while the row still runs
    for k in range(num_canvases):
      canvas_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, k)
      out = sampler.generate(self.variables, prompts, canvas_keys, max_new_tokens=c, cache=cache,
                             return_cache=True, **(extra if k == 0 else {}))
      new, counts = jax.device_get((out.tokens, out.num_denoiser_passes))
      cache = out.cache
      for r in range(real):
        if ended[r] is not None:
          continue
        ids = [int(t) for t in new[r]]
        passes[r] += int(counts[r])
        canvases[r] += 1
        stop_at = next((j for j, t in enumerate(ids) if t in stops), None)
        tokens[r] += ids if stop_at is None else ids[:stop_at]
        if stop_at is not None:
          ended[r] = "stop token"
        elif cut_at_stop(self._text(request, contexts[r], tokens[r][:request.max_tokens], False),
                         request.until)[1]:
          ended[r] = "stop string"
      if all(e is not None for e in ended):
        break
      prompts = [list(map(int, row)) for row in np.asarray(new)]  # the next canvas continues each row
    texts = [cut_at_stop(self._text(request, contexts[r], tokens[r][:request.max_tokens], True),
                         request.until)[0] for r in range(real)]
    return texts, [GenerationStats(passes[r], canvases[r], ended[r] or "length") for r in range(real)]

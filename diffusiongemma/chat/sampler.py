"""`ChatSampler`: a conversation with a DiffusionGemma model that keeps its KV cache between turns.

A turn (`send`) renders the whole conversation in the Gemma 4 chat format (`chat.format`: earlier
thoughts dropped, `<|think|>` opening the system turn when thinking is on, the checkpoint's empty-thought
prefill when its template has one), expands each image placeholder into the image's soft tokens, and
compares the ids with those the KV cache holds: the cache is cut back to their common prefix
(`KVCache.with_length`: every layer keeps keys at slot == position, so any earlier length is a valid
cache) and only the rest is encoded. Turn 2 therefore encodes its own new tokens (the previous answer,
once more, as the prompt now spells it, and the new user turn), not the conversation again. A cut that
would fall inside an image moves back to the image's start: an image's soft tokens are encoded in one call
(they attend to each other both ways).

The reply is the sampler's output up to its first stop token (the checkpoint's eos ids plus eos and
`<turn|>`), split into `thought` and `text` by `ReplyStream`, so no control token reaches the answer.

`on_step`, when given, is called from the running program after every denoiser pass (the sampler's
`on_pass` stream, so it is live, not a replay) with a `Draft`: the pass's argmax
canvas after the committed canvases, split the same way (the draft of the answer and of the thought).

Models: `from_pretrained(folder)` reads a transformers checkpoint folder (weights cast to bf16 by default
and placed over every local device, its tokenizer, its generation defaults and a preset);
`build.chat_sampler(workdir)` a training workdir.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from diffusiongemma.chat import format as fmt
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.data import images as images_lib
from diffusiongemma.model import KVCache
from diffusiongemma.sampling import constrained
from diffusiongemma.sampling import pretrained as pretrained_lib
from diffusiongemma.sampling import prompts as prompts_lib
from diffusiongemma.sampling import sampler as sampler_lib
from diffusiongemma.sampling import stats as stats_lib

IMAGE_PLACEHOLDER = "<|image|>"


@dataclasses.dataclass(frozen=True)
class Draft:
  """What `on_step` receives after each denoiser pass: `canvas` and `step` (from 0), the pass's argmax
  canvas `tokens`, and `parts`, the reply so far (committed canvases, then this draft) split into
  thought and answer without control tokens."""

  canvas: int
  step: int
  tokens: tuple[int, ...]
  parts: fmt.ReplyParts


@dataclasses.dataclass(frozen=True)
class Reply:
  """One answered turn.

  text: the answer; thought: the thought channel ('' without one); tokens: the new token ids up to and
  including the stop token; finished: a stop token ended it (else max_new_tokens did); prompt: the
  turn's rendered prompt text (image placeholders unexpanded); stats: `sampling.stats.summary` of the
  call (new_tokens, denoiser_passes, pooled_tokens_per_forward, steps_per_canvas, seconds,
  tokens_per_second) plus prompt_tokens (the whole conversation), reused_tokens (taken from the cache),
  encoded_tokens (encoded by this turn) and compiled (the call compiled a program: its seconds include
  compilation).
  """

  text: str
  thought: str
  tokens: list[int]
  finished: bool
  prompt: str
  stats: dict[str, Any]


def _check_budgets(image_budget, video_budget) -> None:
  for name, budget in (("image_budget", image_budget), ("video_budget", video_budget)):
    if budget not in images_lib.BUDGETS:
      raise ValueError(f"{name}={budget!r} is not supported: the soft tokens per image must be one of "
                       f"{images_lib.BUDGETS}.")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = min(len(a), len(b))
  mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
  return int(mismatch[0]) if mismatch.size else n


class ChatSampler:
  """A conversation with a model: `send(message)` answers one turn and keeps the KV cache for the next.

  sampler: a `Sampler` of the model; variables: its parameters (`{'params': ...}` or the bare tree);
  tokenizer: one with the Gemma 4 control tokens (`data.hf_tokenizer.CheckpointTokenizer`);
  max_new_tokens: per reply (rounded up to whole canvases); empty_thought: prefill an empty thought when
  thinking is off (Gemma 4's larger checkpoints do; `format.template_prefills_empty_thought`);
  image_budget / video_budget: soft tokens per image / video frame (`data.images.BUDGETS`);
  seed: turns without their own seed use fold_in(key(seed), turn number); reuse_cache: False encodes the
  whole conversation every turn (for comparison).
  """

  def __init__(self, sampler: sampler_lib.Sampler, variables, tokenizer, *, max_new_tokens: int = 256,
               empty_thought: bool = False, image_budget: int = 280, video_budget: int = images_lib.VIDEO_BUDGET,
               seed: int = 0, reuse_cache: bool = True):
    control = getattr(tokenizer, "control_ids", {})
    missing = [t for t in hf_tokenizer.REQUIRED_CONTROL_TOKENS if t not in control]
    if missing:
      raise ValueError(f"ChatSampler needs a tokenizer with the Gemma 4 control tokens; {tokenizer!r} lacks "
                       f"{missing} (a training workdir's sentencepiece tokenizer has none).")
    cfg = sampler.model.config
    outside = {t: i for t, i in control.items() if not 0 <= i < cfg.vocab_size}
    if outside:
      raise ValueError(f"The tokenizer's control tokens {outside} lie outside the model's vocabulary "
                       f"[0, {cfg.vocab_size}): tokenizer and weights do not belong together.")
    _check_budgets(image_budget, video_budget)
    self.max_new_tokens = prompts_lib.check_max_new_tokens(max_new_tokens)
    self.tokenizer, self.variables = tokenizer, prompts_lib.variables(variables)
    self.empty_thought, self.seed, self.reuse_cache = empty_thought, seed, reuse_cache
    self.image_budget, self.video_budget = image_budget, video_budget
    stops = list(sampler.stop_tokens)
    stops += [t for t in (tokenizer.eos_id, control[fmt.TURN_CLOSE]) if t not in stops]
    self.sampler = sampler.replace(config=sampler.config.replace(stop_tokens=tuple(stops)))
    special = getattr(tokenizer, "special_tokens", {})
    self._stop_ids = tuple(t for t in self.sampler.stop_tokens if t in special)  # the reply splitter's stops
    self.reset()

  # ------------------------------------------------------------------------------------ construction
  @classmethod
  def from_pretrained(cls, path: os.PathLike | str, preset: str = "default", *, dtype: str = "bfloat16",
                      shardings: Any = "local", max_new_tokens: int | None = None, image_budget: int = 280,
                      video_budget: int = images_lib.VIDEO_BUDGET, seed: int = 0,
                      model_overrides: Mapping[str, Any] | None = None, **sampler_overrides) -> ChatSampler:
    """A conversation with a transformers checkpoint folder (config.json, safetensors, tokenizer.json or
    tokenizer.model, optional generation_config.json and chat template).

    Loaded by `sampling.pretrained.load`: dtype (the weights are cast to it as they are read, and computation
    runs in it), shardings ("local": over every local device), the checkpoint's generation defaults then
    `preset` ('default', 'code', 'creative') then `sampler_overrides` (SamplerConfig fields), and
    model_overrides (ModelConfig fields, e.g. moe_impl); everything that can be checked without the
    weights (tokenizer, preset, config.json) is checked before they are read. max_new_tokens: default the
    checkpoint's, else 256.
    """
    _check_budgets(image_budget, video_budget)  # before the weights are read
    loaded = pretrained_lib.load(path, preset=preset, dtype=dtype, shardings=shardings,
                                 model_overrides=model_overrides, **sampler_overrides)
    return cls(loaded.sampler, loaded.weights.variables, loaded.tokenizer,
               max_new_tokens=max_new_tokens or loaded.max_new_tokens or 256,
               empty_thought=fmt.template_prefills_empty_thought(path), image_budget=image_budget,
               video_budget=video_budget, seed=seed)

  # ------------------------------------------------------------------------------------ conversation
  def reset(self) -> None:
    """Forgets the conversation (and its cache); the system prompt too."""
    self.system: str | None = None
    self.history: list[dict[str, str]] = []  # user and model turns, as `format.render_prompt` takes them
    self._images: list[images_lib.ProcessedImage] = []  # every image of the conversation, in order
    self._cache: KVCache | None = None
    self._cached_ids: list[int] = []
    self._turns = 0

  @property
  def config(self):
    return self.sampler.model.config

  def _messages(self, system: str | None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + self.history

  def _media(self, images: Sequence[Any], video: Any) -> tuple[list[images_lib.ProcessedImage], str]:
    """The turn's images and video frames, preprocessed, and the text that stands for them."""
    images = list(images or ())
    if not images and video is None:
      return [], ""
    vision = self.config.vision
    if vision is None:
      raise ValueError(f"This model has no vision encoder: it cannot take the {len(images)} image(s)"
                       f"{' and the video' if video is not None else ''} given.")
    geometry = dict(patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size)
    processed = [images_lib.preprocess(image, self.image_budget, **geometry) for image in images]
    text = IMAGE_PLACEHOLDER * len(processed)
    if video is not None:
      if isinstance(video, images_lib.VideoFrames):
        frames = video
      elif isinstance(video, tuple) and len(video) == 2 and not isinstance(video[1], np.ndarray):
        frames = images_lib.sample_video(video[0], fps=video[1], budget=self.video_budget, **geometry)
      else:
        frames = images_lib.sample_video(video, budget=self.video_budget, **geometry)
      processed += frames.frames
      text += images_lib.video_prompt_text(frames.timestamps, IMAGE_PLACEHOLDER)
    return processed, text

  def _rng(self, seed: int | None):
    if seed is not None:
      return jax.random.key(seed)
    return jax.random.fold_in(jax.random.key(self.seed), self._turns)

  def send(self, message: str, system: str | None = None, thinking: bool = False, images: Sequence[Any] = (),
           video: Any = None, max_new_tokens: int | None = None, seed: int | None = None,
           on_step: Callable[[Draft], None] | None = None,
           on_prompt: Callable[[str], None] | None = None, constraint=None) -> Reply:
    """Answers `message` as the next user turn and returns the `Reply`.

    system: sets the system prompt from this turn on (None keeps the current one; '' removes it).
    thinking: this turn's prompt opens the system turn with `<|think|>`. images: file paths, PIL images
    or uint8 arrays, placed before the text at `image_budget` soft tokens each; video: a file path, a pair
    (frames, fps) of arrays, or `data.images.sample_video`'s output, sampled at 1 fps up to 60 s, each
    frame at `video_budget` soft tokens after its "mm:ss" timestamp, after the images. seed: this turn's sampling
    seed. on_step: called live with a `Draft` after every denoiser pass. on_prompt: called with the
    rendered prompt text before anything is encoded. constraint: a `sampling.constrained.Constraint` the
    reply must follow (`self.constraint(regex=...)` or `(json_schema=...)` builds one for this
    conversation's tokenizer and stop tokens). Nothing of the conversation changes if it raises.
    """
    if not isinstance(message, str):
      raise TypeError(f"message must be a str, got {type(message).__name__}.")
    max_new = prompts_lib.check_max_new_tokens(max_new_tokens or self.max_new_tokens)
    system = self.system if system is None else system
    new_images, media_text = self._media(images, video)
    user = {"role": "user", "content": message, "media": media_text}  # the message's text stays text
    messages = self._messages(system) + [user]
    options = dict(thinking=thinking, empty_thought=self.empty_thought)
    prompt_text = fmt.render_prompt(messages, **options)
    all_images = self._images + new_images
    ids = fmt.render_ids(messages, self.tokenizer, **options)
    if self.config.vision is not None:
      ids = images_lib.expand_image_placeholders(ids, [im.num_soft_tokens for im in all_images], self.config)
    c = self.config.canvas_length
    reply_positions = -(-max_new // c) * c
    if len(ids) + reply_positions > self.config.max_positions:
      raise ValueError(f"The conversation is {len(ids)} tokens long and the reply needs {reply_positions} more "
                       f"positions ({reply_positions // c} canvas(es) of {c}): {len(ids) + reply_positions} "
                       f"exceed the model's max_positions={self.config.max_positions}. Start a new conversation "
                       "(reset()) or ask for fewer new tokens.")
    if on_prompt is not None:
      on_prompt(prompt_text)

    cut, suffix_images = self._reuse(ids, all_images)
    cache = self._cut_cache(cut) if cut else self._empty_cache()
    pixels = images_lib.stack(suffix_images)[:2] if suffix_images else None
    compiled_before = sampler_lib.compiled_programs()
    start = time.perf_counter()
    out = self.sampler.generate(self.variables, [ids[cut:]], self._rng(seed), max_new, cache=cache,
                                return_cache=True, images=pixels, constraint=constraint,
                                on_pass=None if on_step is None else self._drafts(on_step))
    out = jax.block_until_ready(out)
    seconds = time.perf_counter() - start

    row = np.asarray(out.tokens)[0]
    tokens = stats_lib.new_tokens(row, self.sampler.stop_tokens, self.config.pad_id)
    parts = fmt.split_reply(tokens, self.tokenizer, stop_ids=self._stop_ids)
    summary = stats_lib.summary(out.tokens, out.canvas_passes, self.config.pad_id, seconds)
    summary.update(prompt_tokens=len(ids), reused_tokens=cut, encoded_tokens=len(ids) - cut,
                   compiled=sampler_lib.compiled_programs() > compiled_before)
    # The state moves on only now that the turn succeeded.
    self.system = system or None
    self.history += [user, {"role": "model", "content": parts.text, "thought": parts.thought}]
    self._images = all_images
    self._cache = out.cache
    self._cached_ids = ids + row[:int(out.cache.length[0]) - len(ids)].tolist()
    self._turns += 1
    return Reply(parts.text, parts.thought, tokens, parts.finished, prompt_text, summary)

  def constraint(self, regex: str | None = None, json_schema: Mapping | str | None = None, **kwargs):
    """A `sampling.constrained.Constraint` for `send`: replies that match `regex`, or JSON texts valid
    under `json_schema` (a dict or JSON text; kwargs: `Constraint.json_schema`'s), then the end of turn.
    Build it once and reuse it: each constraint object compiles its own program."""
    if (regex is None) == (json_schema is None):
      raise ValueError("Pass exactly one of regex= and json_schema=.")
    if regex is not None:
      return constrained.Constraint.regex(regex, self.tokenizer, self.sampler, **kwargs)
    return constrained.Constraint.json_schema(json_schema, self.tokenizer, self.sampler, **kwargs)

  def _empty_cache(self) -> KVCache:
    """An empty cache, on the parameters' mesh when they have one (as the caches the program returns are,
    so that a conversation's first turn and a turn without reuse run the same program as the others)."""
    cache = KVCache.empty(self.config, 1, 0)
    sharding = getattr(jax.tree.leaves(self.variables)[0], "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      cache = jax.device_put(cache, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
    return cache

  def _cut_cache(self, cut: int) -> KVCache:
    """The cache seen as holding its first `cut` positions, its length placed as the program left it
    (so that the next call finds the same input shardings and reuses its compiled program)."""
    length = self._cache.with_length(cut).length
    return self._cache.replace(length=jax.device_put(length, self._cache.length.sharding))

  def _reuse(self, ids: list[int], all_images) -> tuple[int, list[images_lib.ProcessedImage]]:
    """(positions kept from the cache, the images whose soft tokens lie after them)."""
    cfg = self.config
    cut = _common_prefix(self._cached_ids, ids) if (self.reuse_cache and self._cache is not None) else 0
    cut = min(cut, len(ids) - 1)  # at least one token is encoded: the prompt is never empty
    begins = [i for i, t in enumerate(ids) if t == cfg.begin_image_id] if all_images else []
    for image_index, begin in enumerate(begins):  # an image's soft tokens are encoded in one call
      end = begin + all_images[image_index].num_soft_tokens + 1
      if begin < cut <= end:
        cut = begin
    first = sum(1 for begin in begins if begin < cut)
    return cut, list(all_images[first:])

  def _drafts(self, on_step: Callable[[Draft], None]) -> Callable[[sampler_lib.PassEvent], None]:
    """The `generate` listener of one turn: each pass's argmax canvas as a `Draft` of the reply so far."""
    stream = fmt.ReplyStream(self.tokenizer, stop_ids=self._stop_ids)
    state = {"canvas": 0, "last": None}

    def listener(event: sampler_lib.PassEvent) -> None:
      if event.canvas_index != state["canvas"]:  # a new canvas: the previous one is committed
        if state["last"] is not None:
          stream.feed(state["last"])
        state["canvas"] = event.canvas_index
      draft = tuple(int(t) for t in event.argmax[0])
      state["last"] = draft
      on_step(Draft(event.canvas_index, event.step, draft, stream.view(draft)))

    return listener

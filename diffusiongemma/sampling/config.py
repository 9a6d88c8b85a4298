"""`SamplerConfig`: the released block-diffusion sampler's settings, frozen, hashable and validated once."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any


DRAWS = ("sample", "argmax")  # SamplerConfig.draw
REUSES = ("none", "settled")  # SamplerConfig.reuse


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
  """The released sampler's settings (transformers' `generate` defaults), frozen and hashable.

  `Sampler(model, config)` makes its default components from these numbers: the schedule
  `Linear(t_max, t_min)` (T = t_min + (t_max - t_min) * n / N at n of N steps remaining), the acceptance
  rule `EntropyBound(entropy_bound)` and the stopping rule `stable_and_confident(stability_threshold,
  confidence_threshold)`; a sampler given other components ignores the numbers of the ones it replaces.
  The noise process is the model's own (`ModelConfig.noise`).

  max_denoising_steps: the step cap N of a canvas.
  stop_tokens: after the first of them a row is finished and the rest of its output is pad; None means
    the model's `eos_id`.
  canvas_length: None means the model's; anything else must equal it.
  prompt_bucket: prompts are right-padded to a multiple of this, so that nearby prompt lengths share one
    compiled program.
  vocab_chunk_size: the vocabulary head streams the vocabulary in chunks of this many tokens, so that no
    [batch, canvas, vocab] array exists (`sampling.vocab`); None: the whole vocabulary at once; "auto"
    (default): one chunk when a float32 [batch, canvas, vocab] array fits `vocab_budget_mib`, else chunks
    whose [batch, canvas, chunk] arrays do, and on a CPU at most 1024 tokens per chunk (faster there:
    `sampling/vocab.py`). The same tokens either way, up to the order of float sums.
  vocab_budget_mib: the memory budget of "auto", in MiB (256: one chunk at batch 1 and vocabulary 262,144).
  draw: what an accepted position takes: "sample" (released: a draw from the step's tempered
    distribution) or "argmax" (its most likely token, as greedy parallel decoders such as Fast-dLLM do;
    which positions are accepted does not change).
  fuse_commit: encode each committed canvas in the next canvas's first denoiser pass (one model pass over
    both, `DiffusionGemma.encode_denoise`) instead of a pass of its own: the weights are read once, the
    tokens are the same.
  reuse: "none" (every pass recomputes every position) or "settled" (a pass recomputes only positions not
    yet settled and reuses the keys, values and hidden states of the others as last computed: approximate,
    Fast-dLLM style; `steps.reuse_pass`); needs a noise process whose accepted positions stay fixed
    (masked). reuse_refresh: with "settled", a whole pass every this many passes (0: only the first).
    reuse_widths: with "settled", how many static widths a pass may take: the canvas in that many equal
    steps (at least 4 positions; 1: every pass is as wide as the canvas). More widths fit the positions a
    pass recomputes more closely, and each is one more model pass to compile. reuse_delay: with
    "settled", how many passes compute a position while its token is fixed before later ones reuse it (1:
    the first; 2: dKV-Cache's delayed caching, as a token's keys and values still move on the pass after
    it is placed).
  """

  max_denoising_steps: int = 48
  t_max: float = 0.8
  t_min: float = 0.4
  entropy_bound: float = 0.1
  stability_threshold: int = 1
  confidence_threshold: float = 0.005
  stop_tokens: tuple[int, ...] | None = None
  canvas_length: int | None = None
  prompt_bucket: int = 64
  vocab_chunk_size: int | str | None = "auto"
  vocab_budget_mib: float = 256
  draw: str = "sample"
  fuse_commit: bool = False
  reuse: str = "none"
  reuse_refresh: int = 0
  reuse_widths: int = 8
  reuse_delay: int = 1

  def __post_init__(self):
    if self.stop_tokens is not None:
      tokens = (self.stop_tokens,) if isinstance(self.stop_tokens, numbers.Integral) else self.stop_tokens
      if isinstance(tokens, (str, bytes, Mapping)) or not isinstance(tokens, Iterable):  # "12": no list of ids
        raise ValueError(f"SamplerConfig.stop_tokens={self.stop_tokens!r} is invalid: must be a token id or a "
                         "sequence of them.")
      object.__setattr__(self, "stop_tokens", tuple(tokens))
    self._validate()

  def _validate(self):
    def fail(field, allowed):
      raise ValueError(f"SamplerConfig.{field}={getattr(self, field)!r} is invalid: {allowed}.")

    def is_int(value):
      return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    def is_real(value):
      return isinstance(value, numbers.Real) and not isinstance(value, bool)

    for field in ("max_denoising_steps", "prompt_bucket"):
      if not is_int(getattr(self, field)) or getattr(self, field) < 1:
        fail(field, "must be a positive integer")
    for field in ("t_max", "t_min", "entropy_bound", "confidence_threshold", "vocab_budget_mib"):
      value = getattr(self, field)
      if not is_real(value) or not 0 < value < math.inf:
        fail(field, "must be a positive finite number")
    if self.t_min > self.t_max:
      fail("t_min", f"must be at most t_max={self.t_max!r}")
    if not is_int(self.stability_threshold) or self.stability_threshold < 0:
      fail("stability_threshold", "must be an integer >= 0")
    if self.stop_tokens is not None and not all(is_int(t) and t >= 0 for t in self.stop_tokens):
      fail("stop_tokens", "must be non-negative token ids")
    if self.canvas_length is not None and (not is_int(self.canvas_length) or self.canvas_length < 1):
      fail("canvas_length", "must be None or a positive integer")
    if self.reuse not in REUSES:
      fail("reuse", f"must be one of {REUSES}")
    if not is_int(self.reuse_refresh) or self.reuse_refresh < 0:
      fail("reuse_refresh", "must be an integer >= 0 (0: no refresh after the first pass)")
    if not is_int(self.reuse_widths) or not 1 <= self.reuse_widths <= 64:
      fail("reuse_widths", "must be an integer from 1 to 64")
    if not is_int(self.reuse_delay) or not 1 <= self.reuse_delay <= 8:
      fail("reuse_delay", "must be an integer from 1 to 8")
    if not isinstance(self.fuse_commit, bool):
      fail("fuse_commit", "must be True or False")
    if self.draw not in DRAWS:
      fail("draw", f"must be one of {DRAWS}")
    chunk = self.vocab_chunk_size
    if chunk is not None and chunk != "auto" and (not is_int(chunk) or chunk < 1):
      fail("vocab_chunk_size", 'must be None, "auto" or a positive integer')

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> "SamplerConfig":
    """From a mapping such as `config.sampler`; `max_new_tokens` (a `generate` argument) is ignored."""
    values = dict(values.to_dict() if hasattr(values, "to_dict") else values)
    values.pop("max_new_tokens", None)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"Unknown SamplerConfig fields {unknown}; known fields are {sorted(known)}.")
    if isinstance(values.get("stop_tokens"), list):
      values["stop_tokens"] = tuple(values["stop_tokens"])
    return cls(**values)

  def replace(self, **changes) -> "SamplerConfig":
    return dataclasses.replace(self, **changes)

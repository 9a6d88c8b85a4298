"""The text project's runs, shared by its demo, its report and `benchmarks.text_vs_ar`: weights (shipped or
a training workdir), held-out prompts, and both decoders of the same weights (block diffusion, and AR
greedy with the KV cache), scored by those weights' own AR mode.

Statistics (`sampling.stats` definitions): tokens per pass is pooled, all new tokens (up to and including
a stop token) over all denoiser passes; judged perplexity is exp(total NLL / total tokens) of the
continuations given their prompts under the causal encoder (token-weighted, the stop token included);
distinct 4-grams is the mean over continuations of distinct / all 4-grams of each.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import diffusiongemma as dg
from diffusiongemma import build
from diffusiongemma import data as data_lib
from diffusiongemma.evaluation import generative
from diffusiongemma.sampling import prompts as prompts_lib
from diffusiongemma.sampling import speculative as speculative_lib
from diffusiongemma.sampling import stats as stats_lib
from diffusiongemma.build import release

ROOT = pathlib.Path(__file__).parent
WEIGHTS = ROOT / "weights"
PROMPTS = ROOT / "prompts"
DISTILLED, PRETRAINED = "distilled", "pretrained"


@dataclasses.dataclass
class TextModel:
  """A text run loaded once: its config, float32 variables, model, tokenizer and where they came from."""

  config: Any
  variables: Any
  tokenizer: Any
  source: str

  @property
  def model(self) -> dg.DiffusionGemma:
    return build.model(self.config)

  def sampler(self, **overrides) -> dg.Sampler:
    """The run's diffusion sampler (`config.sampler`, then `overrides` of its keys)."""
    return build.sampler(self.config, **overrides)

  def ar_sampler(self) -> dg.ARSampler:
    """AR decoding of the same weights, with the diffusion sampler's stop tokens and prompt bucket."""
    sampler = self.sampler()
    return dg.ARSampler(sampler.model, stop_tokens=sampler.stop_tokens,
                        prompt_bucket=sampler.config.prompt_bucket)

  def speculative_sampler(self, draft_length: int | None = None, temperature: float = 0.0
                          ) -> speculative_lib.SelfSpeculativeSampler:
    """Self-speculative decoding of the same weights (AR greedy's text, or AR sampling's distribution at
    `temperature`; the denoiser drafts `draft_length` positions a pass, default its canvas)."""
    return speculative_lib.SelfSpeculativeSampler.of(self.sampler(), draft_length=draft_length,
                                                     temperature=temperature)

  def judge(self) -> generative.Judge:
    return generative.Judge("self", self.model, self.variables)


def load(workdir: str | None = None, name: str = DISTILLED) -> TextModel:
  """A training workdir's latest checkpoint and tokenizer, or the shipped weights `name`."""
  if workdir:
    config = build.workdir_config(workdir)
    if config is None:
      raise FileNotFoundError(f"{workdir!r} holds no training run (no config.json).")
    weights = build.load(config, workdir=workdir)
    tok = data_lib.Tokenizer(config.data.tokenizer_path or pathlib.Path(workdir) / release.TOKENIZER)
    return TextModel(config, weights.variables, tok, weights.source)
  folder = WEIGHTS / name
  config, variables, provenance = release.load(folder, "shipped text weights")
  return TextModel(config, variables, data_lib.Tokenizer(folder / release.TOKENIZER),
                   f"shipped {name} text weights (step {provenance['step']}, {provenance['storage_dtype']})")


def read_prompts(path, tokenizer, max_prompt_tokens: int = 64, limit: int | None = None) -> list[list[int]]:
  """The prompts of a JSONL file (one `{"prompt": text}` per line, other keys ignored), tokenized, each cut
  to its last `max_prompt_tokens` tokens."""
  texts = [text for text, in data_lib.corpus.read_jsonl_fields(path, ("prompt",))]
  empty = next((i for i, text in enumerate(texts) if not text), None)
  if empty is not None:
    raise ValueError(f"{path}: prompt {empty + 1} is empty.")
  if not texts:
    raise ValueError(f"{path} holds no prompts.")
  texts = texts[:limit]
  return [ids[-max_prompt_tokens:] for ids in tokenizer.encode_batch(texts)]


def _batches(prompts: Sequence[Sequence[int]], batch_size: int):
  """(padded prompts [B, L], lengths [B], real rows) per batch; the last is filled with copies of its
  last row so that every batch has one shape."""
  for start in range(0, len(prompts), batch_size):
    chunk = list(prompts[start:start + batch_size])
    real = len(chunk)
    chunk += [chunk[-1]] * (batch_size - real)
    tokens, lengths = prompts_lib.pad(chunk, 0)
    yield tokens, lengths, real


def _generated(sampler: dg.Sampler, variables, prompts, max_new_tokens: int, batch_size: int, seed: int):
  """(`generate`'s output, real rows) per batch of `prompts`, batch i drawn with key seed + i."""
  for i, (tokens, lengths, real) in enumerate(_batches(prompts, batch_size)):
    yield sampler.generate(variables, tokens, jax.random.key(seed + i), max_new_tokens, prompt_lengths=lengths), real


def diffusion(sampler: dg.Sampler, variables, prompts, max_new_tokens: int, batch_size: int, seed: int = 0
              ) -> tuple[list[list[int]], np.ndarray]:
  """(each prompt's new tokens up to and including its stop token, its denoiser passes [N])."""
  out, passes = [], []
  for result, real in _generated(sampler, variables, prompts, max_new_tokens, batch_size, seed):
    rows = np.asarray(result.tokens)[:real]
    out += [stats_lib.new_tokens(row, sampler.stop_tokens, sampler.model.config.pad_id) for row in rows]
    passes.append(np.asarray(result.num_denoiser_passes)[:real])
  return out, np.concatenate(passes)


def denoised_positions(sampler: dg.Sampler, variables, prompts, max_new_tokens: int, batch_size: int,
                       seed: int = 0) -> np.ndarray:
  """The canvas positions the denoiser computed for each prompt [N] in `diffusion`'s generation (the same
  calls and keys): passes x canvas, fewer where passes reused settled positions."""
  return np.concatenate([np.asarray(result.denoised_positions)[:real]
                         for result, real in _generated(sampler, variables, prompts, max_new_tokens, batch_size, seed)])


def speculative(sampler, variables, prompts, max_new_tokens: int, batch_size: int, seed: int = 0
                ) -> tuple[list[list[int]], np.ndarray]:
  """`diffusion`'s output for `sampling.speculative.SelfSpeculativeSampler` (the encoder's AR text, drafted
  by the denoiser; at a temperature, batch i uses key fold_in(key(seed), i))."""
  out, passes = [], []
  for i, (tokens, lengths, real) in enumerate(_batches(prompts, batch_size)):
    result = sampler.generate(variables, tokens, max_new_tokens, prompt_lengths=lengths,
                              rng=jax.random.fold_in(jax.random.key(seed), i))
    out += [stats_lib.new_tokens(row, sampler.stop_tokens, sampler.model.config.pad_id)
            for row in np.asarray(result.tokens)[:real]]
    passes.append(np.asarray(result.num_denoiser_passes)[:real])
  return out, np.concatenate(passes)


def autoregressive(sampler: dg.ARSampler, variables, prompts, max_new_tokens: int, batch_size: int,
                   temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
  """Each prompt's continuation up to and including its stop token: greedy, or sampled at `temperature`
  (batch i with key fold_in(key(seed), i))."""
  out = []
  for i, (tokens, lengths, real) in enumerate(_batches(prompts, batch_size)):
    result = sampler.generate(variables, tokens, jax.random.fold_in(jax.random.key(seed), i), max_new_tokens,
                              prompt_lengths=lengths, temperature=temperature)
    out += [stats_lib.new_tokens(row, sampler.stop_tokens, sampler.model.config.pad_id)
            for row in np.asarray(result.tokens)[:real]]
  return out


def distinct_ngrams(continuations: Sequence[Sequence[int]], n: int = 4) -> float:
  """Mean over continuations (of at least n tokens) of distinct n-grams / n-grams: 1 when nothing repeats,
  near 0 for a loop."""
  ratios = []
  for ids in continuations:
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if grams:
      ratios.append(len(set(grams)) / len(grams))
  return float(np.mean(ratios)) if ratios else float("nan")


def quality(run: TextModel, prompts, continuations, judge: generative.Judge | None = None) -> dict[str, float]:
  """Judged perplexity (by `judge`, default the run's own AR mode), distinct 4-grams, new tokens and mean
  length of `continuations`."""
  nll, count = generative.continuation_nll(judge or run.judge(), prompts, continuations)
  return {"judged_perplexity": float(np.exp(min(nll.sum() / max(count.sum(), 1), 700.0))),
          "judged_nll_per_token": float(nll.sum() / max(count.sum(), 1)),
          "distinct_4gram": distinct_ngrams(continuations), "new_tokens": int(sum(map(len, continuations))),
          "mean_length": float(np.mean([len(c) for c in continuations]))}


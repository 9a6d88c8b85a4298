"""Generative quality of diffusion samples: their perplexity under autoregressive judges, their entropy.

A validation loss says how well a model predicts text, not whether what it writes is any good. So we
sample continuations of validation prompts with the diffusion sampler and score what came out:

- perplexity of the new tokens given the prompt under the model's **own encoder** (its causal, next-token
  mode, the same weights): cheap, but the judge shares the writer's biases;
- the same under an **independently trained autoregressive baseline** of the same size
  (configs/small_ar.py): the judge that does not;
- **unigram entropy** (nats) of each sample's tokens, averaged over samples: a sample that repeats one
  token has 0, so degenerate, repetitive samples show up here even when a judge finds them likely.

The validation text that really follows each prompt (cut to each sample's length) is scored by the same
judges and the same entropy, so the sample figures can be read against those of real text. Perplexities
are token-weighted: exp(total NLL / total tokens) over every sample, the stop token included.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma import data as data_lib
from diffusiongemma.model import DiffusionGemma, ModelConfig
from diffusiongemma.sampling import prompts as prompts_lib
from diffusiongemma.sampling import stats as stats_lib


@dataclasses.dataclass(frozen=True)
class Judge:
  """An autoregressive scorer: a model's encoder with its variables."""

  name: str
  model: DiffusionGemma
  variables: Any


def unigram_entropy(ids: Sequence[int]) -> float:
  """Entropy (nats) of the empirical token distribution of `ids`: 0 for one repeated token, log V for V
  distinct tokens each once."""
  ids = np.asarray(ids).ravel()
  if ids.size == 0:
    raise ValueError("unigram_entropy of an empty sequence is undefined; every sample needs >= 1 token.")
  _, counts = np.unique(ids, return_counts=True)
  p = counts / counts.sum()
  return float(-(p * np.log(p)).sum())


@functools.partial(jax.jit, static_argnums=0)
def _target_log_probs(model: DiffusionGemma, variables, tokens, lengths):
  """log p(tokens[:, j + 1] | tokens[:, :j + 1]) under the causal encoder, [B, L - 1]."""
  logits, _ = model.apply(variables, tokens, num_tokens=lengths, method=model.encode)  # [B, L, V]
  log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
  return jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]


def continuation_nll(judge: Judge, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                     pad_to: int = 64) -> tuple[np.ndarray, np.ndarray]:
  """(summed NLL in nats [N], token count [N]) of each continuation given its prompt, one encoder pass.

  Rows are right-padded to a multiple of `pad_to` (few distinct shapes: few compilations); a causal
  encoder's predictions never look at the padding after them.
  """
  if len(prompts) != len(continuations):
    raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations.")
  rows = [list(p) + list(c) for p, c in zip(prompts, continuations)]
  if any(len(p) < 1 for p in prompts):
    raise ValueError("Every prompt needs at least one token to condition on.")
  length = max(-(-max(len(r) for r in rows) // pad_to) * pad_to, 2)
  tokens, lengths = prompts_lib.pad(rows, judge.model.config.pad_id)
  tokens = np.pad(tokens, ((0, 0), (0, length - tokens.shape[1])), constant_values=judge.model.config.pad_id)
  log_probs = np.asarray(_target_log_probs(judge.model, judge.variables, jnp.asarray(tokens),
                                           jnp.asarray(lengths)))  # [N, L - 1]
  target = np.arange(1, length)[None]  # the position each log-prob predicts
  starts = np.array([len(p) for p in prompts])[:, None]
  mask = (target >= starts) & (target < lengths[:, None])
  return -(log_probs * mask).sum(1), mask.sum(1)


def perplexity(judge: Judge, prompts, continuations) -> float:
  """exp(total NLL / total tokens) of the continuations given their prompts."""
  nll, count = continuation_nll(judge, prompts, continuations)
  if count.sum() == 0:
    raise ValueError("No continuation token to score.")
  return float(np.exp(min(nll.sum() / count.sum(), 700.0)))


def score(prompts, continuations, judges: Sequence[Judge], references=None) -> dict[str, float]:
  """Perplexity under each judge (`perplexity_<name>`) and mean unigram entropy of `continuations`, and
  the same of `references` (`reference_...`), each cut to its sample's length."""
  out = {"num_samples": len(continuations), "new_tokens": int(sum(len(c) for c in continuations)),
         "unigram_entropy": float(np.mean([unigram_entropy(c) for c in continuations]))}
  out["mean_length"] = out["new_tokens"] / len(continuations)
  for judge in judges:
    out[f"perplexity_{judge.name}"] = perplexity(judge, prompts, continuations)
  if references is not None:
    references = [list(r)[:len(c)] for r, c in zip(references, continuations)]
    out["reference_unigram_entropy"] = float(np.mean([unigram_entropy(r) for r in references]))
    for judge in judges:
      out[f"reference_perplexity_{judge.name}"] = perplexity(judge, prompts, references)
  return out


def sample(sampler, variables, prompts: np.ndarray, rng, max_new_tokens: int, batch_size: int
           ) -> tuple[list[list[int]], dict[str, float]]:
  """Continuations of `prompts` [N, P] (each up to and including its stop token) and the sampler's
  statistics over all of them (`sampling.stats.summary`: pooled and mean tokens per forward, steps per
  canvas).

  Batches are all `batch_size` rows (the last one padded with copies, dropped after), so one program
  serves every batch.
  """
  n = prompts.shape[0]
  stop, pad = sampler.stop_tokens, sampler.model.config.pad_id
  continuations, tokens, passes = [], [], []
  for i, start in enumerate(range(0, n, batch_size)):
    chunk = prompts[start:start + batch_size]
    real = chunk.shape[0]
    if real < batch_size:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, 0)])
    out = sampler.generate(variables, jnp.asarray(chunk), jax.random.fold_in(rng, i),
                           max_new_tokens=max_new_tokens)
    tokens.append(np.asarray(out.tokens)[:real])
    passes.append(np.asarray(out.canvas_passes)[:real])
    continuations += [stats_lib.new_tokens(row, stop, pad) for row in tokens[-1]]
  summary = stats_lib.summary(np.concatenate(tokens), np.concatenate(passes), pad)
  return continuations, {k: summary[k] for k in ("pooled_tokens_per_forward", "mean_tokens_per_forward",
                                                 "steps_per_canvas")}


def validation_prompts(texts: Sequence[str], tokenizer, num_samples: int, *, prompt_length: int,
                       length: int) -> tuple[np.ndarray, np.ndarray]:
  """(prompts [N, P], what follows them [N, length - P]): N windows of `length` tokens of the tokenized
  `texts` (the validation split), evenly spread over them; the prompt is each window's first
  `prompt_length` tokens (the training layout)."""
  stream = data_lib.tokenize_corpus(texts, tokenizer)
  p = prompt_length
  windows = stream.size // length
  if windows < num_samples:
    raise ValueError(f"The validation split has {windows} windows of {length} tokens, fewer than "
                     f"num_samples={num_samples}.")
  starts = np.linspace(0, windows - 1, num_samples).astype(np.int64) * length
  rows = np.stack([stream[s:s + length] for s in starts]).astype(np.int32)
  return rows[:, :p], rows[:, p:]


class GenerativeEval:
  """Everything loaded once (the writer's weights, the judges, the prompts) for many sampler settings.

  `run(**sampler_overrides)` samples a continuation of every prompt with a sampler of `make_sampler(
  **sampler_overrides)` and returns the tokens per forward, the scores of `score` and the settings used.
  (`build.generative_eval(config, workdir, ...)` makes one from a training run.)
  """

  def __init__(self, make_sampler: Callable[..., Any], variables, tokenizer, judges: Sequence[Judge],
               prompts: np.ndarray, following: np.ndarray, *, max_new_tokens: int, source: str = "",
               batch_size: int = 8, seed: int = 0):
    if len(prompts) < 1 or batch_size < 1:
      raise ValueError(f"GenerativeEval needs prompts and batch_size >= 1, got {len(prompts)} and {batch_size}.")
    self.make_sampler, self.variables, self.tokenizer = make_sampler, variables, tokenizer
    self.judges, self.prompts, self.following = list(judges), prompts, following
    self.max_new_tokens, self.source = max_new_tokens, source
    self.batch_size, self.seed = min(batch_size, len(prompts)), seed

  def run(self, max_new_tokens: int | None = None, **sampler_overrides) -> dict[str, Any]:
    sampler = self.make_sampler(**sampler_overrides)
    max_new_tokens = max_new_tokens or self.max_new_tokens
    continuations, stats = sample(sampler, self.variables, self.prompts, jax.random.key(self.seed),
                                  max_new_tokens, self.batch_size)
    results = {"weights": self.source, "max_new_tokens": max_new_tokens, "sampler": sampler.settings(),
               "entropy_bound": sampler.config.entropy_bound,
               "max_denoising_steps": sampler.config.max_denoising_steps, **stats,
               **score(self.prompts, continuations, self.judges, self.following)}
    results["example"] = self.tokenizer.decode([t for t in continuations[0] if t not in sampler.stop_tokens])
    return results

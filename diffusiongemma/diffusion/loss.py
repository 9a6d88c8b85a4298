"""The block-diffusion training objective of DiffusionGemma: the diffusion loss of one (or every) canvas
with self-conditioning, plus the encoder's next-token loss. `LossConfig` describes it in full;
`diffusion_loss` computes it for a batch in the training layout (`data.sft`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from diffusiongemma.diffusion import noise as noise_lib

Array = jax.Array
LOSS_WEIGHTINGS = ("elbo", "flat")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
  """The objective: a frozen, hashable value (a static jit argument), built by `build.loss(config)` from
  `config.diffusion`; its `noise` is the same object the sampler of that config is given.

  Each example is a clean sequence `tokens` [B, L]: a prompt of `prompt_length` tokens, then n canvases
  of C tokens. The encoder runs causally over the whole clean sequence once; because causal keys depend
  only on earlier tokens, `cache.with_length(start)` is exactly the clean cache of everything before
  `start`. Then:

  - one canvas per example (default, as the released model trains): canvas j ~ U{0..n-1}, corrupted at
    t ~ U(eps, 1 - eps), denoised attending to the clean prompt and the clean earlier canvases only;
  - `all_canvases=True`: every canvas, each with its own t, in one block-causal denoiser pass (block i
    sees the cache up to its own start and itself), the loss averaged over canvases. With the same noise
    draws this equals the mean of the one-canvas losses (tested).

  The diffusion loss of a canvas is the mean over its C positions of weight x cross-entropy, the weights
  coming from the noise process (uniform: 1 everywhere; masked: 1/t on masked positions, the ELBO).
  Gradients flow into the encoder through the cache as well as through the denoiser (one set of weights).

  Self-conditioning (with probability p per example): pass 1 denoises with no signal; its raw logits,
  with the gradient stopped, feed pass 2 as the self-conditioning signal. Rows not chosen get a **zero
  signal** (transformers' `self_conditioning_mask`), which is exactly what the sampler's first step
  sees; Google's code feeds them uniform logits instead. The loss is taken on pass 2 only. With p = 0
  pass 1 is skipped.

  Total loss = `diffusion_loss_weight` x diffusion loss + `ar_loss_weight` x the encoder's next-token
  cross-entropy on the clean sequence (every position up to the end of the row's canvases, EOS padding
  included, as the released model supervises it; `ar_loss_on_prompt=False` leaves out the targets inside
  the prompt, as supervised fine-tuning usually does). With `ar_loss_weight=0` the encoder runs only over
  the tokens before the last canvas slot (all the denoiser's cache needs) and `ar_loss` reads 0.

  Supervised fine-tuning (`data.sft`) puts prompts of different lengths in one batch: `prompt_length`
  [B] is where each row's canvases start, and an optional `num_canvases` [B] (<= n) says how many of the
  n canvas slots hold the row's response; the rest of the row is padding that no loss reads. The
  diffusion loss has terms at canvas positions only: the prompt is never noised and never a target, it
  only conditions the canvas through the clean cache. An optional `given` [B, L] marks canvas positions
  held clean (what the sampler's `given=` holds when infilling): they are never corrupted and never
  targets, and the loss is the mean over the other positions.

  `diffusion_loss_weight=0` trains the encoder alone, an autoregressive baseline of the same size
  (configs/small_ar.py): the denoiser passes are then skipped, not multiplied by zero, so the baseline
  costs an AR model's compute, and the diffusion metrics read 0.
  """

  noise: noise_lib.NoiseProcess
  eps: float = 1e-4
  self_conditioning_prob: float = 0.5
  ar_loss_weight: float = 1.0
  diffusion_loss_weight: float = 1.0  # 0: the AR baseline (see the module docstring)
  all_canvases: bool = False
  ar_loss_on_prompt: bool = True  # False: the AR loss covers the response (canvas) targets only
  # 'elbo': the noise process's own weights (uniform: 1 everywhere; masked: 1/t on masked positions, the
  # bound); 'flat': 1 wherever those are positive (masked noise then weighs every masked token alike, which
  # puts the emphasis on heavily masked canvases; uniform noise is unchanged).
  loss_weighting: str = "elbo"
  # Certainty forcing (dParallel, arXiv 2509.26488): + weight x the mean entropy of the denoiser's
  # distribution over the corrupted positions it already predicts right (argmax == target), which pushes a
  # model that is right towards being sure, so that more positions pass a confidence threshold per pass.
  certainty_weight: float = 0.0
  # Masked noise: this share of the examples masks a suffix of each canvas (its last ceil(t C) positions)
  # instead of positions drawn independently: the canvases a left-to-right acceptance rule
  # (`acceptance.ConfidentPrefix`) denoises, a clean prefix and a masked rest.
  suffix_fraction: float = 0.0

  def __post_init__(self):
    if not hasattr(self.noise, "corrupt"):
      raise ValueError(f"LossConfig.noise={self.noise!r} is not a noise process (e.g. "
                       "diffusion.UniformNoise(vocab_size)).")
    if not 0.0 <= self.eps < 0.5:
      raise ValueError(f"config.diffusion.eps must be in [0, 0.5), got {self.eps}.")
    if not 0.0 <= self.self_conditioning_prob <= 1.0:
      raise ValueError("config.diffusion.self_conditioning_prob must be in [0, 1], got "
                       f"{self.self_conditioning_prob}.")
    if self.diffusion_loss_weight < 0:
      raise ValueError("config.diffusion.diffusion_loss_weight must be >= 0, got "
                       f"{self.diffusion_loss_weight}.")
    if not 0.0 <= self.certainty_weight < float("inf"):
      raise ValueError(f"config.diffusion.certainty_weight must be a finite number >= 0, got "
                       f"{self.certainty_weight}.")
    if not 0.0 <= self.suffix_fraction <= 1.0:
      raise ValueError(f"config.diffusion.suffix_fraction must be in [0, 1], got {self.suffix_fraction}.")
    if self.suffix_fraction > 0 and getattr(self.noise, "mask_token_id", None) is None:
      raise ValueError(f"config.diffusion.suffix_fraction={self.suffix_fraction} masks suffixes: it needs "
                       f"masked noise, not {getattr(self.noise, 'name', self.noise)!r}.")
    if self.loss_weighting not in LOSS_WEIGHTINGS:
      raise ValueError(f"config.diffusion.loss_weighting={self.loss_weighting!r} is invalid; expected one of "
                       f"{LOSS_WEIGHTINGS}.")
    if self.diffusion_loss_weight == 0 and self.ar_loss_weight == 0:
      raise ValueError("config.diffusion.diffusion_loss_weight and ar_loss_weight are both 0: nothing "
                       "would be trained; set at least one of them > 0.")

  def replace(self, **changes) -> "LossConfig":
    return dataclasses.replace(self, **changes)

  @property
  def is_elbo(self) -> bool:
    """The weighted diffusion loss bounds the negative log-likelihood (masked noise, ELBO weights)."""
    return self.noise.loss_is_elbo and self.loss_weighting == "elbo"


def _cross_entropy(logits: Array, labels: Array) -> Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


def _encoder_pass(model, params, tokens: Array, ar_mask: Array, config: LossConfig, c: int) -> tuple[Any, Array]:
  """(the clean cache, the sum of the AR loss over `ar_mask` [B, L-1]): the encoder over the clean sequence;
  without an AR term only over the tokens before the last canvas slot (all the denoiser's cache needs)."""
  if config.ar_loss_weight == 0:
    _, cache = model.apply(params, tokens[:, :-c], method=model.encode)
    return cache, jnp.zeros((), jnp.float32)
  enc_logits, cache = model.apply(params, tokens, method=model.encode)  # [B, L, V]
  ar_ce = _cross_entropy(enc_logits[:, :-1], tokens[:, 1:])  # [B, L-1]
  return cache, (ar_ce * ar_mask).sum()


def _denoise(model, params, canvas: Array, cache, block_length: int | None, config: LossConfig,
             sc_mask: Array) -> Array:
  """Denoiser logits [B, k*C, V], with self-conditioning (pass 1 without a signal, its stopped logits
  feeding pass 2 for the rows of `sc_mask` [B]; the others get a zero signal)."""
  def denoise(sc_logits, mask):
    return model.apply(params, canvas, cache, sc_logits, mask, block_length=block_length,
                       method=model.denoise)

  if config.self_conditioning_prob > 0:
    first = jax.lax.stop_gradient(denoise(None, None))
    return denoise(first, sc_mask)
  return denoise(None, None)


def certainty_entropy(logits: Array, labels: Array, mask: Array) -> Array:
  """The mean entropy of softmax(logits) [..., V] over the positions of `mask` whose argmax is already the
  label (0 where there are none): certainty forcing's term. Which positions count takes no gradient."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  probs = jnp.exp(log_probs)
  entropy = -jnp.sum(jnp.where(probs > 0, probs * log_probs, 0.0), axis=-1)  # 0 log 0 = 0
  right = jax.lax.stop_gradient((jnp.argmax(logits, -1) == labels) & mask).astype(jnp.float32)
  return (right * entropy).sum() / jnp.maximum(right.sum(), 1.0)


def diffusion_loss(model, params, batch: Mapping[str, Array], rng: Array, config: LossConfig, *,
                   num_canvases: int, canvas_index: Array | None = None) -> tuple[Array, dict]:
  """(total loss, metrics) of one batch `{'tokens': [B, L], 'prompt_length': [B]}`.

  Args:
    model: a `DiffusionGemma`.
    params: its variables (`{'params': ...}`), boxed or not.
    batch: clean sequences; each row's canvases start at its `prompt_length`; an optional
      `num_canvases` [B] gives each row's canvases (default n for every row); an optional `given` [B, L]
      bool marks canvas positions held as they are (infilling, e.g. a puzzle's clues): never corrupted,
      never a target; an optional `ar_targets` [B, L] bool limits the AR loss to the tokens it marks as
      targets (e.g. the real text of a row whose canvases are a teacher's output).
    rng: all randomness of the loss (t, corruption, canvas choice, self-conditioning rows).
    config: the objective.
    num_canvases: n, canvases per row after the prompt (static).
    canvas_index: [B] forces the canvas of each row (one-canvas mode only; tests).
  """
  examples = prepare(model, batch, rng, config, num_canvases=num_canvases, canvas_index=canvas_index)
  return loss_terms(model, params, examples, normalizers(examples, config), config)


def prepare(model, batch: Mapping[str, Array], rng: Array, config: LossConfig, *, num_canvases: int,
            canvas_index: Array | None = None) -> dict[str, Array]:
  """Everything the loss of `batch` draws or derives without the model, per example (each array's leading
  axis is the batch): the noised canvases, their targets, weights and valid positions, the canvas chosen,
  the self-conditioning rows and the AR targets. A slice of the rows of it is the same slice of the batch's
  loss terms, so that gradient accumulation (`loss_terms` on row slices, `normalizers` of the whole) gives
  the whole batch's loss, with the same random draws."""
  tokens = batch["tokens"]
  start = batch["prompt_length"].astype(jnp.int32)  # [B]
  b = tokens.shape[0]
  c = model.config.canvas_length
  n = num_canvases
  noise = config.noise
  if noise.vocab_size != model.config.vocab_size:
    raise ValueError(f"The {noise.name} noise draws from {noise.vocab_size} tokens but the model has "
                     f"vocab_size={model.config.vocab_size}; build both from one config (build.loss).")
  k_t, k_noise, k_canvas, k_sc = jax.random.split(rng, 4)
  rows = batch.get("num_canvases")
  rows = jnp.full((b,), n, jnp.int32) if rows is None else jnp.clip(rows.astype(jnp.int32), 1, n)  # [B]
  target = jnp.arange(1, tokens.shape[1], dtype=jnp.int32)[None]  # [1, L-1]: position of each AR target
  ar_mask = target < (start + rows * c)[:, None]  # [B, L-1]
  if not config.ar_loss_on_prompt:
    ar_mask &= target >= start[:, None]
  if batch.get("ar_targets") is not None:
    ar_mask &= batch["ar_targets"][:, 1:].astype(bool)
  examples = {"tokens": tokens, "ar_mask": ar_mask.astype(jnp.float32)}
  if config.diffusion_loss_weight == 0:  # the AR baseline: no denoiser pass at all
    return examples

  offsets = start[:, None] + jnp.arange(n * c, dtype=jnp.int32)[None]  # [B, nC]
  clean = jnp.take_along_axis(tokens, offsets, axis=1).reshape(b, n, c)  # [B, n, C]
  held = batch.get("given")
  held = (jnp.zeros(clean.shape, bool) if held is None
          else jnp.take_along_axis(held.astype(bool), offsets, axis=1).reshape(b, n, c))
  t = noise_lib.sample_time(k_t, (b, n), config.eps)  # [B, n]
  noisy, corrupted = noise.corrupt(k_noise, clean, t[..., None])  # [B, n, C]
  if config.suffix_fraction > 0:
    suffix = jnp.arange(c)[None, None] >= c - jnp.ceil(t[..., None] * c)  # [B, n, C]: the last ceil(t C)
    chosen = jax.random.uniform(jax.random.fold_in(k_noise, 1), (b, 1, 1)) < config.suffix_fraction
    corrupted = jnp.where(chosen, suffix, corrupted)
    noisy = jnp.where(corrupted, jnp.asarray(noise.mask_token_id, clean.dtype), clean)
  noisy, corrupted = jnp.where(held, clean, noisy), corrupted & ~held
  weights = noise.loss_weights(corrupted, t[..., None]) * ~held  # [B, n, C]
  if config.loss_weighting == "flat":  # the same positions, without the 1/t
    weights = (weights > 0).astype(jnp.float32)
  valid = (jnp.arange(n)[None] < rows[:, None])[..., None] & ~held  # [B, n, C]: the response's free positions
  if config.all_canvases:  # every canvas, block-causally, in one pass
    cache_length = start
  else:  # one canvas per row, attending to the clean prompt and earlier canvases
    if canvas_index is None:
      canvas_index = jax.random.randint(k_canvas, (b,), 0, rows)
    pick = lambda x: jnp.take_along_axis(x, canvas_index[:, None, None], axis=1)  # [B, 1, C]
    clean, noisy, corrupted, weights, valid = map(pick, (clean, noisy, corrupted, weights, valid))
    cache_length = start + canvas_index.astype(jnp.int32) * c
  valid = valid.astype(jnp.float32)
  return examples | {"clean": clean, "noisy": noisy, "weights": weights, "valid": valid,
                     "corrupted": corrupted.astype(jnp.float32) * valid, "cache_length": cache_length,
                     "sc_mask": jax.random.uniform(k_sc, (b,)) < config.self_conditioning_prob}


def normalizers(examples: Mapping[str, Array], config: LossConfig) -> dict[str, Array]:
  """The whole batch's denominators of the loss and its metrics (from `prepare` of the whole batch)."""
  out = {"ar": jnp.maximum(examples["ar_mask"].sum(), 1.0)}
  if config.diffusion_loss_weight:
    out |= {"diffusion": jnp.maximum(examples["valid"].sum(), 1.0),
            "corrupted": jnp.maximum(examples["corrupted"].sum(), 1.0)}
  return out


def loss_terms(model, params, examples: Mapping[str, Array], norms: Mapping[str, Array],
               config: LossConfig) -> tuple[Array, dict]:
  """(loss, metrics) of the rows in `examples` (`prepare`), each a sum over those rows divided by the whole
  batch's `norms`: over all the rows, the batch's loss; over a slice, that slice's share of it."""
  tokens = examples["tokens"]
  c = model.config.canvas_length
  cache, ar_sum = _encoder_pass(model, params, tokens, examples["ar_mask"], config, c)
  ar_loss = ar_sum / norms["ar"]
  if config.diffusion_loss_weight == 0:
    zero = jnp.zeros((), jnp.float32)
    metrics = {"loss": config.ar_loss_weight * ar_loss, "diffusion_loss": zero, "diffusion_ce": zero,
               "ar_loss": ar_loss, "corrupted_accuracy": zero, "corrupted_fraction": zero,
               "certainty_entropy": zero}
    return metrics["loss"], metrics
  clean, valid, corrupted = examples["clean"], examples["valid"], examples["corrupted"]
  b, k = clean.shape[:2]
  canvas, block_length = examples["noisy"].reshape(b, k * c), (c if config.all_canvases else None)
  cache = cache.with_length(examples["cache_length"])
  logits = _denoise(model, params, canvas, cache, block_length, config, examples["sc_mask"])
  logits = config.noise.prepare_logits(logits).reshape(*clean.shape, -1)  # [B, k, C, V]
  ce = _cross_entropy(logits, clean)  # [B, k, C]
  loss_diffusion = (valid * examples["weights"] * ce).sum() / norms["diffusion"]
  loss = config.diffusion_loss_weight * loss_diffusion + config.ar_loss_weight * ar_loss
  correct = (jnp.argmax(logits, -1) == clean).astype(jnp.float32)
  certainty = jnp.zeros((), jnp.float32)
  if config.certainty_weight > 0:  # normalised by the rows' own count of right positions
    certainty = certainty_entropy(logits, clean, corrupted > 0)
    loss = loss + config.certainty_weight * certainty
  metrics = {
      "loss": loss,
      "diffusion_loss": loss_diffusion,
      "diffusion_ce": (valid * ce).sum() / norms["diffusion"],
      "ar_loss": ar_loss,
      "corrupted_accuracy": (correct * corrupted).sum() / norms["corrupted"],
      "corrupted_fraction": corrupted.sum() / norms["diffusion"],
      "certainty_entropy": certainty,
  }
  return loss, metrics

"""The noise processes and the block-diffusion loss on a tiny random model."""

import functools
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma import diffusion
from diffusiongemma.build.config import load_config_file

ROOT = pathlib.Path(__file__).parent.parent

V = 50
TINY = dg.ModelConfig(
    vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
    num_full_kv_heads=1, full_head_dim=8, sliding_window=6, intermediate_size=32, num_experts=2,
    top_k=1, moe_intermediate_size=16, canvas_length=4, max_positions=64, moe_impl="dense")
PROMPT, CANVASES = 3, 3


def test_sample_time_range():
  t = diffusion.sample_time(jax.random.PRNGKey(0), (100_000,), 0.1)
  assert float(t.min()) >= 0.1 and float(t.max()) <= 0.9
  assert abs(float(t.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("t", [0.05, 0.3, 0.9])
def test_uniform_noise_corrupts_at_rate_t(t):
  noise = diffusion.UniformNoise(V)
  tokens = jnp.zeros((200, 500), jnp.int32) + 7
  noisy, corrupted = noise.corrupt(jax.random.PRNGKey(1), tokens, jnp.float32(t))
  assert abs(float(corrupted.mean()) - t) < 0.01
  # A corrupted token is uniform over the whole vocabulary, so it may equal the original.
  changed = noisy != tokens
  assert abs(float(changed.mean()) - t * (1 - 1 / V)) < 0.01
  assert not bool(jnp.any(changed & ~corrupted))
  counts = np.bincount(np.asarray(noisy[corrupted]), minlength=V)
  assert counts.size == V and counts.min() > 0.7 * counts.mean()
  np.testing.assert_array_equal(noise.loss_weights(corrupted, t), np.ones(tokens.shape))


def test_masked_noise_corrupts_to_mask_with_elbo_weights():
  noise = diffusion.MaskedNoise(V)
  assert noise.mask_token_id == V - 1 == noise.never_token == diffusion.MaskedNoise(V, -1).mask_token_id
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, V - 1, (300, 400)), jnp.int32)
  t = jax.random.uniform(jax.random.PRNGKey(2), (300, 1), minval=0.01, maxval=0.99)
  noisy, corrupted = noise.corrupt(jax.random.PRNGKey(3), tokens, t)
  np.testing.assert_array_equal(noisy, jnp.where(corrupted, V - 1, tokens))
  np.testing.assert_allclose(corrupted.mean(axis=1), t[:, 0], atol=0.08)
  weights = noise.loss_weights(corrupted, t)
  np.testing.assert_allclose(weights, corrupted / t, rtol=1e-6)
  # E[1{masked} / t] = 1 for every t: the ELBO weights every noise level equally in expectation.
  np.testing.assert_allclose(weights.mean(), 1.0, atol=0.02)
  logits = noise.prepare_logits(jnp.zeros((2, V)))
  assert float(logits[0, V - 1]) < -1e8 and float(logits[0, 0]) == 0.0
  assert diffusion.MaskedNoise(V, 10).mask_token_id == 10


def test_noise_processes_for_sampling():
  keys = jax.random.split(jax.random.key(0), 3)
  uniform, masked = diffusion.UniformNoise(V), diffusion.MaskedNoise(V)
  start = uniform.initial_canvas(keys, 64)
  assert start.shape == (3, 64) and len(np.unique(start)) > 30 and not uniform.initial_fixed(start).any()
  np.testing.assert_array_equal(masked.initial_canvas(keys, 4), V - 1)
  sampled = jnp.full((3, 4), 7, jnp.int32)
  accepted = jnp.array([[1, 0, 0, 1]] * 3, bool)
  canvas, fixed = uniform.renoise(keys, start[:, :4], sampled, accepted, jnp.zeros((3, 4), bool))
  np.testing.assert_array_equal(canvas[:, [0, 3]], 7)  # accepted: the sample; the rest re-drawn
  assert not fixed.any() and (np.asarray(canvas[:, 1:3]) != 7).any()
  given = jnp.array([[0, 1, 0, 0]] * 3, bool)  # infilling: given positions never change
  canvas, _ = uniform.renoise(keys, start[:, :4], sampled, accepted, given)
  np.testing.assert_array_equal(canvas[:, 1], start[:, 1])
  masks = masked.initial_canvas(keys, 4)
  canvas, fixed = masked.renoise(keys, masks, sampled, accepted, masked.initial_fixed(masks))
  np.testing.assert_array_equal(canvas, np.where(accepted, 7, V - 1))
  np.testing.assert_array_equal(fixed, accepted)


def _path_kl_rate(logits, clean, noisy, t):
  """The uniform-noise NELBO integrand written out: sum over y != z of R' - R + R log(R / R'), float64."""
  k = logits.shape[-1]
  p = np.exp(logits - logits.max())
  p /= p.sum()
  alpha = 1.0 - t
  true = alpha * (np.arange(k) == clean) + (1 - alpha) / k
  model = alpha * p + (1 - alpha) / k
  total = 0.0
  for y in range(k):
    if y != noisy:
      rate, model_rate = true[y] / true[noisy] / (k * alpha), model[y] / model[noisy] / (k * alpha)
      total += model_rate - rate + rate * np.log(rate / model_rate)
  return total


def test_uniform_nelbo_terms_equal_the_path_kl_rate_written_out():
  rng = np.random.default_rng(0)
  k, n = 7, 12
  logits = 3.0 * rng.standard_normal((n, k))
  clean = rng.integers(0, k, n)
  noisy = np.where(np.arange(n) % 2 == 0, clean, rng.integers(0, k, n))  # clean and corrupted positions
  t = rng.uniform(0.01, 0.99, n)
  terms = diffusion.UniformNoise(k).nelbo_terms(jnp.asarray(logits, jnp.float32), jnp.asarray(clean),
                                                jnp.asarray(noisy), None, jnp.asarray(t, jnp.float32))
  expected = [_path_kl_rate(logits[i], clean[i], noisy[i], t[i]) for i in range(n)]
  np.testing.assert_allclose(terms, expected, rtol=2e-5, atol=1e-6)
  assert (np.asarray(terms) > 0).all()
  perfect = np.where(np.arange(k)[None] == clean[:, None], 0.0, -1e4)  # p = e_x0: the rates agree
  zero = diffusion.UniformNoise(k).nelbo_terms(jnp.asarray(perfect, jnp.float32), jnp.asarray(clean),
                                               jnp.asarray(noisy), None, jnp.asarray(t, jnp.float32))
  np.testing.assert_allclose(zero, 0.0, atol=1e-5)


def test_masked_nelbo_terms_are_the_weighted_loss():
  noise = diffusion.MaskedNoise(V)
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.standard_normal((3, 5, V)), jnp.float32)
  clean = jnp.asarray(rng.integers(0, V - 1, (3, 5)))
  noisy, corrupted = noise.corrupt(jax.random.PRNGKey(2), clean, jnp.float32(0.5))
  t = jnp.full((3, 5), 0.4)
  ce = -jnp.take_along_axis(jax.nn.log_softmax(noise.prepare_logits(logits)), clean[..., None], -1)[..., 0]
  np.testing.assert_allclose(noise.nelbo_terms(logits, clean, noisy, corrupted, t),
                             np.where(corrupted, ce / 0.4, 0.0), rtol=1e-6)


def test_bad_noise_configs():
  with pytest.raises(ValueError, match="Unknown config.diffusion.noise 'gaussian'"):
    dg.build.noise(_config(noise="gaussian"))
  with pytest.raises(ValueError, match="not a noise process"):
    diffusion.LossConfig(noise="absorbing")
  with pytest.raises(ValueError, match="outside the model vocabulary"):
    diffusion.MaskedNoise(V, V)
  with pytest.raises(ValueError, match=r"Unknown config.diffusion fields \['nosie'\]"):
    dg.build.loss(_config(nosie="masked"))
  with pytest.raises(ValueError, match="self_conditioning_prob"):
    diffusion.LossConfig(noise=diffusion.UniformNoise(V), self_conditioning_prob=1.5)


def _config(**diffusion_fields):
  config = load_config_file(ROOT / "configs" / "tiny.py")
  with config.diffusion.unlocked():
    config.diffusion.update(diffusion_fields)
  return config


def test_build_hands_one_noise_object_to_the_loss_and_the_sampler():
  config = _config(noise="masked", mask_token_id=-1)
  loss, sampler = dg.build.loss(config), dg.build.sampler(config)
  assert loss.noise == sampler.noise == diffusion.MaskedNoise(config.model.vocab_size)
  assert loss.noise.mask_token_id == config.model.vocab_size - 1
  assert dg.build.sampler(_config(noise="uniform")).noise == diffusion.UniformNoise(config.model.vocab_size)


@pytest.fixture(scope="module")
def params():
  model = dg.DiffusionGemma(TINY)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 3), jnp.int32),
                          jnp.zeros((1, TINY.canvas_length), jnp.int32))
  rng = np.random.default_rng(0)

  def draw(x):
    if x.ndim < 2:
      return jnp.asarray(1 + 0.1 * rng.standard_normal(x.shape), x.dtype)
    return jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(x.shape[-2]), x.dtype)

  return {"params": jax.tree.map(draw, nn.unbox(shapes)["params"])}


def _batch(seed=0, b=4):
  tokens = np.random.default_rng(seed).integers(0, V - 1, (b, PROMPT + CANVASES * TINY.canvas_length))
  return {"tokens": jnp.asarray(tokens, jnp.int32), "prompt_length": jnp.full((b,), PROMPT, jnp.int32)}


@functools.partial(jax.jit, static_argnames=("config",))
def _loss(params, batch, rng, config, canvas_index=None):
  return diffusion.diffusion_loss(dg.DiffusionGemma(TINY), params, batch, rng, config,
                                  num_canvases=CANVASES, canvas_index=canvas_index)


@pytest.mark.parametrize("noise", [diffusion.UniformNoise(V),
                                   pytest.param(diffusion.MaskedNoise(V), marks=pytest.mark.slow)])
def test_all_canvases_equals_mean_of_one_canvas_losses(params, noise):
  """One block-causal pass over every canvas == each canvas alone, with the same noise draws, also
  when rows have different prompt lengths (canvases at different offsets)."""
  config = diffusion.LossConfig(noise=noise, self_conditioning_prob=0.5)
  batch, rng = _batch(), jax.random.PRNGKey(4)
  batch["prompt_length"] = jnp.asarray([3, 2, 1, 0], jnp.int32)
  _, everything = _loss(params, batch, rng, config.replace(all_canvases=True))
  one = [_loss(params, batch, rng, config, jnp.full((4,), j, jnp.int32))[1] for j in range(CANVASES)]
  for key in ("diffusion_loss", "diffusion_ce", "loss"):
    np.testing.assert_allclose(everything[key], np.mean([m[key] for m in one]), rtol=2e-5)
  np.testing.assert_allclose(everything["ar_loss"], one[0]["ar_loss"], rtol=1e-6)
  assert all(np.isfinite(float(v)) for v in everything.values())
  # At init the CE of every position is near log V: the total is about 2 log V.
  assert 1.5 * np.log(V) < float(everything["loss"]) < 3 * np.log(V)
  other = _loss(params, batch, jax.random.PRNGKey(5), config, jnp.zeros((4,), jnp.int32))[1]
  assert float(other["loss"]) != float(one[0]["loss"])


class _DetachedCache(dg.DiffusionGemma):
  """The same model with the encoder's cache cut from the gradient (a reference, not a feature)."""

  def encode(self, tokens, cache=None, **kwargs):
    logits, cache = super().encode(tokens, cache, **kwargs)
    return logits, jax.lax.stop_gradient(cache)


def test_loss_is_finite_and_gradients_reach_the_encoder(params):
  """With no AR term, the diffusion loss still trains the weights through the encoder's clean KV
  cache (gradients differ from those of a cut cache), and self-conditioning gets gradient."""
  config = diffusion.LossConfig(noise=diffusion.MaskedNoise(V), ar_loss_weight=0.0, self_conditioning_prob=1.0)

  def grad(model, p):
    fn = lambda q: diffusion.diffusion_loss(model, q, _batch(), jax.random.PRNGKey(5), config,
                                            num_canvases=CANVASES)
    return jax.grad(fn, has_aux=True)(p)[0]["params"]

  full, cut = jax.jit(lambda p: (grad(dg.DiffusionGemma(TINY), p), grad(_DetachedCache(TINY), p)))(params)
  flat = lambda g: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(g)[0]}
  full, cut = flat(full), flat(cut)
  assert all(np.isfinite(v).all() for v in full.values())
  assert any(np.abs(v).max() > 0 for k, v in full.items() if "self_conditioning" in k)
  # Attention in layer 0 reads the cache's keys: its weights get gradient through the encoder pass.
  key = "['layer_0']['attn']['k_einsum']"
  difference = np.linalg.norm(full[key] - cut[key]) / np.linalg.norm(full[key])
  assert difference > 0.05, difference


def test_certainty_entropy_on_hand_written_logits():
  """Certainty forcing's term: the mean entropy over masked positions whose argmax is the label."""
  logits = jnp.log(jnp.asarray([[[0.7, 0.2, 0.1], [0.5, 0.5, 0.0], [0.1, 0.1, 0.8], [0.9, 0.05, 0.05]]]))
  labels = jnp.asarray([[0, 1, 0, 0]])  # right, wrong (tie goes to 0), wrong, right
  mask = jnp.asarray([[True, True, True, False]])  # the last is right but not masked
  p = np.array([0.7, 0.2, 0.1])
  np.testing.assert_allclose(diffusion.certainty_entropy(logits, labels, mask), -(p * np.log(p)).sum(), rtol=1e-5)
  assert float(diffusion.certainty_entropy(logits, labels, jnp.zeros_like(mask))) == 0.0


def test_certainty_weight_and_ar_targets_in_the_loss(params):
  """certainty_weight adds weight x the reported certainty entropy (the rest of the loss unchanged), and
  `ar_targets` limits the AR loss to the targets it marks: the encoder's cross-entropy there, by hand."""
  base = diffusion.LossConfig(noise=diffusion.MaskedNoise(V), self_conditioning_prob=0.0, all_canvases=True)
  batch, rng = _batch(), jax.random.PRNGKey(6)
  _, plain = _loss(params, batch, rng, base)
  _, forced = _loss(params, batch, rng, base.replace(certainty_weight=0.5))
  assert float(forced["certainty_entropy"]) > 0
  np.testing.assert_allclose(forced["loss"], plain["loss"] + 0.5 * forced["certainty_entropy"], rtol=1e-6)

  tokens = batch["tokens"]
  targets = np.zeros(tokens.shape, bool)
  targets[:, 1:PROMPT] = True  # the prompt's own tokens only
  targets[0, PROMPT:PROMPT + 3] = True
  _, masked = _loss(params, {**batch, "ar_targets": jnp.asarray(targets)}, rng, base)
  model = dg.DiffusionGemma(TINY)
  logits, _ = jax.jit(lambda p, t: model.apply(p, t, method=model.encode))(params, tokens)
  log_probs = jax.nn.log_softmax(np.asarray(logits[:, :-1], np.float64), axis=-1)
  nll = -np.take_along_axis(np.asarray(log_probs), np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(masked["ar_loss"], nll[targets[:, 1:]].mean(), rtol=1e-5)
  assert abs(float(masked["ar_loss"]) - float(plain["ar_loss"])) > 1e-4


def test_suffix_fraction_masks_a_suffix_of_each_canvas(params):
  """suffix_fraction=1: every canvas's corrupted positions are its last ceil(t C) (a clean prefix, a masked
  rest), so the denoiser is taught the canvases a left-to-right rule decodes; uniform noise refuses it."""
  config = diffusion.LossConfig(noise=diffusion.MaskedNoise(V), self_conditioning_prob=0.0, suffix_fraction=1.0)
  b, n, c = 64, CANVASES, TINY.canvas_length
  t = diffusion.noise.sample_time(jax.random.split(jax.random.PRNGKey(3), 4)[0], (b, n), config.eps)
  spy = {}

  class Tap(dg.DiffusionGemma):
    def denoise(self, canvas, *args, **kwargs):
      jax.debug.callback(lambda x: spy.__setitem__("canvas", np.asarray(x)), canvas)
      return super().denoise(canvas, *args, **kwargs)

  jax.jit(lambda p: diffusion.diffusion_loss(Tap(TINY), p, _batch(b=b), jax.random.PRNGKey(3),
                                             config.replace(all_canvases=True), num_canvases=n)[0])(params)
  masked = (spy["canvas"] == V - 1).reshape(b, n, c)  # clean tokens are < V - 1 (`_batch`)
  np.testing.assert_array_equal(masked.sum(-1), np.ceil(np.asarray(t) * c))
  assert (np.diff(masked.astype(int), axis=-1) >= 0).all()  # once masked, masked to the end
  with pytest.raises(ValueError, match="suffix_fraction=0.5 masks suffixes: it needs masked noise"):
    diffusion.LossConfig(noise=diffusion.UniformNoise(V), suffix_fraction=0.5)

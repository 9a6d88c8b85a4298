"""The streamed vocabulary head (`sampling.vocab`): one chunk is the unchunked path exactly, chunks equal it,
the draw is an exact inverse CDF, and the sampler gives the same tokens with any chunk size."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma.diffusion import NEVER_LOGIT
from diffusiongemma.model import layers
from diffusiongemma.sampling import vocab

V, D = 61, 16
B, C = 2, 5


def _inputs(seed=0, spread=3.0, vocab_size=V):
  rng = np.random.default_rng(seed)
  table = jnp.asarray(rng.standard_normal((vocab_size, D)) * spread / np.sqrt(D), jnp.float32)
  hidden = jnp.asarray(rng.standard_normal((B, C, D)), jnp.float32)
  uniforms = jnp.asarray(rng.uniform(size=(B, C)), jnp.float32)
  return table, hidden, uniforms


def _head(chunk_size=None, never_token=None, softcap=30.0, **fields):
  return vocab.VocabHead(**{"vocab_size": V, **fields}, softcap=softcap, dtype="float32", never_token=never_token,
                         chunk_size=chunk_size)


@functools.partial(jax.jit, static_argnames=("head", "masked"))
def _streamed(head, table, hidden, temperature, uniforms, masked=False):
  """The head's output and the completed draw at every position."""
  restrict = (lambda scaled, first: jnp.where((first + jnp.arange(scaled.shape[-1])) % 3 == 0, NEVER_LOGIT,
                                              scaled)) if masked else None
  out = head(table, hidden, temperature, uniforms, restrict)
  sample = head.draw(table, hidden, out, jnp.ones(uniforms.shape, bool), uniforms, temperature, restrict)
  return out, sample


@functools.partial(jax.jit, static_argnames=("never_token",))
def _unchunked(table, hidden, temperature, uniforms, never_token=None):
  """The logits path: the model's LM head, the noise's never token, the temperature, then token_stats and
  the embedder's soft_encode on the whole [B, C, V] logits."""
  vocab_size = table.shape[0]
  logits = layers.head_logits(hidden, table, jnp.float32, 30.0)
  if never_token is not None:
    logits = dg.diffusion.MaskedNoise(vocab_size, never_token).prepare_logits(logits)
  scaled = logits / temperature
  embedder = layers.Embedder(vocab_size, D, 30.0, jnp.float32, jnp.float32)
  soft = embedder.apply({"params": {"input_embedding": table}}, scaled, method=embedder.soft_encode)
  return vocab.token_stats(scaled, uniforms), soft


@pytest.mark.parametrize("never_token", [None, 7])
def test_one_chunk_is_the_unchunked_path_and_chunks_equal_it(never_token):
  table, hidden, uniforms = _inputs()
  temperature = jnp.float32(0.7)
  want, want_soft = _unchunked(table, hidden, temperature, uniforms, never_token)
  one, one_sample = _streamed(_head(None, never_token), table, hidden, temperature, uniforms)
  # The same operations in another program: XLA may fuse the float sums differently (<= 1 ulp here).
  for field in ("entropy", "confidence"):
    np.testing.assert_allclose(getattr(one.stats, field), getattr(want, field), rtol=1e-6, err_msg=field)
  np.testing.assert_allclose(one.soft_embedding, want_soft, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(one.stats.argmax, want.argmax)
  np.testing.assert_array_equal(one_sample, want.sample)
  assert ((one.stats.sample == want.argmax) | (one.stats.sample == -1)).all()
  for chunk in (1, 13, 64):  # one token per chunk, a ragged last chunk, one chunk past the end
    got, sample = _streamed(_head(chunk, never_token), table, hidden, temperature, uniforms)
    np.testing.assert_allclose(got.stats.entropy, want.entropy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.stats.confidence, want.confidence, rtol=1e-5)
    np.testing.assert_allclose(got.soft_embedding, want_soft, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.stats.argmax, want.argmax)
    np.testing.assert_array_equal(sample, want.sample)
  if never_token is not None:
    assert not (one_sample == never_token).any() and not (want.argmax == never_token).any()


def test_statistics_against_numpy():
  table, hidden, uniforms = _inputs(1)
  temperature = jnp.float32(0.5)
  out, _ = _streamed(_head(16), table, hidden, temperature, uniforms)
  logits = np.asarray(layers.head_logits(hidden, table, jnp.float32, 30.0), np.float64) / 0.5
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  probs = np.exp(logp)
  np.testing.assert_allclose(out.stats.entropy, -(probs * logp).sum(-1), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out.stats.confidence, probs.max(-1), rtol=1e-5)
  np.testing.assert_allclose(out.log_normalizer, (logits - logp)[..., 0], rtol=1e-6)
  soft = np.einsum("bcv,vd->bcd", probs, np.asarray(table)) * np.sqrt(D)
  np.testing.assert_allclose(out.soft_embedding, soft, rtol=1e-4, atol=1e-5)


def test_draw_is_an_inverse_cdf_argmax_first():
  """For u on a fine grid, the draw equals numpy's inverse CDF over the order (argmax, then the other ids),
  so that each token is drawn with its probability; chunked and unchunked alike."""
  table, hidden, _ = _inputs(2, spread=1.0)
  temperature = jnp.float32(1.0)
  logits = np.asarray(layers.head_logits(hidden, table, jnp.float32, 30.0), np.float64)[0, 0]
  probs = np.exp(logits - logits.max())
  probs /= probs.sum()
  top = int(np.argmax(probs))
  order = np.concatenate([[top], np.delete(np.arange(V), top)])
  edges = np.cumsum(probs[order])
  grid = (np.arange(997) + 0.5) / 997
  want = order[np.minimum(np.searchsorted(edges, grid, side="right"), V - 1)]
  row = jnp.broadcast_to(hidden[:1, :1], (1, grid.size, D))
  for chunk in (None, 7):
    _, sample = _streamed(_head(chunk), table, row, temperature, jnp.asarray(grid[None], jnp.float32))
    sample = np.asarray(sample)[0]
    close = np.abs(edges[np.searchsorted(edges, grid, side="right") - 1] - grid) < 1e-5  # float ties
    np.testing.assert_array_equal(sample[~close], want[~close])
    counts = np.bincount(sample, minlength=V) / grid.size
    assert np.abs(counts - probs).max() < 2 / grid.size


def test_restricted_distribution_follows_the_restriction():
  """`restrict` per chunk equals restricting the whole logits: every statistic and draw follows it."""
  table, hidden, uniforms = _inputs(3)
  temperature = jnp.float32(0.8)
  logits = layers.head_logits(hidden, table, jnp.float32, 30.0) / temperature
  masked = jnp.where(jnp.arange(V) % 3 == 0, NEVER_LOGIT, logits)
  want = vocab.token_stats(masked, uniforms)
  for chunk in (None, 10):
    out, sample = _streamed(_head(chunk), table, hidden, temperature, uniforms, masked=True)
    np.testing.assert_allclose(out.stats.entropy, want.entropy, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sample, want.sample)
    assert (np.asarray(sample) % 3 != 0).all() and (np.asarray(out.stats.argmax) % 3 != 0).all()


def test_draw_only_where_needed_and_rows_independent():
  table, hidden, uniforms = _inputs(4, spread=0.5)  # flat distributions: most draws need the rest
  temperature = jnp.float32(1.0)
  head = _head(16)
  out = jax.jit(head.__call__)(table, hidden, temperature, uniforms)
  need = jnp.asarray([[True, False, True, False, True], [False] * 5])
  draw = jax.jit(head.draw)
  sample = np.asarray(draw(table, hidden, out, need, uniforms, temperature))
  full = np.asarray(draw(table, hidden, out, jnp.ones_like(need), uniforms, temperature))
  first = np.asarray(out.stats.sample)
  assert (first == -1).sum() >= 4
  np.testing.assert_array_equal(sample, np.where(np.asarray(need), full, first))
  swapped = draw(table, hidden[::-1], jax.tree.map(lambda x: x[::-1], out), need[::-1], uniforms[::-1],
                 temperature)
  np.testing.assert_array_equal(np.asarray(swapped)[1], sample[0])


def test_bad_chunk_size_is_rejected():
  with pytest.raises(ValueError, match="vocab_chunk_size=0"):
    dg.SamplerConfig(vocab_chunk_size=0)
  with pytest.raises(ValueError, match="vocab_chunk_size='big'"):
    dg.SamplerConfig(vocab_chunk_size="big")
  with pytest.raises(ValueError, match="vocab_budget_mib=0"):
    dg.SamplerConfig(vocab_budget_mib=0)
  with pytest.raises(ValueError, match="vocab_chunk_size=0"):
    _head(0)
  assert dg.SamplerConfig().vocab_chunk_size == "auto"


def test_auto_chunks_follow_the_memory_budget():
  """One chunk when a float32 [B, C, V] array fits the budget, else the fewest chunks (multiples of 128
  tokens) whose [B, C, U] arrays fit it: at the released vocabulary and the default 256 MiB, one chunk at
  batch 1, 32,768 tokens at batch 8."""
  released = vocab.VocabHead(vocab_size=262_144, softcap=30.0, dtype="float32", chunk_size="auto")
  assert released.chunk_for(1 * 256) is None
  assert released.chunk_for(8 * 256) == 32_768
  assert dataclasses.replace(released, budget_mib=2048).chunk_for(8 * 256) is None
  assert dataclasses.replace(released, chunk_size=1024).chunk_for(1 * 256) == 1024  # a number is kept
  capped = dataclasses.replace(released, auto_block_mib=8)  # what a CPU gets: [B, C, U] blocks of <= 8 MiB
  assert capped.chunk_for(1 * 256) == 8192 and capped.chunk_for(8 * 256) == 1024
  assert dataclasses.replace(capped, vocab_size=8192).chunk_for(256) is None  # 8 MiB: one chunk
  assert dataclasses.replace(capped, budget_mib=2).chunk_for(256) == 2048  # the smaller of the two
  for vocab_size, positions, budget_mib in ((262_144, 32 * 256, 256), (100_003, 3 * 256, 50), (5000, 1, 0.01),
                                            (1000, 10, 0.001)):
    head = vocab.VocabHead(vocab_size=vocab_size, softcap=None, dtype="float32", chunk_size="auto",
                           budget_mib=budget_mib)
    budget, column = budget_mib * 2**20, 4 * positions
    size = head.chunk_for(positions)
    if column * vocab_size <= budget:
      assert size is None
      continue
    chunks = -(-vocab_size // size)
    assert size % 128 == 0 and size < vocab_size, size
    assert (size - 127) * column <= budget or size == 128  # fits, up to rounding to the multiple
    assert chunks == -(-vocab_size // max(128, int(budget // column) // 128 * 128))  # as few as fit


def test_auto_cap_is_chosen_by_the_backend_when_the_head_is_built(monkeypatch):
  """"auto" keeps [B, C, U] blocks within 8 MiB on a CPU (faster there) and only the budget's on GPU/TPU;
  the backend is asked once, by `for_model` (faked here: no GPU needed); a number or None is never capped."""
  config = dg.ModelConfig(vocab_size=262_144, hidden_size=16, num_layers=1, num_heads=1, num_kv_heads=1,
                          head_dim=8, num_full_kv_heads=1, full_head_dim=8, moe_impl="dense")
  for backend, cap, batch_1 in (("cpu", 8, 8192), ("gpu", None, None), ("tpu", None, None)):
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
    head = vocab.VocabHead.for_model(config, chunk_size="auto")
    assert head.auto_block_mib == cap and head.chunk_for(256) == batch_1
    assert head.chunk_for(8 * 256) == (1024 if cap else 32_768)
    assert vocab.VocabHead.for_model(config, chunk_size=None).auto_block_mib is None
  assert vocab.VocabHead.for_model(config.replace(vocab_size=1000), chunk_size="auto").chunk_for(256) is None


@pytest.mark.parametrize("never_token", [None, 7])
def test_auto_chunks_equal_the_unchunked_path(never_token):
  """Whatever "auto" chooses (one chunk under a roomy budget, 4 ragged chunks under a tight one), the
  statistics and every draw are the unchunked path's."""
  table, hidden, uniforms = _inputs(5, vocab_size=1000)  # larger than one 128-token chunk
  temperature = jnp.float32(0.9)
  want, want_soft = _unchunked(table, hidden, temperature, uniforms, never_token)
  for budget_mib, chunk in ((1.0, None), (0.01, 256)):  # [2, 5, 1000] float32 is 40,000 bytes
    head = _head("auto", never_token, vocab_size=1000, budget_mib=budget_mib)
    assert head.chunk_for(B * C) == chunk
    got, sample = _streamed(head, table, hidden, temperature, uniforms)
    np.testing.assert_allclose(got.stats.entropy, want.entropy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.soft_embedding, want_soft, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.stats.argmax, want.argmax)
    np.testing.assert_array_equal(sample, want.sample)


@pytest.mark.parametrize("vocab_size, chunk, budget_mib, chunks", [(61, 16, 256, 4), (61, "auto", 256, 1),
                                                                  (300, "auto", 0.02, 3)])
def test_sampler_tokens_do_not_depend_on_the_chunk_size(vocab_size, chunk, budget_mib, chunks):
  """The same tokens and passes as one chunk (None) with 16-token chunks and with "auto", under a budget
  that keeps one chunk and one that streams (3 x 128 tokens for [3, 8, 300])."""
  from test_sampling import CONFIG, TINY, random_params, _keys, _prompts  # pylint: disable=g-import-not-at-top
  model = dg.DiffusionGemma(TINY.replace(vocab_size=vocab_size))
  params = random_params(model)
  samplers = [dg.Sampler(model, CONFIG.replace(vocab_chunk_size=s, vocab_budget_mib=budget_mib))
              for s in (None, chunk)]
  size = samplers[1].head.chunk_for(3 * TINY.canvas_length)
  assert (1 if size is None else -(-vocab_size // size)) == chunks
  outs = [s.generate(params, _prompts(0), _keys(1, 2, 3), 2 * TINY.canvas_length) for s in samplers]
  np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
  np.testing.assert_array_equal(outs[0].canvas_passes, outs[1].canvas_passes)

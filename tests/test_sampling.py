"""The sampler on a tiny random model and on hand-written logits.

Every generation test shares one compiled program (batch 3, prompt bucket 8, two canvases), so that the
file stays fast on two cores; the other rules and noises run end to end under the `slow` marker.
"""

import contextlib
import re
import dataclasses
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import diffusiongemma as dg
from diffusiongemma import diffusion
from diffusiongemma.build.config import load_config_file
from diffusiongemma.diffusion import acceptance, stopping
from diffusiongemma.sampling import autoregressive, sampler as sampler_lib, speculative, stats, steps
from diffusiongemma.sampling import vocab as vocab_lib
import notebooks

ROOT = pathlib.Path(__file__).parent.parent
TINY = dg.ModelConfig(
    vocab_size=61, hidden_size=32, num_layers=2, layer_types=("sliding", "full"), num_heads=2,
    num_kv_heads=1, head_dim=8, num_full_kv_heads=1, full_head_dim=8, sliding_window=4,
    intermediate_size=32, num_experts=2, top_k=1, moe_intermediate_size=16, canvas_length=8,
    max_positions=64)
STOP = (5, 11, 17, 23)  # frequent enough that some rows stop in the first canvas, others later
CONFIG = dg.SamplerConfig(max_denoising_steps=6, stop_tokens=STOP, prompt_bucket=8)
B, NEW = 3, 16


@pytest.fixture(scope="module")
def model():
  return dg.DiffusionGemma(TINY)


def random_params(model, seed=0):
  """Random weights from the parameter shapes alone (nothing compiled): N(0, 1/fan-in) matrices,
  norm scales and layer scalars near one."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens, tokens))["params"])
  rng = np.random.default_rng(seed)

  def draw(leaf):
    if leaf.ndim < 2:
      return jnp.asarray(1.0 + 0.1 * rng.standard_normal(leaf.shape), leaf.dtype)
    return jnp.asarray(rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-2]), leaf.dtype)

  return jax.tree.map(draw, shapes)


@pytest.fixture(scope="module")
def params(model):
  return random_params(model)


@pytest.fixture(scope="module")
def sampler(model):
  return dg.Sampler(model, CONFIG)


@pytest.fixture(scope="module")
def ar_sampler(model):
  return dg.ARSampler(model, stop_tokens=STOP, prompt_bucket=8)


def compiled_programs() -> int:
  """Programs compiled so far for every diffusion sampler (jit's cache of the generation program)."""
  return sampler_lib.compiled_programs()


def _stats(entropy=None, confidence=None):
  """TokenStats with the given [B, C] entropy / confidence (the other fields unused by the rules)."""
  like = entropy if entropy is not None else confidence
  zeros = jnp.zeros(jnp.shape(like), jnp.int32)
  return acceptance.TokenStats(entropy=jnp.asarray(entropy if entropy is not None else jnp.zeros_like(like)),
                               confidence=jnp.asarray(confidence if confidence is not None else
                                                      jnp.zeros_like(like)), argmax=zeros, sample=zeros)


def _prompts(seed, lengths=(5, 5, 5)):
  rng = np.random.default_rng(seed)
  return rng.integers(3, TINY.vocab_size, (len(lengths), max(lengths)))


def _keys(*seeds):
  return jnp.stack([jax.random.key(s) for s in seeds])


# ------------------------------------------------------------------------------------------ config
def test_config_defaults_are_the_released_ones():
  cfg = dg.SamplerConfig()
  assert (cfg.max_denoising_steps, cfg.t_max, cfg.t_min, cfg.entropy_bound, cfg.stability_threshold,
          cfg.confidence_threshold) == (48, 0.8, 0.4, 0.1, 1, 0.005)
  assert hash(cfg) == hash(dg.SamplerConfig()) and cfg == dg.SamplerConfig()
  assert hash(dg.SamplerConfig(stop_tokens=[1, 106])) == hash(dg.SamplerConfig(stop_tokens=(1, 106)))
  from_file = dg.build.sampler_config(load_config_file(ROOT / "configs" / "tiny.py"))
  assert from_file.stop_tokens == (1,) and from_file.max_denoising_steps == 48


@pytest.mark.parametrize("changes,message", [
    (dict(t_min=0.0), "t_min=0.0"),
    (dict(t_max=-1.0), "t_max=-1.0"),
    (dict(t_min=0.9, t_max=0.5), "at most t_max"),
    (dict(entropy_bound=0.0), "entropy_bound=0.0"),
    (dict(entropy_bound=-0.1), "positive"),
    (dict(max_denoising_steps=0), "max_denoising_steps=0"),
    (dict(stability_threshold=-1), "stability_threshold=-1"),
    (dict(confidence_threshold=0), "confidence_threshold=0"),
    (dict(t_max=float("nan")), "t_max=nan"),
    (dict(entropy_bound=float("inf")), "entropy_bound=inf"),
    (dict(stop_tokens=(-1,)), "stop_tokens"),
])
def test_bad_config_is_rejected_clearly(changes, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    dg.SamplerConfig(**changes)


def test_unknown_sampler_field_is_named():
  with pytest.raises(ValueError, match="entropy_bund"):
    dg.SamplerConfig.from_dict({"entropy_bund": 0.1})


def test_bad_input_is_rejected_clearly(model, params, sampler, ar_sampler):
  compiled = compiled_programs()
  key = jax.random.key(0)
  prompt = _prompts(0)
  cases = [
      (dict(prompt_tokens=np.zeros((3, 0), np.int32)), "Empty prompt"),
      (dict(prompt_tokens=prompt, prompt_lengths=[5, 0, 5]), "Empty prompt"),
      (dict(prompt_tokens=np.ones((1, 60), np.int32)), "too long"),
      (dict(prompt_tokens=prompt + TINY.vocab_size), "outside the vocabulary"),
      (dict(prompt_tokens=-prompt), "outside the vocabulary"),
      (dict(prompt_tokens=prompt, max_new_tokens=0), "max_new_tokens=0"),
      (dict(prompt_tokens=prompt, initial_canvas=np.zeros((3, 5), np.int32)), "canvas length 8"),
      (dict(prompt_tokens=prompt, initial_canvas=np.full((3, 8), 99)), "vocabulary"),
  ]
  for kwargs, message in cases:
    kwargs.setdefault("max_new_tokens", NEW)
    with pytest.raises(ValueError, match=message):
      sampler.generate(params, rng=key, **kwargs)
  with pytest.raises(ValueError, match="canvas_length=16 differs"):
    dg.Sampler(model, CONFIG.replace(canvas_length=16))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    dg.Sampler(model, CONFIG.replace(stop_tokens=(61,)))
  with pytest.raises(ValueError, match="masked noise draws from 60 tokens"):
    dg.Sampler(model, CONFIG, noise=diffusion.MaskedNoise(60))
  with pytest.raises(ValueError, match="mask_token_id=61 is outside"):
    diffusion.MaskedNoise(61, 61)
  with pytest.raises(ValueError, match="cache must be a KVCache of 3 rows"):
    sampler.generate(params, prompt, key, NEW, cache=dg.KVCache.empty(TINY, 2, 16))
  with pytest.raises(ValueError, match="temperature"):
    ar_sampler.generate(params, prompt, key, 4, temperature=-1.0)
  with pytest.raises(ValueError, match="top_p"):
    ar_sampler.generate(params, prompt, key, 4, top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    ar_sampler.generate(params, prompt, key, 0)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    dg.ARSampler(model, stop_tokens=(99,))
  assert compiled_programs() == compiled  # all of it is refused before anything is compiled


# ------------------------------------------------------------------------------------------ rules
def _rules(**changes):
  return dg.Sampler(dg.DiffusionGemma(TINY), CONFIG.replace(**changes)).rules


def test_default_components_are_the_released_rules_made_from_the_config():
  rules = _rules()
  assert rules.acceptance == acceptance.EntropyBound(0.1)
  assert rules.stopping == stopping.AllOf((stopping.ArgmaxStable(1), stopping.MeanEntropyBelow(0.005)))
  assert rules.noise == diffusion.UniformNoise(TINY.vocab_size)
  assert rules.schedule == diffusion.Linear(0.8, 0.4)
  sampler = dg.Sampler(dg.DiffusionGemma(TINY), CONFIG)
  margin = sampler.replace(acceptance=acceptance.Margin(0.5))
  assert margin.acceptance == acceptance.Margin(0.5) and margin.head.margin and not sampler.head.margin
  # Sampler.replace makes the components that came from the config again; a given one stays.
  looser = margin.replace(config=CONFIG.replace(entropy_bound=0.3, t_max=1.0))
  assert looser.acceptance == acceptance.Margin(0.5) and looser.schedule == diffusion.Linear(1.0, 0.4)
  assert sampler.replace(config=CONFIG.replace(entropy_bound=0.3)).acceptance == acceptance.EntropyBound(0.3)


def test_temperature_schedule_is_linear_in_the_remaining_steps():
  rules = _rules(max_denoising_steps=4, t_max=0.8, t_min=0.4)
  np.testing.assert_allclose(steps.temperature(rules, jnp.arange(4, 0, -1)), [0.8, 0.7, 0.6, 0.5], rtol=1e-6)


def test_entropy_bound_on_hand_written_entropies():
  ent = jnp.array([[0.30, 0.01, 0.05, 0.02, 0.50, 0.04]])
  all_ = jnp.ones_like(ent, bool)
  # Ascending 0.01, 0.02, 0.04, 0.05, 0.30: sums before each 0, .01, .03, .07, .12 -> four fit 0.1.
  np.testing.assert_array_equal(acceptance.EntropyBound(0.1)(_stats(ent), all_), [[0, 1, 1, 1, 0, 1]])
  for bound in (1e-9, 0.02, 0.1, 0.5, 10.0):
    acc = np.asarray(acceptance.EntropyBound(bound)(_stats(ent), all_))[0]
    chosen = np.sort(np.asarray(ent)[0][acc])
    assert acc.sum() >= 1 and chosen.sum() - chosen.max() <= bound + 1e-7
    rest = np.asarray(ent)[0][~acc]
    assert rest.size == 0 or rest.min() >= chosen.max()  # the lowest entropies are the ones taken
  # A large first entropy is still accepted alone: at least one token per step.
  np.testing.assert_array_equal(acceptance.EntropyBound(0.1)(_stats(jnp.array([[5.0, 7.0]])),
                                                             jnp.ones((1, 2), bool)), [[1, 0]])


def test_entropy_bound_ties_and_eligibility():
  ent = jnp.array([[0.2, 0.2, 0.2, 0.2]])
  all_ = jnp.ones_like(ent, bool)
  # Ties: 0 + .2 > .1 after the first, so exactly one is taken, the lowest index.
  np.testing.assert_array_equal(acceptance.EntropyBound(0.1)(_stats(ent), all_), [[1, 0, 0, 0]])
  np.testing.assert_array_equal(acceptance.EntropyBound(0.45)(_stats(ent), all_), [[1, 1, 1, 0]])
  eligible = jnp.array([[False, True, False, True]])
  zeros = _stats(jnp.zeros((1, 4)))
  np.testing.assert_array_equal(acceptance.EntropyBound(0.1)(zeros, eligible), eligible)
  np.testing.assert_array_equal(acceptance.EntropyBound(0.1)(zeros, jnp.zeros((1, 4), bool)), [[0, 0, 0, 0]])


def test_confidence_and_count_rules():
  conf = _stats(confidence=jnp.array([[0.95, 0.50, 0.91, 0.99], [0.3, 0.6, 0.6, 0.2]]))
  all_ = jnp.ones((2, 4), bool)
  np.testing.assert_array_equal(acceptance.Confidence(0.9)(conf, all_), [[1, 0, 1, 1], [0, 1, 0, 0]])
  no_last = all_.at[0, 3].set(False).at[1, 1].set(False)
  np.testing.assert_array_equal(acceptance.Confidence(0.97)(conf, no_last), [[1, 0, 0, 0], [0, 0, 1, 0]])
  np.testing.assert_array_equal(acceptance.TopCount(2)(conf, all_), [[1, 0, 0, 1], [0, 1, 1, 0]])
  np.testing.assert_array_equal(acceptance.TopCount(3)(conf, no_last), [[1, 1, 1, 0], [1, 0, 1, 1]])


def test_confident_prefix_rule():
  """Left to right: the first eligible position always, then each eligible one while it is confident
  (fixed positions in between are skipped over); nothing for a row with nothing eligible."""
  conf = _stats(confidence=jnp.array([[0.1, 0.9, 0.95, 0.3, 0.99], [0.9, 0.9, 0.9, 0.9, 0.9],
                                      [0.5, 0.9, 0.99, 0.2, 0.9], [0.9, 0.9, 0.9, 0.9, 0.9]]))
  eligible = jnp.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 0, 1, 1], [0, 0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(acceptance.ConfidentPrefix(0.8)(conf, eligible),
                                [[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(acceptance.ConfidentPrefix(0.92)(conf, eligible)[0], [1, 0, 0, 0, 0])


def test_margin_rule_on_hand_written_margins():
  """Margin accepts where top-1 minus top-2 probability reaches the threshold, else the single largest
  margin; a confident but torn position (0.5 / 0.45) waits where Confidence(0.4) would take it."""
  stats = _stats(confidence=jnp.array([[0.50, 0.97, 0.60, 0.30]]))
  stats = stats.replace(margin=jnp.array([[0.05, 0.95, 0.55, 0.10]]))
  all_ = jnp.ones((1, 4), bool)
  np.testing.assert_array_equal(acceptance.Margin(0.5)(stats, all_), [[0, 1, 1, 0]])
  np.testing.assert_array_equal(acceptance.Margin(0.99)(stats, all_), [[0, 1, 0, 0]])  # none: the best
  np.testing.assert_array_equal(acceptance.Margin(0.99)(stats, all_.at[0, 1].set(False)), [[0, 0, 1, 0]])
  np.testing.assert_array_equal(acceptance.Confidence(0.4)(stats, all_), [[1, 1, 1, 0]])
  with pytest.raises(ValueError, match="needs TokenStats.margin"):
    acceptance.Margin(0.5)(stats.replace(margin=None), all_)
  for bad in (0.0, 1.5, float("nan"), True):
    with pytest.raises(ValueError, match="Margin.threshold"):
      acceptance.Margin(bad)


@pytest.mark.parametrize("chunk", [None, 3, 5])
def test_streamed_margin_equals_the_whole_vocabulary(chunk):
  """The head's runner-up logit is tracked across chunks: the margin equals sorted-softmax top-1 minus
  top-2 (ties give 0), whatever the chunking."""
  rng = np.random.default_rng(4)
  table = jnp.asarray(rng.normal(size=(11, 6)), jnp.float32)
  hidden = jnp.asarray(rng.normal(size=(2, 5, 6)) * 3, jnp.float32)
  hidden = hidden.at[1, 0].set(0.0)  # all logits equal: margin 0
  head = vocab_lib.VocabHead(vocab_size=11, softcap=None, dtype="float32", chunk_size=chunk, margin=True)
  out = head(table, hidden, jnp.float32(0.7), jnp.zeros((2, 5)))
  probs = np.sort(np.asarray(jax.nn.softmax((hidden @ table.T) / 0.7, axis=-1)), -1)
  np.testing.assert_allclose(out.stats.margin, probs[..., -1] - probs[..., -2], atol=1e-6)
  assert float(out.stats.margin[1, 0]) == pytest.approx(0.0, abs=1e-7)
  assert vocab_lib.VocabHead(vocab_size=11, softcap=None, dtype="float32")(
      table, hidden, jnp.float32(0.7), jnp.zeros((2, 5))).stats.margin is None


def test_schedules_run_from_t_max_towards_t_min():
  n = jnp.arange(4, 0, -1)
  np.testing.assert_allclose(diffusion.Linear(0.8, 0.4)(n, 4), [0.8, 0.7, 0.6, 0.5], rtol=1e-6)
  cosine = np.asarray(diffusion.Cosine(1.0, 0.5)(n, 4))
  np.testing.assert_allclose(cosine, 0.5 + 0.25 * (1 - np.cos(np.pi * np.arange(4, 0, -1) / 4)), rtol=1e-6)
  assert cosine[0] == pytest.approx(1.0) and (np.diff(cosine) < 0).all()
  np.testing.assert_allclose(diffusion.Constant(0.6)(n, 4), 0.6)
  with pytest.raises(ValueError, match="t_min=0.9 is invalid: must be at most t_max=0.5"):
    diffusion.Cosine(0.5, 0.9)
  with pytest.raises(ValueError, match="Constant.temperature=-1"):
    diffusion.Constant(-1)


def test_on_pass_streams_every_pass_live_and_changes_nothing(params, sampler):
  """`generate(on_pass=fn)` hands fn each pass of each canvas, in order, equal to the returned trace; the
  tokens are those of the call without it; any callable shares one program; a listener's error surfaces."""
  prompts, keys = _prompts(9), _keys(4, 5, 6)
  plain = sampler.generate(params, prompts, keys, max_new_tokens=NEW, return_trace=True)
  events = []
  compiled = compiled_programs()
  streamed = sampler.generate(params, prompts, keys, max_new_tokens=NEW, return_trace=True,
                              on_pass=events.append)
  np.testing.assert_array_equal(streamed.tokens, plain.tokens)
  passes = np.asarray(plain.canvas_passes)
  expected = [(k, n) for k in range(passes.shape[1]) for n in range(passes[:, k].max())]
  assert [(e.canvas_index, e.step) for e in events] == expected
  for e in events:
    np.testing.assert_array_equal(e.argmax, np.asarray(plain.trace.argmax)[e.canvas_index, e.step])
    np.testing.assert_array_equal(e.accepted, np.asarray(plain.trace.accepted)[e.canvas_index, e.step])
    np.testing.assert_array_equal(e.active, e.step < passes[:, e.canvas_index])
  sampler.generate(params, prompts, keys, max_new_tokens=NEW, return_trace=True, on_pass=lambda e: None)
  assert compiled_programs() == compiled + 1  # one streaming program for both listeners
  with pytest.raises(ValueError, match="on_pass must be a callable"):
    sampler.generate(params, prompts, keys, max_new_tokens=NEW, on_pass="print")


def test_on_pass_events_reach_only_their_own_listener(params, sampler):
  """The compiled program sends each pass to the listener its call registered, by id: with another
  listener registered before the call and a third during it, only the call's own gets events (and all)."""
  prompts, keys = _prompts(9), _keys(4, 5, 6)
  plain = sampler.generate(params, prompts, keys, max_new_tokens=NEW)
  others, own = {"before": [], "during": []}, []
  registry = sampler_lib.LISTENERS
  with contextlib.ExitStack() as stack:
    stack.enter_context(registry.registered(others["before"].append))

    def listener(event):
      if not own:  # the call is running: register a newer listener
        stack.enter_context(registry.registered(others["during"].append))
      own.append(event)

    sampler.generate(params, prompts, keys, max_new_tokens=NEW, on_pass=listener)
  assert others == {"before": [], "during": []}
  assert len(own) == int(np.asarray(plain.canvas_passes).max(0).sum())


def test_token_stats_and_acceptance_from_logits():
  # Row of a near one-hot position, a uniform position and a two-way tie.
  logits = jnp.array([[[20.0, 0, 0, 0], [0, 0, 0, 0], [5.0, 5.0, -20, -20]]])
  token_stats = steps.token_stats(logits, jax.random.split(jax.random.key(0), 1))
  np.testing.assert_allclose(token_stats.entropy[0], [0.0, np.log(4), np.log(2)], atol=1e-5)
  np.testing.assert_allclose(token_stats.confidence[0], [1.0, 0.25, 0.5], atol=1e-5)
  np.testing.assert_array_equal(token_stats.argmax[0], [0, 0, 0])
  assert token_stats.sample[0, 0] == 0 and token_stats.sample[0, 2] in (0, 1)
  all_ = jnp.ones((1, 3), bool)
  # Ascending 0, log 2, log 4: the sums before each are 0, 0, log 2.
  np.testing.assert_array_equal(acceptance.EntropyBound(0.1)(token_stats, all_), [[1, 0, 1]])
  np.testing.assert_array_equal(acceptance.EntropyBound(0.7)(token_stats, all_), [[1, 1, 1]])
  np.testing.assert_array_equal(acceptance.TopCount(2)(token_stats, all_), [[1, 0, 1]])


def _step_stats(argmax, entropy):
  return acceptance.TokenStats(entropy=entropy, confidence=jnp.zeros_like(entropy), argmax=argmax,
                               sample=argmax)


def test_stopping_rules():
  rule = _rules().stopping  # stable for 1 step and mean entropy below 0.005
  state = rule.init(2, 3)
  argmax = jnp.array([[1, 2, 3], [4, 5, 6]])
  confident = jnp.zeros((2, 3))
  stop, state = rule(state, _step_stats(argmax, confident))
  assert not stop.any()  # never on the first step
  stop, state = rule(state, _step_stats(argmax.at[1, 0].set(0), confident.at[0].set(0.1)))
  np.testing.assert_array_equal(stop, [False, False])  # row 0 unconfident, row 1 changed
  stop, _ = rule(state, _step_stats(argmax.at[1, 0].set(0), confident))
  np.testing.assert_array_equal(stop, [True, True])
  two = _rules(stability_threshold=2).stopping
  state = two.init(2, 3)
  for expected in ([False] * 2, [False] * 2, [True] * 2):
    stop, state = two(state, _step_stats(argmax, confident))
    np.testing.assert_array_equal(stop, expected)
  never = stopping.NoEarlyStop()
  assert not never(never.init(2, 3), _step_stats(argmax, confident))[0].any()
  # stability 0: confidence alone decides; AnyOf stops when either rule does.
  zero = stopping.stable_and_confident(0, 0.005)
  np.testing.assert_array_equal(zero(zero.init(2, 3), _step_stats(argmax, confident.at[0].set(1.0)))[0],
                                [False, True])
  either = stopping.AnyOf((stopping.ArgmaxStable(1), stopping.MeanEntropyBelow(0.005)))
  np.testing.assert_array_equal(either(either.init(2, 3), _step_stats(argmax, confident.at[0].set(1.0)))[0],
                                [False, True])
  with pytest.raises(ValueError, match="at least one rule"):
    stopping.AllOf(())


# ------------------------------------------------------------------------------------------ generation
def test_one_program_no_retrace_and_outputs(params, sampler):
  out = sampler.generate(params, _prompts(0), _keys(1, 2, 3), max_new_tokens=NEW)
  compiled = compiled_programs()
  again = sampler.generate(params, _prompts(1, (3, 6, 8)), jax.random.key(7), max_new_tokens=NEW - 3,
                           prompt_lengths=[3, 6, 8])
  jax.block_until_ready(again)
  twin = dg.Sampler(dg.DiffusionGemma(TINY), dg.SamplerConfig(**vars(CONFIG)))  # equal, not the same
  np.testing.assert_array_equal(twin.generate(params, _prompts(0), _keys(1, 2, 3), NEW).tokens, out.tokens)
  # New prompts, lengths, keys and max_new_tokens in the same bucket, and an equal sampler: no new program.
  assert compiled_programs() == compiled
  assert out.tokens.shape == (B, NEW) and out.tokens.dtype == jnp.int32
  passes = np.asarray(out.canvas_passes)
  assert ((passes >= 0) & (passes <= CONFIG.max_denoising_steps)).all()
  np.testing.assert_array_equal(out.num_denoiser_passes, passes.sum(-1))
  valid = (np.asarray(out.tokens) != TINY.pad_id).sum(-1)
  np.testing.assert_allclose(out.tokens_per_forward, valid / passes.sum(-1), rtol=1e-6)


def test_stop_tokens_finish_rows(params, sampler):
  out = sampler.generate(params, _prompts(2), _keys(4, 5, 6), max_new_tokens=NEW)
  out2 = sampler.generate(params, _prompts(3), _keys(7, 8, 9), max_new_tokens=NEW)
  tokens = np.concatenate([out.tokens, out2.tokens])
  passes = np.concatenate([out.canvas_passes, out2.canvas_passes])
  c = TINY.canvas_length
  stopped_early = 0
  for row, row_passes in zip(tokens, passes):
    stops = np.flatnonzero(np.isin(row, STOP))
    if stops.size:
      first = stops[0]
      assert (row[first + 1:] == TINY.pad_id).all(), row
      if first < c:
        stopped_early += 1
        assert row_passes[1] == 0  # a finished row does not run (or count) its later canvases
    else:
      assert (row_passes > 0).all()
  assert stopped_early >= 1 and (~np.isin(tokens[:, :c], STOP).any(-1)).any()


def test_batch_independence(params, sampler):
  prompts = _prompts(4)
  a = sampler.generate(params, prompts, _keys(10, 11, 12), max_new_tokens=NEW)
  other = prompts.copy()
  other[1:] = _prompts(5)[1:]
  b = sampler.generate(params, other, _keys(10, 13, 14), max_new_tokens=NEW)
  perm = sampler.generate(params, prompts[[2, 0, 1]], _keys(12, 10, 11), max_new_tokens=NEW)
  np.testing.assert_array_equal(a.tokens[0], b.tokens[0])
  np.testing.assert_array_equal(a.num_denoiser_passes[0], b.num_denoiser_passes[0])
  np.testing.assert_array_equal(a.tokens, np.asarray(perm.tokens)[[1, 2, 0]])


def test_prompts_of_different_lengths_in_one_batch(params, sampler):
  lengths = [2, 5, 8]
  prompts = _prompts(6, lengths)
  keys = _keys(20, 21, 22)
  mixed = sampler.generate(params, prompts, keys, max_new_tokens=NEW, prompt_lengths=lengths)
  ragged = sampler.generate(params, [list(p[:n]) for p, n in zip(prompts, lengths)], keys, np.int64(NEW))
  np.testing.assert_array_equal(ragged.tokens, mixed.tokens)
  for i, n in enumerate(lengths):
    alone = sampler.generate(params, np.repeat(prompts[i:i + 1, :n], B, 0), jnp.stack([keys[i]] * B),
                             max_new_tokens=NEW)
    np.testing.assert_array_equal(mixed.tokens[i], alone.tokens[0])


def test_while_loop_equals_python_loop(model, params, sampler):
  prompts, keys = _prompts(7), _keys(30, 31, 32)
  out = sampler.generate(params, prompts, keys, max_new_tokens=NEW, return_trace=True)
  plain = sampler.generate(params, prompts, keys, max_new_tokens=NEW)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.canvas_passes, plain.canvas_passes)

  variables = {"params": params}
  prompt = jnp.asarray(np.pad(prompts, ((0, 0), (0, 3))), jnp.int32)  # the bucket of 8
  cache = dg.KVCache.empty(TINY, B, 8 + NEW)
  encode = jax.jit(lambda p, c: model.apply(variables, p, c, num_tokens=jnp.full((B,), 5),
                                            method=model.encode))
  _, cache = encode(prompt, cache)
  denoiser = sampler.denoiser(variables, cache)
  start, step_keys = sampler.start_canvas(keys, 0)
  state = steps.init_state(sampler.rules, start, jnp.zeros((B,), bool), TINY.hidden_size)
  step = jax.jit(lambda s: steps.denoise_step(sampler.rules, denoiser, s, step_keys))
  i = 0
  while bool(steps.should_continue(sampler.rules, state)):
    state = step(state)
    np.testing.assert_array_equal(state.argmax, out.trace.argmax[0, i])
    np.testing.assert_array_equal(state.canvas, out.trace.canvas[0, i])
    np.testing.assert_array_equal(state.accepted, out.trace.accepted[0, i])
    i += 1
  np.testing.assert_array_equal(state.passes, out.canvas_passes[:, 0])
  first = np.where(np.cumsum(np.isin(state.argmax, STOP), -1) - np.isin(state.argmax, STOP) > 0,
                   TINY.pad_id, state.argmax)
  np.testing.assert_array_equal(first, out.tokens[:, :TINY.canvas_length])
  accepted = np.asarray(out.trace.accepted).sum(-1)  # [K, N, B]
  assert (accepted[0, :i][np.asarray(out.canvas_passes[:, 0])[None] > np.arange(i)[:, None]] >= 1).all()


def test_fused_commit_is_the_same_generation(params, sampler):
  """`fuse_commit` encodes each committed canvas inside the next canvas's first pass: the same tokens,
  passes and steps, and the same cache after the call (every committed canvas but the last slot's, also
  when every row stops early), with prompts of different lengths."""
  prompts, keys = _prompts(9, lengths=(5, 3, 4)), _keys(50, 51, 52)
  fused = sampler.replace(config=sampler.config.replace(fuse_commit=True))
  for new in (NEW, 4 * TINY.canvas_length):  # the second outlives every row: the loop ends early
    kwargs = dict(prompt_lengths=np.array([5, 3, 4]), max_new_tokens=new, return_trace=True, return_cache=True)
    a, b = sampler.generate(params, prompts, keys, **kwargs), fused.generate(params, prompts, keys, **kwargs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.canvas_passes, b.canvas_passes)
    np.testing.assert_array_equal(a.trace.argmax, b.trace.argmax)
    np.testing.assert_array_equal(a.cache.length, b.cache.length)
    for x, y in zip(a.cache.keys + a.cache.values, b.cache.keys + b.cache.values):
      np.testing.assert_allclose(x, y, atol=1e-5)
  assert (np.asarray(a.canvas_passes) == 0).any()  # some row finished before the last canvas


def test_argmax_draw_takes_each_accepted_positions_argmax(params, sampler):
  """draw="argmax": every accepted token is its step's argmax (uniform noise: nothing is fixed, so the
  trace's argmax is the step's); the released draw samples other tokens of these flat distributions."""
  prompts, keys = _prompts(10), _keys(60, 61, 62)
  greedy = sampler.replace(config=sampler.config.replace(draw="argmax"))
  for s, same in ((greedy, True), (sampler, False)):
    out = s.generate(params, prompts, keys, max_new_tokens=NEW, return_trace=True)
    accepted = np.asarray(out.trace.accepted)
    canvas, argmax = np.asarray(out.trace.canvas), np.asarray(out.trace.argmax)
    assert accepted.any()
    assert (canvas[accepted] == argmax[accepted]).all() == same


def _masked_sampler(model, **changes):
  return dg.Sampler(model, CONFIG.replace(**changes), noise=diffusion.MaskedNoise(TINY.vocab_size),
                    acceptance=acceptance.TopCount(2))


def test_reuse_with_a_refresh_every_pass_is_exact_and_one_program(model, params):
  """reuse="settled" recomputing every slot at every pass (refresh 1) writes exactly what exact decoding
  writes, fused with the commit or not; without the refresh it is one program too, and reuses (other
  tokens on this random model)."""
  prompts, keys = _prompts(11, lengths=(5, 3, 4)), _keys(70, 71, 72)
  kwargs = dict(prompt_lengths=np.array([5, 3, 4]), max_new_tokens=NEW)
  exact = _masked_sampler(model).generate(params, prompts, keys, **kwargs)
  for fuse in (False, True):
    every = _masked_sampler(model, reuse="settled", reuse_refresh=1, fuse_commit=fuse, reuse_widths=2)
    out = every.generate(params, prompts, keys, **kwargs)
    np.testing.assert_array_equal(out.tokens, exact.tokens)
    np.testing.assert_array_equal(out.canvas_passes, exact.canvas_passes)
    np.testing.assert_array_equal(out.denoised_positions, exact.denoised_positions)
  np.testing.assert_array_equal(exact.denoised_positions, exact.num_denoiser_passes * TINY.canvas_length)
  before = compiled_programs()
  settled = _masked_sampler(model, reuse="settled")
  first = settled.generate(params, prompts, keys, **kwargs)
  settled.generate(params, _prompts(12, lengths=(5, 3, 4)), keys, **kwargs)
  assert compiled_programs() == before + 1
  assert (np.asarray(first.tokens) != np.asarray(exact.tokens)).any()


@pytest.mark.parametrize("delay, widths", [(1, 8), (2, 2)])
def test_reused_keys_and_values_are_those_of_the_pass_that_computed_them(model, params, delay, widths):
  """Step by step (a Python loop of `steps.denoise_step`): a reusing pass gives the slots it recomputes what
  a pass over those slots alone gives them (no padding, the other slots' stored keys and values), stores
  their fresh keys and values (at layer 0, those of a whole pass: they depend on the slot alone), leaves the
  other slots' as they were, and settles a slot once `reuse_delay` passes computed it while fixed."""
  sampler = _masked_sampler(model, reuse="settled", reuse_delay=delay, reuse_widths=widths)
  variables = {"params": params}
  prompt = jnp.asarray(_prompts(13), jnp.int32)
  cache = jax.jit(lambda p: model.apply(variables, p, dg.KVCache.empty(TINY, B, 8), method=model.encode)[1])(prompt)
  denoiser = sampler.denoiser(variables, cache)
  start, step_keys = sampler.start_canvas(_keys(80, 81, 82), 0)
  layers = [TINY.layer_dims(i) for i in range(TINY.num_layers)]
  state = steps.init_state(sampler.rules, start, jnp.zeros((B,), bool), TINY.hidden_size).replace(
      reuse=steps.Reuse.empty(layers, B, TINY.canvas_length, TINY.hidden_size, jnp.float32))
  step = jax.jit(lambda s: steps.denoise_step(sampler.rules, denoiser, s, step_keys))
  row0 = sampler.denoiser(variables, jax.tree.map(lambda x: x[:1], cache))
  alone = jax.jit(lambda s, slots: row0.subset(
      s.canvas[:1, slots], slots[None], s.sc_embedding[:1, slots], s.has_sc[:1], s.done[:1],
      tuple(k[:1] for k in s.reuse.keys), tuple(v[:1] for v in s.reuse.values)))
  every = jnp.broadcast_to(jnp.arange(TINY.canvas_length), state.canvas.shape)
  whole = jax.jit(lambda s: denoiser.subset(s.canvas, every, s.sc_embedding, s.has_sc, s.done, s.reuse.keys,
                                            s.reuse.values)[1][0])
  reused = recomputed_fixed = 0
  narrower = False
  while bool(steps.should_continue(sampler.rules, state)):
    settled = np.asarray(state.reuse.fixed_passes) >= delay
    computed = (~settled | (int(state.step) == 0)) & ~np.asarray(state.done)[:, None]
    after = step(state)
    if 0 < computed[0].sum() < TINY.canvas_length:  # row 0 reuses some slots at this pass
      slots = np.flatnonzero(computed[0])
      hidden, keys, _ = alone(state, jnp.asarray(slots))
      np.testing.assert_allclose(after.reuse.hidden[0, slots], hidden[0], atol=1e-5)
      for new, ref in zip(after.reuse.keys, keys):
        np.testing.assert_allclose(np.asarray(new)[0], np.asarray(ref)[0], atol=1e-5)
    np.testing.assert_allclose(np.asarray(after.reuse.keys[0])[computed], np.asarray(whole(state))[computed],
                               atol=1e-5)
    for new, old in zip(after.reuse.keys + after.reuse.values, state.reuse.keys + state.reuse.values):
      np.testing.assert_array_equal(np.asarray(new)[~computed], np.asarray(old)[~computed])
    np.testing.assert_array_equal(after.reuse.fixed_passes, np.asarray(state.reuse.fixed_passes)
                                  + (computed & np.asarray(state.fixed)))
    width = min(w for w in sampler.reuse_widths if w >= computed.sum(-1).max())  # the narrowest that holds all
    np.testing.assert_array_equal(after.positions, state.positions + np.where(state.done, 0, width))
    reused += int((~computed).sum())
    narrower |= width < TINY.canvas_length
    recomputed_fixed = max(recomputed_fixed, int(np.asarray(after.reuse.fixed_passes)[~np.asarray(after.done)].max(
        initial=0)))
    state = after
  assert reused > 0 and recomputed_fixed >= delay  # a slot was computed `delay` times while fixed
  assert narrower or delay == 2  # a pass computed fewer positions than the canvas (with 8 widths)


def test_reuse_settings_are_checked(model):
  assert _masked_sampler(model, reuse="settled").reuse_widths == (4, 5, 6, 7, 8)  # canvas 8 in 8 steps, >= 4
  assert _masked_sampler(model, reuse="settled", reuse_widths=2).reuse_widths == (4, 8)
  assert _masked_sampler(model, reuse="settled", reuse_widths=1).reuse_widths == (8,)
  for changes, message in ((dict(reuse="all"), "SamplerConfig.reuse='all' is invalid"),
                           (dict(reuse_refresh=-1), "SamplerConfig.reuse_refresh=-1 is invalid"),
                           (dict(reuse_widths=0), "SamplerConfig.reuse_widths=0 is invalid"),
                           (dict(reuse_delay=0), "SamplerConfig.reuse_delay=0 is invalid"),
                           (dict(draw="best"), "SamplerConfig.draw='best' is invalid"),
                           (dict(fuse_commit=1), "SamplerConfig.fuse_commit=1 is invalid")):
    with pytest.raises(ValueError, match=re.escape(message)):
      CONFIG.replace(**changes)


def test_initial_canvas_is_used(params, sampler):
  prompts, keys = _prompts(8), _keys(40, 41, 42)
  canvas = np.random.default_rng(0).integers(0, TINY.vocab_size, (B, TINY.canvas_length))
  a = sampler.generate(params, prompts, keys, max_new_tokens=NEW, initial_canvas=canvas)
  b = sampler.generate(params, prompts, keys, max_new_tokens=NEW, initial_canvas=canvas)
  c = sampler.generate(params, prompts, keys, max_new_tokens=NEW, initial_canvas=(canvas + 1) % 61)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()


# ------------------------------------------------------------------------------------------ AR
def test_sample_token():
  logits = jnp.array([1.0, 3.0, 2.9, -5.0])
  keys = jax.random.split(jax.random.key(0), 200)
  draw = jax.jit(jax.vmap(autoregressive.sample_token, in_axes=(0, None, None, None)))
  assert (draw(keys, logits, jnp.float32(0.0), jnp.float32(1.0)) == 1).all()  # greedy
  assert set(np.unique(draw(keys, logits, jnp.float32(1.0), jnp.float32(0.6)))) == {1, 2}  # .51 + .46
  assert (draw(keys, logits, jnp.float32(1.0), jnp.float32(1e-3)) == 1).all()
  assert len(np.unique(draw(keys, logits, jnp.float32(1.0), jnp.float32(1.0)))) >= 3


class _Drafter(dg.DiffusionGemma):
  """A denoiser whose drafts are known: AR greedy's tokens (the encoder run token by token from the cache)
  up to canvas position `wrong_from`, a wrong token there."""

  wrong_from: int = 99

  def denoise(self, canvas, cache=None, *args, **kwargs):
    tokens = [canvas[:, 0]]
    for i in range(1, canvas.shape[1]):
      logits, cache = self.encode(tokens[-1][:, None], cache)
      greedy = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
      tokens.append(greedy if i < self.wrong_from else (greedy + 1) % self.config.vocab_size)
    return 10.0 * jax.nn.one_hot(jnp.stack(tokens, 1), self.config.vocab_size)


@pytest.mark.parametrize("drafter,draft_length", [(None, None), (99, None), (3, None), (99, 3)],
                         ids=["random denoiser", "all right", "2 right", "all right, blocks of 3"])
def test_self_speculative_decoding_writes_ar_greedy(model, params, ar_sampler, drafter, draft_length):
  """Whatever the denoiser drafts, the text is AR greedy's; an iteration commits the next token and the
  drafts that agree with the encoder from the left (all 7, 2, or both of a 3-position draft), so its passes
  follow."""
  prompts, lengths = _prompts(21, lengths=(5, 3, 4)), np.array([5, 3, 4])
  want = ar_sampler.generate(params, prompts, jax.random.key(0), NEW, prompt_lengths=lengths, temperature=0.0)
  drafting = model if drafter is None else _Drafter(TINY, wrong_from=drafter)
  got = speculative.SelfSpeculativeSampler(drafting, mask_id=TINY.vocab_size - 1, stop_tokens=STOP,
                                          draft_length=draft_length).generate(params, prompts, NEW,
                                                                              prompt_lengths=lengths)
  for row, tokens in enumerate(np.asarray(want.tokens)):
    stops = np.flatnonzero(np.isin(tokens, STOP))
    n = stops[0] + 1 if stops.size else NEW  # new tokens up to and including the stop
    np.testing.assert_array_equal(np.asarray(got.tokens)[row, :n], tokens[:n])
    if drafter is not None:
      width = draft_length or TINY.canvas_length
      assert int(got.num_denoiser_passes[row]) == -(-n // min(drafter, width)), (row, n)
  if drafter == 3:  # streamed, ragged prompts padded to a bucket: the same tokens, one event per iteration,
    events = []     # each committing a left prefix
    streamed = speculative.SelfSpeculativeSampler(drafting, mask_id=TINY.vocab_size - 1, stop_tokens=STOP,
                                                  prompt_bucket=8).generate(
        params, [list(p[:n]) for p, n in zip(prompts, lengths)], NEW, on_pass=events.append)
    np.testing.assert_array_equal(streamed.tokens, got.tokens)
    assert [e.canvas_index for e in events] == list(range(len(events)))
    np.testing.assert_array_equal(sum(e.active.astype(int) for e in events), got.num_denoiser_passes)
    for e in events:
      np.testing.assert_array_equal(e.accepted[e.active].sum(1), 3)  # the known token and 2 right drafts
      np.testing.assert_array_equal(e.canvas[e.active, 0], np.asarray(got.tokens)[e.active, 3 * e.canvas_index])
  with pytest.raises(ValueError, match=r"mask_id=61 is invalid; expected a token id in \[0, 61\)"):
    speculative.SelfSpeculativeSampler(model, mask_id=61)
  with pytest.raises(ValueError, match=r"draft_length=1 is invalid; expected None \(the canvas\) or an int in "
                                       r"\[2, canvas_length=8\]"):
    speculative.SelfSpeculativeSampler(model, mask_id=0, draft_length=1)
  with pytest.raises(ValueError, match=r"prompt_bucket=0 is invalid; expected a positive int"):
    speculative.SelfSpeculativeSampler(model, mask_id=0, prompt_bucket=0)
  spec = speculative.SelfSpeculativeSampler(model, mask_id=TINY.vocab_size - 1)
  with pytest.raises(ValueError, match=r"Empty prompt: prompt_lengths=\[5, 0, 4\] has rows of length < 1"):
    spec.generate(params, prompts, NEW, prompt_lengths=[5, 0, 4])
  with pytest.raises(ValueError, match=r"5 prompt tokens \(cached included\) \+ 64 new positions exceed the "
                                       "model's max_positions=64"):
    spec.generate(params, prompts, 56)


def _chi_square_p(counts, probs) -> float:
  """The chi-square test's p-value of observed `counts` against `probs` (cells expected < 5 times merged)."""
  probs = np.ravel(probs) / np.sum(probs)  # float32 sums, to float64 rounding
  counts, expected = np.ravel(counts), probs * np.sum(counts)
  small = expected < 5
  assert counts[expected == 0].sum() == 0, "a token of probability 0 was drawn"
  counts = np.append(counts[~small], counts[small].sum())
  expected = np.append(expected[~small], expected[small].sum())
  return float(scipy_stats.chisquare(counts[expected > 0], expected[expected > 0]).pvalue)


def test_self_speculative_sampling_is_distributed_as_ar_sampling(model, params, sampler):
  """At a temperature (with a nucleus), speculative sampling's first three new tokens over 20000 seeded rows
  follow the encoder's exact AR distribution (enumerated: every 1- and 2-token continuation encoded): token 1,
  the pair (1, 2) and token 3 pass a chi-square test; the denoiser's drafts are rejected often enough that the
  acceptance ratio and the residual both shape them. Rows are independent of their batch."""
  temperature, top_p, n, prompt = 1.0, 0.95, 20000, np.array([3, 14, 15, 9, 26], np.int32)
  spec = speculative.SelfSpeculativeSampler(model, mask_id=TINY.vocab_size - 1, stop_tokens=(), draft_length=4,
                                            prompt_bucket=8, temperature=temperature, top_p=top_p)
  out = spec.generate(params, np.tile(prompt, (n, 1)), 3, rng=jax.random.key(7))
  tokens = np.asarray(out.tokens)
  encode = jax.jit(lambda t: autoregressive.nucleus_log_probs(
      model.apply({"params": params}, t, method=model.encode)[0][:, -1], temperature, top_p))
  v = TINY.vocab_size
  p1 = np.exp(encode(prompt[None]))[0].astype(np.float64)
  pairs = np.stack(np.meshgrid(np.arange(v), np.arange(v), indexing="ij"), -1).reshape(-1, 2)
  p2 = np.exp(encode(np.concatenate([np.tile(prompt, (v, 1)), np.arange(v)[:, None]], 1))).astype(np.float64)
  p3 = np.exp(encode(np.concatenate([np.tile(prompt, (v * v, 1)), pairs], 1))).astype(np.float64)
  joint = p1[:, None] * p2  # [x1, x2]
  third = (joint.reshape(-1, 1) * p3).sum(0)
  count = lambda index, size: np.bincount(index, minlength=size)
  for name, counts, probs in [("token 1", count(tokens[:, 0], v), p1),
                              ("tokens 1-2", count(tokens[:, 0] * v + tokens[:, 1], v * v), joint),
                              ("token 3", count(tokens[:, 2], v), third)]:
    assert _chi_square_p(counts, probs) > 1e-3, name
  passes = np.asarray(out.num_denoiser_passes)
  assert 1.2 < passes.mean() < 2.5, passes.mean()  # 3 tokens: some drafts accepted, some rejected
  keys = jax.random.split(jax.random.key(1), 3)
  both = spec.generate(params, np.tile(prompt, (3, 1)), 8, rng=keys)
  alone = spec.generate(params, prompt[None], 8, rng=keys[1:2])
  np.testing.assert_array_equal(both.tokens[1:2], alone.tokens)
  with pytest.raises(ValueError, match=r"temperature=1.0\) samples: generate needs rng="):
    spec.generate(params, prompt[None], 3)
  with pytest.raises(ValueError, match=r"temperature=-1 is invalid; expected a finite number >= 0"):
    speculative.SelfSpeculativeSampler(model, mask_id=0, temperature=-1)
  with pytest.raises(ValueError, match=r"top_p=0 is invalid; expected a number in \(0, 1\]"):
    speculative.SelfSpeculativeSampler(model, mask_id=0, temperature=1.0, top_p=0)
  with pytest.raises(ValueError, match="drafts with a masked-noise denoiser; this model samples with 'uniform'"):
    speculative.SelfSpeculativeSampler.of(sampler)


def test_autoregressive_greedy_is_the_encoders_argmax(model, params, ar_sampler):
  prompts = _prompts(9)
  out = ar_sampler.generate(params, prompts, jax.random.key(0), max_new_tokens=6)
  tokens = np.asarray(out.tokens)
  # Teacher forcing on prompt + output: causal, so the pad after a stop token changes nothing before it.
  logits, _ = jax.jit(lambda s: model.apply({"params": params}, s, method=model.encode))(
      jnp.asarray(np.concatenate([prompts, tokens], 1), jnp.int32))
  greedy = np.argmax(logits[:, prompts.shape[1] - 1:-1], -1)
  for row, t in enumerate(tokens):
    stops = np.flatnonzero(np.isin(t, STOP))
    n = stops[0] + 1 if stops.size else 6
    assert (t[n:] == TINY.pad_id).all() and out.num_forward_passes[row] == n
    np.testing.assert_array_equal(greedy[row, :n], t[:n])
  # Sampling: every token lies in the top-p nucleus of softmax(logits) given what came before it.
  sampled = np.asarray(ar_sampler.generate(params, prompts, jax.random.key(0), 6, temperature=1.0, top_p=0.5).tokens)
  logits, _ = jax.jit(lambda s: model.apply({"params": params}, s, method=model.encode))(
      jnp.asarray(np.concatenate([prompts, sampled], 1), jnp.int32))
  probs = np.asarray(jax.nn.softmax(logits[:, prompts.shape[1] - 1:-1].astype(jnp.float32), -1))  # [B, 6, V]
  before = np.sum(np.where(probs > np.take_along_axis(probs, sampled[..., None], -1), probs, 0), -1)  # [B, 6]
  for row, t in enumerate(sampled):
    stops = np.flatnonzero(np.isin(t, STOP))
    n = stops[0] + 1 if stops.size else 6
    assert (before[row, :n] < 0.5 + 1e-5).all(), before[row, :n]  # the mass ranked above it is < top_p
  assert (sampled != tokens).any()  # and it is a draw, not the greedy output


# ------------------------------------------------------------------------------------------ slow
@pytest.mark.slow
@pytest.mark.parametrize("components,masked", [
    (dict(acceptance=acceptance.Confidence(0.5)), False),
    (dict(acceptance=acceptance.TopCount(3), stopping=stopping.NoEarlyStop()), False),
    (dict(acceptance=acceptance.Margin(0.5), schedule=diffusion.Cosine(1.0, 0.5)), False),
    ({}, True),
])
def test_other_rules_end_to_end(model, params, components, masked):
  s = dg.Sampler(model, CONFIG, noise=diffusion.MaskedNoise(TINY.vocab_size) if masked else None, **components)
  out = s.generate(params, _prompts(10), _keys(1, 2, 3), max_new_tokens=8, return_trace=True)
  accepted = np.asarray(out.trace.accepted)[0].sum(-1)  # [N, B]
  passes = np.asarray(out.canvas_passes)[:, 0]
  for b in range(B):
    assert (accepted[:passes[b], b] >= 1).all()
  if s.stopping == stopping.NoEarlyStop():
    assert (passes == CONFIG.max_denoising_steps).all()
  if s.acceptance == acceptance.TopCount(3):
    assert (accepted[:, 0] == 3).all()
  if masked:
    mask = TINY.vocab_size - 1
    assert not (np.asarray(out.tokens) == mask).any()
    # Accepted tokens stay: the number of unmasked positions never drops.
    unmasked = (np.asarray(out.trace.canvas)[0] != mask).sum(-1)
    assert (np.diff(unmasked[: passes.min()], axis=0) >= 1).all()


def test_statistics_and_step_display(params, sampler):
  out = sampler.generate(params, _prompts(7), _keys(30, 31, 32), max_new_tokens=NEW, return_trace=True)
  lines = stats.format_steps(out, lambda ids: " ".join(map(str, ids)), row=1)
  assert len(lines) == int(out.num_denoiser_passes[1]) and lines[0].startswith("canvas 0 step  1 accepted")
  per_step = stats.accepted_per_step(out)
  assert per_step.shape == (2, CONFIG.max_denoising_steps) and np.nanmin(per_step) >= 1
  accepted, passes = np.asarray(out.trace.accepted).sum(-1), np.asarray(out.canvas_passes)  # [K, N, B], [B, K]
  for k, n in [(0, 0), (1, int(passes[:, 1].max()) - 1)]:  # the first step; the last step anyone ran
    running = n < passes[:, k]
    np.testing.assert_allclose(per_step[k, n], accepted[k, n][running].mean())
  assert np.isnan(per_step[0, passes[:, 0].max():]).all()  # no row ran: NaN
  summary = stats.summary(out.tokens, out.canvas_passes, TINY.pad_id, seconds=2.0)
  counts = (np.asarray(out.tokens) != TINY.pad_id).sum(-1)
  passes = np.asarray(out.num_denoiser_passes)
  assert summary["denoiser_passes"] == passes.sum() and summary["new_tokens"] == counts.sum()
  np.testing.assert_allclose(summary["pooled_tokens_per_forward"], counts.sum() / passes.sum())
  np.testing.assert_allclose(summary["mean_tokens_per_forward"], np.mean(out.tokens_per_forward), rtol=1e-6)
  np.testing.assert_allclose(summary["tokens_per_second"], counts.sum() / 2.0)
  ran = np.asarray(out.canvas_passes)[np.asarray(out.canvas_passes) > 0]
  np.testing.assert_allclose(summary["steps_per_canvas"], ran.mean())
  row = np.asarray(out.tokens)[0]
  new = stats.new_tokens(row, STOP, TINY.pad_id)
  assert len(new) == counts[0] and (not np.isin(row, STOP).any() or new[-1] in STOP)
  tokens, lengths = dg.sampling.prompts.pad([[5, 6, 7], [8]], 0)
  np.testing.assert_array_equal(tokens, [[5, 6, 7], [8, 0, 0]])
  np.testing.assert_array_equal(lengths, [3, 1])


@dataclasses.dataclass(frozen=True)
class AcceptAll:
  """A rule that is in no registry: every eligible position."""

  needs_margin = False

  def __call__(self, token_stats, eligible):
    return eligible


def test_rule_objects_plug_in_and_masked_noise_stops_when_nothing_is_left(model, params):
  masked = dg.Sampler(model, CONFIG, noise=diffusion.MaskedNoise(TINY.vocab_size), acceptance=AcceptAll())
  out = masked.generate(params, _prompts(11), _keys(1, 2, 3), max_new_tokens=TINY.canvas_length)
  np.testing.assert_array_equal(out.canvas_passes, 1)  # all unmasked at once: nothing left to change
  assert not (np.asarray(out.tokens) == TINY.vocab_size - 1).any()  # the mask token is never sampled
  assert masked != dg.Sampler(model, CONFIG, noise=diffusion.MaskedNoise(TINY.vocab_size))


def test_a_cache_continues_a_prompt(params, model):
  """generate(B, cache=cache after A) equals generate(A + first committed canvas + B) from scratch: the
  returned cache holds the prompt and every committed canvas but the last, and only B is encoded."""
  free = dg.Sampler(model, CONFIG.replace(stop_tokens=()))
  first = free.generate(params, _prompts(12), _keys(1, 2, 3), 2 * TINY.canvas_length, return_cache=True)
  np.testing.assert_array_equal(first.cache.length, 5 + TINY.canvas_length)
  follow = _prompts(13, (2, 2, 2))
  keys = _keys(4, 5, 6)
  cont = free.generate(params, follow, keys, NEW, cache=first.cache, return_cache=True)
  full = np.concatenate([_prompts(12), np.asarray(first.tokens)[:, :TINY.canvas_length], follow], 1)
  scratch = free.generate(params, full, keys, NEW)
  np.testing.assert_array_equal(cont.tokens, scratch.tokens)
  np.testing.assert_array_equal(cont.cache.length, full.shape[1] + TINY.canvas_length)


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
  """colabs/quickstart.ipynb end to end: train the tiny model briefly, sample, show steps, plot."""
  text = notebooks.run_notebook("quickstart.ipynb", {
      "DG_QUICKSTART_WORKDIR": str(tmp_path), "DG_QUICKSTART_STEPS": "20",
      "DG_QUICKSTART_NOISE": "masked"})  # the notebook samples with the noise it trained
  assert "trained to step 20" in text and "canvas 0 step  1 accepted" in text and "autoregressive:" in text
  assert "noise masked" in text


@pytest.mark.slow
def test_sample_script_runs(tmp_path):
  """scripts/sample.py on a random tiny model: text, --show_steps lines, statistics, the AR baseline."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("def main(\nimport os\\nimport sys\n")
  result = subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "sample.py"), "--config", str(ROOT / "configs" / "tiny.py"),
       "--workdir", str(tmp_path / "work"), "--random_init", "--prompt", "class A:", "--prompt_file",
       str(prompts), "--batch_size", "2", "--max_new_tokens", "20", "--show_steps", "--autoregressive",
       "--config.sampler.max_denoising_steps=4"],
      capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert out.count("--- [") == 3 and "canvas 1 step  1 accepted" in out
  assert out.count("diffusion: rows") == 2 and "pooled_tokens_per_forward" in out and "compile" in out
  assert "noise uniform" in out  # every setting the sampler runs with is printed
  assert "autoregressive (greedy)" in out

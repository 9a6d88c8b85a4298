"""Constrained sampling (regex, JSON schema) and infilling in the compiled sampler, on tiny random models.

The regex tests share one program per noise (batch 3, two canvases of 8, the shapes of test_sampling.py).
"""

import dataclasses
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffusiongemma as dg
from diffusiongemma import diffusion
from diffusiongemma.diffusion import acceptance
from diffusiongemma.diffusion import constraints as cons
from diffusiongemma.diffusion import schedules
from diffusiongemma.diffusion import stopping
from diffusiongemma.sampling import constrained
from diffusiongemma.sampling import stats
from diffusiongemma.sampling import steps
from diffusiongemma.sampling import vocab as vocab_lib
from test_constraints import _brute_force
from test_sampling import CONFIG, NEW, TINY, _prompts, compiled_programs, random_params

VOCAB = {i: ch for i, ch in zip(range(30, 61), '0123456789abcdefghij-., :;{}[]"')}
REGEX = r"[a-c]{2,5}-[0-9]{1,4}(\.[0-9]+)?"
NOISES = {"uniform": diffusion.UniformNoise(TINY.vocab_size),
          "masked": diffusion.MaskedNoise(TINY.vocab_size)}


@pytest.fixture(scope="module")
def model():
  return dg.DiffusionGemma(TINY)


@pytest.fixture(scope="module")
def params(model):
  return random_params(model)


@pytest.fixture(scope="module", params=sorted(NOISES))
def sampler(request, model):
  return dg.Sampler(model, CONFIG, noise=NOISES[request.param])


@pytest.fixture(scope="module")
def regex_constraint(sampler):
  return constrained.Constraint.regex(REGEX, VOCAB, sampler)


def _text(row, sampler) -> str:
  ids = stats.new_tokens(row, sampler.stop_tokens, TINY.pad_id)
  return "".join(VOCAB.get(int(t), "?") for t in ids if t not in sampler.stop_tokens)


def _check_trace(out, constraint, sampler) -> None:
  """Every step's argmax canvas continues the committed text within the language and can still finish
  in the positions left; what masked noise holds is always jointly completable."""
  a, c = constraint.automaton, TINY.canvas_length
  tokens, passes = np.asarray(out.tokens), np.asarray(out.canvas_passes)
  trace = jax.tree.map(np.asarray, out.trace)
  k_total = tokens.shape[1] // c
  for row in range(tokens.shape[0]):
    for k in range(k_total):
      prefix = tokens[row, :k * c].tolist()
      after = (k_total - 1 - k) * c
      for n in range(passes[row, k]):
        state = a.advance(prefix + trace.argmax[k, n, row].tolist())
        assert state != a.dead and a.distance[state] <= after, (row, k, n)
        if sampler.noise.name == "masked":
          held = trace.canvas[k, n, row] != sampler.noise.never_token
          constrained.check_given_fits(constraint, np.asarray([prefix + trace.canvas[k, n, row].tolist()]),
                                       np.asarray([[True] * len(prefix) + held.tolist()]), after)


def test_every_output_matches_the_regex_and_unconstrained_output_does_not(params, sampler, regex_constraint):
  rows = free = 0
  for seed in range(6):
    prompts = _prompts(seed)
    out = sampler.generate(params, prompts, jax.random.key(seed), NEW, constraint=regex_constraint,
                           return_trace=seed < 2)
    for row in np.asarray(out.tokens):
      assert re.fullmatch(REGEX, _text(row, sampler)), _text(row, sampler)
      assert regex_constraint.automaton.accepts(row)
      rows += 1
    if seed < 2:
      _check_trace(out, regex_constraint, sampler)
    plain = sampler.generate(params, prompts, jax.random.key(seed), NEW)
    free += sum(bool(re.fullmatch(REGEX, _text(row, sampler))) for row in np.asarray(plain.tokens))
  assert rows == 18 and free == 0


def test_reusing_settled_positions_keeps_constraints_and_held_tokens(params, sampler, regex_constraint):
  """`reuse="settled"` (masked noise) under a regex constraint and with held (given) positions: every output
  still matches and the held tokens stay; uniform noise refuses the option by name."""
  if sampler.noise.name != "masked":
    with pytest.raises(ValueError, match="SamplerConfig.reuse='settled' needs a noise process"):
      dg.Sampler(sampler.model, dataclasses.replace(CONFIG, reuse="settled"), noise=sampler.noise)
    return
  reuse = sampler.replace(config=dataclasses.replace(CONFIG, reuse="settled"))
  out = reuse.generate(params, _prompts(3), jax.random.key(3), NEW, constraint=regex_constraint)
  for row in np.asarray(out.tokens):
    assert re.fullmatch(REGEX, _text(row, reuse)), _text(row, reuse)
  canvas = np.full((3, TINY.canvas_length), 40, np.int32)
  given = np.zeros(canvas.shape, bool)
  given[:, [1, 4]] = True
  held = reuse.generate(params, _prompts(4), jax.random.key(4), NEW, initial_canvas=canvas, given=given)
  assert (np.asarray(held.tokens)[:, :TINY.canvas_length][given] == 40).all()


def test_no_constraint_is_the_plain_program(params, sampler, regex_constraint):
  lowered = []
  original = dg.sampling.sampler._program  # pylint: disable=protected-access

  def spy(*args, **kwargs):
    lowered.append(original.lower(*args, **kwargs).as_text())
    return original(*args, **kwargs)

  prompts, key = _prompts(9), jax.random.key(9)
  before = sampler.generate(params, prompts, key, NEW)
  sampler.generate(params, prompts, key, NEW, constraint=regex_constraint)
  try:
    dg.sampling.sampler._program = spy  # pylint: disable=protected-access
    after = sampler.generate(params, prompts, key, NEW)
    explicit = sampler.generate(params, prompts, key, NEW, constraint=None, given=None)
  finally:
    dg.sampling.sampler._program = original  # pylint: disable=protected-access
  np.testing.assert_array_equal(before.tokens, after.tokens)
  np.testing.assert_array_equal(before.tokens, explicit.tokens)
  assert lowered[0] == lowered[1] and "segment" not in lowered[0]  # no dynamic program in it


@pytest.mark.parametrize("noise", sorted(NOISES))
def test_the_step_commits_the_brute_force_best_canvas(noise):
  """One denoising step with the constraint, on hand-made hidden states: its argmax canvas is the best
  accepted canvas under the step's log-probabilities with the held positions (`test_constraints`'s brute
  force); masked noise holds the draws, which stay completable."""
  v, c, d, b = 7, 4, 8, 4
  automaton = cons.from_regex("(ab|c)+", {2: "a", 3: "b", 4: "ab", 5: "c"}, v, stop_tokens=[1], pad_id=0,
                              disallowed_tokens=[6])
  tables = cons.AutomatonTables.from_automaton(automaton)
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
  hidden = jnp.asarray(rng.normal(size=(b, c, d)) * 2, jnp.float32)
  noise_process = diffusion.UniformNoise(v) if noise == "uniform" else diffusion.MaskedNoise(v, 6)
  rules = steps.Rules(max_denoising_steps=3, schedule=diffusion.Linear(1.0, 0.5), noise=noise_process,
                      acceptance=acceptance.EntropyBound(0.5), stopping=stopping.NoEarlyStop())
  head = vocab_lib.VocabHead(vocab_size=v, softcap=None, dtype="float32",
                             never_token=noise_process.never_token, chunk_size=3)
  start = jnp.full((b,), automaton.start, jnp.int32)
  after = jnp.asarray(2)  # two positions follow this canvas
  denoiser = steps.Denoiser(lambda *args: hidden, head, table,
                            constraint=constrained.CanvasConstraint.for_canvas(tables, start, after))
  keys = jax.random.split(jax.random.key(1), b)
  state = steps.init_state(rules, noise_process.initial_canvas(keys, c), jnp.zeros((b,), bool), d)
  step = jax.jit(lambda s: steps.denoise_step(rules, denoiser, s, keys))
  end_ok = np.asarray(cons.end_mask(tables, jnp.full((b,), 2)))
  for _ in range(3):
    state = step(state)
    temp = steps.temperature(rules, rules.max_denoising_steps - state.step + 1)
    scores = np.asarray(head.scaled_logits(table, hidden, 0, temp))
    fixed, canvas = np.asarray(state.fixed), np.asarray(state.canvas)
    best, _ = _brute_force(automaton, scores, np.asarray(start), end_ok, fixed, canvas)
    for row in range(b):
      assert best[row][1] is not None
      assert tuple(np.asarray(state.argmax[row]).tolist()) == best[row][1], (row, best[row])
  if noise == "masked":
    assert np.asarray(state.fixed).any()


@pytest.mark.parametrize("noise", sorted(NOISES))
def test_each_step_keeps_statistics_draws_and_acceptance_inside_the_allowed_set(noise):
  """At every constrained step: the entropies and the self-conditioning embedding are those of the tempered
  distribution restricted to the tokens some accepted canvas through the held positions uses there (the
  brute-force set), and the argmax, every draw the head reports and every accepted token lie in that
  set. The Viterbi commit and repair would keep outputs valid without the restriction: this catches it."""
  v, c, d, b = 10, 4, 8, 4
  never = 9 if noise == "masked" else None
  automaton = cons.from_regex("(ab|c)+d?", {2: "a", 3: "b", 4: "ab", 5: "c", 6: "d", 7: "e", 8: "ba"}, v,
                              stop_tokens=[1], pad_id=0, disallowed_tokens=[] if never is None else [never])
  tables = cons.AutomatonTables.from_automaton(automaton, padded=True)
  rng = np.random.default_rng(3)
  table = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
  hidden = jnp.asarray(rng.normal(size=(b, c, d)), jnp.float32)
  noise_process = diffusion.UniformNoise(v) if never is None else diffusion.MaskedNoise(v, never)
  rules = steps.Rules(max_denoising_steps=4, schedule=schedules.Linear(3.0, 1.5), noise=noise_process,
                      acceptance=acceptance.EntropyBound(1.0), stopping=stopping.NoEarlyStop())
  seen = []

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class RecordingHead(vocab_lib.VocabHead):  # the step's statistics, as the head computed them
    def __call__(self, *args, **kwargs):
      out = super().__call__(*args, **kwargs)
      jax.debug.callback(seen.append, out.stats)
      return out

  head = RecordingHead(vocab_size=v, softcap=None, dtype="float32", never_token=never)
  start = jnp.full((b,), automaton.start, jnp.int32)
  denoiser = steps.Denoiser(lambda *args: hidden, head, table,
                            constraint=constrained.CanvasConstraint.for_canvas(tables, start, jnp.asarray(1)))
  keys = jax.random.split(jax.random.key(7), b)
  state = steps.init_state(rules, noise_process.initial_canvas(keys, c), jnp.zeros((b,), bool), d)
  end_ok = np.asarray(cons.end_mask(tables, jnp.full((b,), 1)))[:, :automaton.num_states]
  step = jax.jit(lambda s: steps.denoise_step(rules, denoiser, s, keys))
  outside = 0
  for _ in range(rules.max_denoising_steps):
    before = state
    state = step(before)
    jax.effects_barrier()  # the callback has run
    assert len(seen) == int(state.step)
    stats = jax.tree.map(np.asarray, seen[-1])
    temp = steps.temperature(rules, rules.max_denoising_steps - before.step)
    scores = np.asarray(head.scaled_logits(table, hidden, 0, temp))  # [B, C, V], unrestricted
    _, allowed = _brute_force(automaton, scores, np.asarray(start), end_ok, np.asarray(before.fixed),
                              np.asarray(before.canvas))
    restricted = np.where(allowed, scores, -np.inf)
    probs = np.exp(restricted - restricted.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    entropy = -np.sum(np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1)), 0), axis=-1)
    np.testing.assert_allclose(stats.entropy, entropy, atol=1e-4)
    live = ~np.asarray(before.done)  # rows done earlier keep their embedding
    want = probs @ np.asarray(table) * np.sqrt(d)
    np.testing.assert_allclose(np.asarray(state.sc_embedding)[live], want[live], atol=1e-4)
    pick = lambda tokens: np.take_along_axis(allowed, np.asarray(tokens)[..., None], -1)[..., 0]
    assert pick(stats.argmax).all()
    drawn = stats.sample >= 0
    assert pick(np.where(drawn, stats.sample, stats.argmax)).all() and drawn.any()
    accepted = np.asarray(state.accepted)
    assert accepted.any() and pick(np.asarray(state.canvas))[accepted].all()
    outside += int((~allowed).sum())
  assert outside > 0  # the restriction had something to remove


@pytest.fixture(scope="module")
def json_setup(tmp_path_factory):
  from test_constraints import _CORPUS  # pylint: disable=import-outside-toplevel
  tokenizer = dg.data.Tokenizer.train(_CORPUS, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=320)
  model = dg.DiffusionGemma(TINY.replace(vocab_size=330, canvas_length=16, max_positions=128))
  sampler = dg.Sampler(model, dg.SamplerConfig(max_denoising_steps=6, stop_tokens=(1,), prompt_bucket=8))
  return tokenizer, model, random_params(model, 1), sampler


def test_every_output_validates_against_the_json_schema(json_setup):
  jsonschema = pytest.importorskip("jsonschema")
  from test_constraints import SCHEMA  # pylint: disable=import-outside-toplevel
  tokenizer, _, params, sampler = json_setup
  constraint = constrained.Constraint.json_schema(SCHEMA, tokenizer, sampler)
  valid = 0
  for seed in range(3):
    prompts = np.random.default_rng(seed).integers(3, 320, (4, 6))
    for c in (constraint, None):
      out = sampler.generate(params, prompts, jax.random.key(seed), 48, constraint=c)
      for row in np.asarray(out.tokens):
        ids = stats.new_tokens(row, sampler.stop_tokens, 0)
        ids = [t for t in ids if t != 1]
        text = repr(ids)
        try:  # ids past the tokenizer's 320 (the model has 330) make it raise too
          text = tokenizer.decode(ids)
          jsonschema.validate(json.loads(text), SCHEMA)
          ok = True
        except (ValueError, IndexError, jsonschema.ValidationError):
          ok = False
        if c is not None:
          assert ok, text
        valid += ok
  assert valid == 12  # the constrained rows only


# ---------------------------------------------------------------------------------------- infilling
def test_infilling_holds_the_given_positions_in_every_step(params, sampler):
  b, c = 3, TINY.canvas_length
  rng = np.random.default_rng(4)
  initial = rng.integers(24, TINY.vocab_size - 1, (b, 2 * c)).astype(np.int32)  # no stop token given
  given = rng.random((b, 2 * c)) < 0.5
  given[:, c:] = False  # the second canvas is free
  out = sampler.generate(params, _prompts(4), jax.random.key(4), NEW, initial_canvas=initial[:, :c],
                         given=given[:, :c], return_trace=True)
  trace = jax.tree.map(np.asarray, out.trace)
  passes, tokens = np.asarray(out.canvas_passes), np.asarray(out.tokens)
  for row in range(b):
    mask = given[row, :c]
    assert passes[row, 0] > 0
    for n in range(passes[row, 0]):
      np.testing.assert_array_equal(trace.canvas[0, n, row][mask], initial[row, :c][mask])
      np.testing.assert_array_equal(trace.argmax[0, n, row][mask], initial[row, :c][mask])
      assert not trace.accepted[0, n, row][mask].any()
    stop = np.flatnonzero(np.isin(tokens[row], sampler.stop_tokens))
    end = stop[0] if stop.size else c
    end = min(end, c)
    np.testing.assert_array_equal(tokens[row, :end][mask[:end]], initial[row, :end][mask[:end]])
  new = stats.new_token_counts(tokens, TINY.pad_id, given[:, :c])
  np.testing.assert_allclose(out.tokens_per_forward, new / np.maximum(passes.sum(-1), 1), rtol=1e-6)
  assert (new < stats.new_token_counts(tokens, TINY.pad_id)).all()


def test_infilling_with_a_constraint(params, sampler, regex_constraint):
  c = TINY.canvas_length
  ids = {ch: i for i, ch in VOCAB.items()}
  initial = np.zeros((3, c), np.int32)
  given = np.zeros((3, c), bool)
  initial[:, :3] = [ids["a"], ids["b"], ids["-"]]
  given[:, :3] = True
  out = sampler.generate(params, _prompts(5), jax.random.key(5), NEW, initial_canvas=initial, given=given,
                         constraint=regex_constraint)
  for row in np.asarray(out.tokens):
    text = _text(row, sampler)
    assert text.startswith("ab-") and re.fullmatch(REGEX, text), text


def _completable(automaton, state: int, tokens, held) -> bool:
  """Whether some output continues from `state` through `tokens` (held where `held`, free elsewhere) into
  acceptance: a forward walk over state sets, independent of the dynamic programs under test."""
  states = {state} - {automaton.dead}
  live = automaton.transitions != automaton.dead
  for token, is_held in zip(tokens, held):
    if is_held:
      nxt = {int(automaton.transitions[s, automaton.token_class[token]]) for s in states}
    else:
      nxt = {int(t) for s in states for t in automaton.transitions[s][live[s]]}
    states = nxt - {automaton.dead}
  return any(automaton.accepting[s] for s in states)


@pytest.mark.parametrize("regex,held_at,held_text", [
    (r"(?:[a-j]+|[0-9]+)-", (1, 0), "7-"),  # issue 27: the first canvas must end in digits
    (r"[a-c]{1,16}(?:-[0-9]{2})?", (2, 1), "9"),  # held in the third canvas: 15 or 16 letters must come first
])
def test_held_text_in_later_canvases_is_respected(params, sampler, regex, held_at, held_text):
  """Given tokens in a later canvas: every canvas ends in a state from which the held text and the rest
  can still be completed (checked at every step against a forward walk), so every output matches."""
  c, canvases = TINY.canvas_length, 3
  ids = {ch: i for i, ch in VOCAB.items()}
  constraint = constrained.Constraint.regex(regex, VOCAB, sampler)
  a = constraint.automaton
  initial = np.zeros((3, canvases * c), np.int32)
  given = np.zeros((3, canvases * c), bool)
  at = held_at[0] * c + held_at[1]
  initial[:, at:at + len(held_text)] = [ids[ch] for ch in held_text]
  given[:, at:at + len(held_text)] = True
  for seed in range(2):
    out = sampler.generate(params, _prompts(seed), jax.random.key(seed), canvases * c, initial_canvas=initial,
                           given=given, constraint=constraint, return_trace=True)
    tokens, passes = np.asarray(out.tokens), np.asarray(out.canvas_passes)
    argmax = np.asarray(out.trace.argmax)  # [K, N, B, C]
    for row in range(3):
      text = _text(tokens[row], sampler)
      assert re.fullmatch(regex, text), text
      assert tokens[row, at:at + len(held_text)].tolist() == [ids[ch] for ch in held_text], text
      for k in range(canvases):
        for n in range(passes[row, k]):
          state = a.advance(tokens[row, :k * c].tolist() + argmax[k, n, row].tolist())
          end = (k + 1) * c
          assert _completable(a, state, initial[row, end:], given[row, end:]), (seed, row, k, n)


def test_constraints_of_similar_size_share_a_program(sampler):
  """Equality is "same compiled program": small automata pad to one size; `one_program` pads a set to one."""
  small = [constrained.Constraint.regex(r, VOCAB, sampler) for r in ("a+", "[0-9]{2}-b", REGEX)]
  assert len(set(small)) == 1 and small[0].automaton is not small[1].automaton
  big = constrained.Constraint.regex("(?:[a-j0-9]{3}-){20}", VOCAB, sampler)
  assert big.automaton.num_states > 64 and big != small[0]
  shared = constrained.one_program(small + [big])
  assert len(set(shared)) == 1 and shared[0].tables.sizes == big.tables.sizes
  assert [s.automaton for s in shared] == [c.automaton for c in small + [big]]


# ---------------------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_before_compiling(params, sampler, regex_constraint, model):
  with pytest.raises(ValueError, match="unsatisfiable"):
    constrained.Constraint.regex(r"a[^\s\S]", VOCAB, sampler)
  with pytest.raises(ValueError, match="JSON schema at #/type: must be one of"):
    constrained.Constraint.json_schema({"type": "foo"}, VOCAB, sampler)
  with pytest.raises(ValueError, match=r"JSON schema at #/properties/n/multipleOf: 'multipleOf' is not supported"):
    constrained.Constraint.json_schema({"properties": {"n": {"type": "integer", "multipleOf": 2}}}, VOCAB, sampler)
  with pytest.raises(ValueError, match=r"Invalid regex '\[a-': unterminated character set at position 0"):
    constrained.Constraint.regex("[a-", VOCAB, sampler)
  compiled = compiled_programs()
  prompts, key = _prompts(0), jax.random.key(0)
  long = constrained.Constraint.regex("[a-c]{20}", VOCAB, sampler)
  with pytest.raises(ValueError, match="needs at least 20 tokens but only 16.*raise max_new_tokens"):
    sampler.generate(params, prompts, key, NEW, constraint=long)
  canvas = np.full((3, 8), 30, np.int32)  # "0"
  with pytest.raises(ValueError, match=r"given must be a bool mask of initial_canvas's shape \(3, 8\)"):
    sampler.generate(params, prompts, key, NEW, initial_canvas=canvas, given=np.ones((3, 7), bool))
  with pytest.raises(ValueError, match="given must be a bool mask"):
    sampler.generate(params, prompts, key, NEW, initial_canvas=canvas, given=np.ones((3, 8), np.int32))
  with pytest.raises(ValueError, match="needs the initial_canvas"):
    sampler.generate(params, prompts, key, NEW, given=np.ones((3, 8), bool))
  with pytest.raises(ValueError, match="leave no output the constraint accepts"):
    sampler.generate(params, prompts, key, NEW, initial_canvas=canvas, given=np.eye(3, 8, dtype=bool),
                     constraint=regex_constraint)  # "0" where a letter must come
  other = dg.Sampler(model, CONFIG.replace(stop_tokens=(5,)), noise=sampler.noise)
  with pytest.raises(ValueError, match="stop tokens .* that the sampler does not stop at"):
    other.generate(params, prompts, key, NEW, constraint=regex_constraint)
  with pytest.raises(ValueError, match="constraint must be a sampling.constrained.Constraint"):
    sampler.generate(params, prompts, key, NEW, constraint=REGEX)
  assert compiled_programs() == compiled


# ---------------------------------------------------------------------------------------- Sudoku
@pytest.mark.slow
def test_sudoku_infilling_keeps_the_given_cells():
  """The shipped Sudoku model (projects/sudoku/weights) fills a solution canvas of which half the blanks
  of a hard (30-clue) puzzle are given; given cells stay in every pass, and most fills solve the puzzle."""
  from diffusiongemma import build  # pylint: disable=import-outside-toplevel
  from projects.sudoku import data as sudoku  # pylint: disable=import-outside-toplevel
  from projects.sudoku import weights as shipped  # pylint: disable=import-outside-toplevel
  config, variables, _ = shipped.load(shipped.DIFFUSION)
  sampler = build.sampler(config)
  puzzles, solutions = zip(*(sudoku.generate(30, seed=7, split="validation", index=i) for i in range(8)))
  puzzles, solutions = np.asarray(puzzles), np.asarray(solutions)
  rng = np.random.default_rng(0)
  given = (puzzles != 0) | (rng.random(puzzles.shape) < 0.5)
  initial = np.where(given, sudoku.encode_solution(solutions), 0).astype(np.int32)
  out = sampler.generate(variables, sudoku.encode_puzzle(puzzles), jax.random.key(0), 81,
                         initial_canvas=initial, given=given, return_trace=True)
  tokens = np.asarray(out.tokens)[:, :81]
  np.testing.assert_array_equal(tokens[given], initial[given])
  argmax, passes = np.asarray(out.trace.argmax)[0], np.asarray(out.canvas_passes)[:, 0]  # [N, B, C], [B]
  for row in range(len(puzzles)):
    held = given[row]
    assert (argmax[:passes[row], row][:, held] == initial[row, held]).all()
  solved = sudoku.check_solution(puzzles, sudoku.decode_solution(tokens))
  print(f"solved {solved.mean():.2f} of {len(puzzles)} half-given puzzles")
  assert solved.mean() >= 0.5


# ---------------------------------------------------------------------------------------- chat
@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
  import chat_fixtures  # pylint: disable=import-outside-toplevel
  folder = tmp_path_factory.mktemp("chat_checkpoint")
  chat_fixtures.write_chat_checkpoint(folder)
  return folder


def test_chat_replies_follow_a_regex(chat_checkpoint):
  chat = dg.ChatSampler.from_pretrained(chat_checkpoint, dtype="float32", prompt_bucket=128,
                                        max_new_tokens=16)
  answer = chat.constraint(regex="(yes|no|maybe)")
  for seed in range(2):
    reply = chat.send("Is 91 prime?", seed=seed, constraint=answer)
    assert reply.text in ("yes", "no", "maybe") and reply.finished, reply
  with pytest.raises(ValueError, match="exactly one of regex= and json_schema="):
    chat.constraint()


@pytest.mark.slow
def test_chat_replies_follow_a_json_schema(chat_checkpoint):
  jsonschema = pytest.importorskip("jsonschema")
  chat = dg.ChatSampler.from_pretrained(chat_checkpoint, dtype="float32", prompt_bucket=128,
                                        max_new_tokens=32)
  schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
            "required": ["a", "b"]}
  constraint = chat.constraint(json_schema=schema)
  for seed in range(2):
    reply = chat.send("Give me JSON.", seed=seed, constraint=constraint)
    jsonschema.validate(json.loads(reply.text), schema)
  assert not chat.send("And now?", seed=0).text.startswith("{")


@pytest.mark.slow
def test_chat_script_with_a_regex(chat_checkpoint):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(__file__).parent.parent
  result = subprocess.run(
      [sys.executable, str(root / "scripts" / "chat.py"), f"--hf_checkpoint={chat_checkpoint}",
       "--message=Is 91 prime?", "--regex=(yes|no)", "--max_new_tokens=16"],
      capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r"^(yes|no)$", result.stdout, re.M), result.stdout


def test_jointly_inconsistent_draws_are_repaired():
  """Masked noise accepts every position at once from a flat distribution over "a" and "b" under the
  language {ab, ba}: half the joint draws (aa, bb) would leave no accepted canvas; those rows take the
  constrained argmax instead, so every held canvas is in the language, and both words still occur."""
  v, c, d, b = 5, 2, 4, 32
  automaton = cons.from_regex("ab|ba", {2: "a", 3: "b"}, v, stop_tokens=[1], pad_id=0, disallowed_tokens=[4])
  tables = cons.AutomatonTables.from_automaton(automaton)
  table = jnp.asarray(np.tile(np.arange(d, dtype=np.float32), (v, 1)))  # equal logits for every token
  hidden = jnp.ones((b, c, d), jnp.float32)
  noise = diffusion.MaskedNoise(v, 4)
  rules = steps.Rules(max_denoising_steps=1, schedule=diffusion.Linear(1.0, 0.5), noise=noise,
                      acceptance=acceptance.TopCount(c), stopping=stopping.NoEarlyStop())
  head = vocab_lib.VocabHead(vocab_size=v, softcap=None, dtype="float32", never_token=4)
  start = jnp.full((b,), automaton.start, jnp.int32)
  denoiser = steps.Denoiser(lambda *args: hidden, head, table,
                            constraint=constrained.CanvasConstraint.for_canvas(tables, start, jnp.asarray(0)))
  keys = jax.random.split(jax.random.key(2), b)
  state = steps.init_state(rules, noise.initial_canvas(keys, c), jnp.zeros((b,), bool), d)
  state = jax.jit(lambda s: steps.denoise_step(rules, denoiser, s, keys))(state)
  canvas = np.asarray(state.canvas)
  assert np.asarray(state.fixed).all()
  words = {tuple(row) for row in canvas.tolist()}
  assert words == {(2, 3), (3, 2)}, words
  np.testing.assert_array_equal(state.argmax, canvas)

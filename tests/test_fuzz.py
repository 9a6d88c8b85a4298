"""Fuzzed inputs (hypothesis): anything malformed is refused with a clear error naming the value, anything
else gives the documented result, and nothing hangs (pytest-timeout's per-test limit stays on).

- sampler settings: every `SamplerConfig` field and every parameter of every registered component
  (`build/registry.py`), set through `build.sampler` to NaN, infinities, zero, negative and huge numbers,
  booleans, strings, None and lists;
- prompts: batches of three rows of ids inside and outside the vocabulary, empty rows, over-long rows,
  mixed lengths; and `max_new_tokens`;
- infilling: random held positions and canvases (held tokens stay until a stop token), malformed masks;
- the streaming reply parser (`chat.ReplyStream`) fed arbitrary token ids in arbitrary chunks.

Cheap on purpose: the tiny model and sampler of tests/test_sampling.py (prompts of at most 8 tokens share
its one compiled program; everything refused is refused before compiling), fixed seeds (`derandomize`), and
a few dozen examples each. Regexes and JSON schemas are fuzzed in tests/test_constraint_fuzz.py.
"""

import dataclasses
import math
import pathlib

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import chat_fixtures
import diffusiongemma as dg
from diffusiongemma import chat
from diffusiongemma.build import registry
from diffusiongemma.build.config import load_config_file
from diffusiongemma.data import hf_tokenizer
from test_sampling import CONFIG, NEW, STOP, TINY, compiled_programs, model, params, sampler  # noqa: F401

ROOT = pathlib.Path(__file__).parent.parent
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SLOW_FUZZ = settings(FUZZ, max_examples=12)  # examples that run the compiled sampler

# Values a flag or a Python caller could set: every kind that is wrong somewhere, and some that are right;
# each field is tried with all of them, then with numbers drawn by hypothesis.
ODD = [math.nan, math.inf, -math.inf, 0, 0.0, -1, -0.5, 1, 2, 0.5, 1.5, 1e300, 10**12, True, False, None, "",
       "0.5", "auto", "nan", [], [1], [-1, 5], (5,), {"a": 1}]
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**6, 10**6))
BASE = load_config_file(ROOT / "configs" / "tiny.py")
FIELDS = sorted(f.name for f in dataclasses.fields(dg.SamplerConfig))
COMPONENT_PARAMS = sorted((key, kind, name) for kind, table in registry.SAMPLER_COMPONENTS.items()
                          for name, entry in table.items() for key in entry.params)


def _names(error: Exception, field: str, value) -> bool:
  message = str(error)
  shown = {repr(value), str(value)} | ({repr(tuple(value))} if isinstance(value, list) else set())
  return field in message and any(text in message for text in shown)


def _check(field: str, value, overrides: dict, held) -> None:
  """`build.sampler` with `overrides` refuses `value` naming `field` and the value, or runs with it
  (`held(sampler)` is what the sampler holds)."""
  try:
    built = dg.build.sampler(BASE, TINY, **overrides)
  except ValueError as error:
    assert _names(error, field, value), error
  else:
    want = value
    if field == "stop_tokens" and value is not None:
      want = (value,) if isinstance(value, int) else tuple(value)
    if field == "canvas_length" and value is None:
      want = None  # the model's
    got = held(built)
    assert got == want and type(got) is type(want), (field, value, got)


def _each_value(check) -> None:
  for value in ODD:
    check(value)
  given(NUMBERS)(FUZZ(check))()  # numbers drawn by hypothesis, the same check


@pytest.mark.parametrize("field", FIELDS)
def test_every_sampler_field_is_refused_by_name_or_held(field):
  _each_value(lambda value: _check(field, value, {field: value}, lambda s: getattr(s.config, field)))


@pytest.mark.parametrize("key,kind,name", COMPONENT_PARAMS)
def test_every_component_parameter_is_refused_by_name_or_held(key, kind, name):
  entry = registry.SAMPLER_COMPONENTS[kind][name]
  made = lambda value: entry.build({**registry.component_defaults(), key: value})  # (stopping: a factory)
  _each_value(lambda value: _check(key, value, {kind: name, key: value},
                                   lambda s: value if getattr(s, kind) == made(value) else getattr(s, kind)))


# ---------------------------------------------------------------------------------------------- prompts
V, C, LIMIT = TINY.vocab_size, TINY.canvas_length, TINY.max_positions - NEW  # LIMIT: the longest prompt
GOOD_ROW = st.lists(st.integers(3, V - 1), min_size=1, max_size=8)  # one bucket: the shared program
ROWS = st.one_of(
    GOOD_ROW, GOOD_ROW, GOOD_ROW,  # drawn more often: a batch of three is often entirely valid
    st.lists(st.one_of(st.integers(3, V - 1), st.sampled_from([-1, -(2**31), V, V + 1, 2**31 - 1])), max_size=8),
    st.lists(st.integers(3, V - 1), min_size=TINY.max_positions, max_size=TINY.max_positions + 20))  # too long


def test_prompts_are_refused_by_what_is_wrong_or_sampled(params, sampler):
  outcomes = []
  given(rows=st.lists(ROWS, min_size=3, max_size=3), seed=st.integers(0, 2**31 - 1))(SLOW_FUZZ(
      lambda rows, seed: outcomes.append(_prompts_case(params, sampler, rows, seed))))()
  assert {"refused", "sampled"} <= set(outcomes), outcomes  # both paths were taken


def _prompts_case(params, sampler, rows, seed) -> str:
  compiled = compiled_programs()
  outside = sorted({t for row in rows for t in row if not 0 <= t < V})
  try:
    out = sampler.generate(params, rows, jax.random.key(seed), NEW)
  except ValueError as error:
    message = str(error)
    if any(not row for row in rows):
      assert "Empty prompt" in message, message
    elif outside:
      assert f"outside the vocabulary [0, {V})" in message and str(outside[0]) in message, message
    else:
      longest = max(map(len, rows))
      assert longest > LIMIT and f"{longest} prompt tokens" in message and "max_positions=64" in message
    assert compiled_programs() == compiled  # refused before anything compiled
    return "refused"
  assert all(rows) and not outside and max(map(len, rows)) <= LIMIT
  tokens = np.asarray(out.tokens)
  assert tokens.shape == (3, NEW) and ((tokens >= 0) & (tokens < V)).all()
  for row in tokens:  # after a row's first stop token everything is pad
    stops = np.flatnonzero(np.isin(row, STOP))
    assert not stops.size or (row[stops[0] + 1:] == TINY.pad_id).all()
  return "sampled"


# Accepted values stay within two canvases (the shared program); the others are refused before compiling.
MAX_NEW = st.one_of(st.sampled_from([v for v in ODD if not (type(v) is int and 0 < v <= C)]),
                    st.integers(C + 1, NEW), st.integers(-10**6, 0), st.integers(TINY.max_positions, 10**9),
                    st.floats(allow_nan=True, allow_infinity=True))


def test_max_new_tokens_is_refused_by_name_or_fits(params, sampler):
  outcomes = []
  given(MAX_NEW)(settings(SLOW_FUZZ, max_examples=30)(
      lambda value: outcomes.append(_max_new_case(params, sampler, value))))()
  assert {"refused", "sampled"} <= set(outcomes), outcomes


def _max_new_case(params, sampler, value) -> str:
  try:
    out = sampler.generate(params, [[3, 4], [5], [6, 7, 8]], jax.random.key(0), value)
  except ValueError as error:  # the value by name, or the whole canvases it asks for
    message = str(error)
    if f"max_new_tokens={value!r} is invalid" not in message:
      assert f"too long: 3 prompt tokens (cached included) + {-(-value // C) * C} new positions" in message, message
    return "refused"
  assert type(value) is int and C < value <= NEW
  assert np.asarray(out.tokens).shape == (3, NEW)  # whole canvases
  return "sampled"


# ---------------------------------------------------------------------------------------------- infilling


def _grid(elements, canvases):
  return st.lists(st.lists(elements, min_size=canvases * C, max_size=canvases * C), min_size=3, max_size=3)


INFILL = st.integers(1, 2).flatmap(lambda k: st.tuples(_grid(st.booleans(), k), _grid(st.integers(0, V - 1), k)))


def test_held_positions_keep_their_tokens_until_a_stop(params, sampler):
  given(INFILL, st.integers(0, 2**31 - 1))(SLOW_FUZZ(lambda case, seed: _infill_case(params, sampler, *case, seed)))()


def _infill_case(params, sampler, held, initial, seed):
  held, initial = np.asarray(held, bool), np.asarray(initial, np.int32)
  shape = held.shape
  out = sampler.generate(params, [[3, 4], [5], [6, 7, 8]], jax.random.key(seed), NEW, initial_canvas=initial,
                         given=held)
  tokens = np.asarray(out.tokens)[:, :shape[1]]
  for row, held_row, start in zip(tokens, held, initial):
    stops = np.flatnonzero(np.isin(row, STOP))
    end = stops[0] + 1 if stops.size else len(row)
    np.testing.assert_array_equal(row[:end][held_row[:end]], start[:end][held_row[:end]])
    assert (row[end:] == TINY.pad_id).all()


@pytest.mark.parametrize("given_,initial,message", [
    (np.ones((3, C), np.int32), np.zeros((3, C), np.int32), r"given must be a bool mask .* got int32 \(3, 8\)"),
    (np.ones((3, C + 1), bool), np.zeros((3, C), np.int32), r"of initial_canvas's shape \(3, 8\), got bool \(3, 9\)"),
    (np.ones((3, C), bool), None, "needs the initial_canvas"),
    (np.ones((3, 3 * C), bool), np.zeros((3, 3 * C), np.int32), r"initial_canvas has shape \(3, 24\)"),
])
def test_malformed_infilling_is_refused_before_compiling(params, sampler, given_, initial, message):
  compiled = compiled_programs()
  with pytest.raises(ValueError, match=message):
    sampler.generate(params, [[3, 4], [5], [6, 7, 8]], jax.random.key(0), NEW, initial_canvas=initial,
                     given=given_)
  assert compiled_programs() == compiled


# ---------------------------------------------------------------------------------------------- replies
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  folder = tmp_path_factory.mktemp("tokenizer")
  chat_fixtures.write_tokenizer(folder)
  return hf_tokenizer.CheckpointTokenizer(folder)


PIECES = chat_fixtures.tokenizer_pieces()
SPECIAL_TEXTS = chat_fixtures.SPECIAL + chat_fixtures.CONTROL
SPECIAL_IDS = [PIECES.index(t) for t in SPECIAL_TEXTS]
# Ordinary pieces that cannot spell a control token by themselves: no '<' or '>' (nor their bytes).
ORDINARY = [i for i, p in enumerate(PIECES) if i not in SPECIAL_IDS and p not in ("<", ">", "<0x3C>", "<0x3E>")]
TOKENS = st.lists(st.one_of(st.sampled_from(ORDINARY), st.sampled_from(SPECIAL_IDS)), max_size=40)


@FUZZ
@given(ids=TOKENS, cuts=st.lists(st.integers(0, 40), max_size=6), draft=TOKENS, in_thought=st.booleans())
def test_the_reply_stream_never_shows_a_control_token(tokenizer, ids, cuts, draft, in_thought):
  """Fed in any chunks, with any draft: no special token's text in any view, the same final split as
  feeding all at once, nothing kept after the first stop id, and a draft never changes the state."""
  stops = {PIECES.index(t) for t in ("<turn|>", "<|turn>", "<eos>")}
  stream = chat.ReplyStream(tokenizer, in_thought=in_thought)
  bounds = sorted({0, len(ids), *(c for c in cuts if c < len(ids))})
  for start, end in zip(bounds, bounds[1:]):
    for parts in (stream.feed(ids[start:end]), stream.view(draft)):
      for text in (parts.thought, parts.text):
        assert not any(special in text for special in SPECIAL_TEXTS), (text, parts)
  final = stream.result()
  once = chat.ReplyStream(tokenizer, in_thought=in_thought)
  once.feed(ids)
  assert once.result() == final and stream.view() == once.view()
  first_stop = next((i for i, t in enumerate(ids) if t in stops), None)
  assert stream.tokens == ids[:None if first_stop is None else first_stop + 1]
  assert final.finished == (first_stop is not None) == stream.finished
  if not in_thought and not set(ids) & set(SPECIAL_IDS):
    assert final.text == tokenizer.decode(ids).strip() and final.thought == ""

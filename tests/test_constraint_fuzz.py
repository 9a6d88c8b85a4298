"""Property tests (hypothesis) for regex constraints: regexes drawn from a small grammar (literals, classes,
\\d \\w \\s, alternations, repeats, optional parts), matching strings generated here from the grammar (never by
the code under test), given text placed in any canvas, and seeds.

- the token automaton agrees with Python's `re.fullmatch` on generated matches and on random strings;
- through the sampler (tiny random model, three canvases of 8, both noises): every output matches, the
  held text stays, or the request is refused up front; a request whose held text comes from a real match
  that fits is never refused.
Every regex shares one compiled program (small automata pad to the same table sizes).
"""

import re

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from diffusiongemma.diffusion import constraints as cons
from diffusiongemma.sampling import constrained
from test_constrained_sampling import VOCAB, _text, model, params, sampler  # pylint: disable=unused-import
from test_sampling import TINY, _prompts

CHARS = "".join(ch for i, ch in VOCAB.items() if i != TINY.vocab_size - 1)  # (the last id is masked noise's mask)
IDS = {ch: i for i, ch in VOCAB.items()}
ALPHABET = "abc019-. "
CLASSES = {r"\d": "0123456789", r"\w": "".join(ch for ch in CHARS if ch.isalnum() or ch == "_"),
           r"\s": " ", ".": CHARS}
EOS, PAD = 1, 0


def _class(chars: str, negated: bool):
  members = set(chars)
  text = "[" + ("^" if negated else "") + "".join(re.escape(ch) for ch in sorted(members)) + "]"
  return ("set", text, "".join(ch for ch in CHARS if (ch in members) != negated))


LEAVES = st.one_of(
    st.sampled_from(ALPHABET).map(lambda ch: ("set", re.escape(ch), ch)),
    st.sampled_from(sorted(CLASSES)).map(lambda name: ("set", name, CLASSES[name])),
    st.builds(_class, st.text(ALPHABET, min_size=1, max_size=4), st.booleans()),
)


def _extend(children):
  return st.one_of(
      st.lists(children, min_size=2, max_size=3).map(lambda xs: ("cat", xs)),
      st.lists(children, min_size=2, max_size=3).map(lambda xs: ("alt", xs)),
      st.tuples(children, st.sampled_from([(0, 1), (0, None), (1, None), (2, 3), (0, 2), (1, 1)])).map(
          lambda x: ("rep", x[0], *x[1])),
  )


TREES = st.recursive(LEAVES, _extend, max_leaves=6)
LONG = st.tuples(LEAVES, TREES, LEAVES).map(  # matches long enough to reach later canvases
    lambda x: ("cat", [("rep", x[0], 0, None), x[1], ("rep", x[2], 0, None)]))


def _render(tree) -> str:
  kind = tree[0]
  if kind == "set":
    return tree[1]
  if kind == "cat":
    return "".join(f"(?:{_render(t)})" for t in tree[1])
  if kind == "alt":
    return "(?:" + "|".join(_render(t) for t in tree[1]) + ")"
  _, node, lo, hi = tree
  suffix = {(0, 1): "?", (0, None): "*", (1, None): "+"}.get((lo, hi), f"{{{lo},{hi}}}" if hi else f"{{{lo},}}")
  return f"(?:{_render(node)}){suffix}"


def _generate(tree, rng) -> str | None:
  """A random string the tree matches, over the vocabulary's characters (None if it has none)."""
  kind = tree[0]
  if kind == "set":
    return str(rng.choice(list(tree[2]))) if tree[2] else None
  if kind == "cat":
    parts = [_generate(t, rng) for t in tree[1]]
    return None if None in parts else "".join(parts)
  if kind == "alt":
    for i in rng.permutation(len(tree[1])):
      out = _generate(tree[1][i], rng)
      if out is not None:
        return out
    return None
  _, node, lo, hi = tree
  count = int(rng.integers(lo, (hi if hi is not None else lo + 10) + 1))
  parts = [_generate(node, rng) for _ in range(count)]
  return None if None in parts else "".join(parts)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(TREES, st.integers(0, 2**31 - 1))
def test_automaton_agrees_with_python_re(tree, seed):
  regex, rng = _render(tree), np.random.default_rng(seed)
  matches = [m for m in (_generate(tree, rng) for _ in range(8)) if m is not None]
  try:
    automaton = cons.from_regex(regex, VOCAB, TINY.vocab_size, stop_tokens=[EOS], pad_id=PAD)
  except ValueError as e:
    assert not matches and ("unsatisfiable" in str(e) or "No string of tokens" in str(e)), (regex, e)
    return
  for text in matches:
    assert re.fullmatch(regex, text), (regex, text)
    assert automaton.accepts([IDS[ch] for ch in text] + [EOS, PAD]), (regex, text)
  for _ in range(40):
    text = "".join(rng.choice(list(ALPHABET + "e:"), size=rng.integers(0, 7)))
    assert automaton.accepts([IDS[ch] for ch in text]) == bool(re.fullmatch(regex, text)), (regex, text)


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.one_of(TREES, LONG),
       st.lists(st.tuples(st.integers(0, 2), st.integers(0, 7), st.integers(1, 3), st.integers(0, 5)),
                min_size=3, max_size=3),
       st.integers(0, 2**31 - 1))
def test_sampler_outputs_match_with_text_held_in_any_canvas(params, sampler, tree, placements, seed):
  """Per row: hold a piece of a generated match at its own place (canvas, offset, length), or (mode 0) a
  random piece that may make the request impossible. Refused up front, or every output matches."""
  regex, rng, c, canvases = _render(tree), np.random.default_rng(seed), TINY.canvas_length, 3
  try:
    constraint = constrained.Constraint.regex(regex, VOCAB, sampler)
  except ValueError as e:
    assert "unsatisfiable" in str(e) or "No string of tokens" in str(e), (regex, e)
    return
  initial = np.zeros((3, canvases * c), np.int32)
  held = np.zeros((3, canvases * c), bool)
  satisfiable = True
  for row, (canvas, offset, length, mode) in enumerate(placements):
    at = canvas * c + offset
    matches = [m for m in (_generate(tree, rng) for _ in range(30)) if m is not None and len(m) <= canvases * c]
    if mode == 0 or not matches:
      size = min(length, canvases * c - at)
      piece, satisfiable = "".join(rng.choice(list(ALPHABET), size=size)), False
    else:
      match = max(matches, key=lambda m: (len(m) > at, -len(m)))  # the shortest reaching past `at`
      piece = match[at:at + length]
      if not piece and len(match) < canvases * c:  # all matches end before `at`: hold the stop token
        initial[row, len(match)], held[row, len(match)] = sampler.stop_tokens[0], True
    initial[row, at:at + len(piece)] = [IDS[ch] for ch in piece]
    held[row, at:at + len(piece)] = True
  try:
    out = sampler.generate(params, _prompts(seed % 7), jax.random.key(seed), canvases * c, initial_canvas=initial,
                           given=held, constraint=constraint)
  except ValueError as e:
    assert not satisfiable and "leave no output the constraint accepts" in str(e), (regex, e)
    return
  tokens = np.asarray(out.tokens)
  for row in range(3):
    text = _text(tokens[row], sampler)
    assert re.fullmatch(regex, text), (regex, row, text)
    stop = np.flatnonzero(np.isin(tokens[row], sampler.stop_tokens))
    end = stop[0] if stop.size else tokens.shape[1]
    keep = held[row] & (np.arange(tokens.shape[1]) <= end)
    np.testing.assert_array_equal(tokens[row][keep], initial[row][keep])


@pytest.mark.parametrize("bad", [r"(ab", r"[a-", r"a{2,1}", r"(?P<x>a)(?P=x)", r"x\b"])
def test_bad_regexes_are_refused_up_front_with_a_reason(sampler, bad):
  with pytest.raises(ValueError, match=re.escape(repr(bad))):
    constrained.Constraint.regex(bad, VOCAB, sampler)

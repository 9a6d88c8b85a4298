"""Token automata, the constrained Viterbi and reachability passes, infilling canvases, bad input."""

import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffusiongemma import data
from diffusiongemma.diffusion import constraints as cons

PAD, EOS = 0, 1
_CORPUS = [
    json.dumps({"name": n, "n": i, "ok": i % 2 == 0, "tags": ["x", n[:2]]})
    for i, n in enumerate(["alice", "bob", "carol", "dave", "eve", "mallory", "trent", "peggy"] * 20)
] + ["def f(x):\n    return x + 1\n", "The quick brown fox jumps over 12 lazy dogs.\n"] * 20
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "bc"]},
    },
    "required": ["name", "n", "ok"],
}


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory):
  return data.Tokenizer.train(_CORPUS, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=320)


@pytest.fixture(scope="module")
def sp_vocab(sp_tokenizer):
  return cons.vocabulary.from_sentencepiece(sp_tokenizer)


@pytest.fixture(scope="module")
def hf_tokenizer():
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<pad>", "<eos>"], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_CORPUS + ["h\u00e9llo w\u00f6rld \u65e5\u672c"] * 5, trainer)
  return tok


def _random_strings(rng, ids, count, max_len):
  return [list(rng.choice(ids, size=rng.integers(0, max_len + 1))) for _ in range(count)]


# ---------------------------------------------------------------------------------------- vocabulary
def test_sentencepiece_vocabulary_bytes_concatenate_to_decoded_text(sp_tokenizer, sp_vocab):
  assert PAD not in sp_vocab and EOS not in sp_vocab and len(sp_vocab) > 256
  rng = np.random.default_rng(0)
  ids = np.asarray(sorted(sp_vocab))
  for tokens in _random_strings(rng, ids, 200, 12):
    raw = b"".join(sp_vocab[t] for t in tokens)
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError:
      continue  # a partial UTF-8 sequence of byte pieces: decode() would replace it
    assert sp_tokenizer.decode(tokens) == text


def test_hf_vocabulary_bytes_concatenate_to_decoded_text(hf_tokenizer):
  vocab = cons.vocabulary.from_hf_tokenizer(hf_tokenizer)
  assert 0 not in vocab and 1 not in vocab
  assert any(len(b.decode("utf-8", "ignore")) < len(b) for b in vocab.values())  # multi-byte tokens
  rng = np.random.default_rng(1)
  ids = np.asarray(sorted(vocab))
  for tokens in _random_strings(rng, ids, 200, 10):
    raw = b"".join(vocab[t] for t in tokens)
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError:
      continue
    assert hf_tokenizer.decode([int(t) for t in tokens]) == text


# ---------------------------------------------------------------------------------------- automaton
@pytest.mark.parametrize("regex", [
    r"(ab)+c?", r"a|ab", r"(a|ab)(c|bab)*", r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", r"[a-c]{2,4}x?",
    r"(foo|bar)\d{1,3}", r"", r"[^ab]*b",
])
def test_automaton_matches_python_re_on_token_strings(regex):
  vocab = {3: "a", 4: "b", 5: "ab", 6: "c", 7: "ba", 8: "abc", 9: ".", 10: "1", 11: "12", 12: ".5",
           13: "-", 14: "0", 15: "x", 16: "foo", 17: "bar", 18: "fo", 19: "o", 20: "9", 21: "\u00e9"}
  automaton = cons.from_regex(regex, vocab, 24, stop_tokens=[EOS], pad_id=PAD)
  rng = np.random.default_rng(0)
  ids = np.asarray(sorted(vocab))
  strings = _random_strings(rng, ids, 3000, 6) + [list(t) for n in range(3)
                                                   for t in itertools.product(ids, repeat=n)]
  matches = 0
  for tokens in strings:
    want = re.fullmatch(regex, "".join(vocab[t] for t in tokens)) is not None
    assert automaton.accepts(tokens) == want, (regex, tokens)
    assert automaton.accepts(tokens + [EOS, PAD, EOS]) == want  # stop, then fill
    matches += want
  if regex != "":
    assert matches > 0
  dense = automaton.next_state()  # [S, V]
  assert dense.shape == (automaton.num_states, 24)
  assert not automaton.allowed(automaton.stopped)[ids].any()  # no text after a stop token
  assert automaton.allowed(automaton.stopped)[[EOS, PAD]].all()


def test_regex_classes_are_ascii_unless_unicode_and_then_match_python_re():
  """\\d \\w \\s (and negations, and inside classes) mean re.ASCII's sets by default and Python's Unicode
  sets with unicode=True, checked character by character against `re` on a spread of code points."""
  rng = np.random.default_rng(0)
  points = np.concatenate([np.arange(0x3000), rng.integers(0x3000, 0x110000, 20000)])
  points = [int(p) for p in points if not 0xD800 <= p <= 0xDFFF and p != 0x10FFFF]
  for pattern in (r"\d", r"\w", r"\s", r"\D", r"[\w\-]", r"[^\s\d]", "."):
    for unicode in (False, True):
      ranges = next(cons.regexp.char_sets(cons.regexp.parse(pattern, unicode=unicode)))
      starts = np.asarray([lo for lo, _ in ranges])
      inside = lambda p, r=ranges, st=starts: (i := np.searchsorted(st, p, side="right") - 1) >= 0 and p <= r[i][1]
      flags = 0 if unicode else re.ASCII
      wrong = [p for p in points if inside(p) != bool(re.fullmatch(pattern, chr(p), flags))]
      assert not wrong, (pattern, unicode, [hex(p) for p in wrong[:5]])
  vocab = {2: "3", 3: "\u0663", 4: "-", 5: "\u00e9", 6: "e"}  # "3", ARABIC-INDIC DIGIT THREE, "-", "é", "e"
  ascii_digits = cons.from_regex(r"\d+-\w", vocab, 7, stop_tokens=[EOS], pad_id=PAD)
  unicode_digits = cons.from_regex(r"\d+-\w", vocab, 7, stop_tokens=[EOS], pad_id=PAD, unicode=True)
  assert ascii_digits.accepts([2, 2, 4, 6]) and not ascii_digits.accepts([3, 4, 6])
  assert not ascii_digits.accepts([2, 4, 5]) and unicode_digits.accepts([3, 2, 4, 5])
  assert cons.from_regex(r"^(?:ab)$", {2: "a", 3: "b"}, 4, stop_tokens=[EOS]).accepts([2, 3])  # end anchors


@pytest.mark.parametrize("pattern,what", [
    (r"(a)\1", "a backreference"), (r"a(?=b)b", "a lookahead"), (r"(?<!a)b", "a negative lookahead/lookbehind"),
    (r"\bword", "a word boundary"), (r"a^b", "an anchor"), (r"a$b", "an anchor"), (r"(?i)abc", "case-insensitive"),
    (r"(a)?(?(1)b|c)", "a conditional group"), (r"a++", "a possessive repeat"), (r"(?>ab)", "an atomic group"),
])
def test_unsupported_regex_constructs_are_refused_by_name(pattern, what):
  with pytest.raises(ValueError, match=f"The regex {re.escape(repr(pattern))} uses {what}.*cannot enforce"):
    cons.from_regex(pattern, {2: "a", 3: "b"}, 4, stop_tokens=[EOS])


def test_automaton_stop_only_when_accepting_and_distance():
  automaton = cons.from_regex("abc", {3: "a", 4: "b", 5: "c", 6: "bc"}, 8, stop_tokens=[EOS, 7],
                              pad_id=PAD)
  assert not automaton.accepts([3, EOS])
  assert automaton.accepts([3, 6, 7, PAD, EOS])
  assert not automaton.accepts([3, 6, PAD])  # pad is not a stop token
  assert int(automaton.distance[automaton.start]) == 2  # "a" + "bc"
  assert automaton.finishable_within(2)[automaton.start]
  assert not automaton.finishable_within(1)[automaton.start]
  automaton.check_length(2)
  with pytest.raises(ValueError, match="needs at least 2 tokens but only 1"):
    automaton.check_length(1)


def _schema_instances(rng, count):
  """(valid, invalid) values for SCHEMA, drawn here without the code under test."""
  letters = list("abcXYZ09 \"\\\u00e9\u65e5\n\t/")
  valid, invalid = [], []
  for _ in range(count):
    value = {"name": "".join(rng.choice(letters, size=rng.integers(0, 7))), "n": int(rng.integers(-10**6, 10**6)),
             "ok": bool(rng.integers(2))}
    if rng.integers(2):
      value["kind"] = str(rng.choice(["a", "bc"]))
    valid.append(value)
    broken = dict(value)
    key, how = rng.choice(["name", "n", "ok", "kind"]), rng.integers(3)
    if key == "name":
      broken["name"] = "abcdefg"[:7 - how] + "xyz"[:how]  # 7 characters
    elif key == "n":
      broken["n"] = [str(value["n"]), 1.5, None][how]
    elif key == "ok":
      broken.pop("ok") if how == 0 else broken.update(ok=["true", 0, None][how])
    else:
      broken["kind"] = ["b", "A", 1][how]
    invalid.append(broken)
  return valid, invalid


def test_json_schema_automaton_matches_jsonschema_on_independent_instances(sp_tokenizer, sp_vocab):
  """Valid instances written in the constraint's layout (declared key order, ", " and ": ") are accepted;
  invalid ones, and broken texts, are refused. jsonschema labels every instance."""
  jsonschema = pytest.importorskip("jsonschema")
  automaton = cons.from_json_schema(SCHEMA, sp_vocab, 330, stop_tokens=[EOS], pad_id=PAD)
  stats = automaton.stats()
  assert stats["token_classes"] < stats["vocab_size"] and stats["compact_bytes"] < stats["dense_bytes"]
  assert automaton.token_class[325] == automaton.dead_class  # beyond the tokenizer: never allowed
  rng = np.random.default_rng(3)
  valid, invalid = _schema_instances(rng, 150)
  dump = lambda v: json.dumps(v, ensure_ascii=False, separators=(", ", ": "))

  def tokens(text):
    ids = sp_tokenizer.encode(text)
    assert b"".join(sp_vocab[t] for t in ids) == text.encode()
    return ids

  for value in valid:
    assert jsonschema.Draft202012Validator(SCHEMA).is_valid(value)
    assert automaton.accepts(tokens(dump(value)) + [EOS, PAD]), dump(value)
  for value in invalid:
    assert not jsonschema.Draft202012Validator(SCHEMA).is_valid(value)
    assert not automaton.accepts(tokens(dump(value))), dump(value)
  for value in valid[:60]:  # texts cut or with a character changed: refused unless still valid JSON
    text = dump(value)
    i = int(rng.integers(len(text)))
    for broken in (text[:i], text[:i] + "}" + text[i + 1:], text[:i] + '"' + text[i:]):
      try:
        ok = jsonschema.Draft202012Validator(SCHEMA).is_valid(json.loads(broken))
      except json.JSONDecodeError:
        ok = False
      if not ok:
        assert not automaton.accepts(tokens(broken)), broken


# ---------------------------------------------------------------------------------------- Viterbi
def _brute_force(automaton, scores, start, end_ok, given=None, given_tokens=None):
  """(best score, tokens) per row over all V^C strings, and the allowed [B, C, V] sets."""
  b, c, v = scores.shape
  best = [(-np.inf, None)] * b
  allowed = np.zeros((b, c, v), bool)
  for tokens in itertools.product(range(v), repeat=c):
    for row in range(b):  # (padded tables keep every real state's id)
      if given is not None and any(given[row, i] and tokens[i] != given_tokens[row, i] for i in range(c)):
        continue
      state = automaton.advance(tokens, int(start[row]))
      if state == automaton.dead or not end_ok[row, state]:
        continue
      allowed[row, np.arange(c), tokens] = True
      score = float(sum(scores[row, i, t] for i, t in enumerate(tokens)))
      if score > best[row][0]:
        best[row] = (score, tokens)
  return best, allowed


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("regex,with_given", [("(ab|c)+", False), ("(ab|c)+", True), ("a(b|cc)*", True),
                                              ("abcab", False), ("ba", True)])
def test_viterbi_and_reachability_match_brute_force(regex, with_given, padded):
  vocab = {2: "a", 3: "b", 4: "ab", 5: "c"}
  automaton = cons.from_regex(regex, vocab, 6, stop_tokens=[EOS], pad_id=PAD)
  tables = cons.AutomatonTables.from_automaton(automaton, padded=padded)
  dead = tables.num_states
  b, c, v = 6, 4, 6
  rng = np.random.default_rng(hash(regex) % 1000)
  scores = rng.normal(size=(b, c, v)).astype(np.float32)
  start = np.full((b,), automaton.start, np.int32)
  start[-1] = automaton.transitions[automaton.start, automaton.token_class[2]]  # a row that began with "a"
  start[-1] = automaton.start if start[-1] == automaton.dead else start[-1]
  remaining = np.asarray([0, 0, 1, 2, 0, 0], np.int32)  # later rows: canvases that are not the last
  end_ok = np.asarray(cons.end_mask(tables, remaining))
  assert not end_ok[:, automaton.num_states:].any()  # padded states never end a canvas
  given = given_tokens = None
  if with_given:
    given = np.zeros((b, c), bool)
    given_tokens = np.zeros((b, c), np.int32)
    given[1, 0], given_tokens[1, 0] = True, 4
    given[2, 2], given_tokens[2, 2] = True, 5
    given[3, 1], given_tokens[3, 1] = True, 3  # often unsatisfiable
    given[4, 3], given_tokens[4, 3] = True, EOS
  run = jax.jit(cons.viterbi)
  result = run(tables, jnp.asarray(scores), jnp.asarray(start), jnp.asarray(end_ok),
               None if given is None else jnp.asarray(given),
               None if given is None else jnp.asarray(given_tokens))
  allowed = jax.jit(cons.allowed_tokens, static_argnums=3)(
      tables, jnp.asarray(start), jnp.asarray(end_ok), c, None if given is None else jnp.asarray(given),
      None if given is None else jnp.asarray(given_tokens))
  best, want_allowed = _brute_force(automaton, scores, start, end_ok[:, :automaton.num_states], given,
                                    given_tokens)
  np.testing.assert_array_equal(np.asarray(allowed), want_allowed)
  for row in range(b):
    score, tokens = best[row]
    assert bool(result.feasible[row]) == (tokens is not None)
    if tokens is None:
      assert int(result.end_state[row]) == dead
      continue
    np.testing.assert_allclose(float(result.score[row]), score, rtol=1e-5)
    assert tuple(np.asarray(result.tokens[row]).tolist()) == tokens
    assert int(result.end_state[row]) == automaton.advance(tokens, int(start[row]))
    assert int(cons.advance(tables, jnp.asarray(start[row:row + 1]), result.tokens[row:row + 1])[0]) == \
        int(result.end_state[row])


def test_viterbi_unsatisfiable_rows_are_flagged():
  automaton = cons.from_regex("abab", {2: "a", 3: "b"}, 4, stop_tokens=[EOS], pad_id=PAD)
  tables = cons.AutomatonTables.from_automaton(automaton)
  scores = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)), jnp.float32)
  start = jnp.full((2,), automaton.start)
  result = cons.viterbi(tables, scores, start, cons.end_mask(tables, jnp.asarray([0, 1])))
  # 3 positions cannot hold "abab" (row 0), but can hold its first 3 tokens when 1 more follows (row 1).
  assert result.feasible.tolist() == [False, True]
  assert np.asarray(result.tokens[1]).tolist() == [2, 3, 2]
  assert not bool(cons.allowed_tokens(tables, start, cons.end_mask(tables, jnp.zeros((2,), jnp.int32)),
                                      3).any())


@pytest.mark.parametrize("padded", [False, True])
def test_canvas_ends_match_brute_force_with_held_tokens_in_several_canvases(padded):
  """ends[k][s]: some filling of the later canvases' free positions, through their held tokens (text, a
  stop token, pad), reaches acceptance from s. Enumerated over every suffix."""
  vocab = {2: "a", 3: "b", 4: "ab", 5: "c"}
  automaton = cons.from_regex("(ab|c)+", vocab, 6, stop_tokens=[EOS], pad_id=PAD)
  tables = cons.AutomatonTables.from_automaton(automaton, padded=padded)
  k, c, v = 3, 2, 6
  given = np.zeros((5, k * c), bool)
  held = np.zeros((5, k * c), np.int32)
  for row, placements in enumerate([[], [(2, 5)], [(3, 3), (5, EOS)], [(4, EOS), (5, PAD)],
                                    [(2, 2), (4, 4)]]):  # row 3: must stop by the last canvas
    for pos, token in placements:
      given[row, pos], held[row, pos] = True, token
  ends = np.asarray(jax.jit(cons.canvas_ends, static_argnums=1)(tables, k, jnp.asarray(held), jnp.asarray(given)))
  assert ends.shape == (k, 5, tables.num_states) and not ends[..., automaton.num_states:].any()
  for row in range(5):
    for canvas in range(k):
      rest = range((canvas + 1) * c, k * c)
      want = np.zeros(automaton.num_states, bool)
      for suffix in itertools.product(range(v), repeat=len(rest)):
        if any(given[row, p] and suffix[i] != held[row, p] for i, p in enumerate(rest)):
          continue
        for state in range(automaton.num_states):
          end = automaton.advance(suffix, state)
          want[state] |= end != automaton.dead and bool(automaton.accepting[end])
      np.testing.assert_array_equal(ends[canvas, row, :automaton.num_states], want, err_msg=f"{row} {canvas}")
  free = np.asarray(cons.canvas_ends(tables, k, jnp.asarray(held)))  # nothing held: the distance test
  for canvas in range(k):
    after = jnp.full((5,), (k - 1 - canvas) * c)
    np.testing.assert_array_equal(free[canvas], np.asarray(cons.end_mask(tables, after)))


# ---------------------------------------------------------------------------------------- JSON outputs
def test_constrained_argmax_of_random_logits_validates_against_the_schema(sp_tokenizer, sp_vocab):
  jsonschema = pytest.importorskip("jsonschema")
  v = 330
  automaton = cons.from_json_schema(SCHEMA, sp_vocab, v, stop_tokens=[EOS], pad_id=PAD)
  tables = cons.AutomatonTables.from_automaton(automaton)
  b, c, canvases = 16, 24, 2
  run = jax.jit(cons.viterbi)
  for seed in range(8):
    logits = jax.random.normal(jax.random.key(seed), (canvases, b, c, v)) * 3.0
    state = jnp.full((b,), automaton.start, jnp.int32)
    pieces = []
    for k in range(canvases):
      remaining = jnp.full((b,), (canvases - 1 - k) * c, jnp.int32)
      result = run(tables, logits[k], state, cons.end_mask(tables, remaining))
      assert bool(result.feasible.all())
      pieces.append(np.asarray(result.tokens))
      state = result.end_state
    for row in np.concatenate(pieces, axis=1):
      assert automaton.accepts(row)
      stop = list(row).index(EOS) if EOS in row else len(row)
      value = json.loads(sp_tokenizer.decode(row[:stop]))
      jsonschema.validate(value, SCHEMA)
  # Unconstrained argmax of the same logits is never valid JSON.
  assert not any(automaton.accepts(row) for row in np.asarray(jnp.argmax(logits[0], -1)))


# ---------------------------------------------------------------------------------------- infilling
def test_infill_canvas(sp_tokenizer):
  canvas = cons.infill_canvas('{"name": "[MASK:3]", "n": [MASK]}', sp_tokenizer, length=40, fill_id=7)
  tokens, given = canvas.tokens, canvas.given
  assert tokens.shape == given.shape == (40,)
  holes = np.flatnonzero(~given)
  head = sp_tokenizer.encode('{"name": "')
  assert holes[:3].tolist() == list(range(len(head), len(head) + 3))
  assert (tokens[~given] == 7).all() and (~given[-5:]).all()  # free positions after the text
  assert sp_tokenizer.decode(tokens[:len(head)]) == '{"name": "'
  done = cons.infill_canvas("a [MASK] c", sp_tokenizer, length=12, stop_id=EOS, pad_id=PAD)
  end = int(np.flatnonzero(done.tokens == EOS)[0])
  assert done.given[end:].all() and (done.tokens[end + 1:] == PAD).all() and (~done.given).sum() == 1
  # A constraint goes through the given text: the held positions stay, the holes follow the regex.
  vocab = cons.vocabulary.from_sentencepiece(sp_tokenizer)
  automaton = cons.from_regex(r"a [0-9]+ c", vocab, 330, stop_tokens=[EOS], pad_id=PAD)
  tables = cons.AutomatonTables.from_automaton(automaton)
  scores = jax.random.normal(jax.random.key(0), (1, 12, 330))
  result = cons.viterbi(tables, scores, jnp.asarray([automaton.start]), cons.end_mask(tables, jnp.zeros(1)),
                        jnp.asarray(done.given[None]), jnp.asarray(done.tokens[None]))
  out = np.asarray(result.tokens[0])
  assert bool(result.feasible[0]) and (out[done.given] == done.tokens[done.given]).all()
  assert re.fullmatch(r"a [0-9]+ c", sp_tokenizer.decode(out[:end]))


def test_infill_bad_input(sp_tokenizer):
  with pytest.raises(ValueError, match="no infill marker"):
    cons.infill_canvas("no holes", sp_tokenizer)
  with pytest.raises(ValueError, match="needs .* positions but the canvas has 2"):
    cons.infill_canvas("a long text [MASK]", sp_tokenizer, length=2)
  with pytest.raises(ValueError, match="at least 1"):
    cons.infill_canvas("x [MASK:0]", sp_tokenizer)


# ---------------------------------------------------------------------------------------- bad input
def test_bad_constraints_raise_clear_errors(sp_vocab):
  kw = dict(stop_tokens=[EOS], pad_id=PAD)
  with pytest.raises(ValueError, match="unsatisfiable"):
    cons.from_regex(r"a[^\s\S]", sp_vocab, **kw)
  with pytest.raises(ValueError, match=r"Invalid regex '\(ab': missing \), unterminated subpattern at position 0"):
    cons.from_regex(r"(ab", sp_vocab, **kw)
  with pytest.raises(ValueError, match=r"Invalid regex 'a\{3,2\}': min repeat greater than max repeat at"):
    cons.from_regex(r"a{3,2}", sp_vocab, **kw)
  with pytest.raises(ValueError, match="No string of tokens"):
    cons.from_regex("abc", {3: "a", 4: "b"}, **kw)
  with pytest.raises(ValueError, match=r"JSON schema at #/type: must be one of .*got 'foo'"):
    cons.from_json_schema({"type": "foo"}, sp_vocab, **kw)
  with pytest.raises(ValueError, match="not valid JSON"):
    cons.from_json_schema("{nope", sp_vocab, **kw)
  with pytest.raises(ValueError, match=r"#/properties/n/multipleOf: 'multipleOf' is not supported"):
    cons.from_json_schema({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}},
                          sp_vocab, **kw)
  with pytest.raises(ValueError, match="stop_tokens is empty"):
    cons.from_regex("a", sp_vocab, stop_tokens=[])
  with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\)"):
    cons.from_regex("a", {3: "a", 12: "b"}, 10, **kw)
  with pytest.raises(ValueError, match="must be bytes or str"):
    cons.from_regex("a", {3: 5}, **kw)
  automaton = cons.from_json_schema(SCHEMA, sp_vocab, 330, **kw)
  with pytest.raises(ValueError, match="raise max_new_tokens"):
    automaton.check_length(4)


def _chained_refs(n: int) -> dict:
  """n $defs, each an array of two refs to the one before: 2^n compiled subschemas (a 1.3 KB schema at
  n=12 built for a minute before budgets)."""
  defs = {"d0": {"type": "integer"}}
  for i in range(1, n + 1):
    defs[f"d{i}"] = {"type": "array", "prefixItems": [{"$ref": f"#/$defs/d{i - 1}"}] * 2, "items": False}
  return {"$defs": defs, "$ref": f"#/$defs/d{n}"}


@pytest.mark.parametrize("build, budget, limit", [
    (lambda b: cons.from_regex("(a|b)*a(a|b){12}", {2: "a", 3: "b"}, 4, stop_tokens=[EOS], budget=b),
     cons.Budget(max_dfa_states=2000), "max_dfa_states"),  # 2^13 DFA states, the 2^18 of the issue in small
    (lambda b: cons.from_json_schema(_chained_refs(8), {2: "1", 3: "["}, 4, stop_tokens=[EOS], budget=b),
     cons.Budget(max_schema_nodes=100), "max_schema_nodes"),
    (lambda b: cons.from_regex("|".join(f"x{i}" for i in range(200)), {2: "x"}, 4, stop_tokens=[EOS], budget=b),
     cons.Budget(max_regex_chars=500), "max_regex_chars"),
    (lambda b: cons.from_regex("(ab)+", {2: "a", 3: "b"}, 4, stop_tokens=[EOS], budget=b),
     cons.Budget(max_states=2), "max_states"),
    (lambda b: cons.from_json_schema(_chained_refs(3), {2: "1"}, 4, stop_tokens=[EOS], budget=b),
     cons.Budget(seconds=0.0), "seconds"),
])
def test_builds_past_their_budget_are_refused_naming_the_limit(build, budget, limit):
  with pytest.raises(cons.BudgetExceeded, match=limit) as refused:
    build(budget)
  assert refused.value.limit == limit and refused.value.value == getattr(budget, limit)
  generous = cons.Budget(**{limit: 10**9 if limit != "seconds" else 600.0})
  try:
    build(generous)  # within the budget it builds (or fails for its own reasons, never the budget's)
  except cons.BudgetExceeded:
    pytest.fail(f"{limit}: refused within a generous budget")
  except ValueError:
    pass

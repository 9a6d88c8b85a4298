"""JSON schemas: every keyword the compiler claims is enforced (checked against `jsonschema` on instances
written here and on random outputs of each automaton), every other keyword is refused with its path.

`CASES` holds >= 30 schemas covering every supported keyword, each with values `jsonschema` accepts and
rejects. Texts are written in the constraint's layout (declared key order, ", " and ": "), so valid ones
must be accepted; invalid ones must be refused. Random outputs: walks through each automaton (uniform over
the token classes allowed at each step), each decoded and validated. The slow test runs the schemas
through the sampler on a tiny random model.
"""

import json
import re

import jax
import jsonschema
import numpy as np
import pytest

from diffusiongemma.diffusion import constraints as cons

PAD, EOS = 0, 1
BYTES = {b + 2: bytes([b]) for b in range(256)}  # one token per byte: token strings are texts
NODE = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
        "required": ["v"]}
CASES = [  # (id, schema, valid values, invalid values, invalid texts)
    ("null", {"type": "null"}, [None], [0, "null"], []),
    ("boolean", {"type": "boolean"}, [True, False], [0, "true"], []),
    ("integer", {"type": "integer"}, [0, -12, 10**20], [1.5, "1"], ["01", "-", "1e3"]),
    ("integer-range", {"type": "integer", "minimum": -7, "maximum": 12}, [-7, 0, 9, 12], [-8, 13, 100, -70], []),
    ("integer-exclusive", {"type": "integer", "exclusiveMinimum": 99, "exclusiveMaximum": 1000},
     [100, 555, 999], [99, 1000, 0, -100], []),
    ("integer-fractional-bound", {"type": "integer", "minimum": 2.5, "maximum": 1e3}, [3, 1000], [2, 1001], []),
    ("number", {"type": "number"}, [0, -0.25, 3.5, 1e5, 12], ["1", None], ["1.", ".5", "+1"]),
    ("number-range", {"type": "number", "minimum": 0, "maximum": 1}, [0, 0.5, 1, 0.999], [-0.1, 1.01, 2], ["1.5"]),
    ("number-exclusive", {"type": "number", "exclusiveMinimum": -3, "exclusiveMaximum": 2},
     [-2.5, 0, 1.999, -2.001], [-3, 2, 2.5, -3.5], ["-3.0", "2.0"]),
    ("string", {"type": "string"}, ["", "a\"b\\c", "h\u00e9llo \u65e5", "tab\tnew\nline"], [1, None], ['"a']),
    ("string-length", {"type": "string", "minLength": 2, "maxLength": 5}, ["ab", "\u00e9\u00e9\u00e9", "a\"\"\"b"],
     ["a", "abcdef", ""], []),
    ("pattern-alternation", {"type": "string", "pattern": "cat|dog"}, ["cat", "dog"], ["bird", "", "ca"],
     ['"cat', 'dog"']),  # issue 27: outlines-core wrapped it as ("cat|dog")
    ("pattern-escaping", {"type": "string", "pattern": r'^[a-z"\\]{1,3}\d$'}, ['a"b1', "\\\\9", "z0"],
     ["abcd1", "a1b", "1"], ['"a"b1"']),  # a quote and a backslash inside: JSON-escaped in the text
    ("pattern-with-length", {"type": "string", "pattern": "[0-9]{5}", "minLength": 5, "maxLength": 5},
     ["01234"], ["1234", "123456"], []),
    ("pattern-classes", {"type": "string", "pattern": r"\w+\s\d"}, ["ab_1 2", "x\t3", "y\n0"],
     ["ab", "a b", "12"], []),  # (jsonschema searches with Unicode classes; outputs use ASCII ones)
    ("pattern-dot", {"type": "string", "pattern": "a.b"}, ["a\"b", "a\\b", "a\u0001b", "a\u00e9b"],
     ["a\nb", "ab"], []),
    ("format-date", {"type": "string", "format": "date"}, ["2024-02-29", "1999-12-31", "2000-02-29"],
     ["2023-02-29", "2021-04-31", "0000-01-01", "2021-13-01", "1900-02-29"], []),
    ("format-time", {"type": "string", "format": "time"}, ["23:59:59Z", "00:00:00.5+05:30"],
     ["24:00:00Z", "12:60:00Z"], []),
    ("format-date-time", {"type": "string", "format": "date-time"}, ["2024-02-29T12:30:00Z"],
     ["2024-02-30T12:30:00Z", "2024-02-29 12:30:00Z"], []),
    ("format-uuid", {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"],
     ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400"], []),
    ("format-email", {"type": "string", "format": "email"}, ["a.b+c@example.com"], ["no-at-sign"], []),
    ("format-ipv4", {"type": "string", "format": "ipv4"}, ["192.168.0.1", "0.0.0.0"], ["256.1.1.1", "1.2.3"], []),
    ("enum", {"enum": ["red", 3, None, True, {"a": [1]}]}, ["red", 3, None, True, {"a": [1]}],
     ["blue", 4, False, {"a": [2]}], []),
    ("const", {"const": 'fixed"quote'}, ['fixed"quote'], ["fixed"], []),
    ("enum-with-type", {"type": "string", "enum": ["a", 1, "b"]}, ["a", "b"], [1, "c"], []),
    ("type-list", {"type": ["string", "null"], "maxLength": 3}, ["abc", None], ["abcd", 1], []),
    ("array-items", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
     [[1], [1, -2, 3]], [[], [1, 2, 3, 4], ["a"]], []),
    ("array-prefix", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "boolean"}], "items": False},
     [[], ["a"], ["a", True]], [["a", True, 1], [1], ["a", "b"]], []),
    ("array-prefix-counts", {"type": "array", "prefixItems": [{"const": 1}], "items": {"type": "null"},
                             "minItems": 2, "maxItems": 3}, [[1, None], [1, None, None]],
     [[1], [1, None, None, None], [2, None], [1, 0]], []),
    ("array-unique", {"type": "array", "uniqueItems": True, "maxItems": 1}, [[], [3]], [[3, 3], [1, 2]], []),
    ("object", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "age"], "additionalProperties": False},
     [{"name": "x", "age": 3}, {"name": "", "age": -1, "tags": ["a", "b"]}],
     [{"name": "x"}, {"age": 3}, {"name": "x", "age": "3"}, {"name": "x", "age": 1, "extra": 1}], []),
    ("object-all-optional", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"},
                                                              "c": {"type": "boolean"}}},
     [{}, {"a": 1}, {"b": None, "c": True}, {"a": 1, "b": None, "c": False}], [{"a": "1"}, {"c": 0}],
     ['{, "a": 1}']),
    ("object-free-keys", {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
     [{}, {"k": 1}, {"x y": 2, "\u00e9": -3}], [{"k": "v"}, {"a": 1, "b": 2, "c": 3}], []),
    ("object-counts", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "minProperties": 2, "maxProperties": 2},
     [{"a": 1, "b": 2}], [{"a": 1}], []),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, [5, "ab"], ["abc", None], []),
    ("oneOf-types", {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]}, [5, "x", None],
     [True, 1.5], []),
    ("oneOf-values", {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]}, ["a", "b", "c"], ["d"], []),
    ("allOf-one", {"allOf": [{"type": "string", "maxLength": 2}]}, ["ab"], ["abc"], []),
    ("ref", {"$defs": {"pos": {"type": "integer", "minimum": 1}}, "type": "array",
             "items": {"$ref": "#/$defs/pos"}},
     [[], [1, 20]], [[0], [-1]], []),
    ("ref-recursive", {"$defs": {"node": NODE}, "$ref": "#/$defs/node"},
     [{"v": 1}, {"v": 1, "next": {"v": 2, "next": {"v": 3}}}], [{"next": {"v": 1}}, {"v": 1, "next": {}}], []),
    ("definitions", {"definitions": {"flag": {"type": "boolean"}}, "$ref": "#/definitions/flag"}, [True], [1], []),
    ("any", {}, [None, 1, "s", [1, {"a": [2]}], {"k": {"j": []}}], [], ["nul", "[1,]"]),
    ("true", True, [False, {"a": 1}], [], ["{"]),
    ("free-object", {"type": "object"}, [{}, {"a": [1, None]}], [[], "x"], []),
    ("annotations", {"title": "t", "description": "d", "type": "integer", "default": 3, "examples": [1],
                     "$comment": "c", "deprecated": False,
                     "$schema": "https://json-schema.org/draft/2020-12/schema"},
     [1], ["1"], []),
    ("inferred-string", {"minLength": 3}, ["abc"], ["ab"], []),
    ("inferred-object", {"properties": {"a": {"type": "null"}}, "required": ["a"]}, [{"a": None}], [{}], []),
]
REFUSED = [  # (schema, the path and keyword the error must name)
    ({"type": "integer", "multipleOf": 3}, "#/multipleOf"),
    ({"not": {"type": "string"}}, "#/not"),
    ({"if": {"type": "string"}, "then": {"minLength": 1}}, "#/if"),
    ({"type": "array", "contains": {"type": "integer"}}, "#/contains"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "#/patternProperties"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "#/propertyNames"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "#/dependentRequired"),
    ({"type": "object", "unevaluatedProperties": False}, "#/unevaluatedProperties"),
    ({"type": "string", "contentEncoding": "base64"}, "#/contentEncoding"),
    ({"type": "object", "properties": {"x": {"type": "string", "nullable": True}}}, "#/properties/x/nullable"),
    ({"type": "array", "items": [{"type": "string"}]}, "#/items"),
    ({"type": "string", "format": "uri"}, "#/format"),
    ({"type": "string", "pattern": "[a-z]+", "maxLength": 4}, "#/maxLength"),
    ({"type": "string", "pattern": "[a-z]{2}", "minLength": 3}, "#/minLength"),
    ({"type": "string", "format": "date", "pattern": "2.*"}, "#/pattern"),
    ({"type": "string", "pattern": r"(a)\1"}, "#/pattern"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "#/oneOf"),
    ({"oneOf": [{"enum": ["a", "b"]}, {"const": "b"}]}, "#/oneOf"),
    ({"oneOf": [{"const": {"a": [1]}}, {"const": {"a": [1.0]}}]}, "#/oneOf"),  # equal JSON values
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "#/allOf"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, "#/required"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1}, "#/minProperties"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "maxProperties": 1}, "#/maxProperties"),
    ({"type": "object", "additionalProperties": {}, "minProperties": 1}, "#/minProperties"),
    ({"type": "array", "uniqueItems": True}, "#/uniqueItems"),
    ({"type": "number", "minimum": 0.5}, "#/minimum"),
    ({"$ref": "#/$defs/a", "maxLength": 2, "$defs": {"a": {"type": "string"}}}, "#/maxLength"),
    ({"type": "object", "anyOf": [{"required": ["a"]}]}, "#/type"),
    ({"enum": ["a", "bb"], "maxLength": 1}, "#/maxLength"),
    ({"$ref": "https://example.com/schema.json"}, "#/$ref"),
    ({"properties": {"a": {"$id": "x", "type": "null"}}}, "#/properties/a/$id"),
    ({"properties": {"a/b": {"type": "null", "minimum": True}}}, "#/properties/a~1b/minimum"),
]


def _validator(schema):
  return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def _automaton(schema, **kwargs):
  return cons.from_json_schema(schema, BYTES, 258, stop_tokens=[EOS], pad_id=PAD, **kwargs)


def _tokens(text: str):
  return [b + 2 for b in text.encode()]


def _walk(automaton, rng, max_tokens=160):
  """A random accepted token string: uniform over the token classes that can still finish in time."""
  state, out = automaton.start, []
  stops = set(automaton.stop_tokens) | set(automaton.after_stop_tokens)
  text_class = np.asarray([t not in stops for t in range(automaton.vocab_size)])
  for left in range(max_tokens, 0, -1):
    if automaton.accepting[state] and (rng.random() < 0.15 or automaton.distance[state] == 0 and left == 1):
      break
    nxt = automaton.transitions[state]  # [M]
    finish = np.full(len(nxt), False)
    live = nxt != automaton.dead
    finish[live] = automaton.distance[nxt[live]] <= left - 1
    classes = [m for m in np.flatnonzero(finish) if text_class[automaton.token_class == m].any()]
    if not classes:
      break
    klass = rng.choice(classes)
    token = int(rng.choice(np.flatnonzero((automaton.token_class == klass) & text_class)))
    out.append(token)
    state = int(nxt[klass])
  assert automaton.accepting[state], out
  return out


@pytest.mark.parametrize("name,schema,valid,invalid,texts", CASES, ids=[c[0] for c in CASES])
def test_keyword_is_enforced_against_jsonschema(name, schema, valid, invalid, texts):
  del name
  validator, automaton = _validator(schema), _automaton(schema)
  dump = lambda v: json.dumps(v, ensure_ascii=False, separators=(", ", ": "))
  for value in valid:
    assert validator.is_valid(value), value
    assert automaton.accepts(_tokens(dump(value)) + [EOS, PAD]), dump(value)
  for value in invalid:
    assert not validator.is_valid(value), value
    assert not automaton.accepts(_tokens(dump(value))), dump(value)
  for text in texts:
    assert not automaton.accepts(_tokens(text)), text


@pytest.mark.parametrize("name,schema", [c[:2] for c in CASES], ids=[c[0] for c in CASES])
def test_random_outputs_validate(name, schema):
  """Random accepted outputs of each schema's automaton, over several seeds, all validate."""
  del name
  validator, automaton = _validator(schema), _automaton(schema)
  for seed in range(4):
    rng = np.random.default_rng(seed)
    for _ in range(10):
      text = bytes(t - 2 for t in _walk(automaton, rng)).decode("utf-8")
      errors = [e.message for e in validator.iter_errors(json.loads(text))]
      assert not errors, (text, errors)


@pytest.mark.parametrize("kind,bounds", [("integer", [(-3, 4), (0, 0), (-10, -2), (2, 13), (-2.5, 3.5), (7, 120)]),
                                         ("number", [(-3, 4), (0, 0), (-10, -2), (2, 13), (0, 1), (-1, 0)])])
def test_numeric_bounds_match_jsonschema_on_a_grid(kind, bounds):
  """Every pair of bound keywords on a grid: an accepted text is valid, and a valid text in the canonical
  spelling (an integer; for numbers also a decimal) is accepted."""
  texts = [str(i) for i in range(-130, 131)] + [f"{k / 8}" for k in range(-120, 121) if k % 8]
  texts += ["-0", "3.0", "0.50"]
  for lo_key in ("minimum", "exclusiveMinimum", None):
    for hi_key in ("maximum", "exclusiveMaximum", None):
      for lo, hi in bounds:
        schema = {"type": kind, **({lo_key: lo} if lo_key else {}), **({hi_key: hi} if hi_key else {})}
        validator = _validator(schema)
        try:
          automaton = _automaton(schema)
        except ValueError as e:
          assert "admits no value" in str(e) and not any(validator.is_valid(json.loads(t)) for t in texts)
          continue
        for text in texts:
          valid, accepted = validator.is_valid(json.loads(text)), automaton.accepts(_tokens(text))
          canonical = text == str(json.loads(text)) and (kind == "number" or "." not in text)
          assert accepted <= valid and (accepted or not valid or not canonical), (schema, text)


@pytest.mark.parametrize("schema,where", REFUSED, ids=[w for _, w in REFUSED])
def test_unsupported_keyword_is_refused_with_its_path(schema, where):
  with pytest.raises(ValueError, match=f"JSON schema at {re.escape(where)}"):
    _automaton(schema)


def test_every_keyword_is_listed_as_supported_or_refused():
  """The keywords the cases above claim are exactly the compiler's supported set; the refused ones are
  not in it."""
  used = set()

  def collect(schema):
    if isinstance(schema, dict):
      used.update(k for k in schema if k in cons.json_schema.SUPPORTED)
      for value in schema.values():
        collect(value)
    elif isinstance(schema, list):
      for value in schema:
        collect(value)

  for case in CASES:
    collect(case[1])
  assert used == set(cons.json_schema.SUPPORTED)
  refused = {w.rsplit("/", 1)[1] for _, w in REFUSED}
  assert not refused & (cons.json_schema.SUPPORTED - {"items", "format", "pattern", "maxLength", "minLength",
                                                      "oneOf", "allOf", "required", "minProperties",
                                                      "maxProperties", "uniqueItems", "minimum", "type", "$ref"})
  formats = {c[1]["format"] for c in CASES if isinstance(c[1], dict) and "format" in c[1]}
  assert set(cons.json_schema.FORMATS) == formats


def test_whitespace_pattern_and_bad_schemas():
  spaced = _automaton({"type": "array", "items": {"type": "integer"}}, whitespace_pattern=r"[ \n]{0,2}")
  assert spaced.accepts(_tokens("[\n 1 ,\n2 ]")) and not spaced.accepts(_tokens("[\t1]"))
  with pytest.raises(ValueError, match="matches characters other than JSON whitespace"):
    _automaton({"type": "null"}, whitespace_pattern=r"\s*")  # ASCII \s has \v and \f
  with pytest.raises(ValueError, match=r"JSON schema at #/minLength: must be an integer >= 0, got -1"):
    _automaton({"type": "string", "minLength": -1})
  with pytest.raises(ValueError, match=r"#/exclusiveMinimum: must be a finite number \(draft 2020-12\), got True"):
    _automaton({"type": "number", "exclusiveMinimum": True})  # draft 4's boolean form
  with pytest.raises(ValueError, match=r"#/pattern: Invalid regex '\[a-': unterminated character set at position"):
    _automaton({"type": "string", "pattern": "[a-"})
  with pytest.raises(ValueError, match="admits no value"):
    _automaton({"type": "integer", "minimum": 5, "maximum": 4})
  with pytest.raises(ValueError, match=r"#/\$ref: '#/\$defs/x' points to nothing"):
    _automaton({"$ref": "#/$defs/x"})


@pytest.mark.slow
def test_sampler_outputs_validate_for_every_schema(tmp_path_factory):
  """Every schema through the sampler (tiny random model, sentencepiece vocabulary, four canvases of 16,
  both noises), all in one compiled program per noise (`constrained.one_program`): every output of every
  row validates."""
  import diffusiongemma as dg  # pylint: disable=import-outside-toplevel
  from diffusiongemma import diffusion  # pylint: disable=import-outside-toplevel
  from diffusiongemma.sampling import constrained, stats  # pylint: disable=import-outside-toplevel
  from test_constraints import _CORPUS  # pylint: disable=import-outside-toplevel
  from test_sampling import TINY, compiled_programs, random_params  # pylint: disable=import-outside-toplevel
  tokenizer = dg.data.Tokenizer.train(_CORPUS, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=320)
  model = dg.DiffusionGemma(TINY.replace(vocab_size=330, canvas_length=16, max_positions=128))
  params = random_params(model, 1)
  checked = 0
  for noise in (diffusion.UniformNoise(330), diffusion.MaskedNoise(330)):
    sampler = dg.Sampler(model, dg.SamplerConfig(max_denoising_steps=4, stop_tokens=(1,), prompt_bucket=8),
                         noise=noise)
    constraints = constrained.one_program([constrained.Constraint.json_schema(schema, tokenizer, sampler)
                                           for _, schema, *_ in CASES])
    assert len(set(constraints)) == 1
    before = compiled_programs()
    for (name, schema, *_), constraint in zip(CASES, constraints):
      out = sampler.generate(params, np.random.default_rng(len(name)).integers(3, 320, (2, 6)),
                             jax.random.key(len(name)), 64, constraint=constraint)
      for row in np.asarray(out.tokens):
        ids = [t for t in stats.new_tokens(row, sampler.stop_tokens, 0) if t != 1]
        text = tokenizer.decode(ids)
        errors = [e.message for e in _validator(schema).iter_errors(json.loads(text))]
        assert not errors, (name, noise.name, text, errors)
        checked += 1
    assert compiled_programs() == before + 1
  assert checked == 2 * 2 * len(CASES)

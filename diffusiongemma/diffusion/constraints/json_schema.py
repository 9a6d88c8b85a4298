"""JSON schemas as regex trees (`regexp`): every keyword is enforced or the schema is refused.

`compile_schema(schema)` returns the tree of JSON texts the constraint allows. Each allowed text parses
to a value that is valid under the schema (draft 2020-12, as `jsonschema` checks it, formats included);
the converse need not hold: properties come in the order `properties` lists them, numbers and strings
in one spelling, whitespace as `whitespace_pattern` allows. A keyword the compiler cannot enforce
exactly raises a `ValueError` naming the keyword and its JSON-pointer path in the schema, so an
output can never look valid while breaking the schema.

Enforced (see `SUPPORTED`):
- `type` (a name or a list), `enum`, `const` (with `type` beside them, nothing else);
- strings: `minLength`, `maxLength`, `pattern` (Python `re` syntax, the whole string matches it, which
  implies the search the spec asks for; \\d \\w \\s ASCII unless `unicode=True`), `format` in `FORMATS`;
  a length beside `pattern` or `format` only when the pattern's own lengths already lie within it;
- numbers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` (any value for `integer`;
  integral values for `number`, whose outputs then have no exponent);
- arrays: `items`, `prefixItems`, `minItems`, `maxItems`, `uniqueItems` (only when `maxItems` <= 1);
- objects: `properties`, `required` (each name must be in `properties`), `additionalProperties`
  (outputs hold only the listed properties; with no `properties`, any keys with values under
  `additionalProperties`), `minProperties` (when `required` alone reaches it), `maxProperties`;
- `anyOf`; `oneOf` when no value can match two branches (their types, or their finite values, are
  disjoint); `allOf` with one subschema; `$ref` to `#...` JSON pointers, recursion cut at depth
  `REF_DEPTH`; `$defs` / `definitions` as the places refs point to;
- annotations (`title`, `description`, `default`, `examples`, ...) are ignored, `$id` at the root only.
Refused: every other keyword (e.g. `multipleOf`, `not`, `if`/`then`/`else`, `contains`,
`patternProperties`, `propertyNames`, `dependentRequired`, `unevaluatedProperties`), other formats,
sibling keywords beside `$ref`, `anyOf`, `oneOf` or `allOf`, and the cases above outside their limits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from diffusiongemma.diffusion.constraints import regexp as rx
from diffusiongemma.diffusion.constraints.budget import Budget

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema"})
_CONTAINERS = frozenset({"$defs", "definitions"})
_STRING = frozenset({"minLength", "maxLength", "pattern", "format"})
_NUMBER = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_ARRAY = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"})
_OBJECT = frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties"})
_COMBINATORS = ("anyOf", "oneOf", "allOf")
SUPPORTED = frozenset({"type", "enum", "const", "$ref", *_COMBINATORS}) | _STRING | _NUMBER | _ARRAY | _OBJECT
_COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"})
_KINDS = {"pattern": str, "format": str, "$ref": str, "properties": Mapping, "$defs": Mapping,
          "definitions": Mapping, "enum": list, "required": list, "uniqueItems": bool, "anyOf": list,
          "oneOf": list, "allOf": list, "prefixItems": list}
TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
REF_DEPTH = 3  # how many times one $ref may enter itself (deeper recursive branches are left out)
ANY_DEPTH = 2  # nesting of arrays and objects inside a value the schema leaves free ({} or true)
DEFAULT_WHITESPACE = r"[ ]?"
_JSON_WHITESPACE = ((0x09, 0x0A), (0x0D, 0x0D), (0x20, 0x20))
_PLAIN = rx.subtract(rx.UNIVERSE, ((0x00, 0x08), (0x0B, 0x0C), (0x0E, 0x1F)))  # free string characters
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_NUMBER_RE = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_DATE = (r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})-"
         r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
         r"|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)-02-29")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
FORMATS = {  # the texts `jsonschema`'s format checker accepts (a subset of each format's spellings)
    "date": _DATE,
    "time": _TIME,
    "date-time": f"(?:{_DATE})T{_TIME}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": rf"[A-Za-z0-9_%+-]+(?:\.[A-Za-z0-9_%+-]+)*@{_LABEL}(?:\.{_LABEL})+",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
}


def compile_schema(schema: Mapping | bool | str, *, whitespace_pattern: str | None = None,
                   unicode: bool = False, budget: Budget | None = None):
  """The regex tree of the JSON texts valid under `schema` (a dict, a boolean or JSON text).

  whitespace_pattern: the regex (Python syntax) of the whitespace allowed between JSON tokens (default:
  at most one space); it may only match JSON whitespace. unicode: \\d \\w \\s in `pattern` keywords mean
  Python's Unicode classes instead of ASCII ones. budget: its `max_schema_nodes` and `seconds` bound the
  compilation (each `$ref` is compiled again where it is used, so refs to refs multiply).
  """
  if isinstance(schema, str):
    try:
      schema = json.loads(schema)
    except json.JSONDecodeError as e:
      raise ValueError(f"The JSON schema is not valid JSON: {e}.") from None
  if not isinstance(schema, (Mapping, bool)):
    raise ValueError(f"A JSON schema must be an object or a boolean, got {type(schema).__name__}.")
  whitespace = rx.parse(DEFAULT_WHITESPACE if whitespace_pattern is None else whitespace_pattern)
  if any(rx.subtract(ranges, _JSON_WHITESPACE) for ranges in rx.char_sets(whitespace)):
    raise ValueError(f"whitespace_pattern {whitespace_pattern!r} matches characters other than JSON "
                     "whitespace (space, tab, newline, carriage return).")
  budget = budget or Budget()
  tree = _Compiler(schema, whitespace, unicode, budget, budget.deadline()).compile(schema, "#")
  if tree == rx.EMPTY:
    raise ValueError("The JSON schema admits no value the constraint can produce (it is unsatisfiable, or "
                     f"every value is nested deeper than {REF_DEPTH} recursive $refs).")
  return tree


def _pointer(name: str) -> str:
  return name.replace("~", "~0").replace("/", "~1")


def _json_type(value) -> str:
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, (int, float)):
    return "integer" if float(value).is_integer() else "number"
  if isinstance(value, str):
    return "string"
  if isinstance(value, (list, tuple)):
    return "array"
  if isinstance(value, Mapping):
    return "object"
  raise ValueError(f"{value!r} is not a JSON value.")


def _has_type(value, name: str) -> bool:
  kind = _json_type(value)
  return kind == name or (name == "number" and kind == "integer")


def _json_key(value):
  """A key equal for JSON-equal values (1 and 1.0 alike, also inside arrays and objects; true and 1 not)."""
  kind = _json_type(value)
  if kind in ("integer", "number"):
    return "number", float(value)
  if kind == "array":
    return kind, tuple(_json_key(v) for v in value)
  if kind == "object":
    return kind, tuple(sorted((k, _json_key(v)) for k, v in value.items()))
  return kind, value


class _Compiler:
  """One schema's compilation: the root (for $ref), whitespace, and the $refs being expanded."""

  def __init__(self, root, whitespace, unicode: bool, budget: Budget, deadline: float | None):
    self.root, self.ws, self.unicode = root, whitespace, unicode
    self.budget, self.deadline, self.nodes = budget, deadline, 0
    self.sep = rx.seq(whitespace, rx.literal(","), whitespace)
    self.expanding: list[str] = []
    self.any_cache: dict[int, object] = {}

  # ------------------------------------------------------------------------------------ checks
  @staticmethod
  def fail(path: str, message: str):
    raise ValueError(f"JSON schema at {path}: {message}")

  def refuse(self, path: str, keyword: str, why: str):
    self.fail(f"{path}/{keyword}", f"{keyword!r} {why}; refused rather than produce outputs that could "
              "fail validation.")

  def check(self, schema: Mapping, path: str) -> frozenset:
    """The schema's assertion keywords, after refusing unknown ones and checking the values' types."""
    for key, value in schema.items():
      if key == "$id" and path == "#":
        continue
      if key not in SUPPORTED | ANNOTATIONS | _CONTAINERS:
        self.refuse(path, key, "is not supported (the constraint cannot enforce it)")
      if key in _COUNTS and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        self.fail(f"{path}/{key}", f"must be an integer >= 0, got {value!r}.")
      if key in _NUMBER and (isinstance(value, bool) or not isinstance(value, (int, float))
                             or not math.isfinite(value)):
        self.fail(f"{path}/{key}", f"must be a finite number (draft 2020-12), got {value!r}.")
      if key in _KINDS and not isinstance(value, _KINDS[key]):
        self.fail(f"{path}/{key}", f"must be a {_KINDS[key].__name__}, got {type(value).__name__}.")
      if key in ("anyOf", "oneOf", "allOf") and not value:
        self.fail(f"{path}/{key}", "must not be empty.")
    return frozenset(schema) - ANNOTATIONS - _CONTAINERS - {"$id"}

  # ------------------------------------------------------------------------------------ schemas
  def compile(self, schema, path: str):
    self.nodes += 1
    self.budget.check("max_schema_nodes", self.nodes, "number of subschemas compiled ($refs expanded)")
    self.budget.check_time(self.deadline)
    if schema is True:
      return self.any_value(ANY_DEPTH)
    if schema is False:
      return rx.EMPTY
    if not isinstance(schema, Mapping):
      self.fail(path, f"a schema must be an object or a boolean, got {type(schema).__name__}.")
    assertions = self.check(schema, path)
    for key in ("$ref", *_COMBINATORS):
      if key in schema:
        others = sorted(assertions - {key})
        if others:
          self.refuse(path, others[0], f"beside {key!r} is not supported (put it inside the subschemas)")
        return self.ref(schema[key], path) if key == "$ref" else self.combinator(key, schema[key], path)
    if "enum" in schema or "const" in schema:
      return self.enum(schema, path, assertions)
    return rx.alt(*(self.typed(kind, schema, path) for kind in self.types(schema, path, assertions)))

  def types(self, schema: Mapping, path: str, assertions) -> list[str]:
    if "type" not in schema:
      found = [kind for kind, keys in (("string", _STRING), ("number", _NUMBER), ("array", _ARRAY),
                                       ("object", _OBJECT)) if assertions & keys]
      return found or ["null", "boolean", "number", "string", "array", "object"]
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if not kinds or any(k not in TYPES for k in kinds):
      self.fail(f"{path}/type", f"must be one of {list(TYPES)} or a non-empty list of them, got "
                f"{schema['type']!r}.")
    return list(dict.fromkeys(kinds))

  def typed(self, kind: str, schema: Mapping, path: str):
    if kind == "null":
      return rx.literal("null")
    if kind == "boolean":
      return rx.alt(rx.literal("true"), rx.literal("false"))
    return {"integer": self.integer, "number": self.number, "string": self.string, "array": self.array,
            "object": self.object}[kind](schema, path)

  def enum(self, schema: Mapping, path: str, assertions):
    others = sorted(assertions - {"enum", "const", "type"})
    if others:
      self.refuse(path, others[0], "beside 'enum' or 'const' is not supported")
    values = [schema["const"]] if "const" in schema else list(schema["enum"])
    if "const" in schema and "enum" in schema:
      values = [v for v in values if _json_key(v) in {_json_key(e) for e in schema["enum"]}]
    kinds = self.types(schema, path, assertions) if "type" in schema else None
    try:
      return rx.alt(*(self.value(v) for v in values if kinds is None or any(_has_type(v, k) for k in kinds)))
    except ValueError as e:
      self.fail(path, f"an enum/const value is not JSON ({e}).")

  def value(self, value):
    """The texts of one JSON value, whitespace between its tokens as elsewhere."""
    if isinstance(value, Mapping):
      members = [self.member(k, self.value(v)) for k, v in value.items()]
      return rx.seq(rx.literal("{"), self.ws, self.joined(members), self.ws, rx.literal("}"))
    if isinstance(value, (list, tuple)):
      items = self.joined([self.value(v) for v in value])
      return rx.seq(rx.literal("["), self.ws, items, self.ws, rx.literal("]"))
    return rx.literal(json.dumps(value, ensure_ascii=False, allow_nan=False))

  def ref(self, ref: str, path: str):
    if not ref.startswith("#"):
      self.refuse(path, "$ref", f"{ref!r} points outside this schema (only '#...' pointers are supported)")
    target = self.root
    for part in (p for p in ref[1:].split("/") if p):
      part = part.replace("~1", "/").replace("~0", "~")
      if isinstance(target, list) and part.isdigit() and int(part) < len(target):
        target = target[int(part)]
      elif isinstance(target, Mapping) and part in target:
        target = target[part]
      else:
        self.fail(f"{path}/$ref", f"{ref!r} points to nothing in the schema.")
    if self.expanding.count(ref) >= REF_DEPTH:
      return rx.EMPTY
    self.expanding.append(ref)
    try:
      return self.compile(target, ref)
    finally:
      self.expanding.pop()

  def combinator(self, key: str, branches: list, path: str):
    nodes = [self.compile(b, f"{path}/{key}/{i}") for i, b in enumerate(branches)]
    if key == "allOf" and len(nodes) > 1:
      self.refuse(path, key, "with more than one subschema is not supported (merge them into one)")
    if key == "oneOf":
      kinds = [self.possible(b) for b in branches]
      for i in range(len(kinds)):
        for j in range(i + 1, len(kinds)):
          if not _disjoint(kinds[i], kinds[j]):
            self.refuse(path, key, f"branches {i} and {j} can both match one value, so outputs could match "
                        "two; use anyOf, or give the branches distinct types or values")
    return rx.alt(*nodes)

  def possible(self, schema, seen: tuple = ()) -> tuple[frozenset, list | None]:
    """(the JSON types a schema can accept, integer counted as number; its finite values or None)."""
    every = frozenset({"null", "boolean", "number", "string", "array", "object"})
    if not isinstance(schema, Mapping):
      return (every, None) if schema is not False else (frozenset(), [])
    if "$ref" in schema:
      ref = schema["$ref"]
      if ref in seen or not ref.startswith("#"):
        return every, None
      target = self.root
      for part in (p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p):
        target = target[int(part)] if isinstance(target, list) else target[part]
      return self.possible(target, seen + (ref,))
    types = every
    if "type" in schema:
      named = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
      types = frozenset("number" if k == "integer" else k for k in named)
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None:
      types &= frozenset("number" if _json_type(v) == "integer" else _json_type(v) for v in values)
    for key in _COMBINATORS:
      if key in schema:
        parts = [self.possible(b, seen) for b in schema[key]]
        union = frozenset().union(*(p[0] for p in parts))
        types &= union if key != "allOf" else frozenset.intersection(*(p[0] for p in parts))
        if values is None and key != "allOf" and all(p[1] is not None for p in parts):
          values = [v for p in parts for v in p[1]]
    return types, values

  # ------------------------------------------------------------------------------------ kinds
  def bounds(self, schema: Mapping, path: str, integer: bool):
    """(lo, lo exclusive, hi, hi exclusive): the tightest bound on each side (None: unbounded). For
    integers both are inclusive integers (minimum 2.5 is 3, exclusiveMaximum 7 is 6)."""
    lo = hi = None
    lo_x = hi_x = False
    for key in sorted(_NUMBER & set(schema)):
      value, exclusive, upper = schema[key], key.startswith("exclusive"), key.endswith("aximum")
      if integer:
        if upper:
          bound = math.ceil(value) - 1 if exclusive else math.floor(value)
        else:
          bound = math.floor(value) + 1 if exclusive else math.ceil(value)
        exclusive = False
      elif not float(value).is_integer():
        self.refuse(path, key, f"{value!r} on type 'number' is not supported (only integral bounds are)")
      else:
        bound = int(value)
      if upper and (hi is None or bound < hi or (bound == hi and exclusive)):
        hi, hi_x = bound, exclusive
      if not upper and (lo is None or bound > lo or (bound == lo and exclusive)):
        lo, lo_x = bound, exclusive
    return lo, lo_x, hi, hi_x

  def integer(self, schema: Mapping, path: str):
    lo, _, hi, _ = self.bounds(schema, path, integer=True)
    if lo is None and hi is None:
      return rx.parse(_INTEGER)
    return rx.parse(_signed(lo, False, hi, False, integral=True) or "[^\\s\\S]")

  def number(self, schema: Mapping, path: str):
    lo, lo_x, hi, hi_x = self.bounds(schema, path, integer=False)
    if lo is None and hi is None:
      return rx.parse(_NUMBER_RE)
    return rx.parse(_signed(lo, lo_x, hi, hi_x, integral=False) or "[^\\s\\S]")

  def string(self, schema: Mapping, path: str):
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    value, source = None, None
    if "format" in schema:
      if schema["format"] not in FORMATS:
        self.refuse(path, "format", f"{schema['format']!r} is not supported (supported: {sorted(FORMATS)})")
      value, source = rx.parse(FORMATS[schema["format"]]), "format"
    if "pattern" in schema:
      if value is not None:
        self.refuse(path, "pattern", "beside 'format' is not supported")
      try:
        value, source = rx.parse(schema["pattern"], unicode=self.unicode), "pattern"
      except ValueError as e:
        self.fail(f"{path}/pattern", str(e))
    if value is None:
      value = rx.repeat(rx.chars(_PLAIN), lo, hi)
    elif value != rx.EMPTY and (lo or hi is not None):
      fewest, most = rx.width(value)
      if fewest < lo or (hi is not None and (most is None or most > hi)):
        spread = f"{fewest} to {'any number of' if most is None else most}"
        key = "minLength" if fewest < lo else "maxLength"
        self.refuse(path, key, f"beside {source!r} is only supported when every match already has that "
                    f"length (these match {spread} characters); write the length into the {source}")
    return rx.seq(rx.literal('"'), rx.json_text(value), rx.literal('"'))

  def joined(self, nodes) -> object:
    """nodes separated by commas."""
    out = []
    for i, node in enumerate(nodes):
      out += [self.sep, node] if i else [node]
    return rx.seq(*out)

  def listed(self, node, lo: int, hi: int | None):
    """`lo` to `hi` copies of node separated by commas."""
    if hi == 0:
      return rx.EPSILON
    some = rx.seq(node, rx.repeat(rx.seq(self.sep, node), max(lo - 1, 0), None if hi is None else hi - 1))
    return some if lo else rx.optional(some)

  def array(self, schema: Mapping, path: str):
    lo, hi = schema.get("minItems", 0), schema.get("maxItems")
    if schema.get("uniqueItems") and (hi is None or hi > 1):
      self.refuse(path, "uniqueItems", "is only supported with maxItems <= 1")
    prefix = [self.compile(s, f"{path}/prefixItems/{i}") for i, s in enumerate(schema.get("prefixItems", []))]
    item = self.compile(schema.get("items", True), f"{path}/items")
    k = len(prefix)
    options = [self.joined(prefix[:j]) for j in range(k) if lo <= j and (hi is None or j <= hi)]
    if hi is None or hi >= k:
      extra_lo, extra_hi = max(lo - k, 0), None if hi is None else hi - k
      if k:
        options.append(rx.seq(self.joined(prefix), rx.repeat(rx.seq(self.sep, item), extra_lo, extra_hi)))
      else:
        options.append(self.listed(item, extra_lo, extra_hi))
    return rx.seq(rx.literal("["), self.ws, rx.alt(*options), self.ws, rx.literal("]"))

  def member(self, key, value):
    key = rx.literal(json.dumps(key, ensure_ascii=False)) if isinstance(key, str) else key
    return rx.seq(key, self.ws, rx.literal(":"), self.ws, value)

  def object(self, schema: Mapping, path: str):
    props, required = schema.get("properties", {}), schema.get("required", [])
    lo, hi = schema.get("minProperties", 0), schema.get("maxProperties")
    if any(not isinstance(r, str) for r in required) or len(set(required)) != len(required):
      self.fail(f"{path}/required", "must be a list of distinct strings.")
    missing = [r for r in required if r not in props]
    if missing:
      self.refuse(path, "required", f"names {missing} that 'properties' does not declare (the spec requires "
                  "them with any value); declare them under 'properties'")
    if not props:
      extra = schema.get("additionalProperties", True)
      if lo:
        self.refuse(path, "minProperties", "without 'properties' is not supported (free keys may repeat)")
      value = self.compile(extra, f"{path}/additionalProperties")
      body = self.listed(self.member(rx.seq(rx.literal('"'), rx.json_text(rx.repeat(rx.chars(_PLAIN), 0, None)),
                                            rx.literal('"')), value), 0, hi)
    else:
      members = []
      for name, sub in props.items():
        node = self.compile(sub, f"{path}/properties/{_pointer(name)}")
        if node == rx.EMPTY and name in required:
          return rx.EMPTY
        if node != rx.EMPTY:
          members.append((self.member(name, node), name in required))
      if lo > len(required):
        self.refuse(path, "minProperties", f"{lo} is only supported when 'required' lists at least that many")
      if hi is not None and hi < len(members):
        if hi < len(required):
          return rx.EMPTY
        self.refuse(path, "maxProperties", f"{hi} is only supported when 'properties' declares at most that many")
      body = self.ordered(members)
    return rx.seq(rx.literal("{"), self.ws, body, self.ws, rx.literal("}"))

  def ordered(self, members):
    """Comma-separated members in order: each required one present, each optional one present or not."""
    def rest(i):  # members from i on, after one already written
      return rx.seq(*(rx.seq(self.sep, m) if req else rx.optional(rx.seq(self.sep, m)) for m, req in members[i:]))
    options = []
    for j, (member, req) in enumerate(members):
      options.append(rx.seq(member, rest(j + 1)))
      if req:
        break
    else:
      options.append(rx.EPSILON)
    return rx.alt(*options)

  def any_value(self, depth: int):
    if depth not in self.any_cache:
      text = rx.seq(rx.literal('"'), rx.json_text(rx.repeat(rx.chars(_PLAIN), 0, None)), rx.literal('"'))
      node = rx.alt(rx.literal("null"), rx.literal("true"), rx.literal("false"), rx.parse(_NUMBER_RE), text)
      if depth:
        inner = self.any_value(depth - 1)
        array = rx.seq(rx.literal("["), self.ws, self.listed(inner, 0, None), self.ws, rx.literal("]"))
        members = self.listed(self.member(text, inner), 0, None)
        node = rx.alt(node, array, rx.seq(rx.literal("{"), self.ws, members, self.ws, rx.literal("}")))
      self.any_cache[depth] = node
    return self.any_cache[depth]


def _disjoint(a: tuple, b: tuple) -> bool:
  if not a[0] & b[0]:
    return True
  return a[1] is not None and b[1] is not None and not {_json_key(v) for v in a[1]} & {_json_key(v) for v in b[1]}


# ---------------------------------------------------------------------------------------- numbers
def _same_length(lo: str, hi: str) -> str:
  """Digit strings of len(lo) == len(hi) between lo and hi (inclusive)."""
  if lo == hi:
    return lo
  if len(lo) == 1:
    return f"[{lo}-{hi}]"
  n = len(lo) - 1
  if lo[0] == hi[0]:
    return f"{lo[0]}(?:{_same_length(lo[1:], hi[1:])})"
  parts, first, last, tail = [], int(lo[0]), int(hi[0]), None
  if lo[1:] != "0" * n:
    parts.append(f"{lo[0]}(?:{_same_length(lo[1:], '9' * n)})")
    first += 1
  if hi[1:] != "9" * n:
    tail = f"{hi[0]}(?:{_same_length('0' * n, hi[1:])})"
    last -= 1
  if first <= last:
    parts.append(f"[{first}-{last}][0-9]{{{n}}}")
  return "(?:" + "|".join(parts + ([tail] if tail else [])) + ")"


def _natural(lo: int, hi: int | None) -> str | None:
  """Canonical decimal integers in [lo, hi] (lo >= 0; hi None: unbounded), or None if there are none."""
  if hi is not None and lo > hi:
    return None
  top = len(str(lo if hi is None else hi))
  parts = []
  for n in range(len(str(lo)), top + 1):
    a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), 10 ** n - 1 if hi is None else min(hi, 10 ** n - 1)
    if a <= b:
      parts.append(_same_length(str(a), str(b)))
  if hi is None:
    parts.append(f"[1-9][0-9]{{{top},}}")
  return "(?:" + "|".join(parts) + ")"


def _magnitude(a: int, a_x: bool, b: int | None, b_x: bool, integral: bool) -> str | None:
  """Unsigned decimals m (integer part, optional fraction; integers only if `integral`) with a <= m
  (a < m if a_x) and m <= b (m < b if b_x; b None: unbounded)."""
  frac = "" if integral else r"(?:\.[0-9]+)?"
  parts = []
  whole = _natural(a + 1 if a_x else a, None if b is None else b - 1)
  if whole:
    parts.append(whole + frac)
  if a_x and not integral and (b is None or a < b):
    parts.append(rf"{a}\.[0-9]*[1-9][0-9]*")
  if b is not None and not b_x and (b > a or (b == a and not a_x)):
    parts.append(str(b) + ("" if integral else r"(?:\.0+)?"))
  return "(?:" + "|".join(parts) + ")" if parts else None


def _signed(lo, lo_x: bool, hi, hi_x: bool, *, integral: bool) -> str | None:
  """Decimals v with lo <= v <= hi (strict where the flag is set; None: unbounded), no exponent."""
  parts = []
  if hi is None or hi > 0 or (hi == 0 and not hi_x):
    a, a_x = (lo, lo_x) if lo is not None and lo >= 0 else (0, False)
    parts.append(_magnitude(a, a_x, hi, hi_x, integral))
  if lo is None or lo < 0:  # v = -m: v >= lo is m <= -lo, v <= hi is m >= -hi
    a, a_x = (-hi, hi_x) if hi is not None and hi <= 0 else (0, False)
    neg = _magnitude(a, a_x, None if lo is None else -lo, lo_x, integral)
    parts.append(None if neg is None else "-" + neg)
  parts = [p for p in parts if p]
  return "|".join(parts) if parts else None

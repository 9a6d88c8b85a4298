"""Regexes as a small syntax tree: Python's `re` syntax in, the automaton engine's syntax out.

A constraint's regex is read by Python's own parser (`re._parser`), so its meaning is exactly what
`re.fullmatch` gives, and then written out for `outlines-core` (whose engine, Rust's regex-automata, has
its own syntax and Unicode tables). The tree has four kinds of node: `Chars` (a set of code points),
`Seq`, `Alt` and `Repeat`; `EMPTY` (matches nothing) and `EPSILON` (matches only "") are an empty `Alt`
and `Seq`, and the constructors simplify them away, so an unsatisfiable part disappears and only a wholly
unsatisfiable regex stays `EMPTY`.

Meaning, fixed here rather than left to the engine:
- `\\d`, `\\w`, `\\s` (and their negations) are ASCII by default: `[0-9]`, `[A-Za-z0-9_]`,
  `[ \\t\\n\\r\\f\\v]`, as with Python's `re.ASCII`; with `unicode=True` they are the sets Python's `re`
  uses on this interpreter (computed from `re` itself, so `re.fullmatch` agrees character by character).
  `(?a)` in the pattern also selects ASCII.
- `.` is any character but newline (`(?s)`: any character).
- Text is valid UTF-8: surrogates are never matched, nor U+10FFFF (a noncharacter the automaton
  builder uses as its start marker).
- Anchors are accepted only where they cannot change a full match: `^`, `\\A` at the very start, `$`,
  `\\Z` at the very end. Constructs a finite automaton cannot express, or whose meaning differs under a
  full match, are refused with a `ValueError` naming the construct and its position: backreferences,
  lookaround, word boundaries, conditionals, atomic groups and possessive repeats, and case-insensitive
  matching (`(?i)`).

`json_text` rewrites a tree over string values into the tree of their JSON string bodies (each
character raw, or escaped where JSON requires it), which is how a JSON schema's `pattern` is enforced.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator

try:  # Python's own regex parser (private, but the meaning of `re` itself)
  import re._constants as sre  # pylint: disable=import-error
  import re._parser as sre_parse  # pylint: disable=import-error
except ImportError:  # Python 3.10
  import sre_constants as sre  # pylint: disable=deprecated-module
  import sre_parse  # pylint: disable=deprecated-module

Ranges = tuple[tuple[int, int], ...]
MAX_CODE_POINT = 0x10FFFE  # U+10FFFF is the automaton builder's start marker
UNIVERSE: Ranges = ((0, 0xD7FF), (0xE000, MAX_CODE_POINT))  # every code point UTF-8 can carry
_ASCII_CLASSES = {"digit": ((0x30, 0x39),), "word": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
                  "space": ((0x09, 0x0D), (0x20, 0x20))}
_CATEGORIES = {
    sre.CATEGORY_DIGIT: ("digit", False), sre.CATEGORY_NOT_DIGIT: ("digit", True),
    sre.CATEGORY_WORD: ("word", False), sre.CATEGORY_NOT_WORD: ("word", True),
    sre.CATEGORY_SPACE: ("space", False), sre.CATEGORY_NOT_SPACE: ("space", True),
}
_PYTHON_CLASSES = {"digit": r"\d", "word": r"\w", "space": r"\s"}
_REFUSED = {sre.GROUPREF: "a backreference", sre.GROUPREF_EXISTS: "a conditional group",
            sre.ASSERT: "a lookahead/lookbehind", sre.ASSERT_NOT: "a negative lookahead/lookbehind",
            getattr(sre, "POSSESSIVE_REPEAT", "-"): "a possessive repeat",  # (Python 3.11+)
            getattr(sre, "ATOMIC_GROUP", "--"): "an atomic group"}
_START_ANCHORS = (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING)
_END_ANCHORS = (sre.AT_END, sre.AT_END_STRING)


# ---------------------------------------------------------------------------------------- the tree
@dataclasses.dataclass(frozen=True)
class Chars:
  """One character from a set of code points: sorted, disjoint, non-adjacent inclusive ranges."""
  ranges: Ranges


@dataclasses.dataclass(frozen=True)
class Seq:
  """The items one after another (build with `seq`, which flattens and drops what matches only "")."""
  items: tuple


@dataclasses.dataclass(frozen=True)
class Alt:
  """Any one of the options (build with `alt`, which flattens, dedupes and drops `EMPTY`)."""
  options: tuple


@dataclasses.dataclass(frozen=True)
class Repeat:
  """lo to hi copies of node (build with `repeat`)."""
  node: object
  lo: int
  hi: int | None  # None: unbounded


EMPTY = Alt(())
EPSILON = Seq(())


def normalize(ranges) -> Ranges:
  """Sorted, merged ranges, clipped to the code points text can hold (`UNIVERSE`)."""
  out: list[list[int]] = []
  for lo, hi in sorted(ranges):
    if out and lo <= out[-1][1] + 1:
      out[-1][1] = max(out[-1][1], hi)
    else:
      out.append([lo, hi])
  return _intersect(tuple((a, b) for a, b in out), UNIVERSE)


def _intersect(a: Ranges, b: Ranges) -> Ranges:
  out, i, j = [], 0, 0
  while i < len(a) and j < len(b):
    lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if lo <= hi:
      out.append((lo, hi))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return tuple(out)


def complement(ranges: Ranges) -> Ranges:
  out, nxt = [], 0
  for lo, hi in ranges:
    if lo > nxt:
      out.append((nxt, lo - 1))
    nxt = hi + 1
  if nxt <= 0x10FFFF:
    out.append((nxt, 0x10FFFF))
  return normalize(out)


def subtract(a: Ranges, b: Ranges) -> Ranges:
  return _intersect(a, complement(b))


def chars(ranges) -> Chars | Alt:
  ranges = normalize(ranges)
  return Chars(ranges) if ranges else EMPTY


def literal(text: str):
  """The node matching exactly `text`."""
  return seq(*(chars([(ord(ch), ord(ch))]) for ch in text))


def seq(*items):
  flat = []
  for item in items:
    if item == EMPTY:
      return EMPTY
    flat.extend(item.items if isinstance(item, Seq) else [item])
  return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def alt(*options):
  flat = []
  for option in options:
    for o in (option.options if isinstance(option, Alt) else [option]):
      if o not in flat:
        flat.append(o)
  return flat[0] if len(flat) == 1 else Alt(tuple(flat))


def repeat(node, lo: int, hi: int | None):
  if hi is not None and hi < lo:
    return EMPTY
  if node == EMPTY:
    return EPSILON if lo == 0 else EMPTY
  if node == EPSILON or hi == 0:
    return EPSILON
  if lo == hi == 1:
    return node
  return Repeat(node, lo, hi)


def optional(node):
  return repeat(node, 0, 1)


def width(node) -> tuple[int, int | None]:
  """(fewest, most) characters of a match; most is None when unbounded."""
  if isinstance(node, Chars):
    return 1, 1
  if isinstance(node, Seq):
    lo, hi = 0, 0
    for item in node.items:
      a, b = width(item)
      lo, hi = lo + a, None if hi is None or b is None else hi + b
    return lo, hi
  if isinstance(node, Alt):
    if not node.options:
      raise ValueError("An empty language has no width.")
    widths = [width(o) for o in node.options]
    his = [b for _, b in widths]
    return min(a for a, _ in widths), None if None in his else max(his)
  a, b = width(node.node)
  return a * node.lo, None if node.hi is None or b is None else b * node.hi


def char_sets(node) -> Iterator[Ranges]:
  """Every character set in the tree."""
  if isinstance(node, Chars):
    yield node.ranges
  elif isinstance(node, Repeat):
    yield from char_sets(node.node)
  else:
    for child in (node.items if isinstance(node, Seq) else node.options):
      yield from char_sets(child)


# ---------------------------------------------------------------------------------------- JSON strings
_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
JSON_SPECIAL: Ranges = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))  # never raw inside a JSON string


def json_escape(code_point: int) -> str:
  return _SHORT_ESCAPES.get(code_point) or f"\\u{code_point:04x}"


def json_text(node):
  """The tree of the JSON string bodies (without quotes) whose values `node` matches: characters that
  JSON allows raw stay raw, the others (quote, backslash, control characters) become their escape."""
  if isinstance(node, Chars):
    special = _intersect(node.ranges, JSON_SPECIAL)
    escapes = [literal(json_escape(c)) for lo, hi in special for c in range(lo, hi + 1)]
    return alt(chars(subtract(node.ranges, JSON_SPECIAL)), *escapes)
  if isinstance(node, Seq):
    return seq(*(json_text(i) for i in node.items))
  if isinstance(node, Alt):
    return alt(*(json_text(o) for o in node.options))
  return repeat(json_text(node.node), node.lo, node.hi)


# ---------------------------------------------------------------------------------------- engine syntax
def _code(c: int) -> str:
  """One code point in the engine's syntax: letters, digits, < and > as they are (the engine reads \\<
  and \\> as word boundaries), other printable ASCII escaped with a backslash, the rest as \\x{HEX}."""
  ch = chr(c)
  if ch.isascii() and ch.isalnum() or ch in "<>":
    return ch
  return f"\\{ch}" if 0x20 <= c < 0x7F else f"\\x{{{c:X}}}"


def emit(node) -> str:
  """The regex in the engine's syntax (Rust regex, Unicode mode); `EMPTY` cannot be written."""
  if node == EMPTY:
    raise ValueError("The regex matches no text at all (it is unsatisfiable).")
  return _emit(node)


def _emit(node) -> str:
  if isinstance(node, Chars):
    if len(node.ranges) == 1 and node.ranges[0][0] == node.ranges[0][1]:
      return _code(node.ranges[0][0])
    body = "".join(_code(a) if a == b else f"{_code(a)}-{_code(b)}" for a, b in node.ranges)
    return f"[{body}]"
  if isinstance(node, Seq):
    return "".join(f"(?:{_emit(i)})" if isinstance(i, Alt) else _emit(i) for i in node.items)
  if isinstance(node, Alt):
    return "|".join(_emit(o) for o in node.options)
  inner = _emit(node.node) if isinstance(node.node, Chars) else f"(?:{_emit(node.node)})"
  lo, hi = node.lo, node.hi
  suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
  return inner + (suffix or (f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"))


# ---------------------------------------------------------------------------------------- Python syntax
@functools.lru_cache(maxsize=None)
def _python_class(name: str) -> Ranges:
  """The code points Python's `re` matches with \\d, \\w or \\s (Unicode) on this interpreter."""
  text = "".join(chr(c) for lo, hi in UNIVERSE for c in range(lo, hi + 1))
  offsets = [(lo, sum(b - a + 1 for a, b in UNIVERSE[:i])) for i, (lo, _) in enumerate(UNIVERSE)]

  def code(index: int) -> int:
    for lo, start in reversed(offsets):
      if index >= start:
        return lo + index - start
    raise AssertionError(index)

  return normalize((code(m.start()), code(m.end() - 1))
                   for m in re.finditer(_PYTHON_CLASSES[name] + "+", text))


def _category(category, unicode: bool) -> Ranges:
  name, negated = _CATEGORIES[category]
  ranges = _python_class(name) if unicode else _ASCII_CLASSES[name]
  return complement(ranges) if negated else normalize(ranges)


def parse(pattern: str, *, unicode: bool = False):
  """The tree of `pattern` (Python `re` syntax, matched in full). Raises ValueError naming the pattern
  and, for a syntax error, Python's reason and position; for a construct a finite automaton over
  full matches cannot hold, the construct and its position."""
  if not isinstance(pattern, str):
    raise ValueError(f"A regex must be a string, got {type(pattern).__name__}.")
  try:
    tree = sre_parse.parse(pattern)
  except re.error as e:
    where = "" if e.pos is None else f" at position {e.pos}"
    raise ValueError(f"Invalid regex {pattern[:200]!r}: {e.msg}{where}.") from None
  except (OverflowError, RecursionError) as e:
    raise ValueError(f"Invalid regex {pattern[:200]!r}: {e}.") from None
  return _Translator(pattern, unicode).items(tree, tree.state.flags, True, True)


@dataclasses.dataclass
class _Translator:
  pattern: str
  unicode: bool

  def refuse(self, what: str):
    raise ValueError(f"The regex {self.pattern[:200]!r} uses {what}, which a constraint cannot enforce.")

  def check_flags(self, flags: int) -> None:
    if flags & sre.SRE_FLAG_IGNORECASE:
      self.refuse("case-insensitive matching ((?i)); write the cases out, e.g. [Aa]")
    if flags & sre.SRE_FLAG_LOCALE:
      self.refuse("locale matching ((?L))")

  def items(self, items, flags: int, first: bool, last: bool):
    """A sequence of parsed items; `first` / `last`: nothing can come before / after it in a match."""
    self.check_flags(flags)
    items = list(items)
    nodes = []
    for i, (op, av) in enumerate(items):
      ops_before = [o for o, a in items[:i] if not (o is sre.AT and a in _START_ANCHORS)]
      ops_after = [o for o, a in items[i + 1:] if not (o is sre.AT and a in _END_ANCHORS)]
      nodes.append(self.item(op, av, flags, first and not ops_before, last and not ops_after))
    return seq(*nodes)

  def item(self, op, av, flags: int, first: bool, last: bool):
    ascii_only = bool(flags & sre.SRE_FLAG_ASCII) or not self.unicode
    if op is sre.LITERAL:
      return chars([(av, av)])
    if op is sre.NOT_LITERAL:
      return chars(subtract(UNIVERSE, ((av, av),)))
    if op is sre.ANY:
      return chars(UNIVERSE if flags & sre.SRE_FLAG_DOTALL else subtract(UNIVERSE, ((10, 10),)))
    if op is sre.IN:
      return chars(self.char_class(av, not ascii_only))
    if op is sre.BRANCH:
      return alt(*(self.items(branch, flags, first, last) for branch in av[1]))
    if op is sre.SUBPATTERN:
      _, add, remove, sub = av
      return self.items(sub, (flags | add) & ~remove, first, last)
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
      lo, hi, sub = av
      return repeat(self.items(sub, flags, False, False), lo, None if hi == sre.MAXREPEAT else hi)
    if op is sre.AT:
      if (av in _START_ANCHORS and first) or (av in _END_ANCHORS and last):
        return EPSILON
      self.refuse("a word boundary (\\b or \\B)" if av in (sre.AT_BOUNDARY, sre.AT_NON_BOUNDARY) else
                  "an anchor (^, $, \\A, \\Z) away from the pattern's start or end")
    self.refuse(_REFUSED.get(op, f"the construct {op}"))

  def char_class(self, items, unicode: bool) -> Ranges:
    negate, ranges = False, []
    for op, av in items:
      if op is sre.NEGATE:
        negate = True
      elif op is sre.LITERAL:
        ranges.append((av, av))
      elif op is sre.RANGE:
        ranges.append(av)
      elif op is sre.CATEGORY:
        ranges.extend(_category(av, unicode))
      else:
        self.refuse(f"the class item {op}")
    ranges = normalize(ranges)
    return subtract(UNIVERSE, ranges) if negate else ranges

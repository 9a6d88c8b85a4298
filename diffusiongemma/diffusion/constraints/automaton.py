"""Token automata: a regex or JSON schema as a finite automaton over a tokenizer's vocabulary.

`TokenAutomaton` is a deterministic automaton whose letters are token ids: from state s, token v leads
to `next_state[s, v]`, or to the dead state (`num_states`) when no string of the language continues
with v's bytes. Built in four steps:

1. The regex (Python `re` syntax, read by `regexp.parse`; or a JSON schema, compiled by
   `json_schema.compile_schema`) becomes a syntax tree whose meaning is fixed by us (ASCII \\d \\w \\s
   unless `unicode=True`; unsupported constructs and keywords refused), written out in the engine's
   syntax; `outlines-core` compiles that into a byte-level DFA: an `outlines_core.Index` over a vocabulary
   of the 256 single bytes is exactly that DFA (Q states).
2. Byte classes: bytes with identical DFA columns are interchangeable (K classes), so every token is
   rewritten as a string of byte classes and equal strings are walked once.
3. Every distinct token string is walked from every DFA state at once, along a trie of the strings
   (one gather per trie node and chunk of states: about Q x trie-nodes gathers, memory bounded by
   chunking). Tokens whose next-state columns are equal form one *token class*: the automaton is
   stored as `transitions [S, M]` over M classes plus `token_class [V]`, and the dense [S, V] table is
   `transitions[:, token_class]` (materialise it only for small vocabularies).
4. States no token string reaches from the start, or from which no accepting state can be reached,
   are dropped (their transitions become dead), and classes are merged again on what is left. The start
   state is numbered 0.

Ending: text may stop only in an accepting state. A stop token (eos, end of turn) leads from every
accepting state to the `stopped` state, which is accepting and loops on the `after_stop` tokens only:
by default the stop tokens and pad, since the released model is trained with responses padded by eos
(and the sampler pads everything after the first stop token when it commits a canvas). So a fixed-length
canvas is valid when it is an accepted string, or an accepted string, a stop token, then fill.
`distance[s]` is the fewest tokens from s to acceptance: "can still be finished within n tokens" is
`distance <= n`.

Cost: determinising a regex can take exponential time and memory (`(a|b)*a(a|b){17}` has 2^18 byte-DFA
states), and a JSON schema's `$ref`s can multiply its regex. A `budget.Budget` bounds a build: the
subschemas compiled, the regex's length before the DFA is built, the byte DFA's states (Q: the lift walks
Q x trie nodes) and the token automaton's (S: the sampler's tables are [S, M]), and a deadline checked
between the steps and inside the schema compiler and the lift; past one, `BudgetExceeded` names it. The
byte DFA itself is built in one call that cannot be interrupted: only a separate process bounds its time
and memory (the server builds there: `serving.constraints`).

Axes: S states, M token classes, V vocab, Q byte-DFA states, K byte classes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from diffusiongemma.diffusion.constraints import json_schema as json_schema_lib
from diffusiongemma.diffusion.constraints.budget import Budget
from diffusiongemma.diffusion.constraints import regexp
from diffusiongemma.diffusion.constraints import vocabulary as vocab_lib

_UNREACHABLE = np.iinfo(np.int32).max
_MARKER = "\\x{10FFFF}"  # the byte DFA's start marker (see `_byte_dfa`)
_MARKER_BYTES = chr(0x10FFFF).encode("utf-8")
_CHUNK_BYTES = 64 << 20  # memory for one chunk of the trie walk

@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
  """A deterministic automaton over token ids, stored by token class (see the module docstring).

  transitions [S, M] int32: next state per state and token class; `num_states` is the dead state.
  token_class [V] int32: each token's class; the last class (`dead_class`) is never allowed.
  accepting [S] bool: states where the output may end (the `stopped` state included).
  distance [S] int32: fewest tokens from each state to an accepting state.
  """

  transitions: np.ndarray
  token_class: np.ndarray
  accepting: np.ndarray
  distance: np.ndarray
  start: int
  stopped: int
  stop_tokens: tuple[int, ...]
  after_stop_tokens: tuple[int, ...]
  regex: str  # in the engine's syntax (`regexp.emit`)
  build_seconds: float = 0.0

  @property
  def num_states(self) -> int:
    return self.transitions.shape[0]

  @property
  def num_classes(self) -> int:
    return self.transitions.shape[1]

  @property
  def vocab_size(self) -> int:
    return self.token_class.shape[0]

  @property
  def dead(self) -> int:
    return self.num_states

  @property
  def dead_class(self) -> int:
    return self.num_classes - 1

  @property
  def num_edges(self) -> int:
    """Live (state, class) transitions: the work of one position of the dynamic program."""
    return int(np.sum(self.transitions != self.dead))

  @property
  def nbytes(self) -> int:
    """Bytes of the compact form (transitions, token classes, accepting, distances)."""
    return sum(a.nbytes for a in (self.transitions, self.token_class, self.accepting, self.distance))

  @property
  def dense_nbytes(self) -> int:
    """Bytes a dense int32 [S, V] next-state table would take."""
    return 4 * self.num_states * self.vocab_size

  def next_state(self) -> np.ndarray:
    """The dense next-state table [S, V] int32 (dead = `num_states`); O(S V) memory."""
    return self.transitions[:, self.token_class]

  def allowed(self, state: int | None = None) -> np.ndarray:
    """Tokens allowed from `state` [V] bool, or from every state [S, V] when None."""
    if state is None:
      return self.next_state() != self.dead
    return self.transitions[state, self.token_class] != self.dead

  def finishable_within(self, n: int) -> np.ndarray:
    """[S] bool: states from which acceptance can be reached in at most n more tokens."""
    return self.distance <= n

  def advance(self, tokens: Iterable[int], state: int | None = None) -> int:
    """The state after `tokens` from `state` (default: the start); `dead` once a token is refused."""
    state = self.start if state is None else state
    for token in tokens:
      if state == self.dead:
        break
      state = int(self.transitions[state, self.token_class[int(token)]])
    return state

  def accepts(self, tokens: Iterable[int]) -> bool:
    """Whether a complete output (with any stop token and fill after it) is valid."""
    state = self.advance(tokens)
    return state != self.dead and bool(self.accepting[state])

  def check_length(self, max_tokens: int) -> None:
    """Raises unless some valid output fits in `max_tokens` tokens (call before compiling)."""
    need = int(self.distance[self.start])
    if need > max_tokens:
      raise ValueError(f"The constraint needs at least {need} tokens but only {max_tokens} are "
                       f"available (max_new_tokens); raise max_new_tokens to {need} or more.")

  def stats(self) -> dict:
    """Sizes and build time, for reports and benchmark JSON."""
    return dict(states=self.num_states, token_classes=self.num_classes, vocab_size=self.vocab_size,
                edges=self.num_edges, compact_bytes=self.nbytes, dense_bytes=self.dense_nbytes,
                min_tokens=int(self.distance[self.start]), build_seconds=round(self.build_seconds, 3),
                regex_chars=len(self.regex))


# ---------------------------------------------------------------------------------------- builders
def from_regex(regex: str, vocabulary, vocab_size: int | None = None, *, stop_tokens: Sequence[int],
               pad_id: int | None = None, after_stop_tokens: Sequence[int] | None = None,
               disallowed_tokens: Sequence[int] = (), unicode: bool = False,
               budget: Budget | None = None) -> TokenAutomaton:
  """The automaton of `regex` (Python `re` syntax, matched in full, over UTF-8 text) over a vocabulary.

  vocabulary: `{id: bytes | str}` of the text tokens, or a tokenizer (see `vocabulary.from_tokenizer`).
  vocab_size: the model's vocabulary (ids beyond the tokenizer's are never allowed); default: max id + 1.
  stop_tokens: ids that end the output (allowed in accepting states only); at least one.
  after_stop_tokens: ids allowed after a stop token; default: the stop tokens and `pad_id`.
  disallowed_tokens: ids never allowed (e.g. the mask token of masked noise).
  unicode: \\d, \\w, \\s mean Python's Unicode classes (default: ASCII, `[0-9]` etc.; see `regexp`).
  budget: the build's limits (`Budget`; None: none).
  Raises ValueError when the regex is invalid (with Python's reason and position), uses a construct a
  constraint cannot enforce, or no token string matches it; `BudgetExceeded` past a limit.
  """
  return from_tree(regexp.parse(regex, unicode=unicode), vocabulary, vocab_size, stop_tokens=stop_tokens,
                   pad_id=pad_id, after_stop_tokens=after_stop_tokens, disallowed_tokens=disallowed_tokens,
                   description=f"regex {regex[:200]!r}", budget=budget)


def schema_regex(schema: Mapping | str, whitespace_pattern: str | None = None, *, unicode: bool = False) -> str:
  """The regex (in the engine's syntax) of the JSON texts valid under `schema`; raises ValueError for a
  keyword it cannot enforce, naming it and its path (`json_schema`)."""
  return regexp.emit(json_schema_lib.compile_schema(schema, whitespace_pattern=whitespace_pattern,
                                                    unicode=unicode))


def from_json_schema(schema: Mapping | str, vocabulary, vocab_size: int | None = None, *,
                     whitespace_pattern: str | None = None, unicode: bool = False, **kwargs) -> TokenAutomaton:
  """The automaton of the JSON texts valid under `schema` (a dict or JSON text); kwargs: `from_regex`.

  whitespace_pattern: the regex of the whitespace allowed between JSON tokens (default: at most one
  space). Every keyword is enforced or refused with a ValueError naming it (`json_schema`).
  """
  budget = kwargs.pop("budget", None) or Budget()
  deadline = budget.deadline()  # one deadline for the compilation and the automaton
  tree = json_schema_lib.compile_schema(schema, whitespace_pattern=whitespace_pattern, unicode=unicode,
                                        budget=budget)
  return from_tree(tree, vocabulary, vocab_size, description="JSON schema", budget=budget, deadline=deadline,
                   **kwargs)


def from_tree(tree, vocabulary, vocab_size: int | None = None, *, stop_tokens: Sequence[int],
              pad_id: int | None = None, after_stop_tokens: Sequence[int] | None = None,
              disallowed_tokens: Sequence[int] = (), description: str = "regex",
              budget: Budget | None = None, deadline: float | None = None) -> TokenAutomaton:
  """The automaton of a `regexp` syntax tree (see `from_regex` for the arguments; `deadline`: the budget's,
  when the build started earlier, in `time.monotonic()` seconds)."""
  start_time = time.perf_counter()
  budget = budget or Budget()
  deadline = budget.deadline() if deadline is None else deadline
  tokens = vocab_lib.from_tokenizer(vocabulary)
  stop_tokens = tuple(int(t) for t in stop_tokens)
  if not stop_tokens:
    raise ValueError("stop_tokens is empty: a constrained output needs at least one stop token (eos).")
  if after_stop_tokens is None:
    after_stop_tokens = stop_tokens + (() if pad_id is None else (int(pad_id),))
  after_stop_tokens = tuple(dict.fromkeys(int(t) for t in after_stop_tokens))
  special = set(stop_tokens) | set(after_stop_tokens) | {int(t) for t in disallowed_tokens}
  size = vocab_size if vocab_size is not None else max([*tokens, *special]) + 1
  bad = sorted(t for t in set(tokens) | special if not 0 <= t < size)
  if bad:
    raise ValueError(f"Token ids {bad[:10]} are outside the vocabulary [0, {size}).")
  text_tokens = {t: b for t, b in tokens.items() if t not in special}
  if tree == regexp.EMPTY:
    raise ValueError(f"The {description} matches no text at all (it is unsatisfiable).")
  regex = regexp.emit(tree)
  budget.check("max_regex_chars", len(regex), "regex length in characters")
  byte_next, final, q0 = _byte_dfa(regex, description)
  budget.check("max_dfa_states", byte_next.shape[0] - 1, "byte-level DFA's number of states")
  budget.check_time(deadline)
  transitions, token_class = _lift(byte_next, text_tokens, size, lambda: budget.check_time(deadline))
  transitions, final = _prune(transitions, final, q0, description)
  budget.check("max_states", transitions.shape[0] + 1, "token automaton's number of states")
  budget.check_time(deadline)
  transitions, token_class, accepting, stopped = _add_stop(
      transitions, token_class, final, stop_tokens, after_stop_tokens)
  distance = _distance(transitions, accepting)
  return TokenAutomaton(transitions=transitions, token_class=token_class, accepting=accepting,
                        distance=distance, start=0, stopped=stopped, stop_tokens=stop_tokens,
                        after_stop_tokens=after_stop_tokens, regex=regex,
                        build_seconds=time.perf_counter() - start_time)


# ---------------------------------------------------------------------------------------- steps
def _byte_dfa(regex: str, description: str = "regex") -> tuple[np.ndarray, np.ndarray, int]:
  """(next state [Q + 1, 256] int32 with dead = Q, final [Q] bool, start) of the regex's byte DFA.

  An outlines-core `Index` over the 256 single bytes is the byte DFA, with the regex wrapped as
  `(?:regex)$`. Without the end anchor, outlines-core 0.2's DFA (regex-automata, leftmost-first) has two
  defects for full-match use, both seen here: it drops the threads of lower priority once one matches
  (`a|ab` refuses "ab"), and it reports matches one byte late, so a token that leaves an accepting
  state for a non-accepting one is dropped (`(ab)+` allows nothing after "ab"). With `$` no thread
  matches before the end of the text, so neither happens; acceptance is then "the end of text matches".
  A U+10FFFF prefix (our start is the state after its four bytes) keeps the start state free of the
  anchor's context (regex-automata has no universal start state when `$` could hold at the very start);
  `regexp` never lets a regex match that code point, because a prefix that can recur inside the regex
  makes the engine's unanchored DFA (built alongside) blow up exponentially in the repeat counts.
  """
  import outlines_core  # pylint: disable=import-outside-toplevel
  vocab = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})
  try:
    index = outlines_core.Index(f"{_MARKER}(?:{regex})$", vocab)
  except ValueError as e:
    if "incompatible with the regex" in str(e):
      raise ValueError(f"The {description} matches no text at all (it is unsatisfiable).") from None
    raise ValueError(f"Cannot compile the {description} (as {regex[:200]!r}): {e}") from None
  edges = index.get_transitions()
  start = index.get_initial_state()
  finals = set(index.get_final_states())
  ids = sorted(set(edges) | {n for row in edges.values() for n in row.values()} | {start} | finals)
  number = {s: i for i, s in enumerate(ids)}
  q = len(ids)
  table = np.full((q + 1, 256), q, np.int32)
  for s, row in edges.items():
    for b, n in row.items():
      if b < 256:  # 256 is the eos letter outlines adds to final states
        table[number[s], b] = number[n]
  final = np.zeros(q, bool)
  final[[number[s] for s in finals]] = True
  state = number[start]
  for byte in _MARKER_BYTES:
    state = table[state, byte]
  return table, final, int(state)


@dataclasses.dataclass(frozen=True)
class _Trie:
  """The prefixes of a list of strings, numbered level by level (a parent before its children)."""

  parent: np.ndarray  # [N] int64: the node without its last letter (the root is its own parent)
  letter: np.ndarray  # [N] int64: the last letter
  level_start: list[int]  # nodes of depth d are level_start[d - 1]:level_start[d]
  leaf: np.ndarray  # [len(strings)] int64: the node of each string

  @classmethod
  def build(cls, strings: Sequence[bytes]) -> _Trie:
    nodes: dict[bytes, int] = {b"": 0}
    parent, letter, depth = [0], [0], [0]
    for s in strings:
      node = 0
      for d in range(1, len(s) + 1):
        child = nodes.get(s[:d])
        if child is None:
          child = nodes[s[:d]] = len(parent)
          parent.append(node)
          letter.append(s[d - 1])
          depth.append(d)
        node = child
    depth = np.asarray(depth)
    order = np.argsort(depth, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    level_start = np.searchsorted(depth[order], np.arange(1, depth.max() + 2)).tolist()
    return cls(parent=rank[np.asarray(parent)[order]], letter=np.asarray(letter, np.int64)[order],
               level_start=level_start, leaf=rank[np.asarray([nodes[s] for s in strings], np.int64)])

  def walk(self, class_next: np.ndarray, states: np.ndarray) -> np.ndarray:
    """next state [len(strings), len(states)] of each string from each of `states`.

    One gather per trie node and state, in chunks of states; `class_next` [Q + 1, K] has its dead row
    last (dead stays dead).
    """
    dtype = np.int16 if class_next.shape[0] < 2**15 else np.int32
    table = class_next.astype(dtype)
    out = np.empty((len(self.leaf), len(states)), np.int32)
    chunk = max(1, _CHUNK_BYTES // (len(self.parent) * np.dtype(dtype).itemsize))
    for lo in range(0, len(states), chunk):
      node_state = np.empty((len(self.parent), len(states[lo:lo + chunk])), dtype)  # [nodes, chunk]
      node_state[0] = states[lo:lo + chunk]
      for a, b in zip(self.level_start[:-1], self.level_start[1:]):
        node_state[a:b] = table[node_state[self.parent[a:b]], self.letter[a:b, None]]
      out[:, lo:lo + chunk] = node_state[self.leaf]
    return out


def _lift(byte_next: np.ndarray, tokens: Mapping[int, bytes], vocab_size: int, check_time=lambda: None
          ) -> tuple[np.ndarray, np.ndarray]:
  """Token-level (transitions [Q, M] with dead = Q and a dead last class, token_class [V]); `check_time()`
  is called between chunks of states (it raises to stop)."""
  q = byte_next.shape[0] - 1
  columns, byte_class = np.unique(byte_next[:q].T, axis=0, return_inverse=True)
  byte_class = byte_class.reshape(-1)
  class_next = np.concatenate([columns.T, np.full((1, len(columns)), q, np.int32)])  # [Q + 1, K]
  translate = bytes(byte_class.astype(np.uint8).tolist())  # byte -> its class, as a bytes.translate table
  strings: dict[bytes, int] = {}
  token_string = {}
  for token_id, value in tokens.items():
    token_string[token_id] = strings.setdefault(value.translate(translate), len(strings))
  unique = list(strings)
  # Token classes: equal next-state columns. Refine a partition of the strings chunk by chunk of DFA
  # states, each chunk's columns hashed and the classes checked member by member (hashes only propose).
  labels = np.zeros(len(unique), np.int64)
  all_states = np.arange(q, dtype=np.int32)
  step = max(1, (_CHUNK_BYTES // 8) // max(len(unique), 1))
  rng = np.random.default_rng(0)
  trie = _Trie.build(unique)
  for lo in range(0, q, step):
    check_time()
    cols = trie.walk(class_next, all_states[lo:lo + step]).astype(np.uint64)  # [R, chunk]
    weights = rng.integers(1, 2**63, cols.shape[1], dtype=np.uint64) | np.uint64(1)
    key = (cols * weights[None]).sum(axis=1) + labels.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    _, first, new = np.unique(key, return_index=True, return_inverse=True)
    if not np.array_equal(cols, cols[first[new]]) or not np.array_equal(labels, labels[first[new]]):
      _, new = np.unique(np.column_stack([labels.astype(np.uint64), cols]), axis=0, return_inverse=True)
    labels = new.reshape(-1)
  num_text = int(labels.max()) + 1 if len(unique) else 0
  representative = np.unique(labels, return_index=True)[1]
  table = _Trie.build([unique[r] for r in representative]).walk(class_next, all_states).T  # [Q, M_text]
  transitions = np.concatenate([table, np.full((q, 1), q, np.int32)], axis=1)  # + the dead class
  token_class = np.full(vocab_size, num_text, np.int32)
  for token_id, s in token_string.items():
    token_class[token_id] = labels[s]
  return transitions.astype(np.int32), token_class


def _reachable(transitions: np.ndarray, start: int) -> np.ndarray:
  dead = transitions.shape[0]
  seen = np.zeros(dead + 1, bool)
  frontier = np.asarray([start])
  seen[start] = True
  while frontier.size:
    nxt = np.unique(transitions[frontier])
    nxt = nxt[~seen[nxt]]
    seen[nxt] = True
    frontier = nxt[nxt != dead]
  return seen[:dead]


def _distance(transitions: np.ndarray, accepting: np.ndarray) -> np.ndarray:
  """Fewest tokens from each state to an accepting state (backward breadth-first search)."""
  dead = transitions.shape[0]
  distance = np.where(accepting, 0, _UNREACHABLE).astype(np.int64)
  padded = np.append(distance, _UNREACHABLE)
  while True:
    padded[:dead] = np.minimum(padded[:dead], padded[transitions].min(axis=1) + 1)
    if np.array_equal(padded[:dead], distance):
      return np.minimum(distance, _UNREACHABLE).astype(np.int32)
    distance = padded[:dead].copy()


def _prune(transitions: np.ndarray, final: np.ndarray, start: int, description: str
           ) -> tuple[np.ndarray, np.ndarray]:
  """Keeps the states reachable from the start that can still reach a final state, the start first."""
  useful = _reachable(transitions, start) & (_distance(transitions, final) < _UNREACHABLE)
  if not useful[start]:
    raise ValueError(f"No string of tokens of this vocabulary matches the {description}.")
  useful[start] = False
  keep = np.concatenate([[start], np.flatnonzero(useful)])
  number = np.full(transitions.shape[0] + 1, len(keep), np.int32)
  number[keep] = np.arange(len(keep))
  return number[transitions[keep]], final[keep]


def _add_stop(transitions, token_class, final, stop_tokens, after_stop_tokens):
  """Adds the stopped state and the stop / fill tokens, then merges equal class columns."""
  s, dead = transitions.shape[0], transitions.shape[0] + 1
  text = np.where(transitions == s, dead, transitions)  # the old dead id becomes the stopped state
  special = list(dict.fromkeys(stop_tokens + after_stop_tokens))
  extra = np.full((s + 1, len(special)), dead, np.int32)
  for j, token in enumerate(special):
    if token in stop_tokens:
      extra[:s][final, j] = s
    if token in after_stop_tokens:
      extra[s, j] = s
  # The old dead class stays an all-dead column, so exactly one merged class is dead.
  table = np.concatenate([np.concatenate([text, np.full((1, text.shape[1]), dead)]), extra], axis=1)
  classes = token_class.copy()
  classes[special] = text.shape[1] + np.arange(len(special))
  columns, merged = np.unique(table.T, axis=0, return_inverse=True)
  merged = merged.reshape(-1)
  order = np.argsort(np.all(columns == dead, axis=1), kind="stable")  # live classes, then the dead one
  rank = np.empty_like(order)
  rank[order] = np.arange(len(order))
  transitions = columns[order].T.astype(np.int32)  # [S + 1, M]
  accepting = np.append(final, True)
  return (np.ascontiguousarray(transitions), rank[merged][classes].astype(np.int32), accepting, s)

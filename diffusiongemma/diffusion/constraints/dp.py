"""Dynamic programs over (canvas position, automaton state): the constrained argmax canvas and the
tokens that can still lead to an accepted output. Pure JAX, batched, jit-compatible (`lax.scan`).

A canvas of C positions with per-position scores `scores [B, C, V]` (logits or log-probabilities: a
per-position constant does not change the argmax) is read by a `TokenAutomaton` from a per-row start
state. The best canvas the automaton can follow, ending in a state allowed by `end_ok [B, S]`, is

    alpha[0] = 0 at start, -inf elsewhere
    alpha[i + 1][t] = max over edges (s, m, t) of alpha[i][s] + class_score[i][m]
    class_score[i][m] = max over tokens v of class m of scores[i, v]

(a max-product / Viterbi pass; tokens of one class lead to the same state from every state, so the best
token string is the best class string with the best token of each class; classes are further gathered
into groups per state pair, see `AutomatonTables`). A backward pass recovers the
path, then each position's token is the best one of its class. Positions held fixed (`given` [B, C],
e.g. accepted tokens of masked noise or infilling's given text) allow only their token. Work per
position: one reduction over V (class scores), one over the P group members and one over the E state
pairs, so O(B C (V + P + E)).

Reachability is the same recursion in the boolean semiring, forward and backward: a token is allowed at
position i when some accepted canvas through the fixed positions uses it there. Run backward over the
whole output, it gives each canvas's end condition (`canvas_ends`): the states from which the held
tokens of every later canvas, the stop token and pad, and the output's length still allow acceptance.

Tables may be padded to bucketed sizes (`AutomatonTables.from_automaton(..., padded=True)`): extra
states are unreachable, extra classes hold no token, extra groups and edges join only those, so every
result is the same; automata of similar size then share one compiled program.

Axes: B batch, C canvas, V vocab, S states, M token classes, G class groups, P group members,
E edges (state pairs).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma.diffusion.constraints.automaton import TokenAutomaton

Array = jax.Array
_NEG = -jnp.inf


@flax.struct.dataclass
class AutomatonTables:
  """A `TokenAutomaton` as device arrays, the constraint's input to a compiled program (a pytree).

  Edges join state pairs: edge (src, g, dst) stands for all classes that lead from src to dst, the
  class group g. Many state pairs share a group (in a JSON string, "any content token" leads from every
  character-count state to the next), so a position costs one max over the group members (P) and one
  over the state pairs (E), instead of one over every live (state, class) transition.
  """

  token_class: Array  # [V] int32; the last class never allowed
  transitions: Array  # [S + 1, M] int32; row S (dead) stays dead
  member_class: Array  # [P] int32: the classes of each group, listed group by group
  member_group: Array  # [P] int32
  group_size: Array  # [G] int32: members per group (its shape gives G to the compiled program)
  edge_src: Array  # [E] int32: the live state pairs
  edge_group: Array  # [E] int32
  edge_dst: Array  # [E] int32
  distance: Array  # [S] int32: fewest tokens to acceptance
  accepting: Array  # [S] bool

  @classmethod
  def from_automaton(cls, automaton: TokenAutomaton, padded: bool = False,
                     min_sizes: tuple[int, ...] | None = None) -> AutomatonTables:
    """The tables of `automaton`; `padded`: every axis rounded up by `bucket` (at least one spare entry
    each), and to at least `min_sizes` (`sizes` order), so that programs compiled for one automaton serve
    all automata of the same padded sizes (states keep their ids; the dead state becomes the padded
    `num_states`)."""
    t = automaton.transitions
    groups: dict[bytes, int] = {}
    members, src, grp, dst = [], [], [], []
    for state in range(t.shape[0]):
      row = t[state]
      for target in np.unique(row[row != automaton.dead]):
        klasses = np.flatnonzero(row == target).astype(np.int32)
        key = klasses.tobytes()
        if key not in groups:
          groups[key] = len(groups)
          members.append(klasses)
        src.append(state)
        grp.append(groups[key])
        dst.append(target)
    member_group = np.concatenate([np.full(len(m), g, np.int32) for g, m in enumerate(members)] or
                                  [np.zeros(0, np.int32)])
    member_class = np.concatenate(members or [np.zeros(0, np.int32)])
    sizes = [len(m) for m in members]
    distance, accepting = automaton.distance, automaton.accepting
    if padded:  # one spare state s0, class m0 and group g0 at least; spare members and edges use only them
      s0, m0, g0, p0, e0 = len(distance), t.shape[1], len(members), len(member_class), len(src)
      s, m, g, p, e = (max(bucket(n + 1), least) for n, least in zip((s0, m0, g0, p0, e0), min_sizes or (0,) * 5))
      t = np.pad(np.where(t == automaton.dead, s, t), ((0, s - s0), (0, m - m0)), constant_values=s)
      member_class = np.pad(member_class, (0, p - p0), constant_values=m0)
      member_group = np.pad(member_group, (0, p - p0), constant_values=g0)
      sizes = sizes + [p - p0] + [0] * (g - g0 - 1)
      src, grp, dst = (np.pad(np.asarray(x, np.int32), (0, e - e0), constant_values=v)
                       for x, v in ((src, s0), (grp, g0), (dst, s0)))
      distance = np.pad(distance, (0, s - s0), constant_values=np.iinfo(np.int32).max)
      accepting = np.pad(accepting, (0, s - s0))
    dead_row = np.full((1, t.shape[1]), t.shape[0], np.int32)
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))
    return cls(token_class=i32(automaton.token_class), transitions=i32(np.concatenate([t, dead_row])),
               member_class=i32(member_class), member_group=i32(member_group), group_size=i32(sizes),
               edge_src=i32(src), edge_group=i32(grp), edge_dst=i32(dst), distance=i32(distance),
               accepting=jnp.asarray(accepting))

  @property
  def sizes(self) -> tuple[int, int, int, int, int]:
    """(states, classes, groups, group members, edges): the shapes a compiled program depends on."""
    return (self.distance.shape[0], self.transitions.shape[1], self.group_size.shape[0],
            self.member_class.shape[0], self.edge_src.shape[0])

  @property
  def num_states(self) -> int:
    return self.distance.shape[0]

  @property
  def num_classes(self) -> int:
    return self.transitions.shape[1]

  @property
  def num_groups(self) -> int:
    return self.group_size.shape[0]

  def group_scores(self, cs: Array) -> Array:
    """[..., G]: the best class score of each group, from class scores [..., M]."""
    vals = jnp.moveaxis(cs[..., self.member_class], -1, 0)  # [P, ...]
    best = jax.ops.segment_max(vals, self.member_group, num_segments=self.num_groups,
                               indices_are_sorted=True)
    return jnp.moveaxis(best, 0, -1)


def bucket(n: int) -> int:
  """n rounded up to a size class: at least 64, then 8 classes per doubling (at most 1/8 added)."""
  step = max(1, 1 << max(n.bit_length() - 4, 0))
  return max(64, -(-n // step) * step)


@flax.struct.dataclass
class ViterbiResult:
  tokens: Array  # [B, C] int32: the constrained argmax canvas (the unconstrained one where infeasible)
  end_state: Array  # [B] int32: the state after the canvas (S, dead, where infeasible)
  score: Array  # [B] float32: the canvas's summed score (-inf where infeasible)
  feasible: Array  # [B] bool: some canvas through the fixed positions is accepted


def end_mask(tables: AutomatonTables, remaining: Array) -> Array:
  """[B, S] bool: states from which acceptance is reachable within `remaining` [B] more tokens.

  The last canvas of an output uses remaining = 0 (end accepting, or stopped); an earlier one the
  positions still to come after it.
  """
  return tables.distance[None, :] <= jnp.asarray(remaining)[:, None]


def canvas_ends(tables: AutomatonTables, num_canvases: int, tokens: Array, given: Array | None = None) -> Array:
  """[K, B, S] bool: the states each of K canvases may end in, so that the rest of the output can still
  be completed: the tokens [B, K * C] held where `given` [B, K * C] is set (a stop token and pad among
  them) read in place, free positions filled by any token the automaton allows (a stop token and pad
  included), and the last canvas ending accepted. Computed backward over the later canvases' positions
  (a boolean reachability pass); without held tokens, the distance test `end_mask(positions after)`."""
  b, total = tokens.shape
  c = total // num_canvases
  if given is None:
    after = (num_canvases - 1 - jnp.arange(num_canvases)) * c  # [K]
    return jnp.broadcast_to(tables.distance[None, None, :] <= after[:, None, None],
                            (num_canvases, b, tables.num_states))
  ok = _fixed_class_mask(tables, given, jnp.asarray(tokens, jnp.int32), (b, total))  # [B, K*C, M]
  gs = tables.group_scores(jnp.where(ok, 0.0, _NEG)).reshape(b, num_canvases, c, -1)  # [B, K, C, G]
  step = _backward_step(tables)

  def canvas(end, gs_k):  # end [B, S]: where canvas k + 1 may end; gs_k [B, C, G]: canvas k + 1
    start = jax.lax.scan(lambda beta, g: (step(beta, g), None), end, jnp.moveaxis(gs_k, 1, 0),
                         reverse=True)[0]
    return start, end

  last = jnp.broadcast_to(jnp.where(tables.accepting, 0.0, _NEG), (b, tables.num_states))
  first, later = jax.lax.scan(canvas, last, jnp.moveaxis(gs[:, 1:], 1, 0), reverse=True)  # [B, S], [K-1, B, S]
  return jnp.concatenate([first[None], later], axis=0) > _NEG


def advance(tables: AutomatonTables, state: Array, tokens: Array) -> Array:
  """The states [B] after reading `tokens` [B, C] from `state` [B] (S, dead, once refused)."""
  def step(s, token):
    return tables.transitions[s, tables.token_class[token]], None
  return jax.lax.scan(step, state, tokens.T)[0]


def _fixed_class_mask(tables: AutomatonTables, given: Array | None, given_tokens: Array | None,
                      shape) -> Array:
  """[B, C, M] bool: classes allowed at each position (only the given token's class where given)."""
  allowed = jnp.ones(shape[:2] + (tables.num_classes,), bool)
  if given is None:
    return allowed
  one = tables.token_class[given_tokens][..., None] == jnp.arange(tables.num_classes)  # [B, C, M]
  return jnp.where(given[..., None], one, allowed)


def class_scores(tables: AutomatonTables, scores: Array) -> Array:
  """[B, C, M]: the best score among each class's tokens, per position (-inf for empty classes)."""
  b, c, v = scores.shape
  flat = scores.reshape(b * c, v).astype(jnp.float32).T  # [V, B*C]
  best = jax.ops.segment_max(flat, tables.token_class, num_segments=tables.num_classes)  # [M, B*C]
  return best.T.reshape(b, c, tables.num_classes)


def _forward(tables: AutomatonTables, gs: Array, start: Array) -> tuple[Array, Array, Array]:
  """Max-semiring forward pass over group scores gs [B, C, G].

  Returns (alpha before each position [C, B, S], after the last one [B, S], backpointers [C, B, S]:
  the lowest best edge into each state at each position).
  """
  s, e = tables.num_states, tables.edge_src.shape[0]
  alpha0 = jnp.where(jnp.arange(s)[None] == start[:, None], 0.0, _NEG)  # [B, S]

  def step(alpha, gs_i):  # alpha [B, S], gs_i [B, G]
    vals = alpha[:, tables.edge_src] + gs_i[:, tables.edge_group]  # [B, E]
    nxt = jax.ops.segment_max(vals.T, tables.edge_dst, num_segments=s)  # [S, B]
    best = jnp.where(vals.T == nxt[tables.edge_dst], jnp.arange(e)[:, None], e)  # [E, B]
    pointer = jax.ops.segment_min(best, tables.edge_dst, num_segments=s)  # [S, B]
    return nxt.T, (alpha, pointer.T)

  last, (alphas, pointers) = jax.lax.scan(step, alpha0, jnp.moveaxis(gs, 1, 0))
  return alphas, last, pointers


def _backward_step(tables: AutomatonTables):
  """`step(beta after position i [B, S], group scores at i [B, G]) -> beta before i`."""
  def step(beta, gs_i):
    vals = gs_i[:, tables.edge_group] + beta[:, tables.edge_dst]  # [B, E]
    return jax.ops.segment_max(vals.T, tables.edge_src, num_segments=tables.num_states).T  # [B, S]
  return step


def _backward(tables: AutomatonTables, gs: Array, end_ok: Array) -> Array:
  """beta [C + 1, B, S]: the best score of a suffix from each position and state that ends well."""
  beta_end = jnp.where(end_ok, 0.0, _NEG)  # [B, S]
  step = _backward_step(tables)
  first, betas = jax.lax.scan(lambda beta, gs_i: (step(beta, gs_i), beta), beta_end, jnp.moveaxis(gs, 1, 0),
                              reverse=True)
  return jnp.concatenate([first[None], betas], axis=0)


def _best_members(tables: AutomatonTables, cs: Array) -> tuple[Array, Array]:
  """(group scores [B, C, G], the best class of each group [B, C, G]) from class scores [B, C, M]."""
  gs = tables.group_scores(cs)
  vals = cs[..., tables.member_class]  # [B, C, P]
  hit = vals == gs[..., tables.member_group]
  index = jnp.where(hit, jnp.arange(vals.shape[-1]), vals.shape[-1])
  first = jax.ops.segment_min(jnp.moveaxis(index, -1, 0), tables.member_group,
                              num_segments=tables.num_groups, indices_are_sorted=True)  # [G, B, C]
  first = jnp.minimum(jnp.moveaxis(first, 0, -1), vals.shape[-1] - 1)
  return gs, tables.member_class[first]


def _masked_class_scores(tables, scores, given, given_tokens):
  """Class scores [B, C, M]; at a given position only the given token's class, with that token's score."""
  cs = class_scores(tables, scores)
  if given is None:
    return cs
  own = jnp.take_along_axis(scores, given_tokens[..., None], axis=-1).astype(jnp.float32)  # [B, C, 1]
  cs = jnp.where(given[..., None], own, cs)
  return jnp.where(_fixed_class_mask(tables, given, given_tokens, scores.shape), cs, _NEG)


def viterbi(tables: AutomatonTables, scores: Array, start: Array, end_ok: Array,
            given: Array | None = None, given_tokens: Array | None = None) -> ViterbiResult:
  """The highest-scoring canvas [B, C] the automaton follows from `start` [B] into `end_ok` [B, S].

  scores [B, C, V]: per-position log-probabilities or logits; given [B, C] bool with given_tokens
  [B, C]: positions whose token is held. Ties go to the lowest edge, then the lowest token id.
  """
  b, c, v = scores.shape
  start = jnp.asarray(start, jnp.int32)
  if given is not None:
    given_tokens = jnp.asarray(given_tokens, jnp.int32)
  cs = _masked_class_scores(tables, scores, given, given_tokens)  # [B, C, M]
  gs, best_class = _best_members(tables, cs)  # [B, C, G] each
  _, last, pointers = _forward(tables, gs, start)
  final = jnp.where(end_ok, last, _NEG)  # [B, S]
  end_state = jnp.argmax(final, axis=-1).astype(jnp.int32)
  score = jnp.max(final, axis=-1)
  feasible = score > _NEG

  def back(state, pointer_i):  # state [B], pointer_i [B, S]
    edge = jnp.minimum(jnp.take_along_axis(pointer_i, state[:, None], axis=-1)[:, 0],
                       tables.edge_src.shape[0] - 1)  # [B]
    return tables.edge_src[edge], tables.edge_group[edge]

  _, groups = jax.lax.scan(back, end_state, pointers, reverse=True)  # [C, B]
  path = jnp.take_along_axis(best_class, groups.T[..., None], axis=-1)[..., 0]  # [B, C]: classes
  in_class = tables.token_class[None, None, :] == path[..., None]  # [B, C, V]
  tokens = jnp.argmax(jnp.where(in_class, scores, _NEG), axis=-1).astype(jnp.int32)
  tokens = jnp.where(feasible[:, None], tokens, jnp.argmax(scores, axis=-1).astype(jnp.int32))
  if given is not None:
    tokens = jnp.where(given, given_tokens, tokens)
  end_state = jnp.where(feasible, end_state, tables.num_states)
  return ViterbiResult(tokens=tokens, end_state=end_state, score=score, feasible=feasible)


def allowed_classes(tables: AutomatonTables, start: Array, end_ok: Array, length: int,
                    given: Array | None = None, given_tokens: Array | None = None) -> Array:
  """[B, C, M] bool: classes that some accepted canvas through the given positions uses there."""
  b = start.shape[0]
  if given is not None:
    given_tokens = jnp.asarray(given_tokens, jnp.int32)
  ok = _fixed_class_mask(tables, given, given_tokens, (b, length))
  gs = tables.group_scores(jnp.where(ok, 0.0, _NEG))  # [B, C, G]
  alphas, _, _ = _forward(tables, gs, jnp.asarray(start, jnp.int32))  # [C, B, S]
  betas = _backward(tables, gs, end_ok)  # [C + 1, B, S]

  def per_position(alpha_i, beta_next, ok_i):  # [B, S], [B, S], [B, M]
    live = (alpha_i[:, tables.edge_src] > _NEG) & (beta_next[:, tables.edge_dst] > _NEG)  # [B, E]
    group_used = jax.ops.segment_max(live.T.astype(jnp.int32), tables.edge_group,
                                     num_segments=tables.num_groups).T  # [B, G]
    used = jax.ops.segment_max(group_used[:, tables.member_group].T, tables.member_class,
                               num_segments=tables.num_classes).T > 0  # [B, M]
    return used & ok_i

  out = jax.vmap(per_position)(alphas, betas[1:], jnp.moveaxis(ok, 1, 0))  # [C, B, M]
  return jnp.moveaxis(out, 0, 1)


def allowed_tokens(tables: AutomatonTables, start: Array, end_ok: Array, length: int,
                   given: Array | None = None, given_tokens: Array | None = None) -> Array:
  """[B, C, V] bool: tokens that keep the canvas completable (sampling and acceptance masks)."""
  classes = allowed_classes(tables, start, end_ok, length, given, given_tokens)
  allowed = jnp.take(classes, tables.token_class, axis=-1)  # [B, C, V]
  if given is None:
    return allowed
  held = jnp.arange(allowed.shape[-1]) == jnp.asarray(given_tokens)[..., None]
  return jnp.where(given[..., None], allowed & held, allowed)

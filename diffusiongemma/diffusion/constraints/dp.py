"""Dynamic programs over (canvas position, automaton state): the constrained argmax canvas and the
tokens that can still lead to an accepted output. Pure JAX, batched, jit-compatible (`lax.scan`).

A canvas of C positions with per-position scores `scores [B, C, V]` (logits or log-probabilities: a
per-position constant does not change the argmax) is read by a `TokenAutomaton` from a per-row start
state. The best canvas the automaton can follow, ending in a state allowed by `end_ok [B, S]`, is

    alpha[0] = 0 at start, -inf elsewhere
    alpha[i + 1][t] = max over edges (s, m, t) of alpha[i][s] + class_score[i][m]
    class_score[i][m] = max over tokens v of class m of scores[i, v]

(a max-product / Viterbi pass; tokens of one class lead to the same state from every state, so the best
token string is the best class string with the best token of each class). A backward pass recovers the
path, then each position's token is the best one of its class. Positions held fixed (`given` [B, C],
e.g. accepted tokens of masked noise or infilling's given text) allow only their token. Work per
position: one reduction over V (class scores) and one over the E live edges, so O(B C (V + E)).

Reachability is the same recursion in the boolean semiring, forward and backward: a token is allowed at
position i when some accepted canvas through the fixed positions uses it there.

Axes: B batch, C canvas, V vocab, S states, M token classes, E edges.
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
  """A `TokenAutomaton` as device arrays, the constraint's input to a compiled program (a pytree)."""

  token_class: Array  # [V] int32; the last class never allowed
  transitions: Array  # [S + 1, M] int32; row S (dead) stays dead
  edge_src: Array  # [E] int32: the live (state, class) -> state transitions
  edge_class: Array  # [E] int32
  edge_dst: Array  # [E] int32
  distance: Array  # [S] int32: fewest tokens to acceptance
  accepting: Array  # [S] bool

  @classmethod
  def from_automaton(cls, automaton: TokenAutomaton) -> AutomatonTables:
    t = automaton.transitions
    src, klass = np.nonzero(t != automaton.dead)
    dead_row = np.full((1, t.shape[1]), automaton.dead, np.int32)
    return cls(token_class=jnp.asarray(automaton.token_class),
               transitions=jnp.asarray(np.concatenate([t, dead_row])), edge_src=jnp.asarray(src, jnp.int32), edge_class=jnp.asarray(klass, jnp.int32),
               edge_dst=jnp.asarray(t[src, klass], jnp.int32), distance=jnp.asarray(automaton.distance),
               accepting=jnp.asarray(automaton.accepting))

  @property
  def num_states(self) -> int:
    return self.distance.shape[0]

  @property
  def num_classes(self) -> int:
    return self.transitions.shape[1]


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


def _forward(tables: AutomatonTables, cs: Array, start: Array) -> tuple[Array, Array]:
  """(alpha before each position [C, B, S], after the last one [B, S]) in the max semiring."""
  s = tables.num_states
  alpha0 = jnp.where(jnp.arange(s)[None] == start[:, None], 0.0, _NEG)  # [B, S]

  def step(alpha, cs_i):  # alpha [B, S], cs_i [B, M]
    vals = alpha[:, tables.edge_src] + cs_i[:, tables.edge_class]  # [B, E]
    nxt = jax.ops.segment_max(vals.T, tables.edge_dst, num_segments=s).T  # [B, S]
    return nxt, alpha

  last, alphas = jax.lax.scan(step, alpha0, jnp.moveaxis(cs, 1, 0))
  return alphas, last


def _backward(tables: AutomatonTables, cs: Array, end_ok: Array) -> Array:
  """beta [C + 1, B, S]: the best score of a suffix from each position and state that ends well."""
  s = tables.num_states
  beta_end = jnp.where(end_ok, 0.0, _NEG)  # [B, S]

  def step(beta, cs_i):
    vals = cs_i[:, tables.edge_class] + beta[:, tables.edge_dst]  # [B, E]
    prev = jax.ops.segment_max(vals.T, tables.edge_src, num_segments=s).T  # [B, S]
    return prev, beta

  first, betas = jax.lax.scan(step, beta_end, jnp.moveaxis(cs, 1, 0), reverse=True)
  return jnp.concatenate([first[None], betas], axis=0)


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
  alphas, last = _forward(tables, cs, start)
  final = jnp.where(end_ok, last, _NEG)  # [B, S]
  end_state = jnp.argmax(final, axis=-1).astype(jnp.int32)
  score = jnp.max(final, axis=-1)
  feasible = score > _NEG

  def back(state, inputs):  # state [B]
    alpha_i, cs_i = inputs
    vals = alpha_i[:, tables.edge_src] + cs_i[:, tables.edge_class]  # [B, E]
    vals = jnp.where(tables.edge_dst[None] == state[:, None], vals, _NEG)
    edge = jnp.argmax(vals, axis=-1)  # [B]
    return tables.edge_src[edge], tables.edge_class[edge]

  _, path = jax.lax.scan(back, end_state, (alphas, jnp.moveaxis(cs, 1, 0)), reverse=True)
  path = path.T  # [B, C]: the class at each position
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
  cs = jnp.where(ok, 0.0, _NEG)  # [B, C, M]
  alphas, _ = _forward(tables, cs, jnp.asarray(start, jnp.int32))  # [C, B, S]
  betas = _backward(tables, cs, end_ok)  # [C + 1, B, S]

  def per_position(alpha_i, beta_next, ok_i):  # [B, S], [B, S], [B, M]
    live = (alpha_i[:, tables.edge_src] > _NEG) & (beta_next[:, tables.edge_dst] > _NEG)  # [B, E]
    used = jax.ops.segment_max(live.T.astype(jnp.int32), tables.edge_class,
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

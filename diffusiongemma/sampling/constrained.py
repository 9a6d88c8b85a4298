"""Constrained denoising: every committed canvas is text that a token automaton (regex, JSON schema) accepts.

`Constraint` wraps a `diffusion.constraints.TokenAutomaton` built for a sampler (its vocabulary, stop
tokens, pad and never token); `Sampler.generate(..., constraint=c)` takes it as a static argument and
its tables (padded to bucketed sizes, `AutomatonTables.from_automaton(padded=True)`) as arrays. A
constraint compares equal to every other with the same padded table shapes, so constraints of similar
size (every small regex, say) share one compiled program; a sampler without one compiles exactly the
program it always did. Inside the program, each canvas gets a `CanvasConstraint` (the automaton's
tables, the state where the previous canvas ended, the states it may end in: `constraints.canvas_ends`,
computed backward through the held tokens of every later canvas) and its `sample_step` replaces the
streamed vocabulary end of a denoising step (`steps.plain_sample_step`):

1. allowed [B, C, V]: the tokens that some accepted canvas through the held positions (`fixed`: given
   text, masked noise's accepted tokens) uses at each position, from the start state into `end_ok`
   (reachability, `constraints.allowed_tokens`);
2. the tempered distribution restricted to them (disallowed tokens at `NEVER_LOGIT`): its statistics,
   soft embedding (self-conditioning), acceptance and draw, so no drawn token leaves the language;
3. re-noising as usual; then the committed (argmax) canvas is the constrained Viterbi canvas under the
   step's log-probabilities with the held positions (after re-noising) fixed (`constraints.viterbi`);
4. per-position draws can be jointly inconsistent (each token is on some accepted canvas, not all on
   the same one); when a row's held positions then admit no accepted canvas, that row's accepted tokens
   become those of the Viterbi canvas before the draw (always consistent) instead. This runs under a
   `lax.cond`, only in steps where some row needs it.

Cost: this path materialises the [B, C, V] scaled logits and masks (one head matmul over the whole
vocabulary, `vocab_chunk_size` is ignored; the draw is an inverse CDF over every position) plus two
dynamic programs over [C, S] per step; the plain path's streaming is kept for unconstrained samplers.

Canvas chaining: the automaton state after each committed canvas (pad after a stop token included) starts
the next one; a canvas that is not the last may end only in a state from which the positions still to
come, with the tokens held in them (infilling's given text, a given stop token and pad), can complete an
accepted output; the last only in an accepting state (or after a stop token). So the output (K * C
tokens) always matches, held text included.

Axes: B batch, C canvas, V vocab, S automaton states.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma.diffusion import constraints as cons
from diffusiongemma.diffusion.noise import NEVER_LOGIT
from diffusiongemma.sampling import steps
from diffusiongemma.sampling import vocab

Array = jax.Array


def token_bytes(tokenizer) -> dict[int, bytes]:
  """`{id: bytes}` of a tokenizer's text tokens: a mapping, a `tokenizers.Tokenizer`, a sentencepiece
  tokenizer (`data.Tokenizer`) or a checkpoint's `data.hf_tokenizer.CheckpointTokenizer`."""
  backend = getattr(tokenizer, "_backend", None)  # CheckpointTokenizer: its tokenizers / sentencepiece model
  if backend is not None:
    tokenizer = getattr(backend, "_tok", None) or getattr(backend, "_sp", None) or tokenizer
  return cons.vocabulary.from_tokenizer(tokenizer)


@dataclasses.dataclass(frozen=True, eq=False)
class Constraint:
  """A token automaton the sampler's output must follow (static).

  Build it for the sampler that will use it (`regex`, `json_schema`), so that its vocabulary, stop
  tokens and pad agree; `check` says what does not, before anything compiles. Equality (and the hash)
  means "runs in the same compiled program": the same padded table shapes (every automaton starts in
  state 0); compare `automaton` for the language itself.
  """

  automaton: cons.TokenAutomaton
  description: str = "constraint"
  min_sizes: tuple[int, ...] | None = None  # pad the tables to at least these `AutomatonTables.sizes`

  @functools.cached_property
  def tables(self) -> cons.AutomatonTables:
    """The automaton as device arrays, padded to bucketed sizes (built once per constraint)."""
    return cons.AutomatonTables.from_automaton(self.automaton, padded=True, min_sizes=self.min_sizes)

  def _program_key(self) -> tuple:
    return (self.automaton.start,) + tuple(jnp.shape(x) for x in jax.tree.leaves(self.tables))

  def __eq__(self, other) -> bool:
    return isinstance(other, Constraint) and self._program_key() == other._program_key()

  def __hash__(self) -> int:
    return hash(self._program_key())

  @classmethod
  def regex(cls, pattern: str, tokenizer, sampler, *, unicode: bool = False) -> Constraint:
    """Outputs that match `pattern` (Python `re` syntax) in full, then a stop token and pad, over
    `tokenizer`'s tokens. \\d \\w \\s are ASCII unless `unicode=True` (`constraints.regexp`)."""
    return cls(cons.from_regex(pattern, token_bytes(tokenizer), unicode=unicode, **automaton_args(sampler)),
               f"regex {pattern[:60]!r}")

  @classmethod
  def json_schema(cls, schema: Mapping | str, tokenizer, sampler, *, whitespace_pattern: str | None = None,
                  unicode: bool = False) -> Constraint:
    """Outputs that are JSON texts valid under `schema` (a dict or JSON text). Every keyword is enforced
    or refused with a ValueError naming it and its path (`constraints.json_schema` lists them)."""
    automaton = cons.from_json_schema(schema, token_bytes(tokenizer), whitespace_pattern=whitespace_pattern,
                                      unicode=unicode, **automaton_args(sampler))
    return cls(automaton, "JSON schema")

  def check(self, sampler, max_new_tokens: int) -> None:
    """Raises a clear ValueError unless this constraint fits `sampler` and `max_new_tokens`."""
    a, mc = self.automaton, sampler.model.config
    if a.vocab_size != mc.vocab_size:
      raise ValueError(f"The constraint was built over {a.vocab_size} token ids but the model has "
                       f"vocab_size={mc.vocab_size}; build it with Constraint.regex/json_schema(..., "
                       "sampler).")
    extra = sorted(set(a.stop_tokens) - set(sampler.stop_tokens))
    if extra:
      raise ValueError(f"The constraint ends outputs with stop tokens {extra} that the sampler does not stop "
                       f"at (its stop_tokens are {list(sampler.stop_tokens)}); build it for this sampler.")
    if mc.pad_id not in a.after_stop_tokens:
      raise ValueError(f"The constraint does not allow pad (id {mc.pad_id}) after a stop token, but the "
                       "sampler pads everything after one; build it with pad_id=the model's pad_id.")
    never = sampler.noise.never_token
    if never is not None and a.token_class[never] != a.dead_class:
      raise ValueError(f"The constraint allows token {never}, which the {sampler.noise.name} noise never "
                       "samples (its mask token); build it with disallowed_tokens=[that id].")
    a.check_length(max_new_tokens)


def one_program(constraints: Sequence[Constraint]) -> list[Constraint]:
  """The constraints with their tables padded to common sizes, so that all of them run in one compiled
  program (e.g. the schemas a server accepts); each keeps its own automaton."""
  sizes = tuple(max(column) for column in zip(*(c.tables.sizes for c in constraints)))
  return [dataclasses.replace(c, min_sizes=sizes) for c in constraints]


def automaton_args(sampler) -> dict:
  """The `constraints.from_regex` / `from_json_schema` arguments that make an automaton fit `sampler`: its
  vocabulary size, stop tokens, pad and never-sampled token."""
  never = sampler.noise.never_token
  return dict(vocab_size=sampler.model.config.vocab_size, stop_tokens=list(sampler.stop_tokens),
              pad_id=sampler.model.config.pad_id, disallowed_tokens=[] if never is None else [never])


def check_given_fits(constraint: Constraint, tokens: np.ndarray, given: np.ndarray,
                     positions_after: int) -> None:
  """Raises unless every row's given tokens [B, T] (where `given` [B, T]) leave some accepted output of
  T + `positions_after` tokens (a host-side reachability check over the automaton's states)."""
  a = constraint.automaton
  live = a.transitions != a.dead  # [S, M]
  for row in range(tokens.shape[0]):
    states = np.zeros(a.num_states, bool)
    states[a.start] = True
    for i in range(tokens.shape[1]):
      if given[row, i]:
        nxt = a.transitions[states, a.token_class[tokens[row, i]]]
      else:
        nxt = a.transitions[states][live[states]]
      states = np.zeros(a.num_states, bool)
      states[nxt[nxt != a.dead]] = True
      if not states.any():
        raise ValueError(f"Row {row}: the given tokens leave no output the constraint accepts (refused at "
                         f"position {i}).")
    if not (states & (a.distance <= positions_after)).any():
      raise ValueError(f"Row {row}: the given tokens leave no output the constraint accepts within "
                       f"{tokens.shape[1] + positions_after} positions.")


@flax.struct.dataclass
class CanvasConstraint:
  """The constraint as one canvas's denoising steps use it (`steps.Denoiser.constraint`)."""

  tables: cons.AutomatonTables
  start: Array  # [B] int32: the automaton state where the previous canvas ended
  end_ok: Array  # [B, S] bool: states this canvas may end in

  @classmethod
  def for_canvas(cls, tables: cons.AutomatonTables, start: Array, positions_after: Array) -> CanvasConstraint:
    """A canvas followed by `positions_after` [] free positions (0 for the last one); with held tokens
    later, build it with `end_ok` from `constraints.canvas_ends`."""
    remaining = jnp.broadcast_to(positions_after, start.shape)
    return cls(tables=tables, start=start, end_ok=cons.end_mask(tables, remaining))

  def viterbi(self, scores: Array, held: Array, tokens: Array) -> cons.ViterbiResult:
    return cons.viterbi(self.tables, scores, self.start, self.end_ok, held, tokens)

  def sample_step(self, rules: steps.Rules, denoiser: steps.Denoiser, state: steps.DenoiseState,
                  hidden: Array, temp: Array, uniforms: Array, noise_keys: Array) -> steps.SampledStep:
    """`steps.plain_sample_step` under the constraint (see the module docstring)."""
    c = state.canvas.shape[1]
    allowed = cons.allowed_tokens(self.tables, self.start, self.end_ok, c, state.fixed,
                                  state.canvas)  # [B, C, V]
    restrict = lambda scaled, first: jnp.where(allowed, scaled, NEVER_LOGIT)
    head = dataclasses.replace(denoiser.head, chunk_size=None)  # one chunk: `restrict` sees [B, C, V]
    out = head(denoiser.table, hidden, temp, uniforms, restrict)
    scores = head.scaled_logits(denoiser.table, hidden, 0, temp, restrict)  # [B, C, V] (the same matmul)
    stats = out.stats
    accepted = rules.acceptance(stats, ~state.fixed)
    sample = vocab.complete_draw(scores, out, uniforms)  # [B, C]: the same inverse-CDF draw, every position
    canvas, fixed = rules.noise.renoise(noise_keys, state.canvas, sample, accepted, state.fixed)
    best = self.viterbi(scores, fixed, canvas)

    def consistent(_):
      return canvas, fixed, best.tokens

    def repair(_):  # rows whose joint draw left no accepted canvas take the Viterbi tokens instead
      before = self.viterbi(scores, state.fixed, state.canvas)
      bad = ~best.feasible[:, None]
      redrawn = jnp.where(bad, before.tokens, sample)
      canvas2, fixed2 = rules.noise.renoise(noise_keys, state.canvas, redrawn, accepted, state.fixed)
      return canvas2, fixed2, jnp.where(bad, before.tokens, best.tokens)

    ok = jnp.all(best.feasible | state.done)
    canvas, fixed, committed = jax.lax.cond(ok, consistent, repair, None)
    stats = stats.replace(sample=jnp.where(accepted, canvas, stats.sample))
    return steps.SampledStep(stats=stats, soft_embedding=out.soft_embedding, accepted=accepted, canvas=canvas,
                             fixed=fixed, argmax=jnp.where(fixed, canvas, committed))

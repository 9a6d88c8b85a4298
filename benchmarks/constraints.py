r"""Constraint cost: automaton construction time and size, the per-step dynamic programs, and whole
generations with and without the constraint, side by side.

Without a checkpoint tokenizer offline, the vocabulary is a byte-level BPE (`tokenizers`) trained here on
Python source (the standard library, plus installed packages when more text is needed for a large
vocabulary): a stand-in for the 262,144-entry Gemma vocabulary with the same size. Or pass
`--tokenizer=tokenizer.json`. Prints one JSON object.

  python benchmarks/constraints.py --vocab_size=8192 --batch=1,8
  python benchmarks/constraints.py --vocab_size=262144 --batch= --sample_batch=  # construction only

The generation figures (`sampling`): a randomly initialised configs/small.py body (hidden 256, 6 layers,
16 experts top-2) with the tokenizer's vocabulary, canvas --canvas, a --prompt_length prompt, a fixed
--steps denoising steps per canvas (no early stop, so both runs make the same passes), timed after a
compiling call: tokens/s (new tokens: a constrained row stops at its stop token), passes/s and the
seconds per generation, unconstrained and constrained in one process.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from diffusiongemma.diffusion import constraints as cons

_VOCAB = flags.DEFINE_integer("vocab_size", 8192, "Vocabulary of the trained stand-in tokenizer.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "A tokenizer.json to use instead.")
_SCHEMA = flags.DEFINE_string("schema", None, "A JSON schema file (default: a realistic user record).")
_BATCH = flags.DEFINE_list("batch", ["1", "8"], "Batch sizes to time the dynamic programs at.")
_CANVAS = flags.DEFINE_integer("canvas", 256, "Canvas length C.")
_SAMPLE_BATCH = flags.DEFINE_list("sample_batch", ["1", "8"], "Batch sizes of the generations timed.")
_STEPS = flags.DEFINE_integer("steps", 16, "Denoising steps per canvas in the timed generations.")
_PROMPT = flags.DEFINE_integer("prompt_length", 64, "Prompt tokens in the timed generations.")

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                      "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["street", "city"]},
        "status": {"enum": ["active", "inactive", "pending"]}, "score": {"type": "number"},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "status"],
}


def _texts(limit_chars: int):
  roots = [pathlib.Path(sysconfig.get_paths()["stdlib"]), pathlib.Path(sysconfig.get_paths()["purelib"])]
  total = 0
  for root in roots:
    for path in sorted(root.rglob("*.py")):
      try:
        text = path.read_text(encoding="utf-8")
      except (OSError, UnicodeDecodeError):
        continue
      total += len(text)
      if total > limit_chars:
        return
      yield text


def _tokenizer():
  import tokenizers  # pylint: disable=import-outside-toplevel
  if _TOKENIZER.value:
    return tokenizers.Tokenizer.from_file(_TOKENIZER.value), "file"
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=_VOCAB.value, min_frequency=2, special_tokens=["<pad>", "<eos>"], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_texts(200_000_000 if _VOCAB.value > 100_000 else 30_000_000), trainer)
  return tok, "byte-level BPE trained on Python source (stand-in)"


def _best_ms(fn, repeats: int = 3) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return round(1000 * min(times), 1)


def _generations(constraint_of, v: int, repeats: int = 1) -> dict:
  """Tokens/s and passes/s of whole generations without and with the constraint (see the docstring)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import diffusiongemma as dg  # pylint: disable=import-outside-toplevel
  from diffusiongemma import build
  from benchmarks import measure  # pylint: disable=import-outside-toplevel
  from diffusiongemma.build.config import load_config_file  # pylint: disable=import-outside-toplevel
  from diffusiongemma.sampling import stats  # pylint: disable=import-outside-toplevel
  config = load_config_file(str(pathlib.Path(__file__).parent.parent / "configs" / "small.py"))
  cfg = build.model_config(config).replace(vocab_size=v, canvas_length=_CANVAS.value)
  sampler = dg.Sampler(dg.DiffusionGemma(cfg), dg.SamplerConfig(
      max_denoising_steps=_STEPS.value, stop_tokens=(1,), prompt_bucket=64), stopping=dg.diffusion.NoEarlyStop())
  constraint = constraint_of(sampler)
  variables = build.random_variables(cfg)
  out = {}
  for b in [int(x) for x in _SAMPLE_BATCH.value if x]:
    prompts = np.random.default_rng(b).integers(2, v, (b, _PROMPT.value))
    row = {}
    for name, c in (("unconstrained", None), ("constrained", constraint)):
      timing = measure.time_call(sampler.generate, variables, prompts, jax.random.key(0), _CANVAS.value,
                                    repeats=repeats, constraint=c)
      summary = stats.summary(timing.output.tokens, timing.output.canvas_passes, cfg.pad_id, timing.median)
      row[name] = dict(seconds=round(timing.median, 3), compile_seconds=round(timing.compile_seconds, 1),
                       tokens_per_second=round(float(summary["tokens_per_second"]), 1),
                       passes_per_second=round(summary["denoiser_passes"] / timing.median, 2),
                       new_tokens=summary["new_tokens"])
    row["seconds_ratio"] = round(row["constrained"]["seconds"] / row["unconstrained"]["seconds"], 2)
    out[b] = row
  return out


def main(argv):
  del argv
  tok, kind = _tokenizer()
  vocab = cons.vocabulary.from_hf_tokenizer(tok)
  schema = json.loads(pathlib.Path(_SCHEMA.value).read_text()) if _SCHEMA.value else DEFAULT_SCHEMA
  v = tok.get_vocab_size()
  automaton = cons.from_json_schema(schema, vocab, v, stop_tokens=[1], pad_id=0)
  tables = cons.AutomatonTables.from_automaton(automaton, padded=True)  # as the sampler runs it
  report = dict(tokenizer=kind, automaton=automaton.stats(), padded_states=tables.num_states, groups=tables.num_groups,
                group_members=int(tables.member_class.shape[0]), state_pairs=int(tables.edge_src.shape[0]),
                canvas=_CANVAS.value, steps={})
  viterbi, allowed = jax.jit(cons.viterbi), jax.jit(cons.allowed_tokens, static_argnums=3)
  argmax = jax.jit(lambda s: jnp.argmax(s, axis=-1))
  for b in [int(x) for x in _BATCH.value if x]:
    scores = jax.random.normal(jax.random.key(0), (b, _CANVAS.value, v))
    start = jnp.full((b,), automaton.start)
    end_ok = cons.end_mask(tables, jnp.zeros((b,), jnp.int32))
    report["steps"][b] = dict(
        viterbi_ms=_best_ms(lambda: viterbi(tables, scores, start, end_ok).tokens),
        allowed_tokens_ms=_best_ms(lambda: allowed(tables, start, end_ok, _CANVAS.value)),
        plain_argmax_ms=_best_ms(lambda: argmax(scores)))
  if any(x for x in _SAMPLE_BATCH.value):
    from diffusiongemma.sampling import constrained  # pylint: disable=import-outside-toplevel
    of = lambda sampler: constrained.Constraint.json_schema(schema, vocab, sampler)
    report["sampling"] = dict(canvas=_CANVAS.value, steps=_STEPS.value, prompt_length=_PROMPT.value,
                              by_batch=_generations(of, v))
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)

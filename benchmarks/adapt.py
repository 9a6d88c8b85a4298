r"""Adapting an autoregressive model to block diffusion, measured: the AR run before adaptation (its Gemma 4
export, loaded as `configs/adapt.py` loads it), the same after the adapt command, and a DiffusionGemma trained
from scratch, each decoding the same prompts with its own sampler settings (tokens per denoiser pass), every
continuation scored by one fixed judge (the AR run's causal model) and by the model's own AR mode.

  python -m benchmarks.adapt --ar=AR --gemma4=G --adapted=A --scratch=S --output=results/adapt.json

The end-to-end commands that make AR, G, A and S are in docs/training.md ("Start from Gemma 4").
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import app
from absl import flags

from diffusiongemma import build
from diffusiongemma import data as data_lib
from diffusiongemma import timing
from diffusiongemma import training
from diffusiongemma.evaluation import generative
from projects.text import runs

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_AR = flags.DEFINE_string("ar", None, "The AR-only training workdir (configs/small_ar.py): the fixed judge.")
_GEMMA4 = flags.DEFINE_string("gemma4", None, "Its Gemma 4 export (scripts/convert.py): the model before.")
_ADAPTED = flags.DEFINE_string("adapted", None, "The configs/adapt.py workdir that started from --gemma4.")
_SCRATCH = flags.DEFINE_string("scratch", None, "A DiffusionGemma trained from scratch (configs/small.py).")
_PROMPTS = flags.DEFINE_string("prompts", str(runs.PROMPTS / "dev.jsonl"), "JSONL prompts.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 24, "The first N prompts (0: all).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows per call.")
_OUTPUT = flags.DEFINE_string("output", None, "The JSON.")


def before(folder: str, adapted: str) -> runs.TextModel:
  """What the adapt run started from: the Gemma 4 folder's weights under that run's resolved config (its
  canvas and sampler)."""
  config = build.workdir_config(adapted)
  if str(pathlib.Path(config.train.init_from)) != str(pathlib.Path(folder)):
    raise ValueError(f"--adapted={adapted!r} started from {config.train.init_from!r}, not --gemma4={folder!r}.")
  weights = build.load(hf_checkpoint=folder, quantize="none")
  return runs.TextModel(config, weights.variables, data_lib.Tokenizer(config.data.tokenizer_path),
                        f"{weights.source} (the adapt run's start)")


def measure(run: runs.TextModel, judge: generative.Judge, prompts) -> dict:
  """Tokens per pass of `run`'s sampler and the judged quality of its continuations, beside AR greedy's."""
  continuations, passes = runs.diffusion(run.sampler(), run.variables, prompts, _MAX_NEW.value, _BATCH.value)
  fixed = runs.quality(run, prompts, continuations, judge=judge)
  own = runs.quality(run, prompts, continuations)
  return {"weights": run.source, "sampler": run.sampler().settings(),
          "tokens_per_pass": fixed["new_tokens"] / max(int(passes.sum()), 1),
          "passes_per_prompt": float(passes.mean()), **fixed,
          "own_ar_judged_perplexity": own["judged_perplexity"]}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  ar = runs.load(_AR.value)
  judge = ar.judge()
  prompts = runs.read_prompts(_PROMPTS.value, ar.tokenizer, limit=_NUM_PROMPTS.value or None)
  greedy = runs.autoregressive(ar.ar_sampler(), ar.variables, prompts, _MAX_NEW.value, _BATCH.value)
  results = {"ar_greedy": runs.quality(ar, prompts, greedy)}
  print(f"AR run greedy: judged perplexity {results['ar_greedy']['judged_perplexity']:.3f}")
  for name, model in (("before", lambda: before(_GEMMA4.value, _ADAPTED.value)), ("adapted", lambda: runs.load(_ADAPTED.value)),
                      ("scratch", lambda: runs.load(_SCRATCH.value))):
    run = model()
    if run.tokenizer.vocab_size != ar.tokenizer.vocab_size:
      raise ValueError(f"--{name}'s tokenizer has {run.tokenizer.vocab_size} pieces, the AR run's "
                       f"{ar.tokenizer.vocab_size}: the judge would read other ids.")
    results[name] = measure(run, judge, prompts)
    r = results[name]
    print(f"{name} ({run.source}): {r['tokens_per_pass']:.2f} tokens/pass, judged perplexity "
          f"{r['judged_perplexity']:.3f} (AR run greedy x{r['judged_perplexity'] / results['ar_greedy']['judged_perplexity']:.2f}), "
          f"own AR mode {r['own_ar_judged_perplexity']:.3f}, distinct 4-grams {r['distinct_4gram']:.3f}")
  out = pathlib.Path(_OUTPUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  record = {"command": " ".join(sys.argv), "machine": timing.provenance(_ROOT), "prompts": _PROMPTS.value,
            "num_prompts": len(prompts), "max_new_tokens": _MAX_NEW.value,
            "workdirs": {"ar": _AR.value, "gemma4": _GEMMA4.value, "adapted": _ADAPTED.value,
                         "scratch": _SCRATCH.value},
            "training": {name: _training_record(path) for name, path in
                         (("ar", _AR.value), ("adapted", _ADAPTED.value), ("scratch", _SCRATCH.value))},
            "models": results}
  out.write_text(json.dumps(record, indent=2) + "\n")
  print(f"wrote {out}")


def _training_record(workdir: str) -> dict:
  """The run's step, its budget and its first and last evaluations (validation losses, seconds of training)."""
  config = build.workdir_config(workdir)
  evals = [r for r in map(json.loads, (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines())
           if "eval/loss" in r]
  return {"step": training.checkpoint.latest_step(pathlib.Path(workdir)), "time_budget_s": config.train.time_budget_s,
          "num_steps": config.train.num_steps, "first_eval": evals[0] if evals else None,
          "last_eval": evals[-1] if evals else None}


if __name__ == "__main__":
  flags.mark_flags_as_required(["ar", "gemma4", "adapted", "scratch", "output"])
  app.run(main)

r"""The shipped text model writing Python: one held-out prompt's continuation drawn canvas by canvas, pass by
pass, then tokens per pass, judged perplexity and tokens/s of block diffusion against AR greedy decoding of
the same weights, both at batch 1.

  python -m projects.text.demo [--prompts=projects/text/prompts/validation.jsonl] [--num_prompts=16]

Masked positions show as `_`, the tokens a pass accepted are bracketed, and newlines show as `\n`. The
timings are this run's, on whatever else the machine is doing; the README's come from
`benchmarks.text_vs_ar` on a quiet machine. The last lines print the commands that remake the weights.
"""

import sys
import time

from absl import app
from absl import flags
import jax
import numpy as np

from diffusiongemma import training
from projects.text import runs

_PROMPTS = flags.DEFINE_string("prompts", str(runs.PROMPTS / "validation.jsonl"), "JSONL file of prompts.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 16, "Prompts for the table (the first one is drawn).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir instead of the shipped weights.")
_SHOW = flags.DEFINE_bool("show", True, "Draw the first prompt's canvases pass by pass.")

REMAKE = """python scripts/train.py --config=projects/text/config.py --workdir=workdir/text_pretrain
python -m projects.text.teacher --workdir=workdir/text_pretrain --output=workdir/text_teacher
python scripts/train.py --config=projects/text/config.py:distil --workdir=workdir/text \\
  --config.train.init_from=workdir/text_pretrain --config.data.tokenizer_path=workdir/text_pretrain/tokenizer.model \\
  --config.data.distil.teacher=workdir/text_teacher"""


def canvas_text(tokenizer, tokens, masked, accepted, mask_id: int) -> str:
  """One canvas as text: `_` for a masked position, [token] for one accepted by this pass."""
  parts = []
  for token, is_masked, new in zip(tokens, masked, accepted):
    piece = "_" if is_masked else tokenizer.decode([int(token)]).replace("\n", "\\n")
    parts.append(f"[{piece}]" if new else piece)
  return "".join(parts)


def show_one(run: runs.TextModel, sampler, prompt, max_new_tokens: int) -> None:
  mask_id = sampler.noise.never_token
  print("prompt (its last lines):")
  print("\n".join(run.tokenizer.decode(prompt).splitlines()[-4:]))
  print("\ncanvas pass | accepted | the canvas after the pass")

  def on_pass(event):
    canvas = event.canvas[0]
    masked = canvas == mask_id
    print(f"{event.canvas_index:6d} {event.step + 1:4d} | {int(event.accepted[0].sum()):8d} | "
          f"{canvas_text(run.tokenizer, canvas, masked, event.accepted[0], mask_id)}")

  sampler.generate(run.variables, [prompt], jax.random.key(0), max_new_tokens)  # compile, no stream
  out = sampler.generate(run.variables, [prompt], jax.random.key(0), max_new_tokens, on_pass=on_pass)
  new = [t for t in np.asarray(out.tokens)[0] if t != sampler.model.config.pad_id]
  print(f"\n{len(new)} tokens in {int(out.num_denoiser_passes[0])} passes "
        f"({len(new) / int(out.num_denoiser_passes[0]):.1f} tokens per pass):")
  print(run.tokenizer.decode(prompt) + ">>>" + run.tokenizer.decode(new) + "<<<")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  run = runs.load(_WORKDIR.value)
  prompts = runs.read_prompts(_PROMPTS.value, run.tokenizer, limit=_NUM_PROMPTS.value)
  sampler, ar = run.sampler(), run.ar_sampler()
  new = _MAX_NEW.value
  if _SHOW.value:
    show_one(run, sampler, prompts[0], new)
  rows = ["| decoder (batch 1) | tokens / pass | judged perplexity | distinct 4-grams | tokens/s |",
          "|---|---|---|---|---|"]
  results = {}
  for name, decode in (("block diffusion", lambda: runs.diffusion(sampler, run.variables, prompts, new, 1)),
                       ("AR greedy", lambda: (runs.autoregressive(ar, run.variables, prompts, new, 1), None))):
    decode()  # compile
    start = time.perf_counter()
    continuations, passes = decode()
    seconds = time.perf_counter() - start
    q = runs.quality(run, prompts, continuations)
    per_pass = f"{q['new_tokens'] / passes.sum():.2f}" if passes is not None else "1"
    results[name] = q["new_tokens"] / seconds
    rows.append(f"| {name} | {per_pass} | {q['judged_perplexity']:.3f} | {q['distinct_4gram']:.3f} | "
                f"{results[name]:.0f} |")
  print(f"\n{len(prompts)} held-out prompts of {_PROMPTS.value}, {new} new tokens; {run.source}")
  print("\n".join(rows))
  print(f"block diffusion / AR tokens per second: {results['block diffusion'] / results['AR greedy']:.2f}x "
        "(this run; quiet-machine numbers: README)")
  print(f"\nRemake the shipped weights:\n{REMAKE}")
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)

r"""The shipped text model writing Python: one held-out prompt's continuation drawn pass by pass as its
denoiser drafts blocks and its AR mode checks them (self-speculative decoding: AR greedy's exact text),
then tokens per pass, judged perplexity and tokens/s of each decoder of the same weights at batch 1, and
self-speculative sampling at --temperature (distributed exactly as AR sampling) beside AR sampling.

  python -m projects.text.demo [--prompts=projects/text/prompts/validation.jsonl] [--num_prompts=16]

In the drawing, each line is one denoiser pass and one encoder pass: the drafted block with the tokens the
encoder accepted bracketed and the rejected drafts struck through (`~x~`); newlines show as `\n`. The
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
from diffusiongemma.sampling import stats
from projects.text import runs

_PROMPTS = flags.DEFINE_string("prompts", str(runs.PROMPTS / "validation.jsonl"), "JSONL file of prompts.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 16, "Prompts for the table (the first one is drawn).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir instead of the shipped weights.")
_SHOW = flags.DEFINE_bool("show", True, "Draw the first prompt's canvases pass by pass.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "The sampling rows' temperature (0: leave them out).")

REMAKE = """python scripts/train.py --config=projects/text/config.py --workdir=workdir/text_pretrain
python -m projects.text.teacher --workdir=workdir/text_pretrain --output=workdir/text_teacher
python scripts/train.py --config=projects/text/config.py:distil --workdir=workdir/text \\
  --config.train.init_from=workdir/text_pretrain --config.data.tokenizer_path=workdir/text_pretrain/tokenizer.model \\
  --config.data.distil.teacher=workdir/text_teacher"""


def block_text(tokenizer, block, accepted) -> str:
  """One drafted block as text: the accepted tokens bracketed, the rejected drafts struck through."""
  pieces = [tokenizer.decode([int(token)]).replace("\n", "\\n") for token in block]
  return "".join(f"[{piece}]" if ok else f"~{piece}~" for piece, ok in zip(pieces, accepted))


def show_one(run: runs.TextModel, sampler, prompt, max_new_tokens: int) -> None:
  print("prompt (its last lines):")
  print("\n".join(run.tokenizer.decode(prompt).splitlines()[-4:]))
  print(f"\npass | accepted | the drafted block of {sampler.block_length} ([accepted] ~rejected~)")
  count = 0

  def on_pass(event):
    nonlocal count
    if count < max_new_tokens:  # the last block may run past the tokens asked for
      accepted = event.accepted[0][:max_new_tokens - count]
      count += int(accepted.sum())
      drawn = block_text(run.tokenizer, event.canvas[0], accepted)
      print(f"{event.canvas_index + 1:4d} | {int(accepted.sum()):8d} | {drawn}")

  out = sampler.generate(run.variables, [prompt], max_new_tokens, on_pass=on_pass)
  new = stats.new_tokens(np.asarray(out.tokens)[0], sampler.stop_tokens, sampler.model.config.pad_id)
  passes = int(out.num_denoiser_passes[0])
  print(f"\n{len(new)} tokens in {passes} denoiser passes ({len(new) / passes:.1f} tokens per pass):")
  print(run.tokenizer.decode(prompt) + ">>>" + run.tokenizer.decode(new) + "<<<")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  run = runs.load(_WORKDIR.value)
  prompts = runs.read_prompts(_PROMPTS.value, run.tokenizer, limit=_NUM_PROMPTS.value)
  new = _MAX_NEW.value
  spec, spec4, sampler, ar = run.speculative_sampler(), run.speculative_sampler(4), run.sampler(), run.ar_sampler()
  if _SHOW.value:
    show_one(run, spec, prompts[0], new)
  rows = ["| decoder (batch 1) | tokens / denoiser pass | judged perplexity | distinct 4-grams | tokens/s |",
          "|---|---|---|---|---|"]
  results = {}
  decoders = {
      "self-speculative (shipped)": lambda ps: runs.speculative(spec, run.variables, ps, new, 1),
      "self-speculative, 4-token drafts": lambda ps: runs.speculative(spec4, run.variables, ps, new, 1),
      "block diffusion, left to right": lambda ps: runs.diffusion(sampler, run.variables, ps, new, 1),
      "AR greedy": lambda ps: (runs.autoregressive(ar, run.variables, ps, new, 1), None)}
  if temperature := _TEMPERATURE.value:
    spec_t = run.speculative_sampler(temperature=temperature)
    decoders[f"self-speculative, temperature {temperature}"] = lambda ps: runs.speculative(
        spec_t, run.variables, ps, new, 1)
    decoders[f"AR sampling, temperature {temperature}"] = lambda ps: (
        runs.autoregressive(ar, run.variables, ps, new, 1, temperature=temperature), None)
  for name, decode in decoders.items():
    decode(prompts[:1])  # compile
    start = time.perf_counter()
    continuations, passes = decode(prompts)
    seconds = time.perf_counter() - start
    q = runs.quality(run, prompts, continuations)
    per_pass = f"{q['new_tokens'] / passes.sum():.2f}" if passes is not None else "(1 per AR step)"
    results[name] = q["new_tokens"] / seconds
    rows.append(f"| {name} | {per_pass} | {q['judged_perplexity']:.3f} | {q['distinct_4gram']:.3f} | "
                f"{results[name]:.0f} |")
  print(f"\n{len(prompts)} held-out prompts of {_PROMPTS.value}, {new} new tokens; {run.source}")
  print("\n".join(rows))
  print(f"self-speculative / AR tokens per second: {results['self-speculative (shipped)'] / results['AR greedy']:.2f}x "
        "(this run; quiet-machine numbers: README)")
  print(f"\nRemake the shipped weights:\n{REMAKE}")
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)

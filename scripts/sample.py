r"""Samples from a DiffusionGemma model and prints the text and the sampler's statistics.

  python scripts/sample.py --config configs/tiny.py --workdir /tmp/dg_tiny --prompt "def main(" \
      --show_steps
  python scripts/sample.py --config configs/tiny.py --workdir /tmp/dg_tiny --random_init \
      --prompt_file prompts.txt --batch_size 4 --autoregressive
  python scripts/sample.py --config configs/tiny.py --workdir /tmp/dg --hf_checkpoint /path/to/hf_folder

Weights: --hf_checkpoint (a transformers folder) when given, else the latest checkpoint in
--workdir/checkpoints, else (only with --random_init) a random initialisation. The tokenizer is
config.data.tokenizer_path or --workdir/tokenizer.model (trained on the corpus if missing). The model, the
noise (config.diffusion.noise: what the model was trained with) and the sampler settings (config.sampler,
overridden as --config.sampler.max_denoising_steps=16) come from `build`, as in every binary. The first
call compiles; the reported speed is a second call with the same shapes, so compile time is reported apart.
"""

import pathlib

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

import diffusiongemma as dg
from diffusiongemma import benchmarks
from diffusiongemma import build
from diffusiongemma.sampling import stats

_CONFIG = config_flags.DEFINE_config_file("config", None, "A config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The training workdir (checkpoints, tokenizer).")
_HF = flags.DEFINE_string("hf_checkpoint", None, "A transformers DiffusionGemma checkpoint folder.")
_RANDOM = flags.DEFINE_bool("random_init", False, "Use a randomly initialised model.")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A prompt (repeatable).")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "A file with one prompt per line (\\n escapes).")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Prompts per batch; 0: all prompts in one batch.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 0, "New tokens; 0: config.sampler.max_new_tokens.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_SHOW_STEPS = flags.DEFINE_bool("show_steps", False, "Print the argmax canvas of every denoising step.")
_AR = flags.DEFINE_bool("autoregressive", False, "Also decode greedily token by token, for comparison.")
flags.mark_flags_as_required(["config", "workdir"])


def _prompts(prompt, prompt_file) -> list[str]:
  texts = list(prompt)
  if prompt_file:
    texts += [line.rstrip("\n").replace("\\n", "\n") for line in
              pathlib.Path(prompt_file).read_text().splitlines() if line.strip()]
  if not texts:
    raise app.UsageError("No prompt: pass --prompt or --prompt_file.")
  return texts


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  dg.training.quiet_orbax_logs()
  config = _CONFIG.value
  weights = build.load(config, workdir=_WORKDIR.value, hf_checkpoint=_HF.value, random_init=_RANDOM.value,
                       seed=_SEED.value)
  cfg = weights.model_config
  tokenizer = build.tokenizer(config, _WORKDIR.value)
  sampler, ar_sampler = build.sampler(config, cfg), build.ar_sampler(config, cfg)
  max_new = _MAX_NEW.value or build.max_new_tokens(config)
  print(f"weights: {weights.source}; sampler: {stats.describe(sampler.settings())}")
  texts = _prompts(_PROMPT.value, _PROMPT_FILE.value)
  size = _BATCH.value or len(texts)
  for b, start in enumerate(range(0, len(texts), size)):
    batch = texts[start:start + size]
    prompts = [[tokenizer.bos_id] + tokenizer.encode(t) for t in batch]
    rng = jax.random.key(_SEED.value + b)
    timing = benchmarks.time_call(sampler.generate, weights.variables, prompts, rng, max_new,
                                  return_trace=_SHOW_STEPS.value)
    out = timing.output
    for i, text in enumerate(batch):
      ids = stats.new_tokens(out.tokens[i], sampler.stop_tokens, cfg.pad_id)
      print(f"--- [{i}] {text!r}\n{tokenizer.decode([t for t in ids if t not in sampler.stop_tokens])}")
      if _SHOW_STEPS.value:
        print("\n".join(stats.format_steps(out, tokenizer.decode, i, sampler.noise.never_token)))
    summary = stats.summary(out.tokens, out.canvas_passes, cfg.pad_id, timing.median)
    print(f"diffusion: {stats.describe(summary)}; compile {timing.compile_seconds:.2f} s")
    if _AR.value:
      ar = benchmarks.time_call(ar_sampler.generate, weights.variables, prompts, rng, max_new)
      count = int(stats.new_token_counts(ar.output.tokens, cfg.pad_id).sum())
      print(f"autoregressive (greedy): {count} tokens, {count / ar.median:.1f} tokens/s, 1 token per forward; "
            f"compile {ar.compile_seconds:.2f} s, run {ar.median:.3f} s")


if __name__ == "__main__":
  app.run(main)

r"""Samples from a DiffusionGemma model and prints the text and the sampler's statistics.

  python scripts/sample.py --config configs/tiny.py --workdir /tmp/dg_tiny --prompt "def main(" \
      --show_steps
  python scripts/sample.py --config configs/tiny.py --workdir /tmp/dg_tiny --random_init \
      --prompt_file prompts.txt --batch_size 4 --autoregressive
  python scripts/sample.py --config configs/tiny.py --workdir /tmp/dg --hf_checkpoint /path/to/hf_folder

Weights: the latest checkpoint in --workdir/checkpoints, else --hf_checkpoint (a transformers folder),
else --random_init. The tokenizer is config.data.tokenizer_path or --workdir/tokenizer.model (trained
on the standard library if missing). Sampler settings are config.sampler (override them as
--config.sampler.max_denoising_steps=16). The first call compiles; the reported speed is a second call
with the same shapes, so compile time is reported apart.
"""

from absl import app
from absl import flags
import jax
from ml_collections import config_flags
import numpy as np

import diffusiongemma as dg
from diffusiongemma import training
from diffusiongemma.sampling import runner

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


def _batches(items, size):
  size = size or len(items)
  return [items[i:i + size] for i in range(0, len(items), size)]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  config = _CONFIG.value
  cfg, variables, source = runner.load_model(config, _WORKDIR.value, _HF.value, _RANDOM.value, _SEED.value)
  tokenizer = dg.data.get_tokenizer(_WORKDIR.value, path=config.data.tokenizer_path or None,
                                    vocab_size=config.data.vocab_size)
  sampler = runner.sampler_for(cfg, config)
  max_new = _MAX_NEW.value or config.sampler.max_new_tokens
  print(f"weights: {source}; sampler: {sampler.config}")
  for b, texts in enumerate(_batches(runner.load_prompts(_PROMPT.value, _PROMPT_FILE.value), _BATCH.value)):
    prompts, lengths = runner.pad_prompts([[tokenizer.bos_id] + tokenizer.encode(t) for t in texts],
                                          cfg.pad_id)
    rng = jax.random.key(_SEED.value + b)
    timed = runner.timed(sampler.generate, variables, prompts, rng, max_new, lengths,
                         return_trace=_SHOW_STEPS.value)
    out = timed.output
    for i, text in enumerate(texts):
      ids = runner.new_tokens(out.tokens[i], sampler.stop_tokens, cfg.pad_id)
      print(f"--- [{i}] {text!r}\n{tokenizer.decode([t for t in ids if t not in sampler.stop_tokens])}")
      if _SHOW_STEPS.value:
        mask = dg.sampling.steps.mask_token(sampler.config, cfg.vocab_size) \
            if sampler.config.noise == "masked" else None
        print("\n".join(runner.format_steps(out, tokenizer.decode, i, mask)))
    stats = runner.stats(out, timed.run_s, sampler.stop_tokens, cfg.pad_id)
    print(f"diffusion: {runner.describe(stats)}; compile {timed.compile_s:.2f} s, run {timed.run_s:.3f} s")
    if _AR.value:
      ar = runner.timed(sampler.autoregressive, variables, prompts, rng, max_new, lengths)
      count = int(np.sum(ar.output.num_forward_passes))
      print(f"autoregressive (greedy): {count} tokens, {count / ar.run_s:.1f} tokens/s, 1 token per forward; "
            f"compile {ar.compile_s:.2f} s, run {ar.run_s:.3f} s")


if __name__ == "__main__":
  app.run(main)

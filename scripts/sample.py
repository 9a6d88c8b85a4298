r"""Samples from a DiffusionGemma model and prints the text and the sampler's statistics.

  python scripts/sample.py --workdir /tmp/dg_tiny --prompt "def main(" --show_steps
  python scripts/sample.py --config configs/tiny.py --workdir /tmp/dg_tiny --random_init \
      --prompt_file prompts.txt --batch_size 4 --autoregressive
  python scripts/sample.py --hf_checkpoint /path/to/hf_folder --prompt "The capital of France is"
  python scripts/sample.py --hf_checkpoint /path/to/hf_folder --image photo.jpg --prompt "This picture shows"
  python scripts/sample.py --config configs/tiny.py --workdir /tmp/dg_tiny --prompt "x = " \
      --infill "[MASK:4] + 1  # [MASK:6]"
  python scripts/sample.py --config configs/tiny.py --workdir /tmp/dg_tiny --prompt "n = " --regex "[0-9]+"

A transformers checkpoint folder (--hf_checkpoint) alone is enough: its tokenizer, its generation defaults
(generation_config.json) changed by --preset, and its weights cast to --dtype over every local device
(`build.pretrained`); with --config too, config.sampler replaces the generation defaults. Otherwise
--workdir: the latest checkpoint in --workdir/checkpoints, run with the config the run saved (config.json:
LoRA adapters merged, init_from and canvas as trained); a --config given beside it is refused by field name
where it differs in what the weights depend on. With --random_init and --config, a random initialisation;
the tokenizer is config.data.tokenizer_path or --workdir/tokenizer.model (trained on
the corpus if missing); the model, the noise (config.diffusion.noise: what the model was trained with) and
the sampler settings (config.sampler, overridden as --config.sampler.max_denoising_steps=16) come from
`build`, as in every binary. Prompts are plain text after bos (no chat format: scripts/chat.py has it);
--image (repeatable) puts the images before every prompt (a model with a vision encoder). The first call
compiles; the reported speed is a second call with the same shapes, so compile time is reported apart.

--infill: the output starts as this text, whose `[MASK]` (one token) and `[MASK:n]` (n tokens) markers are
the positions to fill; the rest of the text is held as given in every step (`constraints.infill_canvas`),
and positions after it are free. --regex / --json_schema=FILE: every output matches the regex, or is JSON
valid under the schema (`sampling.constrained`); they combine with --infill. Without --prompt, the prompt
is bos alone.

--decoder=speculative (a masked-noise model): self-speculative decoding, the encoder's own AR text drafted by
the denoiser `--draft_length` positions a pass: greedy, or at --temperature (with --top_p) distributed exactly as
AR sampling (`sampling.speculative`); it prints the tokens per denoiser pass.
"""

import pathlib

from absl import app
from absl import flags
import jax
import numpy as np

import diffusiongemma as dg
from benchmarks import measure
from diffusiongemma import build
from diffusiongemma.data import images as images_lib
from diffusiongemma.diffusion import constraints as cons
from diffusiongemma.sampling import constrained
from diffusiongemma.sampling import speculative
from diffusiongemma.sampling import stats

_CONFIG = build.cli.define_config("config", None, "A config file (configs/*.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The training workdir (checkpoints, tokenizer): a folder or "
                               "gs://bucket/path.")
_COMPILATION_CACHE = dg.parallel.define_compilation_cache_flag()
_HF = flags.DEFINE_string("hf_checkpoint", None, "A transformers DiffusionGemma checkpoint folder.")
_RANDOM = flags.DEFINE_bool("random_init", False, "Use a randomly initialised model (and train the workdir's "
                            "tokenizer if it has none).")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A prompt (repeatable).")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "A file with one prompt per line (\\n escapes).")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Prompts per batch; 0: all prompts in one batch.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 0, "New tokens; 0: config.sampler.max_new_tokens.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_SHOW_STEPS = flags.DEFINE_bool("show_steps", False, "Print the argmax canvas of every denoising step.")
_AR = flags.DEFINE_bool("autoregressive", False, "Also decode greedily token by token, for comparison.")
_PRESET = flags.DEFINE_string("preset", "default", "With --hf_checkpoint alone: default, code or creative.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "With --hf_checkpoint: weight and compute dtype.")
_QUANTIZE = flags.DEFINE_enum("quantize", "none", ["none", "int8"], "With --hf_checkpoint: int8 attention, MLP "
                               "and expert weights, quantised as they are read (docs/quantization.md).")
_IMAGE = flags.DEFINE_multi_string("image", [], "An image file placed before every prompt (repeatable).")
_IMAGE_BUDGET = flags.DEFINE_integer("image_budget", 280, "Soft tokens per image: 70, 140, 280, 560 or 1120.")
_INFILL = flags.DEFINE_string("infill", None, "Output text with [MASK] / [MASK:n] markers to fill.")
_REGEX = flags.DEFINE_string("regex", None, "Every output must match this regex (in full).")
_JSON_SCHEMA = flags.DEFINE_string("json_schema", None, "A JSON schema file every output is valid under.")
_DECODER = flags.DEFINE_enum("decoder", "diffusion", ["diffusion", "speculative"], "diffusion: the block-diffusion "
                             "sampler (config.sampler); speculative: the encoder's AR text, drafted by the denoiser.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "--decoder=speculative: 0 is greedy; above, sampling at this "
                                  "temperature (as AR sampling, exactly).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "--decoder=speculative with a temperature: the nucleus.")
_DRAFT = flags.DEFINE_integer("draft_length", 0, "--decoder=speculative: positions drafted a pass (0: the canvas).")


def _prompts(prompt, prompt_file) -> list[str]:
  texts = list(prompt)
  if not texts and not prompt_file and _INFILL.value is not None:
    return [""]
  if prompt_file:
    texts += [line.rstrip("\n").replace("\\n", "\n") for line in
              pathlib.Path(prompt_file).read_text().splitlines() if line.strip()]
  if not texts:
    raise app.UsageError("No prompt: pass --prompt or --prompt_file.")
  return texts


def _load():
  """(weights, tokenizer, sampler, AR sampler, max_new_tokens) from the flags."""
  config = _CONFIG.value
  if _HF.value:
    loaded = build.pretrained(_HF.value, preset=_PRESET.value, dtype=_DTYPE.value,
                              model_overrides={"quantize": _QUANTIZE.value})
    weights, cfg = loaded.weights, loaded.weights.model_config
    if config is None:
      sampler = loaded.sampler
      ar_sampler = dg.ARSampler(sampler.model, stop_tokens=sampler.stop_tokens,
                                prompt_bucket=sampler.config.prompt_bucket)
      return weights, loaded.tokenizer, sampler, ar_sampler, _MAX_NEW.value or loaded.max_new_tokens or 256
    sampler, ar_sampler = build.sampler(config, cfg), build.ar_sampler(config, cfg)
    return weights, loaded.tokenizer, sampler, ar_sampler, _MAX_NEW.value or build.max_new_tokens(config)
  if not _WORKDIR.value:
    raise app.UsageError("Pass --hf_checkpoint=DIR (a transformers checkpoint folder), or --workdir (a training "
                         "run: its saved config.json is the config), or --config and --workdir with --random_init.")
  if _RANDOM.value:
    if config is None:
      raise app.UsageError("--random_init needs --config (the model to initialise).")
  else:
    config = build.run_config(_WORKDIR.value, config)  # the run as trained; a --config given must match it
  weights = build.load(config, workdir=_WORKDIR.value, random_init=_RANDOM.value, seed=_SEED.value)
  cfg = weights.model_config
  tokenizer = build.tokenizer(config, _WORKDIR.value, train_if_missing=_RANDOM.value)
  return (weights, tokenizer, build.sampler(config, cfg), build.ar_sampler(config, cfg),
          _MAX_NEW.value or build.max_new_tokens(config))


def _with_images(prompts: list[list[int]], cfg):
  """(prompts with the --image placeholders after bos, expanded; the images of every row, or None)."""
  if not _IMAGE.value:
    return prompts, None
  if cfg.vision is None:
    raise app.UsageError(f"--image={_IMAGE.value}: this model has no vision encoder.")
  geometry = dict(patch_size=cfg.vision.patch_size, pooling_kernel_size=cfg.vision.pooling_kernel_size)
  processed = [images_lib.preprocess(path, _IMAGE_BUDGET.value, **geometry) for path in _IMAGE.value]
  counts = [image.num_soft_tokens for image in processed]
  placeholders = [cfg.image_id] * len(processed)
  prompts = [images_lib.expand_image_placeholders(p[:1] + placeholders + p[1:], counts, cfg) for p in prompts]
  pixel_values, position_ids, _ = images_lib.stack(processed * len(prompts))  # row 0's images first
  return prompts, (pixel_values, position_ids)


def _constraint(sampler, tokenizer):
  if _REGEX.value is not None and _JSON_SCHEMA.value:
    raise app.UsageError("Pass --regex or --json_schema, not both.")
  if _REGEX.value is not None:  # a bad pattern or schema: one line (build.cli.run)
    return constrained.Constraint.regex(_REGEX.value, tokenizer, sampler)
  if _JSON_SCHEMA.value:
    schema = pathlib.Path(_JSON_SCHEMA.value).read_text()
    return constrained.Constraint.json_schema(schema, tokenizer, sampler)
  return None


def _infill(sampler, tokenizer, max_new: int):
  """(initial canvas [T], given [T]) of --infill, or (None, None)."""
  if _INFILL.value is None:
    return None, None
  c = sampler.canvas_length
  length = -(-max_new // c) * c
  canvas = cons.infill_canvas(_INFILL.value, tokenizer, length=length, pad_id=sampler.model.config.pad_id)
  return canvas.tokens, canvas.given


def _speculative(weights, tokenizer, sampler, max_new: int) -> None:
  """--decoder=speculative: the texts, and the tokens per denoiser pass of each batch."""
  try:
    spec = speculative.SelfSpeculativeSampler.of(sampler, draft_length=_DRAFT.value or None,
                                                 temperature=_TEMPERATURE.value, top_p=_TOP_P.value)
  except ValueError as e:
    raise app.UsageError(f"--decoder=speculative: {e}") from None
  print(f"speculative: draft_length {spec.block_length}, temperature {spec.temperature}, top_p {spec.top_p}")
  texts = _prompts(_PROMPT.value, _PROMPT_FILE.value)
  size = _BATCH.value or len(texts)
  for b, start in enumerate(range(0, len(texts), size)):
    batch = texts[start:start + size]
    prompts = [[tokenizer.bos_id] + tokenizer.encode(t) for t in batch]
    timing = measure.time_call(spec.generate, weights.variables, prompts, max_new,
                               rng=jax.random.key(_SEED.value + b))
    out, count = timing.output, 0
    for i, text in enumerate(batch):
      ids = stats.new_tokens(out.tokens[i], spec.stop_tokens, weights.model_config.pad_id)
      count += len(ids)
      print(f"--- [{i}] {text!r}\n{tokenizer.decode([t for t in ids if t not in spec.stop_tokens])}")
    passes = int(np.asarray(out.num_denoiser_passes).sum())
    print(f"speculative: {count} tokens in {passes} denoiser passes ({count / passes:.2f} tokens per pass, as "
          f"many encoder passes), {count / timing.median:.1f} tokens/s; compile {timing.compile_seconds:.2f} s")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _DECODER.value != "speculative":
    given = [f"--{flag.name}={flag.value}" for flag, default in ((_TEMPERATURE, 0.0), (_TOP_P, 1.0), (_DRAFT, 0))
             if flag.value != default]
    if given:
      raise app.UsageError(f"{', '.join(given)} is for --decoder=speculative (the block-diffusion sampler's "
                           "settings are config.sampler's).")
  else:  # checked before anything loads
    others = [f"--{flag.name}" for flag in (_INFILL, _REGEX, _JSON_SCHEMA) if flag.value is not None]
    others += [f"--{flag.name}" for flag in (_IMAGE, _SHOW_STEPS, _AR) if flag.value]
    if others:
      raise app.UsageError(f"--decoder=speculative decodes text prompts alone; {', '.join(others)} is for "
                           "--decoder=diffusion.")
  dg.parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
  dg.training.quiet_orbax_logs()
  weights, tokenizer, sampler, ar_sampler, max_new = _load()
  cfg = weights.model_config
  if _DECODER.value == "speculative":
    print(f"weights: {weights.source}")
    return _speculative(weights, tokenizer, sampler, max_new)
  print(f"weights: {weights.source}; sampler: {stats.describe(sampler.settings())}")
  constraint = _constraint(sampler, tokenizer)
  infill, given = _infill(sampler, tokenizer, max_new)
  texts = _prompts(_PROMPT.value, _PROMPT_FILE.value)
  size = _BATCH.value or len(texts)
  for b, start in enumerate(range(0, len(texts), size)):
    batch = texts[start:start + size]
    prompts, images = _with_images([[tokenizer.bos_id] + tokenizer.encode(t) for t in batch], cfg)
    rng = jax.random.key(_SEED.value + b)
    rows = len(prompts)
    extra = {} if infill is None else dict(initial_canvas=np.tile(infill, (rows, 1)),
                                           given=np.tile(given, (rows, 1)))
    timing = measure.time_call(sampler.generate, weights.variables, prompts, rng, max_new,
                                  return_trace=_SHOW_STEPS.value, images=images, constraint=constraint,
                                  **extra)
    out = timing.output
    for i, text in enumerate(batch):
      ids = stats.new_tokens(out.tokens[i], sampler.stop_tokens, cfg.pad_id)
      print(f"--- [{i}] {text!r}\n{tokenizer.decode([t for t in ids if t not in sampler.stop_tokens])}")
      if _SHOW_STEPS.value:
        print("\n".join(stats.format_steps(out, tokenizer.decode, i, sampler.noise.never_token)))
    summary = stats.summary(out.tokens, out.canvas_passes, cfg.pad_id, timing.median, extra.get("given"))
    print(f"diffusion: {stats.describe(summary)}; compile {timing.compile_seconds:.2f} s")
    if _AR.value and (images is not None or extra or constraint is not None):
      print("autoregressive: skipped (the AR sampler takes no images, infilling or constraint)")
    elif _AR.value:
      ar = measure.time_call(ar_sampler.generate, weights.variables, prompts, rng, max_new)
      count = int(stats.new_token_counts(ar.output.tokens, cfg.pad_id).sum())
      print(f"autoregressive (greedy): {count} tokens, {count / ar.median:.1f} tokens/s, 1 token per forward; "
            f"compile {ar.compile_seconds:.2f} s, run {ar.median:.3f} s")


if __name__ == "__main__":
  build.cli.run(main)

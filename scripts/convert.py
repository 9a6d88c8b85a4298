r"""Converts weights between transformers folders (DiffusionGemma, Gemma 4) and our orbax checkpoints.

  # transformers folder (DiffusionGemma, or a Gemma 4 causal LM) -> orbax params checkpoint
  python scripts/convert.py --from_hf=/ckpt/diffusiongemma --to_orbax=/tmp/dg_params
  # a Gemma 4 causal LM -> the DiffusionGemma whose encoder it is, as a transformers folder
  python scripts/convert.py --from_hf=/ckpt/gemma4 --to_hf=/tmp/dg_from_gemma4
  # training workdir (its latest checkpoint, or --step) -> transformers folder
  python scripts/convert.py --from_workdir=/tmp/dg_tiny --to_hf=/tmp/dg_tiny_hf
  # ... or its causal encoder alone, as a Gemma 4 causal LM (AutoModelForCausalLM loads it)
  python scripts/convert.py --from_workdir=/tmp/dg_tiny --to_hf=/tmp/dg_tiny_gemma4 --architecture=Gemma4ForCausalLM
  # orbax params checkpoint -> transformers folder
  python scripts/convert.py --from_orbax=/tmp/dg_params --to_hf=/tmp/dg_hf

The model config of an orbax source is the one saved next to it (`model_config.json`); `--config` (a
configs/*.py file, its `config.model`) overrides it. A workdir is read as trained, from its `config.json` (a
LoRA run's adapters merged into the weights they adapt); a `--config` beside it must match it, or stands in
for a config.json that is gone. Only parameters are read from a training checkpoint: the optimizer state is
left behind. `--vision_from` copies the vision tower
of an original checkpoint into the exported folder (otherwise transformers initialises a placeholder).
`--architecture` (with --to_hf): `DiffusionGemmaForBlockDiffusion` (the default, the whole model),
`Gemma4ForCausalLM` (the encoder alone) or `Gemma4ForConditionalGeneration` (the encoder with its vision tower).
The tokenizer of a workdir or transformers source (`tokenizer.model`, or `tokenizer.json` with its
`tokenizer_config.json`) is copied into the transformers folder written from it, so that folder can be adapted
(configs/adapt.py) or served as it is.
"""

from absl import app
from absl import flags

from diffusiongemma import build
from diffusiongemma import convert
from diffusiongemma import training
from diffusiongemma.convert import orbax

_CONFIG = build.cli.define_config("config", None, "A config file whose config.model describes the "
                                "weights of an orbax or workdir source (default: the saved one).")
_FROM_HF = flags.DEFINE_string("from_hf", None, "A transformers folder: DiffusionGemma or a Gemma 4 causal LM.")
_FROM_WORKDIR = flags.DEFINE_string("from_workdir", None, "A training workdir (workdir/checkpoints); a folder or "
                                    "gs://bucket/path.")
_FROM_ORBAX = flags.DEFINE_string("from_orbax", None, "An orbax params checkpoint written by --to_orbax.")
_TO_HF = flags.DEFINE_string("to_hf", None, "Write a transformers folder here (a folder or gs://bucket/path).")
_TO_ORBAX = flags.DEFINE_string("to_orbax", None, "Write an orbax params checkpoint here (a folder or "
                                "gs://bucket/path).")
_STEP = flags.DEFINE_integer("step", None, "With --from_workdir: the checkpoint step (default: latest).")
_DTYPE = flags.DEFINE_string("dtype", None, "Cast the weights (e.g. bfloat16); default: keep each one's.")
_VISION_FROM = flags.DEFINE_string("vision_from", None, "With --to_hf: an original transformers folder "
                                   "whose vision tower and vision config are copied.")
_ARCHITECTURE = flags.DEFINE_enum("architecture", None, list(convert.ARCHITECTURES),
                                  "With --to_hf: what to write (default DiffusionGemmaForBlockDiffusion).")
_MAX_SHARD_BYTES = flags.DEFINE_integer("max_shard_bytes", 5 * 2**30, "With --to_hf: safetensors shard size.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  sources = {k: v for k, v in (("--from_hf", _FROM_HF.value), ("--from_workdir", _FROM_WORKDIR.value),
                               ("--from_orbax", _FROM_ORBAX.value)) if v}
  targets = {k: v for k, v in (("--to_hf", _TO_HF.value), ("--to_orbax", _TO_ORBAX.value)) if v}
  if len(sources) != 1 or len(targets) != 1:
    raise app.UsageError(f"Give one source (--from_hf, --from_workdir or --from_orbax) and one target "
                         f"(--to_hf or --to_orbax); got {sorted(sources) or 'no source'} and "
                         f"{sorted(targets) or 'no target'}.")
  (source, source_path), (target, target_path) = *sources.items(), *targets.items()
  if _ARCHITECTURE.value and target != "--to_hf":
    raise app.UsageError("--architecture is for --to_hf (the transformers folder to write).")
  if target == "--to_orbax":
    if source != "--from_hf":
      raise app.UsageError(f"{source} converts to --to_hf, not --to_orbax.")
    orbax.hf_to_orbax(source_path, target_path, dtype=_DTYPE.value)
    return
  config = _CONFIG.value
  if source == "--from_hf":
    cfg, variables = convert.load_hf(source_path, dtype=_DTYPE.value)
  elif source == "--from_workdir":  # the run as trained (a LoRA run's adapters merged); a --config must match it
    weights = build.load(build.run_config(source_path, config), workdir=source_path, quantize="none",
                         step=_STEP.value)
    cfg, variables = weights.model_config, weights.variables
  else:
    cfg, variables = orbax.load_orbax(source_path, build.model_config(config) if config else None)
  convert.save_hf(cfg, variables, target_path, dtype=_DTYPE.value, vision_from=_VISION_FROM.value,
                  max_shard_bytes=_MAX_SHARD_BYTES.value, architecture=_ARCHITECTURE.value or convert.DIFFUSION_GEMMA)
  if source != "--from_orbax":
    build.copy_tokenizer(source_path, target_path)


if __name__ == "__main__":
  build.cli.run(main)

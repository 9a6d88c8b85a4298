r"""Per-device memory of a config on a mesh, with no allocation; says whether it fits.

  python scripts/plan.py --config=configs/diffusiongemma_26b_a4b.py --num_devices=8 \
      --config.mesh.expert=8 --config.mesh.data=1 --batch_size=8 --sequence_length=8192 --device_gb=80
  python scripts/plan.py --config=configs/diffusiongemma_26b_a4b.py --num_devices=64 --training \
      --config.mesh.fsdp=8 --config.mesh.expert=8 --config.mesh.data=1 --batch_size=64 \
      --sequence_length=4352 --device_gb=80
"""

from absl import app
from absl import flags

import diffusiongemma as dg
from diffusiongemma.parallel import mesh as mesh_lib
from diffusiongemma.build import plan as plan_lib
from diffusiongemma import build

_CONFIG = build.cli.define_config("config", lock_config=True)
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 8, "Devices of the planned mesh (none are needed here).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Global batch (sequences).")
_LENGTH = flags.DEFINE_integer("sequence_length", 8192, "Tokens per sequence: the KV cache length when "
                               "sampling, prompt + canvases when training.")
_TRAINING = flags.DEFINE_bool("training", False, "Plan a train step (float32 parameters and AdamW).")
_QUANTIZE = flags.DEFINE_enum("quantize", None, ["none", "int8"], "Weights as stored for inference (default: "
                               "config.model.quantize); int8 quantises attention, MLP and expert weights.")
_DEVICE_GB = flags.DEFINE_float("device_gb", 80.0, "Memory per device, GB (1e9 bytes).")


def main(argv):
  del argv
  config = _CONFIG.value
  cfg = dg.build.model_config(config)
  if _QUANTIZE.value is not None:
    cfg = cfg.replace(quantize=_QUANTIZE.value)
  if cfg.quantize != "none" and _TRAINING.value:
    raise app.UsageError(f"--quantize={cfg.quantize} is for inference: a train step keeps float32 weights.")
  sizes = mesh_lib.mesh_shape(config.mesh, _NUM_DEVICES.value)
  plan = plan_lib.memory_plan(cfg, sizes, batch_size=_BATCH.value, sequence_length=_LENGTH.value,
                              training=_TRAINING.value, rules=mesh_lib.logical_rules(config.mesh))
  mode = "training" if _TRAINING.value else "inference"
  weights = "" if cfg.quantize == "none" else f", {cfg.quantize} weights"
  print(f"{mode}{weights}: mesh {sizes}, global batch {_BATCH.value}, {_LENGTH.value} tokens per sequence")
  print("| per device | GB |\n|---|---|")
  for name, value in plan.items():
    print(f"| {name} | {value / 1e9:.2f} |")
  fits = plan["total"] <= _DEVICE_GB.value * 1e9
  print(f"{'fits' if fits else 'does NOT fit'} in {_DEVICE_GB.value:g} GB per device "
        f"({100 * plan['total'] / (_DEVICE_GB.value * 1e9):.0f}% used)")


if __name__ == "__main__":
  build.cli.run(main)

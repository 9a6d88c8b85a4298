r"""Per-device memory of a config on a mesh, with no allocation; says whether it fits.

  python scripts/plan.py --config=configs/diffusiongemma_26b_a4b.py --num_devices=8 \
      --config.mesh.expert=8 --config.mesh.data=1 --batch_size=8 --sequence_length=8192 --device_gb=80
  python scripts/plan.py --config=configs/diffusiongemma_26b_a4b.py --num_devices=64 --training \
      --config.mesh.fsdp=8 --config.mesh.expert=8 --config.mesh.data=1 --config.train.batch_size=64 --device_gb=80

A training plan reads what the config trains with (`build.plan.config_plan`): its batch, sequence (prompt and
canvases), precision (train.param_dtype, compute_dtype, mu_dtype), model.remat, grad_accum_steps and objective.
"""

from absl import app
from absl import flags

import diffusiongemma as dg
from diffusiongemma.parallel import mesh as mesh_lib
from diffusiongemma.build import plan as plan_lib
from diffusiongemma import build

_CONFIG = build.cli.define_config("config", lock_config=True)
_NUM_DEVICES = flags.DEFINE_integer("num_devices", 8, "Devices of the planned mesh (none are needed here).")
_BATCH = flags.DEFINE_integer("batch_size", None, "Global batch (sequences); default: 8 for inference, "
                              "config.train.batch_size for --training.")
_LENGTH = flags.DEFINE_integer("sequence_length", None, "The KV cache length when sampling (default 8192); with "
                               "--training, tokens per sequence (default: the config's prompt and canvases).")
_TRAINING = flags.DEFINE_bool("training", False, "Plan a train step of the config (its precision, remat, "
                              "gradient accumulation and objective).")
_QUANTIZE = flags.DEFINE_enum("quantize", None, ["none", "int8"], "Weights as stored for inference (default: "
                               "config.model.quantize); int8 quantises attention, MLP and expert weights.")
_DEVICE_GB = flags.DEFINE_float("device_gb", 80.0, "Memory per device, GB (1e9 bytes).")


def main(argv):
  del argv
  config = _CONFIG.value
  sizes = mesh_lib.mesh_shape(config.mesh, _NUM_DEVICES.value)
  if _TRAINING.value:
    if _QUANTIZE.value not in (None, "none"):
      raise app.UsageError(f"--quantize={_QUANTIZE.value} is for inference: a train step keeps its master weights.")
    plan = plan_lib.config_plan(config, sizes, training=True, batch_size=_BATCH.value,
                                sequence_length=_LENGTH.value)
    train = config.train
    print(f"training: mesh {sizes}, global batch {_BATCH.value or train.batch_size}, master weights "
          f"{train.get('param_dtype', 'float32')}, compute {train.get('compute_dtype', 'float32')}, remat "
          f"{config.model.get('remat', False)}, {train.get('grad_accum_steps', 1)} micro-batch(es)")
  else:
    cfg = dg.build.model_config(config)
    if _QUANTIZE.value is not None:
      cfg = cfg.replace(quantize=_QUANTIZE.value)
    batch, length = _BATCH.value or 8, _LENGTH.value or 8192
    plan = plan_lib.memory_plan(cfg, sizes, batch_size=batch, sequence_length=length, training=False,
                                rules=mesh_lib.logical_rules(config.mesh))
    weights = "" if cfg.quantize == "none" else f", {cfg.quantize} weights"
    print(f"inference{weights}: mesh {sizes}, global batch {batch}, {length} tokens per sequence")
  print("| per device | GB |\n|---|---|")
  for name, value in plan.items():
    print(f"| {name} | {value / 1e9:.2f} |")
  fits = plan["total"] <= _DEVICE_GB.value * 1e9
  print(f"{'fits' if fits else 'does NOT fit'} in {_DEVICE_GB.value:g} GB per device "
        f"({100 * plan['total'] / (_DEVICE_GB.value * 1e9):.0f}% used)")


if __name__ == "__main__":
  build.cli.run(main)

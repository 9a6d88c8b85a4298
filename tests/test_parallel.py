"""Meshes, sharding rules and the memory plan; sharded execution on 8 simulated devices (subprocess)."""

import pathlib
import subprocess
import sys

import jax
import pytest

import diffusiongemma as dg
from diffusiongemma import parallel
from diffusiongemma.build.config import load_config_file
from diffusiongemma.build import plan

ROOT = pathlib.Path(__file__).parent.parent


def test_mesh_shape_fills_the_rest_and_rejects_bad_sizes():
  assert parallel.mesh_shape({"data": -1, "expert": 4}, 8) == dict(data=2, fsdp=1, expert=4, tensor=1)
  with pytest.raises(ValueError, match="does not divide"):
    parallel.mesh_shape({"data": -1, "expert": 3}, 8)
  with pytest.raises(ValueError, match="Only one"):
    parallel.mesh_shape({"data": -1, "fsdp": -1}, 8)
  with pytest.raises(ValueError, match="has 4 devices in all, but there are 8"):
    parallel.mesh_shape({"data": 2, "expert": 2}, 8)
  with pytest.raises(ValueError, match=r"config.mesh.tensor=0"):
    parallel.mesh_shape({"tensor": 0}, 8)
  with pytest.raises(ValueError, match="Unknown config.mesh axes"):
    parallel.mesh_shape({"model": 2}, 8)
  with pytest.raises(ValueError, match="'model', which is not a mesh axis"):
    parallel.logical_rules({"rules": [("embed", "model")]})


def test_initialize_distributed_is_a_no_op_alone_and_checks_its_flags(monkeypatch):
  for name in (*parallel.distributed.ENV_VARS, "JAX_DISTRIBUTED"):
    monkeypatch.delenv(name, raising=False)
  assert parallel.initialize_distributed() is False
  assert parallel.initialize_distributed(num_processes=1, process_id=0) is False
  with pytest.raises(ValueError, match="num_processes=2 and process_id=1 need a coordinator address"):
    parallel.initialize_distributed(num_processes=2, process_id=1)
  with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
    parallel.initialize_distributed("localhost:1", num_processes=2, process_id=2)
  assert parallel.is_main_process()
  parallel.sync("nothing to wait for")


def test_released_model_specs_and_plan():
  cfg = dg.ModelConfig.from_dict(load_config_file(ROOT / "configs" / "diffusiongemma_26b_a4b.py").model)
  sizes = dict(data=1, fsdp=1, expert=8, tensor=1)
  model = dg.DiffusionGemma(cfg)
  boxed = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 2), "int32"),
                         jax.ShapeDtypeStruct((1, cfg.canvas_length), "int32"))["params"]
  specs = parallel.param_specs(boxed, sizes)
  assert specs["layer_0"]["experts"]["gating_einsum"] == jax.P("expert", None, "tensor", "fsdp")
  one_device = plan.memory_plan(cfg, dict(data=1, fsdp=1, expert=1, tensor=1), batch_size=1,
                                sequence_length=1024, training=False)
  assert one_device["parameters"] == 2 * dg.model.count_parameters(cfg)["total"]  # bfloat16, whole
  eight = plan.memory_plan(cfg, sizes, batch_size=8, sequence_length=8192, training=False)
  assert eight["parameters"] < one_device["parameters"] / 4  # the experts, most of the model, split 8 ways
  assert eight["total"] < 80e9


def test_the_training_plan_reads_the_precision_remat_accumulation_and_objective_of_the_config():
  """`plan.config_plan` of configs/tiny.py as its settings change, part by part: bfloat16 master weights halve
  parameters, gradients and moments; a bfloat16 first moment takes a quarter off the moments; remat keeps each
  layer's input only; two micro-batches halve the activations and double the gradients; grading every canvas
  adds the other canvas's logits (from shapes alone: nothing is compiled)."""
  def planned(**overrides):
    config = load_config_file(ROOT / "configs" / "tiny.py")
    config.mesh.data = 1
    for key, value in overrides.items():
      section, field = key.split("__")
      config[section][field] = value
    return plan.config_plan(config, dict(data=1, fsdp=1, expert=1, tensor=1), training=True)

  base = planned()
  assert base["parameters"] == 4 * dg.model.count_parameters(dg.build.model_config(
      load_config_file(ROOT / "configs" / "tiny.py")))["total"]  # float32 master weights, one device
  half = planned(train__param_dtype="bfloat16")
  for key in ("parameters", "gradients", "optimizer_state"):
    assert half[key] == base[key] / 2, key
  assert planned(train__mu_dtype="bfloat16")["optimizer_state"] == base["optimizer_state"] * 3 / 4
  assert planned(model__remat=True)["activations_saved"] < base["activations_saved"] / 4
  assert planned(train__compute_dtype="bfloat16")["kv_cache"] == base["kv_cache"] / 2
  accumulated = planned(train__grad_accum_steps=2)
  assert accumulated["gradients"] == 2 * base["gradients"] and accumulated["logits"] == base["logits"] / 2
  every = planned(diffusion__all_canvases=True)
  # the logits of 64 tokens (encoder: logits and gradient) and 16 graded (and self-conditioning: x3); then 32
  assert every["logits"] == pytest.approx(base["logits"] * (2 * 64 + 3 * 32) / (2 * 64 + 3 * 16))


def _run_on_8_devices(*args):
  result = subprocess.run([sys.executable, str(ROOT / "tests" / "_sharded_forward.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "OK" in result.stdout, result.stdout
  print(result.stdout)


def test_sharded_forward_equals_one_device():
  _run_on_8_devices()


@pytest.mark.slow
def test_sharded_train_step_equals_one_device():
  """configs/tiny.py (2 layers), batch 8: loss, gradients and update on (2,2,2,1) and (1,2,4,1) == one device."""
  _run_on_8_devices("train")


@pytest.mark.hf
def test_sharded_streaming_load(tmp_path):
  pytest.importorskip("torch")
  hf_reference = pytest.importorskip("benchmarks.hf_reference")
  hf_reference.make_tiny_hf(tmp_path, seed=0, max_shards=4, num_experts=8, num_hidden_layers=8)  # 8 layers: the
  # fixed costs of a load (tracing the shapes once, jax's per-array objects) stay well under half the checkpoint
  _run_on_8_devices(tmp_path)

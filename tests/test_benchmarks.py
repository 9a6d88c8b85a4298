"""The benchmarks package: the side-by-side protocol (alternation, the load guard, what the JSON records)
and its entry points run as a module and as a file. No timing is asserted."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import batching
from benchmarks import measure
from diffusiongemma import timing

ROOT = pathlib.Path(__file__).parent.parent


def test_alternate_takes_turns_after_one_first_call_each():
  calls = []
  ours, theirs = measure.alternate(lambda: calls.append("ours") or 1, lambda: calls.append("theirs") or 2, 3)
  assert calls == ["ours", "theirs"] * 4  # a first call each, then ours, theirs, ... 3 times
  assert (ours.output, theirs.output, len(ours.runs), len(theirs.runs)) == (1, 2, 3, 3)
  with pytest.raises(ValueError, match="repeats=0"):
    measure.alternate(lambda: 1, lambda: 2, 0)


def test_a_loaded_machine_is_refused_or_warned_in_the_json():
  quiet, loaded = {"load_average": [0.2, 0.0, 0.0]}, {"load_average": [1.7, 0.0, 0.0]}
  assert timing.loaded_machine(quiet, 0.5, allow=False) == []
  with pytest.raises(SystemExit, match="Refusing to time. LOADED MACHINE: 1-minute load average 1.70 > 0.5"):
    timing.loaded_machine(loaded, 0.5, allow=False)
  (warning,) = timing.loaded_machine(loaded, 0.5, allow=True)
  assert warning.startswith("LOADED MACHINE") and "not results" in warning


def test_batching_shapes_are_parsed_or_refused_by_name():
  assert [batching.parse_shape(s) for s in ("64x2", "1024X64")] == [(64, 2), (1024, 64)]
  for bad in ("64", "64x0", "x8", "64x2x1", "-4x2", "64xtwo"):
    with pytest.raises(ValueError, match=f"PROMPTxCANVASES .* got '{bad}'"):
      batching.parse_shape(bad)


def test_matmuls_alone_counts_every_dot_once_per_run():
  """Dots in nested calls and in a scan (once per iteration) are timed and counted with their FLOPs; those
  under a cond (run or not, known only at run time) are left out and counted apart."""
  def fn(x, w):
    y = jax.jit(lambda a: a @ w)(x)  # a nested call: [64, 32] x [32, 32]
    y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), y, None, length=3)  # 3 more
    y = jax.lax.cond(y.sum() > 0, lambda y: y @ w, lambda y: y, y)  # left out
    return jnp.einsum("bij,bkj->bik", y[None], y[None])  # [1, 64, 32] x [1, 64, 32]^T
  found = measure.matmuls_alone(fn, jnp.ones((64, 32)), jnp.ones((32, 32)), repeats=1)
  assert (found["dots"], found["distinct"], found["conditional_dots"]) == (5, 2, 1)
  assert found["flops"] == 4 * 2 * 64 * 32 * 32 + 2 * 64 * 64 * 32 and found["seconds"] > 0


def _vs_transformers(*args, module=True):
  entry = ["-m", "benchmarks.vs_transformers"] if module else [str(ROOT / "benchmarks" / "vs_transformers.py")]
  return subprocess.run([sys.executable, *entry, "--size=tiny", "--quick", *args], capture_output=True,
                        text=True, timeout=1200, cwd=ROOT, check=False)


def test_vs_transformers_refuses_a_loaded_machine(tmp_path):
  result = _vs_transformers("--max_load=-1", f"--output={tmp_path / 'out.json'}")  # any load is too much
  assert result.returncode != 0 and "Refusing to run. LOADED MACHINE" in result.stderr
  assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
@pytest.mark.hf
def test_vs_transformers_smoke_run_records_the_protocol(tmp_path):
  """A tiny run from the file path (no sys.path tricks): alternated runs, compile time apart, the load
  average, a matmul peak, the device, every sampler setting (with the backend's MoE choice), the commit;
  the warning for the load in the JSON (forced by --max_load=-1 with --allow_load)."""
  pytest.importorskip("transformers")
  output = tmp_path / "out.json"
  result = _vs_transformers("--max_load=-1", "--allow_load", f"--output={output}", module=False)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads(output.read_text())
  machine = results["machine"]
  assert {"device", "backend", "load_average", "load_average_after", "git_commit", "torch_device"} <= set(machine)
  assert machine["matmul_peak_tflops"] > 0 and machine["matmul_peak_dtype"] == "float32"
  assert results["warnings"] and results["warnings"][0].startswith("LOADED MACHINE")
  fixed = results["settings"]["fixed"]
  assert fixed["stopping_rule"] == "NoEarlyStop()" and fixed["moe_impl"] in ("grouped", "ragged")
  assert fixed["vocab_chunk_size"] == "auto" and results["settings"]["transformers_fixed"]["max_denoising_steps"] == 16
  (run,) = results["runs"]
  assert len(run["ours_runs"]) == len(run["hf_runs"]) == 3 and run["ours_compile_seconds"] >= 0
  assert run["ours_passes_per_canvas"] == run["hf_passes_per_canvas"] == 16  # both ran every step
  (breakdown,) = results["breakdown"]
  assert breakdown["step_mfu"] > 0 and breakdown["step_dots"] > 0 and breakdown["ratio_at_matmuls_alone"] > 0
  assert "LOADED MACHINE" in result.stdout


@pytest.mark.slow
@pytest.mark.hf
def test_accelerator_smoke_run_measures_every_section(tmp_path):
  """`benchmarks.accelerator --smoke` (tiny shapes on the CPU, each section in its own process, two at a time):
  every section ran with no error and has its numbers, its settings, FLOPs equal to the plan's count where
  passes are fixed, and the machine it ran on is recorded. A section that breaks fails this test."""
  pytest.importorskip("transformers")
  output = tmp_path / "accelerator.json"
  result = subprocess.run([sys.executable, "-m", "benchmarks.accelerator", "--smoke", f"--output={output}"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
  assert output.exists(), result.stderr[-3000:]
  results = json.loads(output.read_text())
  sections = results["sections"]
  assert list(sections) == ["vs_transformers", "text", "train", "batching"]
  assert {name: s["error"] for name, s in sections.items()} == dict.fromkeys(sections), result.stderr[-3000:]
  assert result.returncode == 0, result.stderr[-3000:]
  for name, section in sections.items():
    assert section["flops"] > 0 and section["seconds"] > 0 and section["settings"], name
    assert "peak_memory_bytes" in section and section["compile_seconds"] >= 0, name
  for name in ("vs_transformers", "train", "batching"):  # every pass at its cap: the plan's count is exact
    assert sections[name]["flops"] == pytest.approx(results["plan"][name]["flops"], rel=1e-9), name
  (run,) = sections["vs_transformers"]["runs"]
  assert run["ours_best_tokens_per_second"] > 0 and run["hf_best_tokens_per_second"] > 0 and run["best_ratio"] > 0
  assert run["ours_passes_per_canvas"] == run["hf_passes_per_canvas"] == 4 and run["ours_mfu_of_measured_peak"] > 0
  text = sections["text"]
  assert {r["decoder"] for r in text["runs"]} == {"speculative", "diffusion", "ar"}
  assert all(r["tokens_per_second"] > 0 and r["tokens_per_model_call"] > 0 for r in text["runs"])
  assert text["speculative_at_temperature"].startswith("not measured")
  train = sections["train"]
  assert train["seconds_per_step"] > 0 and train["tokens_per_second"] > 0 and train["mfu_of_measured_peak"] > 0
  assert train["mfu"] == train["mfu_of_measured_peak"] and train["mfu_peak"] == "measured"  # a CPU has no datasheet
  assert train["settings"]["remat"] and train["settings"]["compute_dtype"] == "bfloat16"
  batching = sections["batching"]
  assert [r["batch_size"] for r in batching["runs"]] == [1, 2] and batching["best_over_batch_1"] > 0
  assert all(r["passes_per_row"] == 12 for r in batching["runs"])
  machine = results["machine"]
  assert {"device", "backend", "jax", "jaxlib", "platform_version", "git_commit", "load_average",
          "load_average_after"} <= set(machine)

"""The benchmark binaries in their smallest form: they run, and every figure they report is sane."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


def _numbers(tree):
  if isinstance(tree, dict):
    for value in tree.values():
      yield from _numbers(value)
  elif isinstance(tree, list):
    for value in tree:
      yield from _numbers(value)
  elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
    yield tree


@pytest.mark.slow
def test_benchmark_quick_on_tiny(tmp_path):
  command = [sys.executable, str(ROOT / "scripts" / "benchmark.py"),
             f"--config={ROOT / 'configs' / 'tiny.py'}",
             f"--workdir={tmp_path}", "--quick", "--max_new_tokens=16", "--prompt_length=8",
             "--config.sampler.max_denoising_steps=6"]
  result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads((tmp_path / "benchmark.json").read_text())
  assert {"config", "params", "model", "sampler", "machine", "decoding", "efficiency", "moe", "training",
          "accepted_per_step", "plots"} <= set(results)
  assert [row["batch_size"] for row in results["decoding"]] == [1, 4]
  for row in results["decoding"]:
    for key in ("diffusion_tokens_per_second", "ar_tokens_per_second", "speedup", "tokens_per_forward",
                "steps_per_canvas", "diffusion_latency_seconds", "ar_latency_seconds"):
      assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row["steps_per_canvas"] <= 6
  for key in ("denoiser_mfu", "ar_step_bandwidth_fraction", "denoiser_flops", "ar_step_bytes",
              "ar_step_min_bytes"):
    assert math.isfinite(results["efficiency"][key]) and results["efficiency"][key] > 0, key
  assert [row["config"] for row in results["training"]] == ["tiny"]  # --quick: the first train config
  for key in ("tokens_per_second", "seconds_per_step", "compile_seconds", "flops_per_step", "mfu"):
    value = results["training"][0][key]
    assert math.isfinite(value) and value > 0, (key, value)
  assert all(math.isfinite(x) and x >= 0 for x in _numbers(results))
  assert sum(results["accepted_per_step"]) > 0
  for plot in results["plots"]:
    assert pathlib.Path(plot).read_bytes()[:4] == b"\x89PNG"
  assert "| batch | diffusion tok/s |" in result.stdout
  assert "| training config |" in result.stdout

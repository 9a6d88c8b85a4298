r"""What batching can buy on this machine: `Sampler.generate` of a batch of B rows against B calls of one row,
at the same shape (prompt bucket, reply canvases), for the serving grid's shapes.

No scheduler batches better than a batch of identical rows with no padding, so `16 x seconds(batch 1) /
seconds(batch 16)` bounds the throughput any server can reach over serving the same requests one at a time
(before HTTP and tokenizing, which one at a time pays per request too). The model is a transformers
checkpoint loaded as `scripts/serve.py` loads it (`--dtype`, bfloat16 by default); prompts are random tokens
of the full bucket, and no token stops a row (`stop_tokens=()`), so every row writes every canvas; each
canvas runs to the sampler's stopping rule or step cap (a batch to its slowest row's, as a served batch).
Every pass is streamed to a host listener that does nothing (`on_pass`, as the server streams every pass).
Batch sizes are alternated `--repeats` times (best kept) on a quiet machine (`--max_load`); the JSON records
the load averages, a matmul peak and every setting. The runs are `measure.shape_runs` (`benchmarks.accelerator`
times the same on an accelerator).

  python -m benchmarks.batching --hf_checkpoint=DIR --output=results/batching.json
"""

from __future__ import annotations

import json
import os
import pathlib

from absl import app
from absl import flags

from benchmarks import measure
from diffusiongemma import build
from diffusiongemma import timing

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_HF = flags.DEFINE_string("hf_checkpoint", None, "A transformers DiffusionGemma checkpoint folder.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Weight and compute dtype (as scripts/serve.py).")
_OUTPUT = flags.DEFINE_string("output", None, "Where the JSON goes.")
_SHAPES = flags.DEFINE_list("shapes", [f"{p}x{c}" for p, c in measure.SERVING_SHAPES],
                            "PROMPTxCANVASES: prompt bucket (tokens) and reply canvases of each program timed.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Batch sizes (1 must be among them).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs of each batch size (alternated, best kept).")
_MAX_LOAD = flags.DEFINE_float("max_load", 0.5, "Refuse to time above this 1-minute load average.")
_ALLOW_LOAD = flags.DEFINE_bool("allow_load", False, "Time on a loaded machine anyway (warned in the JSON).")


def parse_shape(text: str) -> tuple[int, int]:
  """"PROMPTxCANVASES" -> (prompt bucket, canvases), both positive."""
  parts = text.lower().split("x")
  if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"A shape is PROMPTxCANVASES with two positive integers (e.g. 256x8), got {text!r}.")
  return int(parts[0]), int(parts[1])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  shapes = [parse_shape(s) for s in _SHAPES.value]
  batch_sizes = sorted({int(b) for b in _BATCH_SIZES.value})
  if batch_sizes[0] != 1:
    raise app.UsageError(f"--batch_sizes must include 1 (the rate the others are compared with), got "
                         f"{_BATCH_SIZES.value}.")
  machine = timing.provenance(_ROOT)
  warnings = timing.loaded_machine(machine, _MAX_LOAD.value, _ALLOW_LOAD.value)
  loaded = build.pretrained(_HF.value, dtype=_DTYPE.value)
  sampler = loaded.sampler.replace(config=loaded.sampler.config.replace(stop_tokens=()))
  rows = []
  for prompt, canvases in shapes:
    rows += measure.shape_runs(sampler, loaded.weights.variables, prompt, canvases, batch_sizes, _REPEATS.value)
    for row in rows[-len(batch_sizes):]:
      print(f"prompt {prompt} x {canvases} canvases, batch {row['batch_size']}: {row['seconds']:.3f} s, "
            f"{row['over_batch_1']:.2f}x batch 1's rows/s, {row['passes_per_row']:.0f} passes a row", flush=True)
  machine.update(matmul_peak_gflops=timing.matmul_peak_flops() / 1e9, load_average_after=list(os.getloadavg()),
                 warnings=warnings)
  largest = max(batch_sizes)
  result = {"runs": rows,
            "best_over_batch_1": max(r["over_batch_1"] for r in rows if r["batch_size"] == largest),
            "machine": machine,
            "settings": {"hf_checkpoint": pathlib.Path(_HF.value).resolve().name, "dtype": _DTYPE.value,
                         "shapes": _SHAPES.value, "batch_sizes": batch_sizes, "repeats": _REPEATS.value,
                         "on_pass": "a listener that does nothing", "sampler": sampler.settings()}}
  out = pathlib.Path(_OUTPUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(f"batch {largest} at best {result['best_over_batch_1']:.2f}x the rows/s of batch 1; wrote {out}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["hf_checkpoint", "output"])
  app.run(main)

r"""Data at scale on this machine: prepare throughput by worker count, and a training run's memory and time
against the size of its prepared corpus.

  python -m benchmarks.data_scale --output=results/data_scale.json [--large_mb=600 --small_mb=20]

Builds two JSONL corpora from the standard library's source (each record one file, tagged with its copy
number so that copies differ): `small_mb` and `large_mb` megabytes. Prepares a `--prepare_mb` slice with 1
and with 2 workers, alternated `--repeats` times (best kept), then both corpora; then runs the same 20-step
`configs/tiny.py` training (scripts/train.py, a fresh workdir each time) on each prepared corpus, alternated,
recording each run's wall time and peak resident memory (the child's ru_maxrss). On a quiet machine only
(`--max_load`); the JSON holds every setting, the load and the commit.
"""

import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from diffusiongemma import data as data_lib
from diffusiongemma import timing
from diffusiongemma.data import prepared
from diffusiongemma.data import sources

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_OUTPUT = flags.DEFINE_string("output", "results/data_scale.json", "Where to write the JSON.")
_SMALL_MB = flags.DEFINE_integer("small_mb", 20, "The small corpus, in MB of JSONL.")
_LARGE_MB = flags.DEFINE_integer("large_mb", 600, "The large corpus, in MB of JSONL.")
_PREPARE_MB = flags.DEFINE_integer("prepare_mb", 100, "The corpus whose preparation is timed by worker count.")
_STEPS = flags.DEFINE_integer("steps", 20, "Training steps of each run.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Alternated repeats of each timing.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Scratch folder (default: a temporary one, removed after).")
_MAX_LOAD = flags.DEFINE_float("max_load", 0.5, "Refuse to time above this 1-minute load average.")
_ALLOW_LOAD = flags.DEFINE_bool("allow_load", False, "Time anyway on a loaded machine (marked in the JSON).")


def _jsonl(path: pathlib.Path, megabytes: int) -> dict:
  """A JSONL corpus of about `megabytes` MB: the stdlib's files, copy after copy, each record tagged."""
  files = data_lib.stdlib_files()
  texts = [t for t in (data_lib.corpus.read_text(p) for p in files) if t]
  written, copies, records = 0, 0, 0
  with path.open("w", encoding="utf-8") as f:
    while written < megabytes * 2**20:
      for text in texts:
        line = json.dumps({"text": f"# copy {copies}\n{text}"}) + "\n"
        f.write(line)
        written += len(line.encode("utf-8"))
        records += 1
        if written >= megabytes * 2**20:
          break
      copies += 1
  return {"path": str(path), "bytes": written, "records": records}


def _peak_rss_mb(corpus: pathlib.Path, workdir: pathlib.Path) -> tuple[float, float]:
  """(wall s, peak RSS MB) of one training run, measured in a fresh child of a fresh Python (so that
  ru_maxrss is this run's alone)."""
  code = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
          "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
          "print(json.dumps({'rc': r.returncode, 'wall_s': time.perf_counter() - t, 'err': r.stderr[-2000:], "
          "'peak_rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))")
  args = [sys.executable, str(_ROOT / "scripts" / "train.py"), f"--config={_ROOT / 'configs' / 'tiny.py'}",
          f"--workdir={workdir}", f"--config.data.corpus={corpus}", f"--config.train.num_steps={_STEPS.value}",
          "--config.train.eval_every=0", f"--config.train.checkpoint_every={_STEPS.value}",
          "--config.train.log_every=10"]
  out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false"))
  result = json.loads(out.stdout)
  if result["rc"]:
    raise SystemExit(f"training failed: {result['err']}")
  shutil.rmtree(workdir, ignore_errors=True)
  return result["wall_s"], result["peak_rss_mb"]


def main(argv):
  del argv
  machine = timing.provenance(_ROOT)
  warnings = timing.loaded_machine(machine, _MAX_LOAD.value, _ALLOW_LOAD.value)
  scratch = pathlib.Path(_WORKDIR.value or tempfile.mkdtemp(prefix="data_scale_"))
  scratch.mkdir(parents=True, exist_ok=True)
  try:
    corpora = {name: _jsonl(scratch / f"{name}.jsonl", mb) for name, mb in
               (("prepare", _PREPARE_MB.value), ("small", _SMALL_MB.value), ("large", _LARGE_MB.value))}
    tok = data_lib.Tokenizer.train(sources.sample_documents(sources.open_source("stdlib"), 4_000_000),
                                   scratch / "tokenizer.model", vocab_size=4096)
    throughput = {1: [], 2: []}
    for _ in range(_REPEATS.value):
      for workers in (1, 2):
        out = scratch / f"prepared_{workers}"
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        manifest = prepared.prepare(corpora["prepare"]["path"], out, tok, workers=workers)
        throughput[workers].append(time.perf_counter() - start)
    tokens = manifest["splits"]["train"]["tokens"] + manifest["splits"]["validation"]["tokens"]
    prepare = {str(w): {"best_s": min(t), "runs_s": t, "mb_per_s": corpora["prepare"]["bytes"] / 2**20 / min(t),
                        "tokens_per_s": tokens / min(t)} for w, t in throughput.items()}
    prepare["speedup_2_over_1"] = min(throughput[1]) / min(throughput[2])
    folders, prepare_times = {}, {}
    for name in ("small", "large"):
      start = time.perf_counter()
      manifest = prepared.prepare(corpora[name]["path"], scratch / f"prepared_{name}", tok, workers=2)
      prepare_times[name] = time.perf_counter() - start
      folders[name] = scratch / f"prepared_{name}"
      corpora[name]["train_tokens"] = manifest["splits"]["train"]["tokens"]
      corpora[name]["prepare_s_2_workers"] = prepare_times[name]
    runs = {"small": [], "large": []}
    for i in range(_REPEATS.value):
      for name in ("small", "large"):
        runs[name].append(_peak_rss_mb(folders[name], scratch / f"work_{name}_{i}"))
    training = {name: {"wall_s": [w for w, _ in r], "peak_rss_mb": [m for _, m in r],
                       "median_wall_s": sorted(w for w, _ in r)[len(r) // 2],
                       "median_peak_rss_mb": sorted(m for _, m in r)[len(r) // 2]} for name, r in runs.items()}
    training["rss_difference_mb"] = training["large"]["median_peak_rss_mb"] - training["small"]["median_peak_rss_mb"]
    training["wall_difference_s"] = training["large"]["median_wall_s"] - training["small"]["median_wall_s"]
  finally:
    if not _WORKDIR.value:
      shutil.rmtree(scratch, ignore_errors=True)
  result = {"command": " ".join(["python -m benchmarks.data_scale", *sys.argv[1:]]), "machine": machine,
            "warnings": warnings, "settings": {"small_mb": _SMALL_MB.value, "large_mb": _LARGE_MB.value,
                                               "prepare_mb": _PREPARE_MB.value, "steps": _STEPS.value,
                                               "repeats": _REPEATS.value, "config": "configs/tiny.py",
                                               "tokenizer_vocab": tok.vocab_size},
            "corpora": corpora, "prepare": prepare, "training": training,
            "matmul_peak_gflops": timing.matmul_peak_flops() / 1e9}
  pathlib.Path(_OUTPUT.value).write_text(json.dumps(result, indent=2))
  print(json.dumps({"prepare": prepare, "training": {k: v for k, v in training.items()}}, indent=1))


if __name__ == "__main__":
  app.run(main)

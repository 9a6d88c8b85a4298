r"""One prepared accelerator run: every figure that only a GPU or TPU can give, in one command.

A device is lent for minutes, so this measures everything in one call, each section in its own process (so
that one that fails, hangs or runs out of memory is recorded and the others still run, and so that each
section's peak device memory is its own), within `--time_limit` seconds in all:
1. `vs_transformers`: our sampler against transformers' `generate` on the same converted random ~1B model
   (hidden 1536, `--layers` layers, 32 experts top-4, vocab 262,144, canvas 256, the released layer pattern),
   bf16 on both sides, 16 fixed steps, batch 1 / 8 / 32: tokens/s of each, alternated, and their ratio
   (`measure.side_by_side`), with our useful TFLOP/s and MFU;
2. `text`: the shipped text weights (`projects/text`) decoded three ways on held-out prompts, batch 1 and 8,
   alternated: self-speculative (greedy), block diffusion and
   AR greedy: tokens/s and tokens per model call;
3. `train`: the train step of the ~1B model of section 1 (bf16 compute, rematerialised layers): seconds per
   step, tokens/s, MFU of the analytic FLOPs (`measure.train_step_flops`);
4. `batching`: `benchmarks.batching`'s bound (one batch of B identical rows against B calls of one row,
   `measure.shape_runs`) at its shapes, on a tiny random model (`measure.SIZES["tiny"]`, 12 passes a canvas).
Every section records its settings, its wall seconds (compilation included), the useful FLOPs it ran
(counted from the shapes and the passes each call made), the device's peak memory (`memory_stats`, None
where the backend has none) and its error (None when it ran). MFU is against a datasheet's dense bf16 peak
for the device kind (`PEAKS`; on a CPU, the measured one) and against a bf16 matmul peak measured in the run.
The JSON is rewritten after every section; the exit status is 1 when any section failed. The schema, the
wheels to carry and the time estimate: docs/performance.md, "On an accelerator".

  python -m benchmarks.accelerator --output=results/accelerator_h100.json    # one GPU, <= 8 minutes
  python -m benchmarks.accelerator --smoke --output=/tmp/accelerator.json    # tiny shapes on a CPU, <= 2 minutes
  python -m benchmarks.accelerator --plan                                    # the full run's FLOPs; runs nothing
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from absl import app
from absl import flags
import jax
import numpy as np

import diffusiongemma as dg
from benchmarks import measure
from diffusiongemma import build
from diffusiongemma import parallel
from diffusiongemma import timing
from diffusiongemma.build.config import base_config

_ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = ("vs_transformers", "text", "train", "batching")  # run in this order: the last is cut first
_OUTPUT = flags.DEFINE_string("output", None, "Where the JSON goes (e.g. results/accelerator_h100.json).")
_SMOKE = flags.DEFINE_bool("smoke", False, "Every section with tiny shapes (a CPU, <= 2 minutes): the script's test.")
_SECTIONS = flags.DEFINE_list("sections", list(SECTIONS), f"Sections to run, of {', '.join(SECTIONS)}.")
_LAYERS = flags.DEFINE_integer("layers", 8, "Layers of the ~1B random model of vs_transformers and train "
                               "(8: 1.0B parameters; 12: the 1.3B model of NOTES' H200 run).")
_TIME_LIMIT = flags.DEFINE_float("time_limit", 480.0, "Seconds for the whole run: a section may use what is "
                                 "left minus 45 s for each section after it, or is stopped and recorded.")
_ISOLATE = flags.DEFINE_bool("isolate", True, "Each section in its own process (its own peak memory; a crash or "
                             "hang costs that section only).")
_JOBS = flags.DEFINE_integer("jobs", 0, "Sections at a time, each in its own process (0: 2 for --smoke, else 1). "
                             "Side by side their timings mean nothing: for smoke runs only.")
_PLAN = flags.DEFINE_bool("plan", False, "Print the full run's settings and analytic FLOPs per section, run nothing.")
_SECTION = flags.DEFINE_string("section", None, "Internal: run this one section here and write its JSON to --output.")
_COMPILATION_CACHE = parallel.define_compilation_cache_flag()

# Dense bf16 TFLOP/s by device kind (datasheets; the first name contained in `device_kind` wins).
PEAKS = timing.PEAKS
# Transformers config field -> ModelConfig field, for the random models `measure.SIZES` gives as the former.
_HF_TO_OURS = dict(hidden_size="hidden_size", num_hidden_layers="num_layers", num_attention_heads="num_heads",
                   num_key_value_heads="num_kv_heads", head_dim="head_dim", global_head_dim="full_head_dim",
                   num_global_key_value_heads="num_full_kv_heads", sliding_window="sliding_window",
                   intermediate_size="intermediate_size", moe_intermediate_size="moe_intermediate_size",
                   num_experts="num_experts", top_k_experts="top_k", vocab_size="vocab_size",
                   canvas_length="canvas_length")
# Tokens per pass of the shipped text weights on held-out prompts (NOTES 2026-12-07; results/reuse.json's exact
# decoding), for `plan`: greedy decoding makes the same text on any device.
_TEXT_TOKENS_PER_PASS = {"ar": 1.0, "speculative": 4.43, "diffusion": 2.32}


def settings(smoke: bool, layers: int) -> dict:
  """Every setting of every section: full, or smoke (the tiny side-by-side size, one batch size where one
  is enough, a single canvas, one timed run per figure: each section compiles as few programs as it can)."""
  tiny = measure.SIZES["tiny"][0]
  big = tiny if smoke else dict(measure.SIZES["realistic"][0], num_hidden_layers=layers)
  repeats = 1 if smoke else 3
  return {
      "vs_transformers": dict(model=big, dtype="bfloat16", batch_sizes=[1] if smoke else [1, 8, 32],
                              steps=4 if smoke else 16, prompt_length=16 if smoke else 64,
                              new_tokens=32 if smoke else 256, repeats=repeats, torch_threads=2),
      "text": dict(weights="distilled", prompts="validation.jsonl", num_prompts=2 if smoke else 8,
                   batch_sizes=[2] if smoke else [1, 8], max_new_tokens=16 if smoke else 128,
                   max_prompt_tokens=64, repeats=repeats),
      "train": dict(model={_HF_TO_OURS[k]: v for k, v in big.items()}, batch_size=2 if smoke else 4,
                    prompt_length=16 if smoke else 256, num_canvases=1 if smoke else 2, compute_dtype="bfloat16",
                    remat=True, repeats=repeats),
      "batching": dict(model=tiny, dtype="bfloat16", max_denoising_steps=12,
                       shapes=[[16, 1]] if smoke else [list(x) for x in measure.SERVING_SHAPES],
                       batch_sizes=[1, 2] if smoke else [1, 4, 16], repeats=repeats),
  }


def _peaks() -> dict:
  """The device kind's datasheet bf16 peak (None if unknown) and a bf16 matmul peak measured now."""
  table = timing.datasheet_peak_flops()
  size = 1024 if jax.default_backend() == "cpu" else 8192
  return {"datasheet_peak_flops": table, "matmul_peak_flops": timing.matmul_peak_flops(size, dtype="bfloat16")}


def _mfus(flops_per_second: float, peaks: dict) -> dict:
  """MFU against the device kind's datasheet peak, or the measured one where the kind is not in `PEAKS` (a
  CPU); `mfu_peak` says which; and against the measured one always."""
  table, measured = peaks["datasheet_peak_flops"], peaks["matmul_peak_flops"]
  return {"mfu": flops_per_second / (table or measured), "mfu_peak": "measured" if table is None else "datasheet",
          "mfu_of_measured_peak": flops_per_second / measured}


def _compile_all(calls) -> float:
  """Runs every call once, all at a time from a thread each, and returns the wall seconds: XLA compiles
  their programs on the host's cores in parallel (one at a time, a device run's compilation would take most
  of its minutes) while their executions queue on the device. The timed runs after it find them compiled,
  so their `compile_seconds` are ~0 and this is the section's compilation."""
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(len(calls), 1)) as pool:
    for future in [pool.submit(lambda fn=fn: jax.block_until_ready(fn())) for fn in calls]:
      future.result()
  return time.perf_counter() - start


def _vs_transformers(s: dict) -> dict:
  import torch  # pylint: disable=g-import-not-at-top  (the `hf` extra)
  import transformers  # pylint: disable=g-import-not-at-top
  folder = pathlib.Path(tempfile.mkdtemp(prefix="dg_accelerator_"))
  try:
    hf_reference, hf_model, torch_device = measure.transformers_model(folder, s["model"], s["dtype"],
                                                                      s["torch_threads"], released_layers=True)
    cfg, params = dg.convert.load_hf(folder, vision=None, dtype=s["dtype"])
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  cfg = cfg.replace(dtype=s["dtype"], param_dtype=s["dtype"])
  params = jax.device_put(params)
  sampler = dg.Sampler(dg.DiffusionGemma(cfg), dg.SamplerConfig(max_denoising_steps=s["steps"], stop_tokens=()),
                       stopping=dg.diffusion.NoEarlyStop())
  hf_kwargs = dict(max_new_tokens=s["new_tokens"], max_denoising_steps=s["steps"], confidence_threshold=1e-30)
  rng = np.random.default_rng(0)
  prompts = {b: rng.integers(3, cfg.vocab_size, (b, s["prompt_length"])) for b in s["batch_sizes"]}
  compile_seconds = _compile_all([lambda p=p: sampler.generate(params, p, jax.random.key(1), s["new_tokens"])
                                  for p in prompts.values()])
  peaks, runs, flops = _peaks(), [], 0.0
  for b in s["batch_sizes"]:
    row = measure.side_by_side(sampler, params, hf_reference, hf_model, prompts[b], hf_kwargs, s["new_tokens"],
                               s["repeats"])
    row["flops_per_call"] = measure.generation_flops(cfg, b, s["prompt_length"], row["ours_canvas_passes"])
    row["ours_tflops_per_second"] = row["flops_per_call"] / row["ours_best_seconds"] / 1e12
    row.update({f"ours_{k}": v for k, v in _mfus(row["flops_per_call"] / row["ours_best_seconds"], peaks).items()})
    flops += 2 * (1 + s["repeats"]) * row["flops_per_call"]  # both sides, every call
    runs.append(row)
    print(json.dumps(row), flush=True)
  counts = dg.model.count_parameters(cfg)
  cuda = torch_device == "cuda"
  return {"runs": runs, "flops": flops, "compile_seconds": compile_seconds, **peaks, "sampler": sampler.settings(),
          "transformers": hf_kwargs,
          "model": {"total_parameters": counts["total"], "active_parameters": counts["active"]},
          "torch_device": torch_device, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
          "transformers_version": transformers.__version__,
          "torch_peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def _text_flops(cfg, decoder: str, prompts, new_tokens: list[int], passes: int) -> float:
  """Useful FLOPs of one decoding of `prompts` (per row, at its mean cache length): the prompts encoded;
  AR: one encoder step per new token; block diffusion: its denoiser passes (self-conditioned: the first of a
  canvas is not, a small overcount) and every canvas but the last committed; self-speculative: per pass a
  denoiser pass over the block (no self-conditioning) and the encoder checking it."""
  c = cfg.canvas_length
  cache = int(np.mean([len(p) for p in prompts]) + np.mean(new_tokens) / 2)
  flops = sum(measure.encoder_flops(cfg, 1, len(p)) for p in prompts)
  if decoder == "ar":
    return flops + sum(new_tokens) * measure.encoder_flops(cfg, 1, 1, cache)
  if decoder == "speculative":  # a denoiser pass with no self-conditioning, then the encoder over its block
    return flops + passes * (measure.denoiser_flops(cfg, 1, cache, self_conditioning=False)
                             + measure.encoder_flops(cfg, 1, c, cache))
  flops += passes * measure.denoiser_flops(cfg, 1, cache)
  commits = sum(max(math.ceil(n / c) - 1, 0) for n in new_tokens)
  return flops + commits * measure.encoder_flops(cfg, 1, c, cache)


def _text(s: dict) -> dict:
  from projects.text import runs  # pylint: disable=g-import-not-at-top
  run = runs.load(None, s["weights"])
  prompts = runs.read_prompts(runs.PROMPTS / s["prompts"], run.tokenizer, s["max_prompt_tokens"], s["num_prompts"])
  spec, sampler, ar, new = run.speculative_sampler(), run.sampler(), run.ar_sampler(), s["max_new_tokens"]
  cfg = run.model.config
  decoders = {"speculative": lambda p, b: runs.speculative(spec, run.variables, p, new, b),
              "diffusion": lambda p, b: runs.diffusion(sampler, run.variables, p, new, b),
              "ar": lambda p, b: (runs.autoregressive(ar, run.variables, p, new, b), None)}
  compile_seconds = _compile_all([lambda f=f, b=b: f(prompts[:b], b) for f in decoders.values()
                                  for b in s["batch_sizes"]])  # one batch each: its program
  rows = []
  for b in s["batch_sizes"]:
    calls = {name: lambda f=f, b=b: f(prompts, b) for name, f in decoders.items()}
    for decoder, t in timing.alternate_all(calls, s["repeats"]).items():
      continuations, passes = t.output
      lengths = [len(c) for c in continuations]
      tokens = sum(lengths)
      passes = tokens if passes is None else int(np.sum(passes))  # AR: one step a token
      # Model calls a row makes: AR a step per token; self-speculative a denoiser pass and an encoder pass
      # per iteration; block diffusion its passes and the commit of every canvas but its last.
      calls_made = {"ar": passes, "speculative": 2 * passes,
                    "diffusion": passes + sum(max(math.ceil(n / cfg.canvas_length) - 1, 0) for n in lengths)}
      flops = _text_flops(cfg, decoder, prompts, lengths, passes)
      rows.append({"decoder": decoder, "batch_size": b, "new_tokens": tokens, "seconds": t.best, "runs": t.runs,
                   "compile_seconds": t.compile_seconds, "tokens_per_second": tokens / t.best,
                   "tokens_per_second_median": tokens / t.median, "passes": passes,
                   "tokens_per_pass": tokens / passes, "model_calls": calls_made[decoder],
                   "tokens_per_model_call": tokens / calls_made[decoder], "flops_per_call": flops})
      print(json.dumps(rows[-1]), flush=True)
  return {"runs": rows, "flops": sum(r["flops_per_call"] * (1 + s["repeats"]) for r in rows),
          "compile_seconds": compile_seconds, "weights_source": run.source,
          "model": {"total_parameters": dg.model.count_parameters(cfg)["total"]}, "sampler": sampler.settings(),
          "speculative": {"draft_length": spec.block_length, "mask_id": spec.mask_id},
          "ar": {"decoding": "greedy", "kv_cache": True},
          "speculative_at_temperature": "not measured: this section times greedy decoding (the sampled "
                                        "decoders' quality: benchmarks.text_vs_ar --temperature)"}


def _ours(hf_fields: dict, **changes) -> dg.ModelConfig:
  """Our ModelConfig of a random model given as transformers config fields (`measure.SIZES`), the released
  layer pattern (`hf_reference.released_layer_types`, ModelConfig's default), then `changes`."""
  return dg.ModelConfig(**{_HF_TO_OURS[k]: v for k, v in hf_fields.items()}, **changes)


def _batching(s: dict) -> dict:
  cfg = _ours(s["model"], dtype=s["dtype"], param_dtype=s["dtype"])
  params = build.random_variables(cfg)["params"]
  sampler = dg.Sampler(dg.DiffusionGemma(cfg), dg.SamplerConfig(max_denoising_steps=s["max_denoising_steps"],
                                                                stop_tokens=()), stopping=dg.diffusion.NoEarlyStop())
  variables, rows, rng = {"params": jax.device_put(params)}, [], np.random.default_rng(1)
  compile_seconds = _compile_all([measure.shape_call(sampler, variables, prompt, canvases, b, rng)
                                  for prompt, canvases in s["shapes"] for b in s["batch_sizes"]])
  for prompt, canvases in s["shapes"]:
    for row in measure.shape_runs(sampler, variables, prompt, canvases, s["batch_sizes"], s["repeats"]):
      row["flops_per_call"] = measure.generation_flops(cfg, row["batch_size"], prompt, row["canvas_passes"])
      rows.append(row)
      print(json.dumps(row), flush=True)
  largest = max(s["batch_sizes"])
  return {"runs": rows, "best_over_batch_1": max(r["over_batch_1"] for r in rows if r["batch_size"] == largest),
          "flops": sum(r["flops_per_call"] * (1 + s["repeats"]) for r in rows), "compile_seconds": compile_seconds,
          "sampler": sampler.settings(),
          "model": {"total_parameters": dg.model.count_parameters(cfg)["total"]}}


def _train_config(s: dict):
  config = base_config(**s["model"], max_positions=4096)
  config.model.remat = s["remat"]
  config.data.vocab_size = s["model"]["vocab_size"]
  config.data.prompt_length, config.data.num_canvases = s["prompt_length"], s["num_canvases"]
  config.train.batch_size, config.train.compute_dtype = s["batch_size"], s["compute_dtype"]
  return config


def _train(s: dict) -> dict:
  config = _train_config(s)
  result = measure.benchmark_train_step(config, repeats=s["repeats"])
  cfg = build.model_config(config)
  step_flops = measure.train_step_flops(cfg, s["batch_size"], s["prompt_length"], s["num_canvases"],
                                        config.diffusion.self_conditioning_prob > 0)
  peaks, seconds = _peaks(), result["seconds_per_step"]
  return {**result, "analytic_flops_per_step": step_flops, "flops": step_flops * (1 + s["repeats"]),
          "tflops_per_second": step_flops / seconds / 1e12, **_mfus(step_flops / seconds, peaks), **peaks,
          "xla_mfu_of_measured_peak": result["flops_per_step"] / seconds / peaks["matmul_peak_flops"],
          "moe_impl": cfg.moe_impl}


_RUNNERS = {"vs_transformers": _vs_transformers, "text": _text, "batching": _batching, "train": _train}


def machine() -> dict:
  """Where this process runs: `timing.provenance` (devices, load averages, jax, commit) with jaxlib, the
  platform's version string (CUDA's on a GPU), CUDA and driver versions where jax reports them, and
  `nvidia-smi`'s GPU name, driver and memory when it is on the PATH."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  info = timing.provenance(_ROOT)
  device = jax.devices()[0]
  info.update(jaxlib=jaxlib.__version__, platform_version=getattr(device.client, "platform_version", None))
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top  (None without CUDA)
    if cuda_versions is not None:
      info.update(cuda_runtime=cuda_versions.cuda_runtime_get_version(),
                  cuda_driver=cuda_versions.cuda_driver_get_version(), cudnn=cuda_versions.cudnn_get_version())
  except Exception as e:  # pylint: disable=broad-except  (a private module: versions are optional)
    info["cuda_versions_error"] = repr(e)
  if shutil.which("nvidia-smi"):
    query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30, check=False)
    info["nvidia_smi"] = query.stdout.strip().splitlines()
  return info


def run_section(name: str, s: dict) -> dict:
  """One section here: its figures, settings, seconds, peak device memory and error (None when it ran)."""
  start = time.perf_counter()
  out = {"settings": s, "error": None}
  try:
    out.update(_RUNNERS[name](s))
  except Exception:  # pylint: disable=broad-except  (recorded: the other sections still run)
    out["error"] = traceback.format_exc(limit=-8)
    print(out["error"], file=sys.stderr, flush=True)
  out["seconds"] = time.perf_counter() - start
  stats = jax.devices()[0].memory_stats() or {}
  out["peak_memory_bytes"] = stats.get("peak_bytes_in_use")
  out["memory_limit_bytes"] = stats.get("bytes_limit")
  return out


def _environment(name: str, env) -> None:
  """A section's process settings, in `env` (os.environ in the process itself): JAX capped at 45% of the device
  where torch shares it; for --smoke, XLA's LLVM optimisation off, as compiling is most of a smoke run and
  its timings mean nothing (a fifth less CPU here)."""
  if name == "vs_transformers":  # JAX would otherwise reserve 75% of the GPU
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
  if _SMOKE.value:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()


def _child(name: str, part: pathlib.Path, timeout: float) -> dict:
  """`run_section` in a fresh process (the settings come from the flags it is given), or the error."""
  passed = [f"--layers={_LAYERS.value}", "--smoke" if _SMOKE.value else "--nosmoke"]
  if _COMPILATION_CACHE.value:
    passed.append(f"--compilation_cache={_COMPILATION_CACHE.value}")
  env = dict(os.environ)
  _environment(name, env)
  command = [sys.executable, "-m", "benchmarks.accelerator", f"--section={name}", f"--output={part}", *passed]
  try:
    done = subprocess.run(command, cwd=_ROOT, env=env, timeout=timeout, check=False, stderr=subprocess.PIPE,
                          text=True)
  except subprocess.TimeoutExpired:
    return {"error": f"stopped after {timeout:.0f} s (the time limit)", "seconds": timeout}
  if part.exists():
    return json.loads(part.read_text())
  return {"error": f"the section's process exited with status {done.returncode}:\n{done.stderr[-3000:]}"}


def _report(results: dict) -> str:
  lines = []
  for name, out in results["sections"].items():
    state = "ok" if out.get("error") is None else "FAILED: " + out["error"].strip().splitlines()[-1]
    memory = out.get("peak_memory_bytes")
    lines.append(f"{name}: {out.get('seconds', 0):.0f} s, {out.get('flops', 0) / 1e12:.2f} TFLOP, peak memory "
                 f"{'n/a' if memory is None else f'{memory / 2**30:.2f} GiB'}, {state}")
  for r in results["sections"].get("vs_transformers", {}).get("runs", []):
    lines.append(f"  batch {r['batch_size']}: ours {r['ours_best_tokens_per_second']:.0f} tok/s, transformers "
                 f"{r['hf_best_tokens_per_second']:.0f}: {r['best_ratio']:.2f}x")
  for r in results["sections"].get("text", {}).get("runs", []):
    lines.append(f"  text {r['decoder']} batch {r['batch_size']}: {r['tokens_per_second']:.0f} tok/s, "
                 f"{r['tokens_per_model_call']:.2f} tokens per model call")
  return "\n".join(lines)


def plan(s: dict) -> dict:
  """What each section of these settings runs, counted without running anything: its useful FLOPs (`measure`'s
  counts; passes at their caps, as a random model never stops early, and for text the tokens per pass the
  shipped weights reach on the CPU, `_TEXT_TOKENS_PER_PASS`), its sequential model calls (loop iterations
  one after another: what bounds a small model's time on a GPU), and the layers of each program it
  compiles (the train step's: its forward, backward and rematerialised forward). docs/performance.md turns
  these into the time estimate; the smoke run's JSON holds the same FLOP counts at its shapes."""
  v, t, b, x = s["vs_transformers"], s["train"], s["batching"], s["text"]
  big = _ours(v["model"])
  canvases = -(-v["new_tokens"] // big.canvas_length)
  calls = 1 + v["repeats"]
  per_call = {n: measure.generation_flops(big, n, v["prompt_length"], [v["steps"]] * canvases)
              for n in v["batch_sizes"]}
  out = {"vs_transformers": {"flops": 2 * calls * sum(per_call.values()), "flops_per_call": per_call,
                             "calls": 2 * calls * len(v["batch_sizes"]) * canvases * (v["steps"] + 1),
                             "program_layers": [big.num_layers] * len(v["batch_sizes"])}}
  train_cfg = dg.ModelConfig(**t["model"])
  out["train"] = {"flops": (1 + t["repeats"]) * measure.train_step_flops(train_cfg, t["batch_size"],
                                                                         t["prompt_length"], t["num_canvases"]),
                  "calls": 1 + t["repeats"], "program_layers": [3 * train_cfg.num_layers]}
  from projects.text import runs  # pylint: disable=g-import-not-at-top
  text, new = runs.load(None, x["weights"]).model.config, x["max_new_tokens"]
  passes = {d: math.ceil(new / _TEXT_TOKENS_PER_PASS[d]) for d in ("ar", "diffusion", "speculative")}
  loop = {"ar": new, "speculative": 2 * passes["speculative"],  # model calls a row's decoding makes in turn
          "diffusion": passes["diffusion"] + math.ceil(new / text.canvas_length) - 1}
  prompt = [[0] * x["max_prompt_tokens"]]
  decodes = x["num_prompts"] * (1 + x["repeats"]) * len(x["batch_sizes"])
  out["text"] = {"flops": decodes * sum(_text_flops(text, d, prompt, [new], passes[d]) for d in passes),
                 "calls": (1 + x["repeats"]) * sum(-(-x["num_prompts"] // n) for n in x["batch_sizes"])
                          * sum(loop.values()),
                 "program_layers": [text.num_layers] * len(loop) * len(x["batch_sizes"])}
  small = _ours(b["model"])
  steps = b["max_denoising_steps"]
  out["batching"] = {"flops": sum((1 + b["repeats"]) * measure.generation_flops(small, n, p, [steps] * c)
                                  for p, c in b["shapes"] for n in b["batch_sizes"]),
                     "calls": (1 + b["repeats"]) * len(b["batch_sizes"]) * sum(c * (steps + 1) for _, c in b["shapes"]),
                     "program_layers": [small.num_layers] * len(b["shapes"]) * len(b["batch_sizes"])}
  return {"sections": out, "settings": s}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  all_settings = settings(_SMOKE.value, _LAYERS.value)
  if _PLAN.value:
    print(json.dumps(plan(all_settings), indent=1))
    return 0
  if not _OUTPUT.value:
    raise app.UsageError("--output is required.")
  output = pathlib.Path(_OUTPUT.value)
  output.parent.mkdir(parents=True, exist_ok=True)
  if _SECTION.value:  # a child: one section, its machine, its JSON
    parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
    out = {**run_section(_SECTION.value, all_settings[_SECTION.value]), "machine": machine()}
    output.write_text(json.dumps(out, indent=1) + "\n")
    return 0
  unknown = sorted(set(_SECTIONS.value) - set(SECTIONS))
  if unknown:
    raise app.UsageError(f"--sections={_SECTIONS.value}: unknown {unknown}; choose from {SECTIONS}.")
  isolate = _ISOLATE.value
  if isolate:  # the parent must not take the accelerator (JAX would reserve most of its memory): CPU only
    jax.config.update("jax_platforms", "cpu")
  else:  # before the device is first used
    _environment("vs_transformers" if "vs_transformers" in _SECTIONS.value else "", os.environ)
    parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
  jobs = _JOBS.value or (2 if _SMOKE.value else 1)
  if jobs > 1 and not isolate:
    raise app.UsageError(f"--jobs={jobs} runs sections side by side in processes of their own: drop --noisolate.")
  start, deadline = time.perf_counter(), time.perf_counter() + _TIME_LIMIT.value
  # The load average before anything starts and the commit; the device's fields come from the first section's
  # process when the sections run apart.
  results = {"machine": timing.provenance(_ROOT) if isolate else machine(), "smoke": _SMOKE.value, "isolated": isolate,
             "jobs": jobs, "time_limit": _TIME_LIMIT.value, "command": sys.argv, "sections": {},
             "plan": plan(all_settings)["sections"]}
  names = [n for n in SECTIONS if n in _SECTIONS.value]
  lock = threading.Lock()

  def one(i: int, name: str, parts: str) -> None:
    # One at a time, a section may use what is left but 45 s for each after it; side by side, all that is left.
    budget = deadline - time.perf_counter() - (45.0 * (len(names) - i - 1) if jobs == 1 else 0.0)
    if budget < 20:
      out = {"error": f"not run: {budget:.0f} s left of --time_limit={_TIME_LIMIT.value:.0f} for it"}
    elif isolate:
      out = _child(name, pathlib.Path(parts) / f"{name}.json", budget)
    else:
      out = run_section(name, all_settings[name])
    out.setdefault("settings", all_settings[name])
    device = out.pop("machine", None)
    with lock:
      if device and "platform_version" not in results["machine"]:
        results["machine"].update({k: v for k, v in device.items() if k != "load_average"})
      results["sections"][name] = out
      results["sections"] = {n: results["sections"][n] for n in names if n in results["sections"]}  # in order
      results["machine"]["load_average_after"] = list(os.getloadavg())
      results["total_seconds"] = time.perf_counter() - start
      output.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{name}: done in {out.get('seconds', 0):.0f} s" + ("" if out.get("error") is None else " (FAILED)"),
          flush=True)

  with tempfile.TemporaryDirectory(prefix="dg_accelerator_") as parts:
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
      for future in [pool.submit(one, i, name, parts) for i, name in enumerate(names)]:
        future.result()
  print(_report(results))
  print(f"wrote {output}")
  return int(any(out.get("error") is not None for out in results["sections"].values()))


if __name__ == "__main__":
  app.run(main)

r"""Our sampler against transformers' `generate` on the same converted model, side by side in one process.

Builds a random DiffusionGemma in transformers (benchmarks/hf_reference.py's weights: every weight and scale
drawn at random), saves it, converts it with `dg.convert.load_hf`, and times on the same prompts:
- ours (`dg.Sampler`, float32) and transformers' `generate` (float32, eager, its default DynamicCache,
  `torch.set_num_threads(--threads)`) with `--steps` fixed denoising steps (ours: stopping 'fixed';
  theirs: an unreachable confidence threshold, so both run every step) and with the released defaults
  (48 steps, entropy-bound acceptance, stable-and-confident stop) at `--default_batch_sizes`;
- our autoregressive baseline (`dg.ARSampler`, greedy) on the same prompts and number of new tokens;
- at each batch size, one denoising step of ours taken apart (`measure.step_breakdown`): the denoiser
  pass, the vocabulary head, the whole step; the rest of a generation (prompt encoding, the loops) is its
  time per step minus the step's; the MFU of denoiser + head against a float32 matmul peak measured in
  this run (useful FLOPs counted from the shapes, `measure.denoiser_flops`; XLA's count beside it);
- a bfloat16 copy of ours (parameters and matmuls in bf16, statistics in f32) against float32: speed, and
  token agreement from the same initial canvas and seed (committed tokens, and the first step's argmax).
Tokens/s are new tokens / the median wall time of a call after a first (compiling / warm-up) call. The
machine may be shared: compare the ratios of one run, not absolute rates across runs.

  python benchmarks/vs_transformers.py --output=workdir/benchmark_vs_transformers.json
  python benchmarks/vs_transformers.py --quick   # batch 1, one repeat, no defaults run

JSON (times in seconds): model (sizes, parameters, the ModelConfig), machine (backend, devices, processor,
torch_threads, matmul_peak_gflops: the best of the peaks measured during the run), settings (ours:
`Sampler.settings()` per run kind; transformers: the generate kwargs; prompt length, new tokens, repeats),
runs[] (kind, batch_size, ours_seconds, ours_compile_seconds, ours_tokens_per_second,
ours_passes_per_canvas; per torch thread count t: hf{t}_seconds, hf{t}_tokens_per_second,
hf{t}_passes_per_canvas, ratio{t} = ours / transformers tokens/s), ar[] (batch_size, seconds,
tokens_per_second), breakdown[] (batch_size; denoiser_, head_, bare_lm_head_, step_seconds: standalone,
fastest run; step_in_program_seconds: the marginal cost of a step inside the compiled generation;
generate_seconds, rest_seconds; useful_flops, xla_flops (XLA counts a loop body once, so it undercounts
the MoE tiles and vocabulary chunks); mfu = useful FLOPs of denoiser + head / their time / peak, xla_mfu;
denoiser_fraction (denoiser + head) and sampling_fraction of a step, rest_fraction of a generation),
bf16[] (batch_size, f32_/bf16_tokens_per_second, speedup, token_agreement,
first_step_argmax_agreement).
"""

from __future__ import annotations

import json
import pathlib
import platform
import sys
import tempfile
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import diffusiongemma as dg
from benchmarks import measure

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8", "16"], "Batch sizes of the fixed-steps runs.")
_DEFAULT_BATCH_SIZES = flags.DEFINE_list("default_batch_sizes", ["1", "8"],
                                         "Batch sizes of the runs at the released defaults (48 steps).")
_STEPS = flags.DEFINE_integer("steps", 16, "Fixed denoising steps per canvas.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed calls per figure after a first call (median).")
_THREADS = flags.DEFINE_list("threads", ["2"], "torch.set_num_threads for transformers: each value is a run "
                             "of transformers (on a busy machine 2 threads can be slower than 1).")
_QUICK = flags.DEFINE_bool("quick", False, "Batch 1 only, one repeat, no defaults run.")
_OUTPUT = flags.DEFINE_string("output", "workdir/benchmark_vs_transformers.json", "Where the JSON goes.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "Folder for the random transformers checkpoint "
                                  "(default: a temporary one).")

# The 25M-parameter model: hidden 256, 6 layers, 16 experts top-2, vocab 8192, canvas 256.
MODEL = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             global_head_dim=128, num_global_key_value_heads=1, sliding_window=128, intermediate_size=512,
             moe_intermediate_size=256, num_experts=16, top_k_experts=2, vocab_size=8192, canvas_length=256)
PROMPT_LENGTH, NEW_TOKENS = 64, 256


def _transformers_model(path: pathlib.Path):
  sys.path.insert(0, str(_ROOT / "tests"))
  import hf_reference  # pylint: disable=g-import-not-at-top
  if (path / "config.json").exists():
    return hf_reference, hf_reference.load_hf(path, attn_implementation="sdpa")
  return hf_reference, hf_reference.make_tiny_hf(path, seed=0, attn_implementation="sdpa", **MODEL)


def _hf_generate(hf_reference, model, prompts, kwargs, repeats, threads):
  """(median seconds, passes per canvas) of transformers' generate after one warm-up call."""
  import torch  # pylint: disable=g-import-not-at-top  (test-only dependency)
  torch.set_num_threads(threads)
  hf_reference.generate(model, prompts, **kwargs)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    _, tpf = hf_reference.generate(model, prompts, **kwargs)
    times.append(time.perf_counter() - start)
  return float(np.median(times)), float(np.mean(NEW_TOKENS / tpf))


def _ours(sampler, params, prompts, repeats, rng=jax.random.key(1), **kwargs):
  timing = measure.time_call(sampler.generate, params, prompts, rng, NEW_TOKENS, repeats=repeats, **kwargs)
  passes = np.asarray(timing.output.canvas_passes)
  return timing, float(passes[passes > 0].mean())


def _bf16(cfg, params, prompts, steps_config, repeats):
  """bf16 against f32 at one batch: tokens/s of each, agreement of committed tokens and of the first step's
  argmax canvas, from the same initial canvas and seed."""
  canvas = np.random.default_rng(5).integers(0, cfg.vocab_size, (prompts.shape[0], cfg.canvas_length))
  out = {"batch_size": int(prompts.shape[0])}
  results = {}
  for name, dtype in (("f32", "float32"), ("bf16", "bfloat16")):
    model_cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    p = jax.tree.map(lambda x: x.astype(dtype), params)
    sampler = dg.Sampler(dg.DiffusionGemma(model_cfg), steps_config)
    timing, _ = _ours(sampler, p, prompts, repeats, initial_canvas=canvas)
    traced = sampler.generate(p, prompts, jax.random.key(1), NEW_TOKENS, initial_canvas=canvas,
                              return_trace=True)
    results[name] = (np.asarray(timing.output.tokens), np.asarray(traced.trace.argmax)[0, 0])
    out[f"{name}_tokens_per_second"] = prompts.shape[0] * NEW_TOKENS / timing.median
  out["speedup"] = out["bf16_tokens_per_second"] / out["f32_tokens_per_second"]
  out["token_agreement"] = float((results["f32"][0] == results["bf16"][0]).mean())
  out["first_step_argmax_agreement"] = float((results["f32"][1] == results["bf16"][1]).mean())
  return out


def _breakdown(model, params, prompts, num_steps, peak, repeats):
  """The step taken apart (standalone pieces, fastest of their runs), and the generation's time outside
  its steps: a call with 2N fixed steps minus one with N gives the marginal cost of N steps inside the
  compiled program; the rest of a call (prompt encoding, loop set-up, transfers) is what remains."""
  times = {}
  for n in (num_steps, 2 * num_steps):
    sampler = dg.Sampler(model, dg.SamplerConfig(max_denoising_steps=n, stopping="fixed", stop_tokens=()))
    times[n] = measure.time_call(sampler.generate, params, prompts, jax.random.key(1), NEW_TOKENS,
                                    repeats=max(repeats, 3)).best
  in_program = (times[2 * num_steps] - times[num_steps]) / num_steps
  parts = measure.step_breakdown(dg.Sampler(model, dg.SamplerConfig(
      max_denoising_steps=num_steps, stopping="fixed", stop_tokens=())), params, prompts,
                                    repeats=max(repeats, 3))
  denoiser = parts["denoiser_seconds"] + parts["head_seconds"]
  rest = max(times[num_steps] - num_steps * in_program, 0.0)
  return {"batch_size": int(prompts.shape[0]), **parts, "step_in_program_seconds": in_program,
          "generate_seconds": times[num_steps], "rest_seconds": rest,
          "mfu": parts["useful_flops"] / denoiser / peak, "xla_mfu": parts["xla_flops"] / denoiser / peak,
          "denoiser_fraction": min(denoiser / parts["step_seconds"], 1.0),
          "sampling_fraction": max(1.0 - denoiser / parts["step_seconds"], 0.0),
          "rest_fraction": rest / times[num_steps]}


def _table(results: dict) -> str:
  m = results["machine"]
  threads = m["torch_threads"]
  lines = [f"{results['model']['description']}; {m['processor']}, {m['devices']} JAX device(s); matmul peak "
           f"measured in this run {m['matmul_peak_gflops']:.0f} GFLOP/s.", "",
           "| steps | batch | ours tok/s | " + " | ".join(f"transformers tok/s ({t} thr.) | ours / transformers "
                                                        f"({t} thr.)" for t in threads) + " | passes per canvas |",
           "|---" * (4 + 2 * len(threads)) + "|"]
  for r in results["runs"]:
    cells = " | ".join(f"{r[f'hf{t}_tokens_per_second']:.0f} | **{r[f'ratio{t}']:.2f}x**" for t in threads)
    passes = ", ".join(f"{r[k]:.0f}" for k in ["ours_passes_per_canvas"] + [f"hf{t}_passes_per_canvas"
                                                                           for t in threads])
    lines.append(f"| {r['kind']} | {r['batch_size']} | {r['ours_tokens_per_second']:.0f} | {cells} | {passes} |")
  lines += ["", "| batch | denoiser MFU (XLA count) | denoiser + head | sampling and acceptance | the rest | "
            "head / bare LM head | AR tok/s | diffusion / AR |", "|---" * 8 + "|"]
  ar = {r["batch_size"]: r for r in results["ar"]}
  fixed = {r["batch_size"]: r for r in results["runs"] if r["kind"] != "defaults"}
  for r in results["breakdown"]:
    b = r["batch_size"]
    lines.append(f"| {b} | {100 * r['mfu']:.0f}% ({100 * r['xla_mfu']:.0f}%) | {100 * r['denoiser_fraction']:.0f}% | "
                 f"{100 * r['sampling_fraction']:.0f}% | {100 * r['rest_fraction']:.0f}% | "
                 f"{r['head_seconds'] / r['bare_lm_head_seconds']:.2f} | {ar[b]['tokens_per_second']:.0f} | "
                 f"{fixed[b]['ours_tokens_per_second'] / ar[b]['tokens_per_second']:.2f} |")
  if results.get("bf16"):
    lines += ["", "| batch | f32 tok/s | bf16 tok/s | bf16 / f32 | committed tokens equal | first-step argmax equal |",
              "|---" * 6 + "|"]
    for r in results["bf16"]:
      lines.append(f"| {r['batch_size']} | {r['f32_tokens_per_second']:.0f} | {r['bf16_tokens_per_second']:.0f} | "
                   f"{r['speedup']:.2f} | {100 * r['token_agreement']:.0f}% | "
                   f"{100 * r['first_step_argmax_agreement']:.0f}% |")
  return "\n".join(lines)


def main(argv):
  del argv
  quick = _QUICK.value
  repeats = 1 if quick else _REPEATS.value
  batch_sizes = [1] if quick else [int(b) for b in _BATCH_SIZES.value]
  default_batches = [] if quick else [int(b) for b in _DEFAULT_BATCH_SIZES.value]
  folder = pathlib.Path(_CHECKPOINT.value or tempfile.mkdtemp(prefix="dg_vs_hf_"))
  folder.mkdir(parents=True, exist_ok=True)
  hf_reference, hf_model = _transformers_model(folder)
  cfg, params = dg.convert.load_hf(folder, vision=None)
  params = jax.device_put(params)  # load_hf gives host arrays: keep them from being copied at every call
  model = dg.DiffusionGemma(cfg)
  counts = dg.model.count_parameters(cfg)
  rng = np.random.default_rng(0)
  fixed_cfg = dg.SamplerConfig(max_denoising_steps=_STEPS.value, stopping="fixed", stop_tokens=())
  default_cfg = dg.SamplerConfig(stop_tokens=())
  hf_fixed = dict(max_new_tokens=NEW_TOKENS, max_denoising_steps=_STEPS.value, confidence_threshold=1e-30)
  hf_default = dict(max_new_tokens=NEW_TOKENS)
  peaks = [measure.matmul_peak_flops(2048, repeats=5)]
  results = {
      "model": {"description": f"random {counts['total'] / 1e6:.1f}M-parameter DiffusionGemma (hidden "
                                f"{cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_experts} experts "
                                f"top-{cfg.top_k}, vocab {cfg.vocab_size}, canvas {cfg.canvas_length}), "
                                f"{PROMPT_LENGTH}-token prompts, {NEW_TOKENS} new tokens",
                "total_parameters": counts["total"], "active_parameters": counts["active"],
                **{k: v for k, v in cfg.to_dict().items() if k != "vision"}},
      "machine": {"backend": jax.default_backend(), "devices": jax.device_count(),
                  "processor": platform.processor() or platform.machine(),
                  "torch_threads": [int(t) for t in _THREADS.value]},
      "settings": {"fixed": dg.Sampler(model, fixed_cfg).settings(),
                   "defaults": dg.Sampler(model, default_cfg).settings(),
                   "transformers_fixed": hf_fixed, "transformers_defaults": hf_default,
                   "transformers_attention": "sdpa", "ar": {"temperature": 0.0, "stop_tokens": []},
                   "prompt_length": PROMPT_LENGTH, "max_new_tokens": NEW_TOKENS, "repeats": repeats},
      "runs": [], "ar": [], "breakdown": [], "bf16": [],
  }
  ar_sampler = dg.ARSampler(model, stop_tokens=())
  for kind, ours_cfg, hf_kwargs, batches in (("fixed", fixed_cfg, hf_fixed, batch_sizes),
                                              ("defaults", default_cfg, hf_default, default_batches)):
    sampler = dg.Sampler(model, ours_cfg)
    label = f"{_STEPS.value} fixed" if kind == "fixed" else "defaults (48)"
    for b in batches:
      prompts = rng.integers(3, cfg.vocab_size, (b, PROMPT_LENGTH))
      timing, ours_passes = _ours(sampler, params, prompts, repeats)
      row = {"kind": label, "batch_size": b, "ours_seconds": timing.median,
             "ours_compile_seconds": timing.compile_seconds,
             "ours_tokens_per_second": b * NEW_TOKENS / timing.median, "ours_passes_per_canvas": ours_passes}
      for threads in (int(t) for t in _THREADS.value):
        hf_seconds, hf_passes = _hf_generate(hf_reference, hf_model, prompts, hf_kwargs, repeats, threads)
        row[f"hf{threads}_seconds"] = hf_seconds
        row[f"hf{threads}_tokens_per_second"] = b * NEW_TOKENS / hf_seconds
        row[f"hf{threads}_passes_per_canvas"] = hf_passes
        row[f"ratio{threads}"] = row["ours_tokens_per_second"] / row[f"hf{threads}_tokens_per_second"]
      results["runs"].append(row)
      print(json.dumps(row), flush=True)
      if kind == "fixed":
        ar = measure.time_call(ar_sampler.generate, params, prompts, jax.random.key(1), NEW_TOKENS,
                                  repeats=repeats)
        results["ar"].append({"batch_size": b, "seconds": ar.median,
                              "tokens_per_second": b * NEW_TOKENS / ar.median})
        peaks.append(measure.matmul_peak_flops(2048, repeats=5))
        results["breakdown"].append(_breakdown(model, params, prompts, _STEPS.value, max(peaks), repeats))
        print(json.dumps(results["breakdown"][-1]), flush=True)
  for b in ([1] if quick else [1, 8]):
    results["bf16"].append(_bf16(cfg, params, rng.integers(3, cfg.vocab_size, (b, PROMPT_LENGTH)), fixed_cfg,
                                 repeats))
    print(json.dumps(results["bf16"][-1]), flush=True)
  results["machine"]["matmul_peak_gflops"] = max(peaks) / 1e9
  output = pathlib.Path(_OUTPUT.value)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(results, indent=1))
  print(_table(results))
  print(f"wrote {output}")


if __name__ == "__main__":
  app.run(main)

r"""Our sampler against transformers' `generate` on the same converted model, side by side in one process.

Builds a random DiffusionGemma in transformers (`benchmarks.hf_reference`: every weight and scale drawn at
random), saves it, converts it with `dg.convert.load_hf`, and times both on the same prompts, on whatever
the machine has: JAX's default backend, and CUDA for torch when it is available (else the CPU with
`--threads` threads). Both sides compute in `--dtype` (float32, or bfloat16 weights and matmuls).

Protocol (what makes the ratio mean something):
- the machine must be quiet: with a 1-minute load average above `--max_load` (0.5) before the start it
  refuses to run, unless `--allow_load`, which writes a loud warning into the JSON instead;
- fixed-steps runs: `--steps` denoising steps per canvas on both sides, early stopping off (ours: stopping
  'fixed'; theirs: an unreachable confidence threshold); runs at the released defaults (48 steps, entropy
  bound, stable-and-confident stop, so each side stops on its own) at `--default_batch_sizes`;
- each figure: one first call per side (ours compiles: reported apart as compile seconds), then ours,
  theirs, ours, theirs, ... `--repeats` (>= 3) times each, the median reported (`measure.alternate`);
- a matmul peak in `--dtype` (bf16 inputs, float32 accumulation for bf16) measured at the start and again
  at every batch size; MFU is reported against the best of them.
Also, ours alone: the AR baseline (`dg.ARSampler`, greedy) at the fixed-steps batch sizes, one denoising
step taken apart (`measure.step_breakdown`: denoiser, vocabulary head, bare LM head, the whole step, MFU of
the step and of denoiser + head), and for float32 runs a bf16 copy of ours against it (speed and token
agreement from the same initial canvas and seed).
The model sizes, the transformers model and one side-by-side figure are `measure`'s (`SIZES`,
`transformers_model`, `side_by_side`), shared with `benchmarks.accelerator`.

  python -m benchmarks.vs_transformers --output=workdir/benchmark_vs_transformers.json   # quiet machine
  python -m benchmarks.vs_transformers --size=tiny --quick --allow_load                  # a smoke run
  python -m benchmarks.vs_transformers --size=realistic --dtype=bfloat16 --batch_sizes=1,8,32   # a GPU

Sizes: tiny (hidden 64, 2 layers, vocab 512, canvas 32: seconds, for smoke runs), small (the default:
25M parameters, hidden 256, 6 layers, 16 experts top-2, vocab 8192, canvas 256), realistic (1.30B: hidden
1536, 12 layers, 32 experts top-4, expert width 384, vocab 262,144, canvas 256, the released layer
pattern; what the H200 run of NOTES.md measured).

JSON (times in seconds): machine (`measure.provenance`: backend, device, devices, processor, load averages
before the start, git commit; torch_device, torch_threads, load_average_after, matmul_peak_tflops and
every peak measured), warnings[], model (description, sizes, parameters, the ModelConfig), settings
(dtype, size, steps, repeats, prompt length, new tokens; ours: `Sampler.settings()` per run kind with the
vocabulary chunk chosen at each batch; theirs: the generate kwargs and attention), runs[] (kind,
batch_size, ours_/hf_ seconds (median), _runs (every timed call), _compile_seconds (first call minus
median), _tokens_per_second, _passes_per_canvas; ratio = ours / transformers tokens/s), ar[], breakdown[]
(batch_size; denoiser_, head_, bare_lm_head_, bare_head_matmuls_, step_seconds (standalone);
step_in_program_seconds (a step inside the generation's loop), generate_seconds, rest_seconds; useful_flops,
xla_flops, peak_flops; step_mfu (in the loop), standalone_step_mfu, mfu and xla_mfu (denoiser + head),
head_over_bare_lm_head, head_over_bare_head_matmuls, denoiser_fraction, outside_denoiser_fraction (of a
standalone step), rest_fraction (of a generation); none clamped; step_matmuls_alone_seconds (the step's
matmuls run one at a time, `measure.matmuls_alone`), step_matmul_flops, step_dots, step_conditional_dots,
step_over_matmuls_alone (the step in the loop over that), tokens_per_second_at_matmuls_alone and
ratio_at_matmuls_alone (a generation whose steps cost only those matmuls, against transformers)), bf16[].
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

from absl import app
from absl import flags
import jax
import numpy as np

import diffusiongemma as dg
from benchmarks import measure

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_SIZE = flags.DEFINE_enum("size", "small", ["tiny", "small", "realistic"], "Model size (module docstring).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and compute, both sides.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8", "16"], "Batch sizes of the fixed-steps runs.")
_DEFAULT_BATCH_SIZES = flags.DEFINE_list("default_batch_sizes", ["1", "8"],
                                         "Batch sizes of the runs at the released defaults (48 steps).")
_STEPS = flags.DEFINE_integer("steps", 16, "Fixed denoising steps per canvas.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per side and figure, alternated (median).")
_THREADS = flags.DEFINE_integer("threads", 2, "torch.set_num_threads for transformers on the CPU.")
_QUICK = flags.DEFINE_bool("quick", False, "Batch 1 only, no defaults runs, no bf16 comparison.")
_MAX_LOAD = flags.DEFINE_float("max_load", 0.5, "Refuse to start above this 1-minute load average.")
_ALLOW_LOAD = flags.DEFINE_bool("allow_load", False, "Run on a loaded machine anyway (warned in the JSON).")
_OUTPUT = flags.DEFINE_string("output", "workdir/benchmark_vs_transformers.json", "Where the JSON goes.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "", "Folder for the random transformers checkpoint "
                                  "(default: a temporary one; an existing one is reused).")

SIZES = measure.SIZES  # transformers config fields, then (prompt length, new tokens)


def _check_load(machine: dict) -> list[str]:
  """Warnings for the JSON; raises when the machine is busy and that is not allowed."""
  load = machine["load_average"][0]
  if load <= _MAX_LOAD.value:
    return []
  message = (f"LOADED MACHINE: 1-minute load average {load:.2f} > {_MAX_LOAD.value} before the start "
             f"({machine['cpu_count']} CPUs); other work distorts the ratio (eager torch suffers most): "
             "do not quote these numbers.")
  if not _ALLOW_LOAD.value:
    raise SystemExit(f"Refusing to run. {message} Wait for a quiet machine, or pass --allow_load.")
  print(f"WARNING: {message}", flush=True)
  return [message]


def _bf16(cfg, params, prompts, steps_config, new_tokens, repeats):
  """bf16 against f32 at one batch: tokens/s of each, agreement of committed tokens and of the first step's
  argmax canvas, from the same initial canvas and seed."""
  canvas = np.random.default_rng(5).integers(0, cfg.vocab_size, (prompts.shape[0], cfg.canvas_length))
  out = {"batch_size": int(prompts.shape[0])}
  results = {}
  for name, dtype in (("f32", "float32"), ("bf16", "bfloat16")):
    p = jax.tree.map(lambda x, d=dtype: x.astype(d), params)
    sampler = dg.Sampler(dg.DiffusionGemma(cfg.replace(dtype=dtype, param_dtype=dtype)), steps_config,
                         stopping=dg.diffusion.NoEarlyStop())
    timing = measure.time_call(sampler.generate, p, prompts, jax.random.key(1), new_tokens, repeats=repeats,
                               initial_canvas=canvas)
    traced = sampler.generate(p, prompts, jax.random.key(1), new_tokens, initial_canvas=canvas,
                              return_trace=True)
    results[name] = (np.asarray(timing.output.tokens), np.asarray(traced.trace.argmax)[0, 0])
    out[f"{name}_tokens_per_second"] = prompts.shape[0] * new_tokens / timing.median
  out["speedup"] = out["bf16_tokens_per_second"] / out["f32_tokens_per_second"]
  out["token_agreement"] = float((results["f32"][0] == results["bf16"][0]).mean())
  out["first_step_argmax_agreement"] = float((results["f32"][1] == results["bf16"][1]).mean())
  return out


def _breakdown(model, params, prompts, num_steps, new_tokens, peak, repeats):
  """The step taken apart (standalone pieces, fastest of their runs), and the step as it runs inside a
  generation: a call with 2N fixed steps minus one with N gives the marginal cost of N steps inside the
  compiled program (`step_in_program_seconds`); the rest of a call (prompt encoding, loop set-up,
  transfers) is what remains. MFU against `peak`, one matmul peak measured in this run. Nothing is clamped:
  a share below zero says the standalone pieces took longer than the whole (their own overheads)."""
  fixed = lambda n: dg.Sampler(model, dg.SamplerConfig(max_denoising_steps=n, stop_tokens=()),
                               stopping=dg.diffusion.NoEarlyStop())
  times = {n: measure.time_call(fixed(n).generate, params, prompts, jax.random.key(1), new_tokens,
                                repeats=repeats).best for n in (num_steps, 2 * num_steps)}
  in_program = (times[2 * num_steps] - times[num_steps]) / num_steps
  parts = measure.step_breakdown(fixed(num_steps), params, prompts, repeats=repeats)
  denoiser = parts["denoiser_seconds"] + parts["head_seconds"]
  rest = times[num_steps] - num_steps * in_program
  return {"batch_size": int(prompts.shape[0]), **parts, "step_in_program_seconds": in_program,
          "generate_seconds": times[num_steps], "rest_seconds": rest, "peak_flops": peak,
          "step_mfu": parts["useful_flops"] / in_program / peak,
          "standalone_step_mfu": parts["useful_flops"] / parts["step_seconds"] / peak,
          "mfu": parts["useful_flops"] / denoiser / peak, "xla_mfu": parts["xla_flops"] / denoiser / peak,
          "step_over_matmuls_alone": in_program / parts["step_matmuls_alone_seconds"],
          "head_over_bare_lm_head": parts["head_seconds"] / parts["bare_lm_head_seconds"],
          "head_over_bare_head_matmuls": parts["head_seconds"] / parts["bare_head_matmuls_seconds"],
          "denoiser_fraction": denoiser / parts["step_seconds"],
          "outside_denoiser_fraction": 1.0 - denoiser / parts["step_seconds"],
          "rest_fraction": rest / times[num_steps]}


def _table(results: dict) -> str:
  m = results["machine"]
  lines = [*(f"**{w}**" for w in results["warnings"]),
           f"{results['model']['description']}; {results['settings']['dtype']}; JAX on {m['device']} "
           f"({m['backend']}), transformers on {m['torch_device']}; matmul peak in this run "
           f"{m['matmul_peak_tflops']:.2f} TFLOP/s; load average before {m['load_average'][0]:.2f}.", "",
           "| steps | batch | ours tok/s | transformers tok/s | ours / transformers | passes per canvas (ours, "
           "theirs) | ours compile s |", "|---" * 7 + "|"]
  for r in results["runs"]:
    lines.append(f"| {r['kind']} | {r['batch_size']} | {r['ours_tokens_per_second']:.0f} | "
                 f"{r['hf_tokens_per_second']:.0f} | **{r['ratio']:.2f}x** | {r['ours_passes_per_canvas']:.0f}, "
                 f"{r['hf_passes_per_canvas']:.0f} | {r['ours_compile_seconds']:.1f} |")
  lines += ["", "| batch | step MFU (in the loop) | denoiser + head MFU (XLA count) | outside denoiser + head "
            "(share of a step) | outside the steps (share of a generation) | step / its matmuls one at a time | "
            "ours / transformers if a step cost only those | head / bare LM head | head / its two matmuls bare | "
            "AR tok/s | diffusion / AR |", "|---" * 11 + "|"]
  ar = {r["batch_size"]: r for r in results["ar"]}
  fixed = {r["batch_size"]: r for r in results["runs"] if not r["kind"].startswith("defaults")}
  for r in results["breakdown"]:
    b = r["batch_size"]
    lines.append(f"| {b} | {100 * r['step_mfu']:.1f}% | {100 * r['mfu']:.1f}% ({100 * r['xla_mfu']:.1f}%) | "
                 f"{100 * r['outside_denoiser_fraction']:.0f}% | {100 * r['rest_fraction']:.0f}% | "
                 f"{r['step_over_matmuls_alone']:.2f} | {r['ratio_at_matmuls_alone']:.2f}x | "
                 f"{r['head_over_bare_lm_head']:.2f} | {r['head_over_bare_head_matmuls']:.2f} | "
                 f"{ar[b]['tokens_per_second']:.0f} | "
                 f"{fixed[b]['ours_tokens_per_second'] / ar[b]['tokens_per_second']:.2f} |")
  if results["bf16"]:
    lines += ["", "| batch | f32 tok/s | bf16 tok/s | bf16 / f32 | committed tokens equal | first-step argmax equal |",
              "|---" * 6 + "|"]
    for r in results["bf16"]:
      lines.append(f"| {r['batch_size']} | {r['f32_tokens_per_second']:.0f} | {r['bf16_tokens_per_second']:.0f} | "
                   f"{r['speedup']:.2f} | {100 * r['token_agreement']:.0f}% | "
                   f"{100 * r['first_step_argmax_agreement']:.0f}% |")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _REPEATS.value < 3:
    raise app.UsageError(f"--repeats={_REPEATS.value}: the protocol alternates each side at least 3 times.")
  machine = measure.provenance(_ROOT)  # the load average before anything starts
  warnings = _check_load(machine)
  quick, repeats, size, dtype = _QUICK.value, _REPEATS.value, _SIZE.value, _DTYPE.value
  prompt_length, new_tokens = SIZES[size][1]
  batch_sizes = [1] if quick else [int(b) for b in _BATCH_SIZES.value]
  default_batches = [] if quick else [int(b) for b in _DEFAULT_BATCH_SIZES.value]
  folder = pathlib.Path(_CHECKPOINT.value or tempfile.mkdtemp(prefix="dg_vs_hf_"))
  folder.mkdir(parents=True, exist_ok=True)
  hf_reference, hf_model, torch_device = measure.transformers_model(
      folder, SIZES[size][0], dtype, _THREADS.value, released_layers=size == "realistic")
  cfg, params = dg.convert.load_hf(folder, vision=None, dtype=dtype)
  cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
  params = jax.device_put(params)  # load_hf gives host arrays: keep them from being copied at every call
  model = dg.DiffusionGemma(cfg)
  counts = dg.model.count_parameters(cfg)
  rng = np.random.default_rng(0)
  fixed_cfg = dg.SamplerConfig(max_denoising_steps=_STEPS.value, stop_tokens=())  # with NoEarlyStop
  default_cfg = dg.SamplerConfig(stop_tokens=())
  hf_fixed = dict(max_new_tokens=new_tokens, max_denoising_steps=_STEPS.value, confidence_threshold=1e-30)
  hf_default = dict(max_new_tokens=new_tokens)
  peak_size = 2048 if jax.default_backend() == "cpu" else 8192
  peaks = [measure.matmul_peak_flops(peak_size, repeats=5, dtype=dtype)]
  results = {
      "machine": {**machine, "torch_device": torch_device, "torch_threads": _THREADS.value},
      "warnings": warnings,
      "model": {"description": f"random {counts['total'] / 1e6:.1f}M-parameter DiffusionGemma (hidden "
                                f"{cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_experts} experts "
                                f"top-{cfg.top_k}, vocab {cfg.vocab_size}, canvas {cfg.canvas_length}), "
                                f"{prompt_length}-token prompts, {new_tokens} new tokens",
                "size": size, "total_parameters": counts["total"], "active_parameters": counts["active"],
                **{k: v for k, v in cfg.to_dict().items() if k != "vision"}},
      "settings": {"dtype": dtype, "size": size, "steps": _STEPS.value, "repeats": repeats,
                   "alternated": True, "prompt_length": prompt_length, "max_new_tokens": new_tokens,
                   "fixed": dg.Sampler(model, fixed_cfg, stopping=dg.diffusion.NoEarlyStop()).settings(),
                   "defaults": dg.Sampler(model, default_cfg).settings(),
                   "transformers_fixed": hf_fixed, "transformers_defaults": hf_default,
                   "transformers_attention": "sdpa", "ar": {"temperature": 0.0, "stop_tokens": []}},
      "runs": [], "ar": [], "breakdown": [], "bf16": [],
  }
  ar_sampler = dg.ARSampler(model, stop_tokens=())
  for kind, ours_cfg, hf_kwargs, batches in (("fixed", fixed_cfg, hf_fixed, batch_sizes),
                                              ("defaults", default_cfg, hf_default, default_batches)):
    sampler = dg.Sampler(model, ours_cfg, stopping=dg.diffusion.NoEarlyStop() if kind == "fixed" else None)
    for b in batches:
      prompts = rng.integers(3, cfg.vocab_size, (b, prompt_length))
      row = measure.side_by_side(sampler, params, hf_reference, hf_model, prompts, hf_kwargs, new_tokens,
                                 repeats)
      row["kind"] = f"{_STEPS.value} fixed" if kind == "fixed" else "defaults (48, adaptive)"
      results["runs"].append(row)
      print(json.dumps(row), flush=True)
      if kind == "fixed":
        ar = measure.time_call(ar_sampler.generate, params, prompts, jax.random.key(1), new_tokens,
                               repeats=repeats)
        results["ar"].append({"batch_size": b, "seconds": ar.median, "compile_seconds": ar.compile_seconds,
                              "tokens_per_second": b * new_tokens / ar.median})
        peaks.append(measure.matmul_peak_flops(peak_size, repeats=5, dtype=dtype))
        parts = _breakdown(model, params, prompts, _STEPS.value, new_tokens, max(peaks), repeats)
        # The tokens/s a generation would reach if its steps cost only their matmuls, one at a time.
        bound = b * new_tokens / (_STEPS.value * parts["step_matmuls_alone_seconds"])
        parts.update(tokens_per_second_at_matmuls_alone=bound,
                     ratio_at_matmuls_alone=bound / row["hf_tokens_per_second"])
        results["breakdown"].append(parts)
        print(json.dumps(results["breakdown"][-1]), flush=True)
  if dtype == "float32" and not quick:
    for b in (1, 8):
      results["bf16"].append(_bf16(cfg, params, rng.integers(3, cfg.vocab_size, (b, prompt_length)), fixed_cfg,
                                   new_tokens, repeats))
      print(json.dumps(results["bf16"][-1]), flush=True)
  results["machine"].update(matmul_peak_tflops=max(peaks) / 1e12, matmul_peaks_tflops=[p / 1e12 for p in peaks],
                            matmul_peak_dtype=dtype, load_average_after=list(os.getloadavg()))
  output = pathlib.Path(_OUTPUT.value)
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(results, indent=1))
  print(_table(results))
  print(f"wrote {output}")


if __name__ == "__main__":
  app.run(main)

r"""Diffusion sampling against autoregressive decoding on the same weights, with the machine's limits.

One process, one run, the same parameters and prompts for both decoders:
- per batch size: new tokens/s, latency per sequence, tokens per denoiser pass (pooled and the mean of the
  rows, `sampling.stats`), steps per canvas, and the compile time of each decoder reported apart (first
  call minus the median run);
- the denoiser pass's achieved FLOP/s as a fraction of a float32 matmul peak measured here (MFU), and
  the AR step's bytes/s as a fraction of a measured read bandwidth (a matrix-vector product), counting
  the bytes it must read: every parameter and the KV cache once (XLA's per-op `bytes accessed`, which
  counts cache-resident intermediates too, is reported beside it; XLA cost analysis counts the FLOPs);
- one denoising step taken apart at the largest batch (`measure.step_breakdown`): the denoiser pass,
  the vocabulary head, sampling and acceptance (the rest of the step), and the rest of a generation
  (its time outside the steps: prompt encoding, loops, transfers);
- the model's MoE layer against a dense GeGLU MLP with the same active parameters;
- the train step of each `--train_configs` file (default tiny and small; `--quick`: the first only) on
  random tokens: tokens/s, seconds per step, compile time apart, XLA's FLOPs per step and MFU.
It writes `<workdir>/benchmark.json`, prints markdown tables and draws two PNG plots (tokens/s against
batch size; accepted tokens per denoising step across a canvas). Parameters come from the latest
checkpoint in `--workdir` when there is one, else a random initialisation (say so in results). The model,
the diffusion sampler (with the noise the model was trained with, `config.diffusion.noise`) and the AR
decoder all come from `build`, as in every other binary.

  python benchmarks/suite.py --config=configs/tiny.py --workdir=workdir/tiny --quick
  python benchmarks/suite.py --config=configs/small.py --workdir=workdir/small --batch_sizes=1,4,16

benchmark.json (times in seconds, rates per second, every number finite and >= 0):
  config, params                 config file stem; "checkpoint step N" or "random init (...)"
  model                          total_parameters, active_parameters, canvas_length, dtype
  sampler                        max_new_tokens, prompt_length and every setting of the sampler
                                 (`Sampler.settings()`: SamplerConfig fields, noise, rules, dtype)
  machine                        `measure.provenance` (backend, device, devices, processor, load_average,
                                 git_commit, ...), matmul_peak_gflops, read_bandwidth_gbps
  decoding[]                     one per batch size: batch_size; for diffusion_ and ar_: seconds,
                                 compile_seconds, tokens_per_second, latency_seconds, new_tokens;
                                 pooled_tokens_per_forward, mean_tokens_per_forward, steps_per_canvas,
                                 row_tokens_per_forward (each row's), speedup (diffusion / AR tok/s)
  prompts                        the prompt tokens of the smallest batch (to rerun it elsewhere)
  efficiency                     at the largest batch: batch_size; for denoiser_ and ar_step_: seconds,
                                 flops, bytes (XLA), min_bytes (parameters + KV cache), mfu,
                                 bandwidth_fraction (min_bytes / seconds / read bandwidth)
  step                           at the largest batch: batch_size; denoiser_, head_, bare_lm_head_, step_
                                 seconds (standalone, fastest run); useful_flops, xla_flops;
                                 denoiser_fraction, head_fraction, sampling_fraction (of a step);
                                 rest_fraction (of a generation: 1 - loop steps x step / its time)
  moe                            tokens, moe_seconds, dense_same_active_seconds, moe_over_dense, impl,
                                 experts, top_k
  training[]                     one per train config: config, batch_size, sequence_length,
                                 tokens_per_step, seconds_per_step, compile_seconds, tokens_per_second,
                                 flops_per_step, achieved_gflops, mfu, parameters, final_loss
  accepted_per_step              mean accepted tokens at each step of the first canvas
  plots                          the PNG paths
"""

from __future__ import annotations

import json
import pathlib

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_flags

import diffusiongemma as dg
from benchmarks import measure
from diffusiongemma import build
from diffusiongemma.build.config import load_config_file

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_CONFIG = build.cli.define_config("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoint to benchmark, and where benchmark.json goes.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Batch sizes for both decoders.")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 0, "New tokens per row (0: config.sampler's).")
_PROMPT_LENGTH = flags.DEFINE_integer("prompt_length", 0, "Prompt tokens (0: config.data.prompt_length).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per figure (median; peaks: the best of 5 or more).")
_QUICK = flags.DEFINE_bool("quick", False, "Smallest sizes: batch sizes 1 and 4, one repeat, small peaks; the "
                            "step's matmuls are not timed one by one.")
_TRAIN_CONFIGS = flags.DEFINE_list(
    "train_configs", ["configs/tiny.py", "configs/small.py"],
    "Config files (path or path:arg) whose train step is timed; --quick times only the first.")
_OUTPUT = flags.DEFINE_string("output", "", "JSON path (default: <workdir>/benchmark.json).")


def _prompts(cfg: dg.ModelConfig, batch: int, length: int, tokenizer_ids: np.ndarray | None) -> jax.Array:
  """Prompts: windows of validation tokens when a tokenizer and corpus are at hand, else random ids."""
  rng = np.random.default_rng(0)
  if tokenizer_ids is not None and tokenizer_ids.size > batch * length:
    starts = rng.integers(0, tokenizer_ids.size - length, batch)
    return jnp.asarray(np.stack([tokenizer_ids[s:s + length] for s in starts]), jnp.int32)
  return jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, length)), jnp.int32)


def _validation_ids(config, workdir: pathlib.Path) -> np.ndarray | None:
  path = workdir / "tokenizer.model"
  if not path.exists():
    return None
  tokenizer = dg.data.Tokenizer(path)
  texts = dg.data.load_corpus(config.data.corpus, "validation", text_field=config.data.text_field)
  return dg.data.tokenize_corpus(texts[:50], tokenizer)


def _decoders(sampler, ar_sampler, params, prompts, rng, new_tokens, repeats):
  """Timings and statistics of both decoders at one batch size."""
  pad = sampler.model.config.pad_id
  row = {"batch_size": prompts.shape[0]}
  diffusion = measure.time_call(sampler.generate, params, prompts, rng, new_tokens, repeats=repeats)
  ar = measure.time_call(ar_sampler.generate, params, prompts, rng, new_tokens, repeats=repeats)
  for name, timing in (("diffusion", diffusion), ("ar", ar)):
    new = int(dg.sampling.stats.new_token_counts(timing.output.tokens, pad).sum())
    row[f"{name}_seconds"] = timing.median
    row[f"{name}_compile_seconds"] = timing.compile_seconds
    row[f"{name}_tokens_per_second"] = new / timing.median
    row[f"{name}_latency_seconds"] = timing.median  # every row of the batch finishes within one call
    row[f"{name}_new_tokens"] = new
  out = diffusion.output
  summary = dg.sampling.stats.summary(out.tokens, out.canvas_passes, pad)
  for key in ("pooled_tokens_per_forward", "mean_tokens_per_forward", "steps_per_canvas", "denoiser_passes"):
    row[key] = summary[key]
  row["row_tokens_per_forward"] = np.asarray(out.tokens_per_forward).tolist()
  row["loop_steps"] = int(np.asarray(out.canvas_passes).max(0).sum())  # steps the batch ran
  row["speedup"] = row["diffusion_tokens_per_second"] / row["ar_tokens_per_second"]
  return row


def _efficiency(model, params, prompts, peak_flops, bandwidth, repeats):
  """MFU of one denoiser pass and the bandwidth fraction of one AR step, at this batch."""
  cfg = model.config
  variables = {"params": params}
  b = prompts.shape[0]
  _, cache = jax.jit(lambda v, p: model.apply(v, p, model.init_cache(b, p.shape[1] + cfg.canvas_length),
                                              method=model.encode))(variables, prompts)
  canvas = jnp.zeros((b, cfg.canvas_length), jnp.int32)
  denoise = lambda v, c, cc: model.apply(v, c, cc, method=model.denoise)
  step = lambda v, t, cc: model.apply(v, t, cc, method=model.encode)
  token = prompts[:, :1]
  min_bytes = float(sum(x.nbytes for x in jax.tree.leaves((params, cache))))  # each read at least once
  out = {}
  for name, fn, args in (("denoiser", denoise, (variables, canvas, cache)), ("ar_step", step,
                                                                          (variables, token, cache))):
    counted = measure.cost(fn, *args)
    seconds = measure.time_call(jax.jit(fn), *args, repeats=repeats).median
    out[f"{name}_seconds"] = seconds
    out[f"{name}_flops"] = counted["flops"]
    out[f"{name}_bytes"] = counted["bytes accessed"]
    out[f"{name}_mfu"] = counted["flops"] / seconds / peak_flops
    out[f"{name}_min_bytes"] = min_bytes
    out[f"{name}_bandwidth_fraction"] = min_bytes / seconds / bandwidth
  return out


def _training(config_files: list[str], peak_flops: float, repeats: int) -> list[dict]:
  """The train step's throughput and MFU for each config file (`path` or `path:arg`)."""
  rows = []
  for spec in config_files:
    path, _, arg = spec.partition(":")
    if not pathlib.Path(path).is_file() and (_ROOT / path).is_file():
      path = str(_ROOT / path)  # the default paths work from any directory
    result = measure.benchmark_train_step(load_config_file(path, arg or None), repeats=repeats)
    result["config"] = pathlib.Path(path).stem + (f":{arg}" if arg else "")
    result["mfu"] = result["flops_per_step"] / result["seconds_per_step"] / peak_flops
    logging.info("training %s: %s", spec, result)
    rows.append(result)
  return rows


def _plots(results: dict, trace_counts: np.ndarray, directory: pathlib.Path) -> list[str]:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  rows = results["decoding"]
  batches = [r["batch_size"] for r in rows]
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot(batches, [r["diffusion_tokens_per_second"] for r in rows], "o-", label="diffusion")
  ax.plot(batches, [r["ar_tokens_per_second"] for r in rows], "s-", label="autoregressive")
  ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="new tokens / s",
         title=f"{results['config']} on {results['machine']['backend']}")
  ax.legend()
  fig.tight_layout()
  paths = [directory / "benchmark_tokens_per_second.png"]
  fig.savefig(paths[0], dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(5, 3.5))
  steps = np.arange(1, trace_counts.shape[0] + 1)
  ax.bar(steps, trace_counts)
  ax.set(xlabel="denoising step", ylabel="accepted tokens (mean over rows)",
         title="accepted tokens per step, first canvas")
  fig.tight_layout()
  paths.append(directory / "benchmark_accepted_per_step.png")
  fig.savefig(paths[1], dpi=120)
  plt.close(fig)
  return [str(p) for p in paths]


def _table(results: dict) -> str:
  lines = [f"noise {results['sampler']['noise']}, {results['params']}",
           "| batch | diffusion tok/s | AR tok/s | diffusion / AR | tokens per forward (pooled) | "
           "steps per canvas | diffusion compile s | AR compile s |", "|---" * 8 + "|"]
  for r in results["decoding"]:
    lines.append(f"| {r['batch_size']} | {r['diffusion_tokens_per_second']:.1f} | "
                 f"{r['ar_tokens_per_second']:.1f} | {r['speedup']:.2f} | {r['pooled_tokens_per_forward']:.2f} | "
                 f"{r['steps_per_canvas']:.1f} | {r['diffusion_compile_seconds']:.1f} | "
                 f"{r['ar_compile_seconds']:.1f} |")
  e = results["efficiency"]
  lines.append("")
  lines.append(f"denoiser pass (batch {e['batch_size']}): MFU {100 * e['denoiser_mfu']:.1f}% of a measured "
               f"{results['machine']['matmul_peak_gflops']:.0f} GFLOP/s; AR step: "
               f"{100 * e['ar_step_bandwidth_fraction']:.1f}% of a measured "
               f"{results['machine']['read_bandwidth_gbps']:.1f} GB/s read bandwidth")
  st = results["step"]
  lines.append(f"one denoising step (batch {st['batch_size']}, {1e3 * st['step_seconds']:.0f} ms): denoiser "
               f"{100 * st['denoiser_fraction']:.0f}%, vocabulary head {100 * st['head_fraction']:.0f}%, "
               f"sampling and acceptance {100 * st['sampling_fraction']:.0f}%; outside the steps: "
               f"{100 * st['rest_fraction']:.0f}% of a generation")
  m = results["moe"]
  lines.append(f"MoE layer ({m['experts']} experts, top-{m['top_k']}, {m['impl']}): "
               f"{1e3 * m['moe_seconds']:.1f} ms vs {1e3 * m['dense_same_active_seconds']:.1f} ms for a "
               f"dense MLP of the same active width ({m['moe_over_dense']:.2f}x) at {m['tokens']} tokens")
  if results["training"]:
    lines += ["", "| training config | batch x length | tokens/s | s/step | GFLOP/step | MFU | compile s |",
              "|---" * 7 + "|"]
    for t in results["training"]:
      lines.append(f"| {t['config']} | {t['batch_size']} x {t['sequence_length']} | "
                   f"{t['tokens_per_second']:.0f} | {t['seconds_per_step']:.3f} | "
                   f"{t['flops_per_step'] / 1e9:.2f} | {100 * t['mfu']:.1f}% | {t['compile_seconds']:.1f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  dg.training.quiet_orbax_logs()
  config = _CONFIG.value
  workdir = pathlib.Path(_WORKDIR.value or "workdir/benchmark")
  workdir.mkdir(parents=True, exist_ok=True)
  quick = _QUICK.value
  repeats = 1 if quick else _REPEATS.value
  batch_sizes = [1, 4] if quick else [int(b) for b in _BATCH_SIZES.value]
  weights = build.load(config, workdir=workdir, random_init=dg.training.latest_step(workdir) is None)
  cfg, params = weights.model_config, weights.variables["params"]
  sampler, ar_sampler = build.sampler(config, cfg), build.ar_sampler(config, cfg)
  counts = dg.model.count_parameters(cfg)
  new_tokens = _NEW_TOKENS.value or build.max_new_tokens(config)
  prompt_length = _PROMPT_LENGTH.value or config.data.prompt_length
  ids = _validation_ids(config, workdir)

  machine = measure.provenance(_ROOT)  # the load average before the measurements
  peak = measure.matmul_peak_flops(1024 if quick else 2048, repeats=max(repeats, 5))
  bandwidth = measure.read_bandwidth((64 if quick else 256) * 2**20, repeats=max(repeats, 5))
  results = {
      "config": pathlib.Path(config_flags.get_config_filename(flags.FLAGS["config"])).stem,
      "params": weights.source,
      "model": {"total_parameters": counts["total"], "active_parameters": counts["active"],
                "canvas_length": cfg.canvas_length, "dtype": cfg.dtype},
      "sampler": {"max_new_tokens": new_tokens, "prompt_length": prompt_length, **sampler.settings()},
      "machine": {**machine, "matmul_peak_gflops": peak / 1e9, "read_bandwidth_gbps": bandwidth / 1e9},
      "decoding": [],
  }
  rng = jax.random.key(1)
  for batch in batch_sizes:
    prompts = _prompts(cfg, batch, prompt_length, ids)
    if batch == min(batch_sizes):
      results["prompts"] = np.asarray(prompts).tolist()
    row = _decoders(sampler, ar_sampler, params, prompts, rng, new_tokens, repeats)
    results["decoding"].append(row)
    logging.info("batch %d: %s", batch, row)
  results["efficiency"] = {"batch_size": batch_sizes[-1],
                           **_efficiency(sampler.model, params, prompts, peak, bandwidth, repeats)}
  step = measure.step_breakdown(sampler, params, prompts, repeats=max(repeats, 3), matmuls=not quick)
  last = results["decoding"][-1]
  results["step"] = {"batch_size": batch_sizes[-1], **step,
                     **{f"{part}_fraction": step[f"{part}_seconds"] / step["step_seconds"]
                        for part in ("denoiser", "head")},
                     "sampling_fraction": max(1 - (step["denoiser_seconds"] + step["head_seconds"])
                                              / step["step_seconds"], 0.0),
                     "rest_fraction": max(1 - last["loop_steps"] * step["step_seconds"]
                                          / last["diffusion_seconds"], 0.0)}
  results["moe"] = measure.moe_against_dense(cfg, batch_sizes[-1] * cfg.canvas_length, max(repeats, 2))
  train_configs = _TRAIN_CONFIGS.value[:1] if quick else _TRAIN_CONFIGS.value
  results["training"] = _training(train_configs, peak, repeats)

  traced = sampler.generate(params, prompts, rng, max_new_tokens=cfg.canvas_length, return_trace=True)
  accepted = dg.sampling.stats.accepted_per_step(traced)[0]  # [steps] of the first canvas; NaN after all stop
  accepted = accepted[~np.isnan(accepted)]
  results["accepted_per_step"] = accepted.tolist()
  output = pathlib.Path(_OUTPUT.value) if _OUTPUT.value else workdir / "benchmark.json"
  output.parent.mkdir(parents=True, exist_ok=True)
  results["plots"] = _plots(results, accepted, output.parent)
  output.write_text(json.dumps(results, indent=2, default=float))
  print(_table(results))
  print(f"wrote {output} and {', '.join(results['plots'])}")


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)

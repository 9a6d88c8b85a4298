r"""Text from the same weights two ways: the denoiser's decoding against AR greedy decoding with the KV cache.
The denoiser side is the shipped setting by default (`--decoder=speculative`: the denoiser drafts 16-token
blocks, the encoder checks them, so the text is AR greedy's), or the block-diffusion sampler
(`--decoder=sampler`, `config.sampler` with `--sampler` overrides).

On held-out prompts (`--prompts`, one `{"prompt": text}` per line), each cut to its last
`--max_prompt_tokens` tokens, with `--max_new_tokens` new tokens:
- quality (all prompts, batch `--quality_batch_size`): tokens per denoiser pass (pooled: all new tokens up
  to and including a stop token over all passes), judged perplexity of each decoder's continuations under
  the same weights' AR mode (token-weighted), distinct 4-grams (mean over continuations), lengths;
- speed (the first `--timing_prompts` prompts, at each of `--batch_sizes`): new tokens per second of each
  decoder, the two alternated `--repeats` times after a first call that compiles (best and median kept;
  the ratio uses the best of each), compile time apart.
The machine must be quiet: above `--max_load` (1-minute load average) before the start it refuses to time,
unless `--allow_load`, which writes a loud warning into the JSON. The JSON records the load averages
before and after, a float32 matmul peak measured in the run, every sampler setting and the commit.

  python -m benchmarks.text_vs_ar --prompts=projects/text/prompts/validation.jsonl --output=results/text_validation.json
  python -m benchmarks.text_vs_ar --prompts=P --output=O --workdir=W      # a training run instead
  python -m benchmarks.text_vs_ar --prompts=P --output=O --decoder=sampler   # block diffusion, left to right
  python -m benchmarks.text_vs_ar --prompts=P --output=O --temperature=0.8 --batch_sizes=  # sampling, no timing

--temperature (with --decoder=speculative): both sides sample at it, the speculative side distributed exactly
as AR sampling, so their quality columns differ by chance alone. An empty --batch_sizes times nothing (and
needs no quiet machine).

JSON: weights, prompts, settings (max_new_tokens, max_prompt_tokens, batch sizes, repeats, decoder, sampler =
every setting, ar = the AR decoder's), machine (`measure.provenance`, matmul_peak_gflops, load_average_after,
warnings); diffusion / ar: tokens_per_pass (diffusion), judged_perplexity, judged_nll_per_token,
distinct_4gram, new_tokens, mean_length, and tokens_per_second, tokens_per_second_median, seconds,
compile_seconds, timed_new_tokens, each keyed by batch size ("1", "8"); speedup: diffusion / AR tokens per
second by batch size; perplexity_ratio: diffusion / AR judged perplexity; example: one prompt and both
continuations as text.
"""

from __future__ import annotations

import json
import os
import pathlib

from absl import app
from absl import flags
import numpy as np

from benchmarks import measure
from diffusiongemma import timing
from projects.text import runs

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_PROMPTS = flags.DEFINE_string("prompts", str(runs.PROMPTS / "validation.jsonl"), "JSONL file of prompts.")
_OUTPUT = flags.DEFINE_string("output", None, "Where the JSON goes.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir instead of the shipped weights.")
_WEIGHTS = flags.DEFINE_string("weights", runs.DISTILLED, "Which shipped text weights.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", 64, "Each prompt's last tokens that are kept.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 0, "Use the first N prompts (0: all).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes timed.")
_QUALITY_BATCH = flags.DEFINE_integer("quality_batch_size", 8, "Batch size of the quality pass.")
_TIMING_PROMPTS = flags.DEFINE_integer("timing_prompts", 16, "Prompts per timed call.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls of each decoder (alternated).")
_MAX_LOAD = flags.DEFINE_float("max_load", 0.5, "Refuse to time above this 1-minute load average.")
_ALLOW_LOAD = flags.DEFINE_bool("allow_load", False, "Time on a loaded machine anyway (warned in the JSON).")
_DECODER = flags.DEFINE_enum("decoder", "speculative", ["speculative", "sampler"], "The diffusion side: "
                              "self-speculative decoding (the shipped setting: the denoiser drafts, the encoder "
                              "checks, so the text is AR greedy's; each denoiser pass comes with an encoder pass), "
                              "or the block-diffusion sampler.")
_DRAFT = flags.DEFINE_integer("draft_length", 0, "--decoder=speculative: positions drafted per pass (0: the "
                              "canvas).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "--decoder=speculative: both decoders sample at this "
                                  "temperature (0: greedy).")
_SAMPLER = flags.DEFINE_multi_string("sampler", [], "config.sampler overrides, key=value (e.g. "
                                     "confidence_accept=0.8).")


def _overrides(items) -> dict:
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep:
      raise app.UsageError(f"--sampler={item!r} is not key=value.")
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out


def main(argv):
  del argv
  machine = measure.provenance(_ROOT)  # the load average before anything starts
  warnings = timing.loaded_machine(machine, _MAX_LOAD.value, _ALLOW_LOAD.value) if _BATCH_SIZES.value else []
  run = runs.load(_WORKDIR.value, _WEIGHTS.value)
  prompts = runs.read_prompts(_PROMPTS.value, run.tokenizer, _MAX_PROMPT.value, _NUM_PROMPTS.value or None)
  sampler, ar = run.sampler(**_overrides(_SAMPLER.value)), run.ar_sampler()
  new = _MAX_NEW.value

  speculative = _DECODER.value == "speculative"
  if speculative and _SAMPLER.value:
    raise app.UsageError(f"--sampler={_SAMPLER.value} sets the block-diffusion sampler; --decoder=speculative "
                         "does not use it.")
  if _DRAFT.value and not speculative:
    raise app.UsageError(f"--draft_length={_DRAFT.value} is for --decoder=speculative.")
  temperature = _TEMPERATURE.value
  if temperature and not speculative:
    raise app.UsageError(f"--temperature={temperature} is for --decoder=speculative (the block-diffusion sampler's "
                         "temperatures are config.sampler's).")
  spec = run.speculative_sampler(_DRAFT.value or None, temperature) if speculative else None

  def decode(prompts_, batch_size):
    if speculative:
      return runs.speculative(spec, run.variables, prompts_, new, batch_size)
    return runs.diffusion(sampler, run.variables, prompts_, new, batch_size)

  cont_d, passes = decode(prompts, _QUALITY_BATCH.value)
  cont_a = runs.autoregressive(ar, run.variables, prompts, new, _QUALITY_BATCH.value, temperature)
  result = {"weights": run.source, "prompts": _PROMPTS.value, "num_prompts": len(prompts),
            "settings": {"max_new_tokens": new, "max_prompt_tokens": _MAX_PROMPT.value,
                         "batch_sizes": [int(b) for b in _BATCH_SIZES.value], "repeats": _REPEATS.value,
                         "timing_prompts": _TIMING_PROMPTS.value, "quality_batch_size": _QUALITY_BATCH.value,
                         "decoder": _DECODER.value,
                         "sampler": ({"mask_id": spec.mask_id, "stop_tokens": list(spec.stop_tokens),
                                      "draft_length": spec.block_length, "temperature": spec.temperature,
                                      "top_p": spec.top_p}
                                     if speculative else sampler.settings()),
                         "ar": {"decoding": f"sampling at temperature {temperature}" if temperature else "greedy",
                                "kv_cache": True, "stop_tokens": list(ar.stop_tokens),
                                "prompt_bucket": ar.prompt_bucket}},
            "diffusion": {"tokens_per_pass": sum(map(len, cont_d)) / max(int(passes.sum()), 1),
                          "passes": int(passes.sum()), **runs.quality(run, prompts, cont_d)},
            "ar": runs.quality(run, prompts, cont_a)}
  result["perplexity_ratio"] = result["diffusion"]["judged_perplexity"] / result["ar"]["judged_perplexity"]
  result["example"] = {"prompt": run.tokenizer.decode(prompts[0]), "diffusion": run.tokenizer.decode(cont_d[0]),
                       "ar": run.tokenizer.decode(cont_a[0])}

  timed = prompts[:_TIMING_PROMPTS.value]
  for key in ("tokens_per_second", "tokens_per_second_median", "seconds", "compile_seconds", "timed_new_tokens"):
    result["diffusion"][key], result["ar"][key] = {}, {}
  result["speedup"] = {}
  for b in map(int, _BATCH_SIZES.value):
    outputs = {}

    def decode_diffusion(b=b):
      outputs["diffusion"] = decode(timed, b)[0]

    def decode_ar(b=b):
      outputs["ar"] = runs.autoregressive(ar, run.variables, timed, new, b, temperature)

    t_d, t_a = measure.alternate(decode_diffusion, decode_ar, _REPEATS.value)
    for name, t in (("diffusion", t_d), ("ar", t_a)):
      tokens = sum(map(len, outputs[name]))
      side = result[name]
      side["tokens_per_second"][str(b)] = tokens / t.best
      side["tokens_per_second_median"][str(b)] = tokens / t.median
      side["seconds"][str(b)] = t.runs
      side["compile_seconds"][str(b)] = t.compile_seconds
      side["timed_new_tokens"][str(b)] = tokens
    result["speedup"][str(b)] = (result["diffusion"]["tokens_per_second"][str(b)]
                                 / result["ar"]["tokens_per_second"][str(b)])
  machine.update(matmul_peak_gflops=measure.matmul_peak_flops() / 1e9, load_average_after=list(os.getloadavg()),
                 warnings=warnings)
  result["machine"] = machine
  out = pathlib.Path(_OUTPUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  d, a = result["diffusion"], result["ar"]
  print(f"{run.source}; {len(prompts)} prompts of {_PROMPTS.value}")
  print(f"diffusion: {d['tokens_per_pass']:.2f} tokens/pass, judged perplexity {d['judged_perplexity']:.3f}, "
        f"distinct 4-grams {d['distinct_4gram']:.3f}")
  print(f"AR {result['settings']['ar']['decoding']}: judged perplexity {a['judged_perplexity']:.3f}, "
        f"distinct 4-grams {a['distinct_4gram']:.3f}")
  for b in _BATCH_SIZES.value:
    print(f"batch {b}: diffusion {d['tokens_per_second'][b]:.0f} tok/s, AR {a['tokens_per_second'][b]:.0f} tok/s, "
          f"{result['speedup'][b]:.2f}x")
  if warnings:
    print("\n".join(warnings))
  print(f"wrote {out}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["output"])
  app.run(main)

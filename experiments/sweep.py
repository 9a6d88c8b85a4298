r"""Quality against speed: generative perplexity and tokens per forward over entropy bound x step cap.

For a trained workdir, every (entropy_bound, max_denoising_steps) setting samples continuations of the
same validation prompts with the same seed (config.sampler otherwise) and scores them as
`scripts/evaluate.py --generative` does (diffusiongemma/evaluation/generative.py). A looser bound accepts more
tokens per denoiser pass (faster) at some cost in quality; the step cap bounds the passes per canvas and
also sets the temperature schedule's length. The released defaults (SamplerConfig's: entropy bound 0.1,
48 steps) are always in the grid and are marked on the curve.

  python experiments/sweep.py --config configs/small.py --workdir workdir/small \
      --baseline_workdir workdir/small_ar --entropy_bounds 0.01,0.03,0.1,0.3,1 --max_steps 8,16,48

Writes `<workdir>/sweep.json` ({"settings": [...], one record of `GenerativeEval.run` per setting,
"judge": the perplexity plotted, "defaults": {...}, "plot": path}) and `<workdir>/sweep.png` (tokens per
forward (pooled: all new tokens / all passes) against generative perplexity, one line per step cap; the dashed line is the same judge's
perplexity of the real validation continuations).
"""

import json
import pathlib

from absl import app
from absl import flags
from absl import logging

import diffusiongemma as dg
from diffusiongemma import training
from diffusiongemma import build

_CONFIG = build.cli.define_config("config", None, "The config file the model was trained with.",
                                lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The training workdir (latest checkpoint).")
_COMPILATION_CACHE = dg.parallel.define_compilation_cache_flag()
_BASELINE = flags.DEFINE_string("baseline_workdir", None, "An AR baseline's workdir: the judge plotted.")
_BOUNDS = flags.DEFINE_list("entropy_bounds", ["0.01", "0.03", "0.1", "0.3", "1.0"], "Entropy bounds.")
_STEPS = flags.DEFINE_list("max_steps", ["8", "16", "48"], "Step caps (max_denoising_steps).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 16, "Validation prompts to continue per setting.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per sampler call.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 0, "New tokens; 0: config.sampler.max_new_tokens.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (the same for every setting).")
_OUTPUT = flags.DEFINE_string("output", "", "JSON path (default: <workdir>/sweep.json; the PNG beside it).")
flags.mark_flags_as_required(["config", "workdir"])

DEFAULTS = dg.SamplerConfig()


def _grid(bounds: list[str], steps: list[str]) -> tuple[list[float], list[int]]:
  """The flags' values as numbers, with the released defaults added; positive or an error."""
  try:
    bounds_, steps_ = [float(b) for b in bounds], [int(s) for s in steps]
  except ValueError as error:
    raise app.UsageError(f"--entropy_bounds needs numbers and --max_steps integers: {error}") from error
  if any(b <= 0 for b in bounds_) or any(s < 1 for s in steps_):
    raise app.UsageError(f"Entropy bounds must be > 0 and step caps >= 1, got {bounds_} and {steps_}.")
  return (sorted(set(bounds_) | {DEFAULTS.entropy_bound}),
          sorted(set(steps_) | {DEFAULTS.max_denoising_steps}))


def _plot(settings: list[dict], judge: str, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top

  key = f"perplexity_{judge}"
  fig, ax = plt.subplots(figsize=(5.5, 4))
  for steps in sorted({s["max_denoising_steps"] for s in settings}):
    row = sorted((s for s in settings if s["max_denoising_steps"] == steps), key=lambda s: s["entropy_bound"])
    ax.plot([s["pooled_tokens_per_forward"] for s in row], [s[key] for s in row], "o-", label=f"max {steps} steps")
    for s in row:
      ax.annotate(f"{s['entropy_bound']:g}", (s["pooled_tokens_per_forward"], s[key]), fontsize=7,
                  textcoords="offset points", xytext=(3, 3))
  default = next(s for s in settings if s["entropy_bound"] == DEFAULTS.entropy_bound
                 and s["max_denoising_steps"] == DEFAULTS.max_denoising_steps)
  ax.plot(default["pooled_tokens_per_forward"], default[key], "*", color="black", markersize=14,
          label=f"released defaults ({DEFAULTS.entropy_bound:g}, {DEFAULTS.max_denoising_steps} steps)")
  ax.axhline(settings[0][f"reference_{key}"], color="gray", linestyle="--", label="real continuations")
  ax.set(xscale="log", xlabel="tokens per forward (denoiser pass)",
         ylabel=f"generative perplexity ({judge} judge)",
         title="quality against speed (labels: entropy bound)")
  ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
  ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # the default labels overlap
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  dg.parallel.enable_compilation_cache(_COMPILATION_CACHE.value)
  training.quiet_orbax_logs()
  bounds, steps = _grid(_BOUNDS.value, _STEPS.value)
  evaluation = build.generative_eval(_CONFIG.value, _WORKDIR.value, baseline_workdir=_BASELINE.value,
                                      num_samples=_NUM_SAMPLES.value, batch_size=_BATCH_SIZE.value,
                                      seed=_SEED.value)
  settings = []
  for cap in steps:
    for bound in bounds:
      result = evaluation.run(_MAX_NEW.value or None, entropy_bound=bound, max_denoising_steps=cap)
      logging.info("entropy bound %g, max %d steps: %s", bound, cap, result)
      settings.append(result)
  judge = "baseline" if _BASELINE.value else "self"
  output = pathlib.Path(_OUTPUT.value) if _OUTPUT.value else pathlib.Path(_WORKDIR.value) / "sweep.json"
  output.parent.mkdir(parents=True, exist_ok=True)
  plot = output.with_suffix(".png")
  _plot(settings, judge, plot)
  defaults = {"entropy_bound": DEFAULTS.entropy_bound, "max_denoising_steps": DEFAULTS.max_denoising_steps}
  output.write_text(json.dumps({"settings": settings, "judge": judge, "defaults": defaults,
                                "plot": str(plot)}, indent=2), encoding="utf-8")
  print(f"| entropy bound | max steps | tokens per forward | perplexity ({judge}) | unigram entropy |")
  print("|---" * 5 + "|")
  for s in settings:
    print(f"| {s['entropy_bound']:g} | {s['max_denoising_steps']} | {s['pooled_tokens_per_forward']:.2f} | "
          f"{s[f'perplexity_{judge}']:.1f} | {s['unigram_entropy']:.2f} |")
  print(f"wrote {output} and {plot}")


if __name__ == "__main__":
  app.run(main)

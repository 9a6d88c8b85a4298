r"""The text project's curve: tokens per denoiser pass against judged perplexity over acceptance settings,
before and after distillation, on the dev prompts (the set the shipped decoding is chosen on).

For each model (the pretrained run and the distilled one, shipped or from workdirs) it decodes the prompts
with AR greedy once and with block diffusion at every acceptance setting of the grid (greedy draws, each
canvas until no position is masked), scores both with that model's own AR mode, and writes a JSON (every
point with its settings) and a PNG. The chosen setting is the one with the most tokens per pass among those
whose judged perplexity is within `--max_ratio` of AR greedy's and whose distinct 4-grams are within 0.05 of
AR greedy's.

  python -m projects.text.report --output=results/text_curve.json
  python -m projects.text.report --pretrained=P --distilled=W --output=O   # training workdirs
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import app
from absl import flags
import numpy as np

from diffusiongemma import timing, training
from projects.text import runs

_PRETRAINED = flags.DEFINE_string("pretrained", None, "The pretrained workdir (default: shipped).")
_DISTILLED = flags.DEFINE_string("distilled", None, "The distilled workdir (default: shipped).")
_PROMPTS = flags.DEFINE_string("prompts", str(runs.PROMPTS / "dev.jsonl"), "JSONL prompts.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 0, "The first N prompts (0: all).")
_OUTPUT = flags.DEFINE_string("output", None, "The JSON; the PNG goes beside it.")
_ACCEPTANCE = flags.DEFINE_enum("acceptance", "prefix", ["prefix", "confidence"],
                                "The acceptance rule whose threshold the grid varies.")
_THRESHOLDS = flags.DEFINE_list("thresholds", ["0.5", "0.7", "0.8", "0.9", "0.95", "0.98", "0.99"],
                                "Thresholds of the grid.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows per call.")
_MAX_RATIO = flags.DEFINE_float("max_ratio", 1.05, "Judged perplexity / AR greedy's allowed when choosing.")


def curve(run: runs.TextModel, prompts, acceptance: str, thresholds, max_new_tokens: int, batch_size: int
          ) -> dict:
  """AR greedy's quality and one point per threshold of `acceptance` ('prefix' or 'confidence')."""
  ar = runs.quality(run, prompts, runs.autoregressive(run.ar_sampler(), run.variables, prompts, max_new_tokens,
                                                      batch_size))
  points = []
  for threshold in thresholds:
    sampler = run.sampler(acceptance=acceptance, **{f"{acceptance}_accept": threshold})
    continuations, passes = runs.diffusion(sampler, run.variables, prompts, max_new_tokens, batch_size)
    q = runs.quality(run, prompts, continuations)
    points.append({"acceptance": acceptance, "threshold": threshold,
                   "tokens_per_pass": q["new_tokens"] / max(int(passes.sum()), 1),
                   "perplexity_ratio": q["judged_perplexity"] / ar["judged_perplexity"], **q})
  return {"weights": run.source, "ar": ar, "points": points, "sampler": run.sampler().settings()}


def choose(result: dict, max_ratio: float) -> dict | None:
  """The point with the most tokens per pass within `max_ratio` of AR's perplexity and 0.05 of its
  distinct 4-grams (None if none is)."""
  ok = [p for p in result["points"] if p["perplexity_ratio"] <= max_ratio
        and abs(p["distinct_4gram"] - result["ar"]["distinct_4gram"]) <= 0.05]
  return max(ok, key=lambda p: p["tokens_per_pass"]) if ok else None


def plot(results: dict, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, result in results.items():
    x = [p["tokens_per_pass"] for p in result["points"]]
    y = [p["perplexity_ratio"] for p in result["points"]]
    ax.plot(x, y, marker="o", label=name)
    for p in result["points"]:
      ax.annotate(f"{p['threshold']:g}", (p["tokens_per_pass"], p["perplexity_ratio"]), fontsize=7)
  ax.axhline(1.10, color="grey", linestyle="--", linewidth=0.8)  # the goal
  ax.set_yscale("log")
  ax.set_xlabel("new tokens per denoiser pass")
  ax.set_ylabel("judged perplexity / AR greedy's")
  ax.set_title(f"{_ACCEPTANCE.value} threshold: tokens per pass against quality")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  training.quiet_orbax_logs()
  thresholds = [float(t) for t in _THRESHOLDS.value]
  results = {}
  for name, workdir, shipped_name in (("pretrained", _PRETRAINED.value, runs.PRETRAINED),
                                      ("distilled", _DISTILLED.value, runs.DISTILLED)):
    run = runs.load(workdir, shipped_name)
    prompts = runs.read_prompts(_PROMPTS.value, run.tokenizer, limit=_NUM_PROMPTS.value or None)
    results[name] = curve(run, prompts, _ACCEPTANCE.value, thresholds, _MAX_NEW.value, _BATCH.value)
    results[name]["chosen"] = choose(results[name], _MAX_RATIO.value)
    print(f"{name} ({run.source}): AR greedy perplexity {results[name]['ar']['judged_perplexity']:.3f}")
    for p in results[name]["points"]:
      print(f"  {p['acceptance']} {p['threshold']:g}: {p['tokens_per_pass']:.2f} tokens/pass, perplexity x"
            f"{p['perplexity_ratio']:.3f}, distinct 4-grams {p['distinct_4gram']:.3f}")
  out = pathlib.Path(_OUTPUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  record = {"command": " ".join(sys.argv), "machine": timing.provenance(pathlib.Path(__file__).resolve().parents[2]), "prompts": _PROMPTS.value, "max_new_tokens": _MAX_NEW.value, "max_ratio": _MAX_RATIO.value,
            "models": results}
  out.write_text(json.dumps(record, indent=2) + "\n")
  plot(results, out.with_suffix(".png"))
  print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["output"])
  app.run(main)

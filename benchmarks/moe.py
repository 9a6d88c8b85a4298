r"""MoE layer time against the number of experts at fixed top-k: grouped vs ragged vs dense.

At fixed top-k the useful work per token is constant, so a sparse layer should take about the same time
for 8 or 128 experts, while the dense all-experts reference grows linearly. A dense GeGLU MLP with the
same active parameters (k x the expert width) is the floor. Everything runs in one process, side by side,
and reports the median of `--repeats` timed calls after one warm-up (compile) call
(`measure.moe_against_dense`: the router and the experts, as the model runs them).

  python benchmarks/moe.py                      # T=2048, D=F=256, k=2
  python benchmarks/moe.py --experts=8,16 --repeats=2 --output=/tmp/moe.json
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
import jax

import diffusiongemma as dg
from benchmarks import measure

_EXPERTS = flags.DEFINE_list("experts", ["8", "16", "32", "64", "128"], "Numbers of experts to time.")
_IMPLS = flags.DEFINE_list("impls", ["grouped", "ragged", "dense"], "MoE implementations to time.")
_TOKENS = flags.DEFINE_integer("tokens", 2048, "Tokens per call (e.g. 8 canvases of 256).")
_HIDDEN = flags.DEFINE_integer("hidden", 256, "Model width D.")
_FFN = flags.DEFINE_integer("ffn", 256, "Expert width F.")
_TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (median reported).")
_OUTPUT = flags.DEFINE_string("output", "", "Write the results as JSON here.")


def _config(num_experts: int, impl: str) -> dg.ModelConfig:
  return dg.ModelConfig(
      vocab_size=256, hidden_size=_HIDDEN.value, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
      num_full_kv_heads=1, full_head_dim=8, intermediate_size=8, num_experts=num_experts, top_k=_TOP_K.value,
      moe_intermediate_size=_FFN.value, moe_impl=impl)


def main(argv):
  del argv
  t, d, f, k = _TOKENS.value, _HIDDEN.value, _FFN.value, _TOP_K.value
  useful_flops = 2 * t * k * 3 * d * f  # gate, up and down projections of the k chosen experts
  results = {"tokens": t, "hidden": d, "ffn": f, "top_k": k, "backend": jax.default_backend(), "moe": []}
  header = False
  for num_experts in map(int, _EXPERTS.value):
    row = {"experts": num_experts}
    for impl in _IMPLS.value:
      measured = measure.moe_against_dense(_config(num_experts, impl), t, repeats=_REPEATS.value)
      row[f"{impl}_ms"] = 1e3 * measured["moe_seconds"]
      row["dense_mlp_same_active_ms"] = 1e3 * measured["dense_same_active_seconds"]
    if not header:
      print(f"T={t} D={d} F={f} k={k} on {jax.default_backend()}; a dense MLP of width k*F={k * f}: "
            f"{row['dense_mlp_same_active_ms']:.1f} ms")
      print("| experts | " + " | ".join(f"{impl} ms" for impl in _IMPLS.value) + " | " +
            " | ".join(f"{impl} useful GFLOP/s" for impl in _IMPLS.value) + " |")
      print("|---" * (1 + 2 * len(_IMPLS.value)) + "|")
      header = True
    results["moe"].append(row)
    ms = [row[f"{impl}_ms"] for impl in _IMPLS.value]
    print(f"| {num_experts} | " + " | ".join(f"{m:.1f}" for m in ms) + " | " +
          " | ".join(f"{useful_flops / m / 1e6:.0f}" for m in ms) + " |", flush=True)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f_out:
      json.dump(results, f_out, indent=2)


if __name__ == "__main__":
  app.run(main)

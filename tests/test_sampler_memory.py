"""Peak resident memory of one generation at the released vocabulary (262,144 tokens), in a fresh process.

Hidden 64, 2 layers, batch 8, canvas 256, a 64-token prompt, 4 fixed steps, the default sampler settings:
the sampler keeps no [batch, canvas, vocab] array (self-conditioning is carried as [B, C, D] embeddings;
the head's "auto" chunking streams the vocabulary: in 1024-token chunks on this CPU, and in 32,768-token
chunks as on a GPU (its choice, faked here), since a float32 [8, 256, 262144] array, 2 GiB, exceeds the
256 MiB budget), so the peak stays under 2.5 GiB either way (before streaming it was 11.7 GiB).
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
LIMIT_GIB = 2.5

_SCRIPT = r"""
import json, sys, time
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np
import diffusiongemma as dg

def status_gib(field):
  with open("/proc/self/status") as status:
    return next(int(line.split()[1]) for line in status if line.startswith(field)) / 2**20  # kB

# VmHWM, not getrusage's ru_maxrss: ru_maxrss survives exec, so a child of a large pytest process would
# report its parent's resident size at the fork (measured: 4.26 GiB under the full suite).
peak_gib = lambda: status_gib("VmHWM:")
current_gib = lambda: status_gib("VmRSS:")

cfg = dg.ModelConfig(vocab_size=262_144, hidden_size=64, num_layers=2, layer_types=("sliding", "full"),
                     num_heads=2, num_kv_heads=1, head_dim=32, num_full_kv_heads=1, full_head_dim=32,
                     sliding_window=128, intermediate_size=128, num_experts=4, top_k=2,
                     moe_intermediate_size=64, canvas_length=256, max_positions=1024)
model = dg.DiffusionGemma(cfg)
tokens = jnp.zeros((1, 1), jnp.int32)
shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens, tokens))["params"])
rng = np.random.default_rng(0)
draw = lambda s: rng.standard_normal(s.shape) / np.sqrt(s.shape[-1]) if s.ndim >= 2 else np.ones(s.shape)
params = jax.tree.map(lambda s: jnp.asarray(draw(s), s.dtype), shapes)
baseline = peak_gib()
if sys.argv[1] != "native":
  jax.default_backend = lambda: sys.argv[1]  # the head's "auto" chunking as that backend chooses it
sampler = dg.Sampler(model, dg.SamplerConfig(max_denoising_steps=4, stop_tokens=()), stopping=dg.diffusion.NoEarlyStop())
prompts = rng.integers(3, cfg.vocab_size, (8, 64))
start = time.perf_counter()
out = sampler.generate(params, prompts, jax.random.key(0), cfg.canvas_length)
jax.block_until_ready(out.tokens)
first_peak, after = peak_gib(), current_gib()
jax.block_until_ready(sampler.generate(params, prompts, jax.random.key(1), cfg.canvas_length).tokens)
print(json.dumps({"baseline_gib": baseline, "peak_gib": peak_gib(), "first_call_peak_gib": first_peak,
                  "resident_after_first_call_gib": after, "seconds": time.perf_counter() - start,
                  "passes": np.asarray(out.canvas_passes).tolist(), "settings": sampler.settings(),
                  "vocab_chunk": sampler.head.chunk_for(8 * cfg.canvas_length)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend, chunk", [("native", 1024), ("gpu", 32_768)])
def test_generation_at_the_released_vocabulary_stays_small(backend, chunk, optimized_env):
  result = subprocess.run([sys.executable, "-c", _SCRIPT, backend], capture_output=True, text=True,
                          timeout=1200, cwd=ROOT, check=False, env=optimized_env)
  assert result.returncode == 0, result.stderr[-3000:]
  measured = json.loads(result.stdout.strip().splitlines()[-1])
  print(f"peak resident memory {measured['peak_gib']:.2f} GiB (after building the parameters "
        f"{measured['baseline_gib']:.2f} GiB; resident after the first call, compiled program included, "
        f"{measured['resident_after_first_call_gib']:.2f} GiB), two generations {measured['seconds']:.0f} s")
  assert measured["passes"] == [[4]] * 8
  assert measured["settings"]["vocab_chunk_size"] == "auto" and measured["vocab_chunk"] == chunk
  assert measured["peak_gib"] < LIMIT_GIB

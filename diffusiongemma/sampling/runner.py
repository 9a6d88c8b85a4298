"""What `scripts/sample.py` and the quickstart notebook share: loading weights, timing, showing steps.

Weights come from (in this order of preference) a training workdir's latest orbax checkpoint, a
transformers checkpoint folder, or a random initialisation (to try the sampler without a model).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffusiongemma.model import DiffusionGemma, ModelConfig
from diffusiongemma.sampling.config import SamplerConfig
from diffusiongemma.sampling.sampler import SampleOutput, Sampler

CHECKPOINT_DIRNAME = "checkpoints"


def sampler_config(config, **overrides) -> SamplerConfig:
  """`config.sampler` as a SamplerConfig, with the noise of `config.diffusion` (what the model learned)."""
  values = dict(config.sampler.to_dict() if hasattr(config.sampler, "to_dict") else config.sampler)
  diffusion = getattr(config, "diffusion", None)
  if diffusion is not None and "noise" in diffusion:
    values.setdefault("noise", diffusion.noise)
    mask = diffusion.get("mask_token_id", -1) if hasattr(diffusion, "get") else -1
    if mask is not None and mask >= 0:
      values.setdefault("mask_token_id", mask)
  values.update(overrides)
  return SamplerConfig.from_dict(values)


def restore_workdir_params(workdir, shardings=None) -> tuple[Any, int] | None:
  """(variables, step) of the latest checkpoint in `workdir/checkpoints`, or None when there is none.

  Only the parameters are read (`training.load_params`), so no optimizer has to be rebuilt.
  """
  from diffusiongemma import training  # pylint: disable=g-import-not-at-top

  directory = pathlib.Path(workdir).absolute() / CHECKPOINT_DIRNAME
  if not directory.is_dir() or not any(p.name.isdigit() for p in directory.iterdir()):
    return None
  return training.load_params(workdir, shardings=shardings)


def random_params(model: DiffusionGemma, seed: int = 0):
  """Freshly initialised variables (jitted init: much faster than eager)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  canvas = jnp.zeros((1, model.config.canvas_length), jnp.int32)
  return jax.jit(lambda rng: nn.unbox(model.init(rng, tokens, canvas)))(jax.random.key(seed))


def load_model(config=None, workdir=None, hf_checkpoint=None, random_init: bool = False, seed: int = 0
               ) -> tuple[ModelConfig, Any, str]:
  """(model config, variables, where they came from): workdir checkpoint, else transformers, else random."""
  if hf_checkpoint:
    from diffusiongemma import convert  # pylint: disable=g-import-not-at-top
    cfg, params = convert.load_hf(hf_checkpoint)
    return cfg, {"params": params}, f"transformers checkpoint {hf_checkpoint}"
  if config is None:
    raise ValueError("A config is needed to load a workdir checkpoint or to initialise randomly.")
  cfg = ModelConfig.from_dict(config.model)
  if workdir is not None and not random_init:
    restored = restore_workdir_params(workdir)
    if restored is not None:
      return cfg, restored[0], f"{workdir}/{CHECKPOINT_DIRNAME} step {restored[1]}"
  if not random_init:
    raise FileNotFoundError(f"No checkpoint in {workdir}/{CHECKPOINT_DIRNAME}: train first, or pass "
                            "--hf_checkpoint=<folder> or --random_init.")
  return cfg, random_params(DiffusionGemma(cfg), seed), "random initialisation"


@dataclasses.dataclass
class Timed:
  output: Any
  compile_s: float  # first call (trace + compile + one run) minus one run
  run_s: float  # a second call with the same shapes


def timed(fn, *args, **kwargs) -> Timed:
  """Calls `fn` twice (the first compiles) and times both calls to completion."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args, **kwargs))
  first = time.perf_counter() - start
  start = time.perf_counter()
  output = jax.block_until_ready(fn(*args, **kwargs))
  run = time.perf_counter() - start
  return Timed(output, max(first - run, 0.0), run)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded [B, L] prompts and their lengths [B]."""
  lengths = np.array([len(p) for p in prompts], np.int32)
  tokens = np.full((len(prompts), max(int(lengths.max()), 1)), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, lengths


def new_tokens(row: np.ndarray, stop_tokens: Sequence[int], pad_id: int) -> list[int]:
  """A row's tokens up to and including its first stop token (pad dropped after it)."""
  row = np.asarray(row).tolist()
  for i, t in enumerate(row):
    if t in stop_tokens:
      return row[:i + 1]
  return row


def stats(out: SampleOutput, seconds: float, stop_tokens: Sequence[int], pad_id: int) -> dict[str, float]:
  """Tokens/s, tokens per forward and steps per canvas of one `generate` output."""
  count = sum(len(new_tokens(r, stop_tokens, pad_id)) for r in np.asarray(out.tokens))
  return {"new_tokens": count, "tokens_per_s": count / seconds if seconds > 0 else float("inf"),
          **pass_stats(count, np.asarray(out.canvas_passes))}


def pass_stats(count: int, passes: np.ndarray) -> dict[str, float]:
  """Tokens per forward (`count` new tokens over all denoiser passes), steps per canvas that ran, and
  the number of passes, from `canvas_passes` ([B, K], of one or several `generate` outputs)."""
  ran = passes[passes > 0]
  return {"tokens_per_forward": count / max(int(passes.sum()), 1),
          "steps_per_canvas": float(ran.mean()) if ran.size else 0.0, "denoiser_passes": int(passes.sum())}


def format_steps(out: SampleOutput, decode, row: int = 0, mask_token: int | None = None) -> list[str]:
  """One line per denoising step of `row`: canvas, step, accepted count and the argmax canvas text."""
  if out.trace is None:
    raise ValueError("generate(..., return_trace=True) is needed to show the steps.")
  passes = np.asarray(out.canvas_passes)[row]
  argmax = np.asarray(out.trace.argmax)[:, :, row]  # [K, N, C]
  accepted = np.asarray(out.trace.accepted)[:, :, row].sum(-1)  # [K, N]
  lines = []
  for k in range(argmax.shape[0]):
    for n in range(int(passes[k])):
      ids = [int(t) for t in argmax[k, n] if t != mask_token]
      text = decode(ids).replace("\n", "\\n")
      lines.append(f"canvas {k} step {n + 1:2d} accepted {int(accepted[k, n]):3d} | {text}")
  return lines


def accepted_per_step(out: SampleOutput) -> np.ndarray:
  """Mean accepted tokens per step over the rows still running [K, N] (NaN where none ran)."""
  if out.trace is None:
    raise ValueError("generate(..., return_trace=True) is needed.")
  passes = np.asarray(out.canvas_passes)  # [B, K]
  accepted = np.asarray(out.trace.accepted).sum(-1).astype(float)  # [K, N, B]
  running = np.arange(accepted.shape[1])[None, :, None] < passes.T[:, None, :]  # [K, N, B]
  with np.errstate(invalid="ignore"):
    return np.where(running, accepted, 0).sum(-1) / running.sum(-1)


def load_prompts(prompt: Sequence[str] | str | None, prompt_file: str | None) -> list[str]:
  texts = [prompt] if isinstance(prompt, str) else list(prompt or [])
  if prompt_file:
    texts += [line.rstrip("\n").replace("\\n", "\n") for line in
              pathlib.Path(prompt_file).read_text().splitlines() if line.strip()]
  if not texts:
    raise ValueError("No prompt: pass --prompt or --prompt_file.")
  return texts


def sampler_for(cfg: ModelConfig, config=None, **overrides) -> Sampler:
  model = DiffusionGemma(cfg)
  sampler_cfg = sampler_config(config, **overrides) if config is not None else SamplerConfig(**overrides)
  return Sampler(model, sampler_cfg)


def describe(values: Mapping[str, float]) -> str:
  return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())

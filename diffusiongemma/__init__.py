"""diffusiongemma: DiffusionGemma block diffusion in JAX/Flax.

The public names resolve on first use, so `import diffusiongemma as dg` loads nothing heavy: `dg.Sampler`
imports the sampler (and JAX), `dg.convert` the converter, `dg.build` the composition root.
"""

import importlib

_SUBPACKAGES = ("build", "chat", "convert", "data", "diffusion", "evaluation", "model", "parallel", "sampling",
                "serving", "training")
_NAMES = {
    "ARSampler": "diffusiongemma.sampling.autoregressive",
    "ChatSampler": "diffusiongemma.chat.sampler",
    "DiffusionGemma": "diffusiongemma.model.transformer",
    "KVCache": "diffusiongemma.model.attention",
    "ModelConfig": "diffusiongemma.model.config",
    "Sampler": "diffusiongemma.sampling.sampler",
    "SamplerConfig": "diffusiongemma.sampling.config",
}

__all__ = sorted(_NAMES) + list(_SUBPACKAGES)


def __getattr__(name):
  if name in _NAMES:
    value = getattr(importlib.import_module(_NAMES[name]), name)
  elif name in _SUBPACKAGES:
    value = importlib.import_module(f"diffusiongemma.{name}")
  else:
    raise AttributeError(f"module 'diffusiongemma' has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))

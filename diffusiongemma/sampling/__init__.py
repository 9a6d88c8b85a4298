"""Sampling: the compiled block-diffusion sampler, autoregressive decoding, and their statistics.

The sampler needs a model, its parameters and the diffusion objects; `sampling.pretrained` also reads a
transformers checkpoint folder (weights, tokenizer, generation defaults).
"""

from diffusiongemma.sampling import constrained
from diffusiongemma.sampling import prompts
from diffusiongemma.sampling import stats
from diffusiongemma.sampling.autoregressive import ARSampleOutput
from diffusiongemma.sampling.autoregressive import ARSampler
from diffusiongemma.sampling.config import SamplerConfig
from diffusiongemma.sampling.constrained import Constraint
from diffusiongemma.sampling.sampler import PassEvent
from diffusiongemma.sampling.sampler import SampleOutput
from diffusiongemma.sampling.sampler import Sampler
from diffusiongemma.sampling.steps import DenoiseState
from diffusiongemma.sampling.steps import Rules
from diffusiongemma.sampling.steps import StepTrace

__all__ = [
    "ARSampleOutput", "ARSampler", "Constraint", "DenoiseState", "PassEvent", "Rules", "SampleOutput", "Sampler",
    "SamplerConfig", "StepTrace", "constrained", "prompts", "stats",
]

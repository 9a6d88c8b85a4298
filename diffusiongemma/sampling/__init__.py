"""Sampling: the compiled block-diffusion sampler, its swappable rules, and autoregressive decoding."""

from diffusiongemma.sampling import rules
from diffusiongemma.sampling.autoregressive import ARSampleOutput
from diffusiongemma.sampling.config import ACCEPTANCE_RULES, NOISES, STOPPING_RULES, SamplerConfig
from diffusiongemma.sampling.sampler import SampleOutput, Sampler, row_keys
from diffusiongemma.sampling.steps import DenoiseState, StepTrace, denoise_canvas, denoise_step, init_state

__all__ = [
    "ACCEPTANCE_RULES",
    "ARSampleOutput",
    "DenoiseState",
    "NOISES",
    "STOPPING_RULES",
    "SampleOutput",
    "Sampler",
    "SamplerConfig",
    "StepTrace",
    "denoise_canvas",
    "denoise_step",
    "init_state",
    "row_keys",
    "rules",
]

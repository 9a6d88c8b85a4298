"""The diffusion process as objects shared by training and sampling: noise processes, acceptance rules,
stopping rules, temperature schedules, and the block-diffusion training loss."""

from diffusiongemma.diffusion.acceptance import AcceptanceRule
from diffusiongemma.diffusion.acceptance import Confidence
from diffusiongemma.diffusion.acceptance import ConfidentPrefix
from diffusiongemma.diffusion.acceptance import EntropyBound
from diffusiongemma.diffusion.acceptance import Margin
from diffusiongemma.diffusion.acceptance import TokenStats
from diffusiongemma.diffusion.acceptance import TopCount
from diffusiongemma.diffusion.loss import certainty_entropy
from diffusiongemma.diffusion.loss import diffusion_loss
from diffusiongemma.diffusion.loss import LossConfig
from diffusiongemma.diffusion.noise import MaskedNoise
from diffusiongemma.diffusion.noise import NEVER_LOGIT
from diffusiongemma.diffusion.noise import NoiseProcess
from diffusiongemma.diffusion.noise import sample_time
from diffusiongemma.diffusion.noise import UniformNoise
from diffusiongemma.diffusion.schedules import Constant
from diffusiongemma.diffusion.schedules import Cosine
from diffusiongemma.diffusion.schedules import Linear
from diffusiongemma.diffusion.schedules import Schedule
from diffusiongemma.diffusion.stopping import AllOf
from diffusiongemma.diffusion.stopping import AnyOf
from diffusiongemma.diffusion.stopping import ArgmaxStable
from diffusiongemma.diffusion.stopping import MeanEntropyBelow
from diffusiongemma.diffusion.stopping import NoEarlyStop
from diffusiongemma.diffusion.stopping import stable_and_confident
from diffusiongemma.diffusion.stopping import StoppingRule

__all__ = [
    "AcceptanceRule", "AllOf", "AnyOf", "ArgmaxStable", "Confidence", "ConfidentPrefix", "Constant", "Cosine", "EntropyBound",
    "Linear", "LossConfig", "Margin", "MaskedNoise", "MeanEntropyBelow", "NEVER_LOGIT", "NoEarlyStop",
    "NoiseProcess", "Schedule", "StoppingRule", "TokenStats", "TopCount", "UniformNoise", "certainty_entropy", "diffusion_loss",
    "sample_time", "stable_and_confident",
]

"""Constraints for canvas denoising: token automata of regexes and JSON schemas (`automaton`), the
dynamic programs over (position, state) that give the constrained argmax canvas and the tokens that can
still lead to acceptance (`dp`), and infilling canvases (`infill`)."""

from diffusiongemma.diffusion.constraints import vocabulary
from diffusiongemma.diffusion.constraints.automaton import from_json_schema
from diffusiongemma.diffusion.constraints.automaton import from_regex
from diffusiongemma.diffusion.constraints.automaton import schema_regex
from diffusiongemma.diffusion.constraints.automaton import TokenAutomaton
from diffusiongemma.diffusion.constraints.dp import advance
from diffusiongemma.diffusion.constraints.dp import allowed_classes
from diffusiongemma.diffusion.constraints.dp import allowed_tokens
from diffusiongemma.diffusion.constraints.dp import AutomatonTables
from diffusiongemma.diffusion.constraints.dp import class_scores
from diffusiongemma.diffusion.constraints.dp import end_mask
from diffusiongemma.diffusion.constraints.dp import viterbi
from diffusiongemma.diffusion.constraints.dp import ViterbiResult
from diffusiongemma.diffusion.constraints.infill import infill_canvas
from diffusiongemma.diffusion.constraints.infill import InfillCanvas

__all__ = [
    "AutomatonTables", "InfillCanvas", "TokenAutomaton", "ViterbiResult", "advance", "allowed_classes",
    "allowed_tokens", "class_scores", "end_mask", "from_json_schema", "from_regex", "infill_canvas",
    "schema_regex", "viterbi", "vocabulary",
]

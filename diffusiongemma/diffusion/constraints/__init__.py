"""Constraints for canvas denoising: regexes as syntax trees with a fixed meaning (`regexp`), JSON schemas
compiled into them or refused keyword by keyword (`json_schema`), token automata of both (`automaton`)
built within a `budget`, the dynamic programs over (position, state) that give the constrained argmax
canvas, the tokens that can still lead to acceptance and each canvas's end condition (`dp`), and
infilling canvases (`infill`)."""

from diffusiongemma.diffusion.constraints import budget
from diffusiongemma.diffusion.constraints import json_schema
from diffusiongemma.diffusion.constraints import regexp
from diffusiongemma.diffusion.constraints import vocabulary
from diffusiongemma.diffusion.constraints.budget import Budget
from diffusiongemma.diffusion.constraints.budget import BudgetExceeded
from diffusiongemma.diffusion.constraints.automaton import from_json_schema
from diffusiongemma.diffusion.constraints.automaton import from_regex
from diffusiongemma.diffusion.constraints.automaton import from_tree
from diffusiongemma.diffusion.constraints.automaton import schema_regex
from diffusiongemma.diffusion.constraints.automaton import TokenAutomaton
from diffusiongemma.diffusion.constraints.dp import advance
from diffusiongemma.diffusion.constraints.dp import allowed_classes
from diffusiongemma.diffusion.constraints.dp import allowed_tokens
from diffusiongemma.diffusion.constraints.dp import AutomatonTables
from diffusiongemma.diffusion.constraints.dp import canvas_ends
from diffusiongemma.diffusion.constraints.dp import class_scores
from diffusiongemma.diffusion.constraints.dp import end_mask
from diffusiongemma.diffusion.constraints.dp import viterbi
from diffusiongemma.diffusion.constraints.dp import ViterbiResult
from diffusiongemma.diffusion.constraints.infill import infill_canvas
from diffusiongemma.diffusion.constraints.infill import InfillCanvas

__all__ = [
    "AutomatonTables", "Budget", "BudgetExceeded", "InfillCanvas", "TokenAutomaton", "ViterbiResult", "advance",
    "allowed_classes", "allowed_tokens", "budget", "canvas_ends", "class_scores", "end_mask", "from_json_schema",
    "from_regex", "from_tree", "infill_canvas", "json_schema", "regexp", "schema_regex", "viterbi", "vocabulary",
]

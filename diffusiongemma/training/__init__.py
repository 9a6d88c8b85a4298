"""Training: `train(task, workdir)` on objects; train state, optimizer, jitted steps, orbax checkpoints,
metrics, and the validation pass."""

from diffusiongemma.training.checkpoint import Checkpointer
from diffusiongemma.training.checkpoint import config_mismatches
from diffusiongemma.training.checkpoint import ConfigMismatchError
from diffusiongemma.training.checkpoint import latest_step
from diffusiongemma.training.checkpoint import load_params
from diffusiongemma.training.checkpoint import load_weights
from diffusiongemma.training import lora
from diffusiongemma.training import validation
from diffusiongemma.training.loop import evaluate
from diffusiongemma.training.loop import train
from diffusiongemma.training.metrics import quiet_orbax_logs
from diffusiongemma.training.metrics import read_metrics
from diffusiongemma.training.optim import learning_rate_schedule
from diffusiongemma.training.optim import make_optimizer
from diffusiongemma.training.optim import OptimizerSettings
from diffusiongemma.training.state import abstract_train_state
from diffusiongemma.training.state import create_train_state
from diffusiongemma.training.state import state_shardings
from diffusiongemma.training.state import TrainState
from diffusiongemma.training.step import check_finite
from diffusiongemma.training.step import make_eval_step
from diffusiongemma.training.step import make_train_step
from diffusiongemma.training.step import NonFiniteError
from diffusiongemma.training.task import LoopSettings
from diffusiongemma.training.task import Task

__all__ = [
    "Checkpointer",
    "LoopSettings",
    "OptimizerSettings",
    "Task",
    "validation",
    "ConfigMismatchError",
    "NonFiniteError",
    "TrainState",
    "abstract_train_state",
    "check_finite",
    "config_mismatches",
    "create_train_state",
    "evaluate",
    "latest_step",
    "learning_rate_schedule",
    "load_params",
    "load_weights",
    "lora",
    "make_eval_step",
    "make_optimizer",
    "make_train_step",
    "quiet_orbax_logs",
    "read_metrics",
    "state_shardings",
    "train",
]

"""The composition root: the only place where an ml_collections config's names become objects.

Scripts, notebooks, benchmarks and tests build what they need here; nothing inside the package imports it.

- `config`: the base config every config file starts from (`base_config`, `load_config_file`);
- `cli`: `run(main)`, absl's `app.run` with a user's mistake in one line (no traceback);
- `registry`: which config name means which noise, acceptance rule, stopping rule or schedule;
- `models`: `model_config`, `noise`, `loss`, `sampler`, `ar_sampler` of a config;
- `tasks`: `train_task(config, workdir)` (a `training.Task`), datasets, the tokenizer; `train`, `evaluate`;
- `init_from`: what `config.model.init_from` names (a transformers folder or a workdir) as the run's model
  config, starting weights and tokenizer (`resolve`); `copy_tokenizer` for a folder exported from a workdir;
- `weights`: `load` (a workdir checkpoint with LoRA merged, a transformers folder, or random weights),
  `pretrained` (a transformers folder with its tokenizer and generation defaults), `chat_sampler`;
- `plan`: per-device memory plans of a config on a mesh.
"""

from diffusiongemma.build import cli
from diffusiongemma.build import config
from diffusiongemma.build import registry
from diffusiongemma.build.models import ar_sampler
from diffusiongemma.build.models import loss
from diffusiongemma.build.models import max_new_tokens
from diffusiongemma.build.models import model
from diffusiongemma.build.models import model_config
from diffusiongemma.build.models import noise
from diffusiongemma.build.models import random_variables
from diffusiongemma.build.models import sampler
from diffusiongemma.build.models import sampler_config
from diffusiongemma.build.evaluation import generative_eval
from diffusiongemma.build.init_from import copy_tokenizer
from diffusiongemma.build.tasks import dataset
from diffusiongemma.build.tasks import evaluate
from diffusiongemma.build.tasks import lora_config
from diffusiongemma.build.tasks import tokenizer
from diffusiongemma.build.tasks import train
from diffusiongemma.build.tasks import train_task
from diffusiongemma.build.weights import chat_sampler
from diffusiongemma.build.weights import load
from diffusiongemma.build.weights import pretrained
from diffusiongemma.build.weights import Pretrained
from diffusiongemma.build.weights import Weights
from diffusiongemma.build.weights import run_config
from diffusiongemma.build.weights import workdir_config

__all__ = [
    "Pretrained", "Weights", "ar_sampler", "chat_sampler", "cli", "config", "copy_tokenizer", "dataset",
    "evaluate", "generative_eval", "load", "lora_config", "loss", "max_new_tokens", "model", "model_config",
    "noise", "pretrained", "random_variables", "registry", "run_config", "sampler", "sampler_config",
    "tokenizer", "train", "train_task", "workdir_config",
]

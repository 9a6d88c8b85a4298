"""Training tasks: from `config.data` to the datasets and tokenizer, and from a whole config to a
`training.Task`.

A task kind is named by `config.data.task`: one of `TASKS` (`lm`: the packed corpus; `sft`: prompt/response
pairs of a JSONL file), or a module of the installed `projects` package (`projects.sudoku.task`) that defines
`TASK`, an object with the same two members as the built-ins:

  needs_tokenizer: bool
  dataset(data, split, *, tokenizer, canvas_length, batch_size, seed, shard_index, shard_count,
          cache_dir) -> grain.IterDataset

where `data` is `config.data` as a plain dict. So a project adds a task without a line here. A config read
back from a workdir names its task too, so nothing else is ever imported: a module path outside the installed
projects package is refused by name. Everything is validated before anything is written to the workdir, so
a bad config fails with a message naming the field and loses nothing.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import pathlib
import sys
from typing import Any

import jax

from diffusiongemma import data as data_lib
from diffusiongemma import parallel
from diffusiongemma import training
from diffusiongemma.build import config as config_lib
from diffusiongemma.build import init_from
from diffusiongemma.build import models
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.data import sft
from diffusiongemma.training import lora as lora_lib
from diffusiongemma.training import optim
from diffusiongemma.training.task import LoopSettings

CACHE_DIRNAME = "data_cache"


def _corpus_split(data: dict, split: str) -> list[str]:
  return data_lib.load_corpus(data["corpus"], split, text_field=data["text_field"],
                              validation_fraction=data["validation_fraction"])


@dataclasses.dataclass(frozen=True)
class LanguageModelling:
  """The corpus (`data.corpus`: 'stdlib', a folder of text files or a JSONL file) packed into windows of a
  prompt and `data.num_canvases` canvases (`data.pipeline`)."""

  needs_tokenizer = True

  def dataset(self, data, split, *, tokenizer, canvas_length, batch_size, seed, shard_index, shard_count,
              cache_dir):
    return data_lib.make_dataset(
        _corpus_split(data, split), tokenizer, prompt_length=data["prompt_length"],
        canvas_length=canvas_length, num_canvases=data["num_canvases"], batch_size=batch_size, seed=seed,
        train=split == "train", shard_index=shard_index, shard_count=shard_count, cache_dir=cache_dir)


@dataclasses.dataclass(frozen=True)
class SupervisedPairs:
  """Prompt/response pairs of the JSONL file `data.corpus` (`data.sft`): the prompt is never noised."""

  needs_tokenizer = True

  def dataset(self, data, split, *, tokenizer, canvas_length, batch_size, seed, shard_index, shard_count,
              cache_dir):
    del cache_dir
    examples = sft.jsonl_examples(data["corpus"], tokenizer, split, prompt_length=data["prompt_length"],
                                  canvas_length=canvas_length, num_canvases=data["num_canvases"],
                                  validation_fraction=data["validation_fraction"], seed=seed)
    return sft.examples_dataset(examples, batch_size=batch_size, seed=seed, train=split == "train",
                                shard_index=shard_index, shard_count=shard_count)


TASKS: dict[str, Any] = {"lm": LanguageModelling(), "sft": SupervisedPairs()}


# The `projects` package installed with this one (beside it, as setup.py installs both): the only place a
# task named by a module path may come from. Resolved by location, not by the import path, on which the
# current folder often comes first (`python -m ...`, notebooks): a config saved in a workdir must never run
# a file that came with the workdir or lies in the folder the user happens to be in.
PROJECTS_DIR = pathlib.Path(__file__).resolve().parent.parent.parent / "projects"
_PROJECTS = "projects"


def _within(path, folder: pathlib.Path) -> bool:
  return path is not None and pathlib.Path(path).resolve().is_relative_to(folder)


def _project_task(name: str):
  """The `TASK` of the module `name` of the installed projects package; anything else refused by name,
  before anything is imported."""
  parts = name.split(".")
  allowed = (f"expected one of {tuple(TASKS)} or a module of the installed projects package "
             f"({PROJECTS_DIR}), e.g. 'projects.sudoku.task'")
  if len(parts) < 2 or parts[0] != _PROJECTS or not all(p.isidentifier() for p in parts):
    raise ValueError(f"Unknown config.data.task {name!r}; {allowed}.")
  package = sys.modules.get(_PROJECTS)
  origin = getattr(package, "__file__", None) if package else getattr(importlib.util.find_spec(_PROJECTS),
                                                                    "origin", None)
  if not _within(origin, PROJECTS_DIR):
    raise ValueError(f"config.data.task={name!r}: the 'projects' package on the import path is {origin}, not the "
                     f"installed one ({PROJECTS_DIR}); refusing to import a task from it.")
  try:
    spec = importlib.util.find_spec(name)
  except ImportError as e:
    raise ValueError(f"config.data.task={name!r}: cannot import that module ({e}).") from None
  if spec is None or not _within(spec.origin, PROJECTS_DIR):
    raise ValueError(f"config.data.task={name!r}: no such module in the installed projects package "
                     f"({PROJECTS_DIR}); {allowed}.")
  try:
    module = importlib.import_module(name)
  except ImportError as e:
    raise ValueError(f"config.data.task={name!r}: cannot import that module ({e}).") from None
  if not hasattr(module, "TASK"):
    raise ValueError(f"config.data.task={name!r}: the module defines no TASK.")
  return module.TASK


def task_kind(config):
  """The task object `config.data.task` names: a registry key, or a module of the installed `projects`
  package defining `TASK` (never a module found elsewhere on the import path, see `PROJECTS_DIR`)."""
  name = config.data.get("task", "lm")
  if not isinstance(name, str):
    raise ValueError(f"config.data.task={name!r} is not a task name; expected one of {tuple(TASKS)} or a module "
                     "path such as 'projects.sudoku.task'.")
  return TASKS[name] if name in TASKS else _project_task(name)


def tokenizer(config, workdir, *, train_if_missing: bool = False):
  """The tokenizer of `config` and `workdir` (`config.data.tokenizer_path`, else `workdir/tokenizer.model`;
  None for a task without one), checked against the model vocabulary and the token the noise must never
  produce. A missing `workdir/tokenizer.model` is an error, unless `train_if_missing` (training: it is
  trained on the corpus then; only process 0 trains it, the others wait for the file)."""
  if not task_kind(config).needs_tokenizer:
    return None
  source = init_from.source(config)
  config = init_from.resolve(config)
  if source and not config.data.tokenizer_path:  # none given, and the source has none
    raise ValueError(f"config.model.init_from={source!r} has no tokenizer (tokenizer.json or "
                     "tokenizer.model): name the one its vocabulary was made with, "
                     "--config.data.tokenizer_path=FILE (a tokenizer trained here would not match its ids).")
  model_cfg = models.model_config(config)
  mask = models.noise(config).never_token
  vocab_size = int(config.data.vocab_size)
  if mask is not None and not config.data.tokenizer_path:
    vocab_size = min(vocab_size, mask)
  data = config.data.to_dict()
  path = config.data.tokenizer_path or None
  if path is not None and pathlib.Path(path).name == hf_tokenizer.TOKENIZER_JSON:  # a checkpoint's own
    load = lambda: hf_tokenizer.CheckpointTokenizer(pathlib.Path(path).parent)
  else:
    load = lambda: data_lib.get_tokenizer(workdir, path, corpus_texts_fn=lambda: _corpus_split(data, "train"),
                                          vocab_size=vocab_size, train_if_missing=train_if_missing)
  if config.data.tokenizer_path or not train_if_missing:
    tok = load()
  elif parallel.is_main_process():  # trains workdir/tokenizer.model if missing; the others then read it
    tok = load()
    parallel.sync("tokenizer")
  else:
    parallel.sync("tokenizer")
    tok = load()
  if tok.vocab_size > model_cfg.vocab_size:
    raise ValueError(f"The tokenizer has {tok.vocab_size} pieces, more than "
                     f"model.vocab_size={model_cfg.vocab_size}.")
  if mask is not None and mask < tok.vocab_size:
    raise ValueError(f"The mask token {mask} of masked noise is a piece of the tokenizer "
                     f"({tok.vocab_size} pieces): set config.diffusion.mask_token_id to an id "
                     f">= {tok.vocab_size} below model.vocab_size, or use a smaller tokenizer.")
  return tok


def dataset(config, workdir, split: str, *, shard_index: int | None = None, shard_count: int | None = None,
            tok=None, train_tokenizer: bool = False):
  """The grain dataset of this process's shard of `split` (train: shuffled and repeated). Process i of n
  reads shard i of n, with batch_size / n rows per batch; `shard_index` / `shard_count` override that."""
  shard_count = jax.process_count() if shard_count is None else shard_count
  shard_index = jax.process_index() if shard_index is None else shard_index
  kind = task_kind(config)
  if kind.needs_tokenizer and tok is None:
    tok = tokenizer(config, workdir, train_if_missing=train_tokenizer)
  return kind.dataset(config.data.to_dict(), split, tokenizer=tok,
                      canvas_length=models.model_config(config).canvas_length,
                      batch_size=config.train.batch_size // shard_count, seed=config.train.seed,
                      shard_index=shard_index, shard_count=shard_count,
                      cache_dir=pathlib.Path(workdir) / CACHE_DIRNAME)


def lora_config(config) -> lora_lib.LoraConfig | None:
  """`config.train`'s LoRA settings (None: full training)."""
  rank = config.train.get("lora_rank", 0)
  if not rank:
    return None
  if not (config.train.get("init_from", "") or init_from.source(config)):
    raise ValueError(f"config.train.lora_rank={rank} trains adapters on frozen weights: set "
                     "config.train.init_from to a training workdir or a transformers checkpoint folder.")
  return lora_lib.LoraConfig(rank=rank, alpha=config.train.get("lora_alpha", 16.0))


def _check_batch(config) -> None:
  batch_size = config.train.batch_size
  sizes = parallel.mesh_shape(config.mesh)
  parallel.logical_rules(config.mesh)
  shards = math.prod(sizes[a] for a in parallel.BATCH_AXES)
  if batch_size % shards:
    raise ValueError(f"config.train.batch_size={batch_size} is not divisible by the {shards} batch "
                     f"shards of the mesh (data*fsdp*expert of {sizes}); use a multiple of {shards}.")
  processes = jax.process_count()
  if batch_size % processes:
    raise ValueError(f"config.train.batch_size={batch_size} is not divisible by the {processes} "
                     f"processes, which each read batch_size / {processes} rows.")
  if shards % processes:
    raise ValueError(f"The {shards} batch shards of the mesh (data*fsdp*expert of {sizes}) are not a "
                     f"multiple of the {processes} processes: each process feeds its own rows, so its "
                     "devices must hold their own part of the batch (move devices from tensor to data).")


def train_task(config, workdir, *, train_tokenizer: bool = True) -> training.Task:
  """`config` as a `training.Task` for `training.train(task, workdir)`: every section checked first. Its
  datasets train `workdir/tokenizer.model` if it is missing and `train_tokenizer` (training), else refuse.
  A `config.model.init_from` is resolved first (`build.init_from`): the task and the saved config are the
  resolved ones."""
  config = init_from.resolve(config)
  model_cfg = models.model_config(config)
  if model_cfg.quantize != "none":
    raise ValueError(f"config.model.quantize={model_cfg.quantize!r} is for inference: int8 weights get no "
                     "gradients. Train with quantize='none'; sample, serve or evaluate the checkpoint with "
                     f"--config.model.quantize={model_cfg.quantize}.")
  loss_cfg = models.loss(config)
  task_kind(config)
  loop = LoopSettings.from_mapping(config.train)
  optimizer = optim.OptimizerSettings.from_mapping(config.train)
  _check_batch(config)
  for name in ("prompt_length", "num_canvases"):
    if config.data[name] < 1:
      raise ValueError(f"config.data.{name} must be >= 1, got {config.data[name]}.")
  length = config.data.prompt_length + config.data.num_canvases * model_cfg.canvas_length
  if length > model_cfg.max_positions:
    raise ValueError(f"A sequence of prompt_length + num_canvases * canvas_length = {length} tokens "
                     f"exceeds model.max_positions={model_cfg.max_positions}.")
  return training.Task(
      model_config=model_cfg, loss=loss_cfg, optimizer=optimizer, loop=loop,
      datasets=lambda split: dataset(config, workdir, split, train_tokenizer=train_tokenizer),
      sequence_length=length,
      num_canvases=config.data.num_canvases, mesh=dict(config.mesh), lora=lora_config(config),
      init_from=config.train.get("init_from", ""), description=config_lib.to_json(config),
      description_defaults=config_lib.to_json(config_lib.base_config()))


def train(config, workdir):
  """`training.train(train_task(config, workdir), workdir)`: what scripts/train.py runs."""
  return training.train(train_task(config, workdir), workdir)


def evaluate(config, workdir, **kwargs):
  """`training.evaluate(train_task(config, workdir), workdir, ...)`: what scripts/evaluate.py runs."""
  return training.evaluate(train_task(config, workdir, train_tokenizer=False), workdir, **kwargs)

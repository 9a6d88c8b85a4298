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
import os
import pathlib
import sys
from typing import Any

import jax

from diffusiongemma import _files
from diffusiongemma import data as data_lib
from diffusiongemma import parallel
from diffusiongemma import training
from diffusiongemma.build import config as config_lib
from diffusiongemma.build import init_from
from diffusiongemma.build import models
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.data import prepared
from diffusiongemma.data import sft
from diffusiongemma.data import sources
from diffusiongemma.training import lora as lora_lib
from diffusiongemma.training import optim
from diffusiongemma.training.task import LoopSettings

CACHE_DIRNAME = "data_cache"


def _tokenizer_sample(data: dict) -> list[str]:
  """Training documents of `data.corpus` to train a tokenizer on: a bounded sample, not the whole corpus."""
  pairs = ("prompt", "response") if data.get("task", "lm") == "sft" else None
  source = sources.open_source(data["corpus"], text_field=data["text_field"], pairs=pairs)
  return sources.sample_documents(source, validation_fraction=data["validation_fraction"])


def _main_process_first(name: str, make) -> None:
  """Runs `make()` on process 0 while the others wait at the barrier `name`; an error of process 0 is raised
  there after the barrier, so that no process waits for it forever (the others then find nothing made)."""
  error = None
  if parallel.is_main_process():
    try:
      make()
    except Exception as e:  # pylint: disable=broad-except  (raised below, once every process is past the barrier)
      error = e
  parallel.sync(name)
  if error is not None:
    raise error


def prepared_corpus(data: dict, tokenizer, cache_dir, *, kind: str = "text"):
  """The prepared folder of `data.corpus`: the corpus itself when it is one (checked against `tokenizer`),
  else `cache_dir/prepared`, which process 0 prepares (once; a later run finds it done) while the others
  wait."""
  if prepared.is_prepared(data["corpus"]):
    manifest = prepared.read_manifest(data["corpus"], tokenizer)
    if manifest["kind"] != kind:
      raise ValueError(f"config.data.corpus={data['corpus']!r} holds prepared {manifest['kind']} data; this task "
                       f"(config.data.task={data.get('task', 'lm')!r}) reads {kind} data.")
    return _files.as_path(data["corpus"], "config.data.corpus")
  output = _files.as_path(cache_dir) / "prepared"
  _main_process_first("prepared_corpus", lambda: prepared.prepare(
      data["corpus"], output, tokenizer, kind=kind, validation_fraction=data["validation_fraction"],
      text_field=data["text_field"], threads=-1))
  if not prepared.is_prepared(output):
    raise ValueError(f"Process 0 could not prepare config.data.corpus={data['corpus']!r} into {output} (its log "
                     "says why); every process stops.")
  return output


@dataclasses.dataclass(frozen=True)
class LanguageModelling:
  """The corpus (`data.corpus`: 'stdlib', a folder of text files, a JSONL, parquet or datasets source, or a
  folder prepared by scripts/prepare_data.py) packed into windows of a prompt and `data.num_canvases`
  canvases (`data.pipeline`), read from its prepared token shards."""

  needs_tokenizer = True

  def dataset(self, data, split, *, tokenizer, canvas_length, batch_size, seed, shard_index, shard_count,
              cache_dir):
    stream = prepared.open_split(prepared_corpus(data, tokenizer, cache_dir), split)
    return data_lib.make_dataset(
        stream, None, prompt_length=data["prompt_length"],
        canvas_length=canvas_length, num_canvases=data["num_canvases"], batch_size=batch_size, seed=seed,
        train=split == "train", shard_index=shard_index, shard_count=shard_count)


@dataclasses.dataclass(frozen=True)
class SupervisedPairs:
  """Prompt/response pairs (`data.sft`; `data.corpus`: a JSONL, parquet or datasets source of `prompt` and
  `response` fields, or a folder prepared from one): the prompt is never noised."""

  needs_tokenizer = True

  def dataset(self, data, split, *, tokenizer, canvas_length, batch_size, seed, shard_index, shard_count,
              cache_dir):
    folder = prepared_corpus(data, tokenizer, cache_dir, kind="pairs")
    return sft.pairs_dataset(prepared.open_split(folder, split), prompt_length=data["prompt_length"],
                             canvas_length=canvas_length, num_canvases=data["num_canvases"],
                             eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, batch_size=batch_size, seed=seed,
                             train=split == "train", shard_index=shard_index, shard_count=shard_count,
                             source=f"{data['corpus']} ({split})")


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
  if path is None and prepared.is_prepared(data["corpus"]):  # the tokenizer it was made with
    path = _prepared_tokenizer(data["corpus"])
  if path is not None and pathlib.Path(path).name == hf_tokenizer.TOKENIZER_JSON:  # a checkpoint's own
    load = lambda train: hf_tokenizer.CheckpointTokenizer(pathlib.Path(path).parent)
  else:
    load = lambda train: data_lib.get_tokenizer(workdir, path, corpus_texts_fn=lambda: _tokenizer_sample(data),
                                                vocab_size=vocab_size, train_if_missing=train)
  if path or not train_if_missing:
    tok = load(False)
  else:  # process 0 trains workdir/tokenizer.model if missing; then every process reads it
    _main_process_first("tokenizer", lambda: load(True))
    tok = load(False)
  hf_tokenizer.check_fits(tok, model_cfg.vocab_size, "model.vocab_size")
  if mask is not None and mask < tok.vocab_size:
    raise ValueError(f"The mask token {mask} of masked noise is a piece of the tokenizer "
                     f"({tok.vocab_size} pieces): set config.diffusion.mask_token_id to an id "
                     f">= {tok.vocab_size} below model.vocab_size, or use a smaller tokenizer.")
  return tok


def _prepared_tokenizer(folder) -> str:
  manifest = prepared.read_manifest(folder)
  if "file" not in manifest["tokenizer"]:
    raise ValueError(f"The prepared corpus {folder!r} was made with a checkpoint's tokenizer (sha256 "
                     f"{manifest['tokenizer']['sha256']}): name it, --config.data.tokenizer_path=FILE.")
  return os.fspath(_files.as_path(folder, "config.data.corpus") / manifest["tokenizer"]["file"])


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
                      cache_dir=_files.as_path(workdir, "--workdir") / CACHE_DIRNAME)


def lora_config(config) -> lora_lib.LoraConfig | None:
  """`config.train`'s LoRA settings (None: full training, or a config without a train section)."""
  rank = config.train.get("lora_rank", 0) if "train" in config else 0
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
  accum = config.train.get("grad_accum_steps", 1)
  if isinstance(accum, int) and accum > 1 and batch_size % (shards * accum):
    raise ValueError(f"config.train.batch_size={batch_size} does not split into grad_accum_steps={accum} "
                     f"micro-batches over the {shards} batch shards of the mesh: use a multiple of "
                     f"{shards * accum}.")
  processes = jax.process_count()
  if batch_size % processes:
    raise ValueError(f"config.train.batch_size={batch_size} is not divisible by the {processes} "
                     f"processes, which each read batch_size / {processes} rows.")
  if shards % processes:
    raise ValueError(f"The {shards} batch shards of the mesh (data*fsdp*expert of {sizes}) are not a "
                     f"multiple of the {processes} processes: each process feeds its own rows, so its "
                     "devices must hold their own part of the batch (move devices from tensor to data).")


def training_model_config(config):
  """`models.model_config(config)` with the precision policy of training: master weights in
  `config.train.param_dtype` (float32 by default, whatever `config.model.param_dtype` says for inference),
  computing in `config.train.compute_dtype`. With LoRA the frozen base keeps `config.model.param_dtype`
  (it is never updated); the adapters are the master weights."""
  dtype = config.train.get("param_dtype", "float32")
  if dtype not in models.COMPUTE_DTYPES:
    raise ValueError(f"Unknown config.train.param_dtype {dtype!r}; expected one of {models.COMPUTE_DTYPES}.")
  model_cfg = models.model_config(config)
  return model_cfg if config.train.get("lora_rank", 0) else model_cfg.replace(param_dtype=dtype)


def train_task(config, workdir, *, train_tokenizer: bool = True) -> training.Task:
  """`config` as a `training.Task` for `training.train(task, workdir)`: every section checked first. Its
  datasets train `workdir/tokenizer.model` if it is missing and `train_tokenizer` (training), else refuse.
  A `config.model.init_from` is resolved first (`build.init_from`): the task and the saved config are the
  resolved ones."""
  config = init_from.resolve(config)
  model_cfg = training_model_config(config)
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

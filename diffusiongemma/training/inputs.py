"""From a config to the objects training and evaluation need: configs, tokenizer, datasets, the mesh.

Everything is validated here, before anything is written to the workdir, so that a bad config fails
with a message naming the field and loses nothing.
"""

from __future__ import annotations

import math
import os
import pathlib

import jax
import numpy as np
from jax.sharding import NamedSharding

from diffusiongemma import build
from diffusiongemma import data as data_lib
from diffusiongemma import parallel
from diffusiongemma.diffusion import loss as loss_lib
from diffusiongemma.diffusion import noise as noise_lib
from diffusiongemma.model import ModelConfig
from diffusiongemma.training import step as step_lib

CACHE_DIRNAME = "data_cache"


def validate(config) -> tuple[ModelConfig, loss_lib.LossConfig]:
  """Checks every section training reads; returns the model and loss configs (`build`'s)."""
  model_cfg = build.model_config(config)
  loss_cfg = build.loss(config)
  train = config.train
  if train.nan_policy not in step_lib.NAN_POLICIES:
    raise ValueError(f"Unknown config.train.nan_policy {train.nan_policy!r}; expected one of "
                     f"{step_lib.NAN_POLICIES}.")
  for name in ("batch_size", "log_every", "checkpoint_every", "keep_checkpoints"):
    if train[name] < 1:
      raise ValueError(f"config.train.{name} must be >= 1, got {train[name]}.")
  for name in ("num_steps", "warmup_steps", "eval_every", "eval_batches"):
    if train[name] < 0:
      raise ValueError(f"config.train.{name} must be >= 0, got {train[name]}.")
  sizes = parallel.mesh_shape(config.mesh)
  parallel.logical_rules(config.mesh)
  shards = math.prod(sizes[a] for a in parallel.BATCH_AXES)
  if train.batch_size % shards:
    raise ValueError(f"config.train.batch_size={train.batch_size} is not divisible by the {shards} batch "
                     f"shards of the mesh (data*fsdp*expert of {sizes}); use a multiple of {shards}.")
  processes = jax.process_count()
  if train.batch_size % processes:
    raise ValueError(f"config.train.batch_size={train.batch_size} is not divisible by the {processes} "
                     f"processes, which each read batch_size / {processes} rows.")
  if shards % processes:
    raise ValueError(f"The {shards} batch shards of the mesh (data*fsdp*expert of {sizes}) are not a "
                     f"multiple of the {processes} processes: each process feeds its own rows, so its "
                     "devices must hold their own part of the batch (move devices from tensor to data).")
  for name in ("prompt_length", "num_canvases"):
    if config.data[name] < 1:
      raise ValueError(f"config.data.{name} must be >= 1, got {config.data[name]}.")
  length = config.data.prompt_length + config.data.num_canvases * model_cfg.canvas_length
  if length > model_cfg.max_positions:
    raise ValueError(f"A sequence of prompt_length + num_canvases * canvas_length = {length} tokens "
                     f"exceeds model.max_positions={model_cfg.max_positions}.")
  return model_cfg, loss_cfg


def get_tokenizer(config, workdir, model_cfg: ModelConfig, noise: noise_lib.NoiseProcess) -> data_lib.Tokenizer:
  """The configured tokenizer, or `workdir/tokenizer.model` (trained on the train split if missing).

  The token the noise must never produce (masked noise: the mask token) must be outside the tokenizer:
  a tokenizer trained here gets at most that many pieces. Only process 0 trains it; the others wait for
  the file.
  """
  if config.data.get("task", "lm") == "sudoku":  # a token-level task: no tokenizer (data.sudoku)
    return None
  mask = noise.never_token
  vocab_size = int(config.data.vocab_size)
  if mask is not None and not config.data.tokenizer_path:
    vocab_size = min(vocab_size, mask)
  load = lambda: data_lib.get_tokenizer(
      workdir, config.data.tokenizer_path or None,
      corpus_texts_fn=lambda: load_split(config, "train"), vocab_size=vocab_size)
  if config.data.tokenizer_path:
    tokenizer = load()
  elif parallel.is_main_process():  # trains workdir/tokenizer.model if missing; the others then read it
    tokenizer = load()
    parallel.sync("tokenizer")
  else:
    parallel.sync("tokenizer")
    tokenizer = load()
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(f"The tokenizer has {tokenizer.vocab_size} pieces, more than "
                     f"model.vocab_size={model_cfg.vocab_size}.")
  if mask is not None and mask < tokenizer.vocab_size:
    raise ValueError(f"The mask token {mask} of masked noise is a piece of the tokenizer "
                     f"({tokenizer.vocab_size} pieces): set config.diffusion.mask_token_id to an id "
                     f">= {tokenizer.vocab_size} below model.vocab_size, or use a smaller tokenizer.")
  return tokenizer


def load_split(config, split: str) -> list[str]:
  return data_lib.load_corpus(config.data.corpus, split, text_field=config.data.text_field,
                              validation_fraction=config.data.validation_fraction)


def make_dataset(config, workdir, tokenizer, model_cfg: ModelConfig, split: str, *,
                 shard_index: int | None = None, shard_count: int | None = None):
  """The grain dataset of this process's shard of `split` (train: shuffled and repeated).

  Process i of n reads shard i of n, with batch_size / n rows per batch: its rows of every global
  batch. `shard_index` and `shard_count` override the process's (to rebuild another process's input).
  """
  shard_count = jax.process_count() if shard_count is None else shard_count
  shard_index = jax.process_index() if shard_index is None else shard_index
  if config.data.get("task", "lm") != "lm":  # supervised fine-tuning: prompt/response pairs (data.sft)
    return data_lib.sft.dataset_from_config(
        config, split, tokenizer=tokenizer, canvas_length=model_cfg.canvas_length,
        batch_size=config.train.batch_size // shard_count, shard_index=shard_index,
        shard_count=shard_count, cache_dir=pathlib.Path(workdir) / CACHE_DIRNAME)
  return data_lib.make_dataset(
      load_split(config, split), tokenizer, prompt_length=config.data.prompt_length,
      canvas_length=model_cfg.canvas_length, num_canvases=config.data.num_canvases,
      batch_size=config.train.batch_size // shard_count, seed=config.train.seed,
      train=split == "train", shard_index=shard_index, shard_count=shard_count,
      cache_dir=pathlib.Path(workdir) / CACHE_DIRNAME)


def to_global(batch, sharding: NamedSharding):
  """A process-local numpy batch (this process's rows) as global jax arrays in `sharding`."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


def workdir_path(workdir: os.PathLike | str) -> pathlib.Path:
  path = pathlib.Path(workdir)
  if path.exists() and not path.is_dir():
    raise ValueError(f"--workdir {str(path)!r} exists and is not a directory.")
  return path

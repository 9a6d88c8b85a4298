"""Evaluations of a training run's sampler, composed from its config: the generative-quality evaluation
(`evaluation.generative`) with its judges."""

from __future__ import annotations

import functools

from diffusiongemma import _files
from diffusiongemma import data as data_lib
from diffusiongemma.build import models
from diffusiongemma.build import tasks
from diffusiongemma.build import weights as weights_lib
from diffusiongemma.evaluation import generative
from diffusiongemma.model import DiffusionGemma, ModelConfig
from diffusiongemma.training import checkpoint


def load_judge(name: str, workdir, model_config: ModelConfig | None = None) -> generative.Judge:
  """The latest checkpoint of a training workdir as a judge; its model config comes from the workdir's
  config.json (so a baseline may differ from the writer), else `model_config`."""
  if checkpoint.latest_step(workdir) is None:
    raise FileNotFoundError(f"No checkpoint in {workdir}/{checkpoint.CHECKPOINT_DIRNAME} for the {name} judge: "
                            "train it first (e.g. scripts/train.py --config=configs/small_ar.py).")
  saved = weights_lib.workdir_config(workdir)
  if saved is not None:
    model_config = models.model_config(saved)
  if model_config is None:
    raise ValueError(f"{workdir}/{checkpoint.CONFIG_FILENAME} is missing and no model config was given for "
                     f"the {name} judge.")
  return generative.Judge(name, DiffusionGemma(model_config), checkpoint.load_params(workdir)[0])


def _workdir_tokenizer(workdir) -> bytes | None:
  """The serialized tokenizer a workdir trained with, when it can be found."""
  path = _files.as_path(workdir, "workdir") / data_lib.TOKENIZER_FILENAME
  saved = weights_lib.workdir_config(workdir)
  if saved is not None:
    path = _files.as_path(saved.data.get("tokenizer_path") or path, "data.tokenizer_path")
  return data_lib.Tokenizer(path).serialized if _files.present(path) else None


def generative_eval(config, workdir, *, baseline_workdir=None, num_samples: int = 16, batch_size: int = 8,
                    seed: int = 0) -> generative.GenerativeEval:
  """The run's latest weights writing continuations of `num_samples` validation prompts, judged by their own
  encoder and, with `baseline_workdir`, by an independently trained AR baseline of the same tokenizer."""
  if num_samples < 1 or batch_size < 1:
    raise ValueError(f"num_samples and batch_size must be >= 1, got {num_samples} and {batch_size}.")
  weights = weights_lib.load(config, workdir=workdir)
  tokenizer = tasks.tokenizer(config, workdir)
  judges = [generative.Judge("self", DiffusionGemma(weights.model_config), weights.variables)]
  if baseline_workdir:
    baseline = load_judge("baseline", baseline_workdir, weights.model_config)
    if baseline.model.config.vocab_size != weights.model_config.vocab_size:
      raise ValueError(f"The baseline in {baseline_workdir} has vocab_size {baseline.model.config.vocab_size}, "
                       f"the model {weights.model_config.vocab_size}: a judge must share the tokenizer.")
    other = _workdir_tokenizer(baseline_workdir)
    if other is not None and other != tokenizer.serialized:
      raise ValueError(f"The baseline in {baseline_workdir} was trained with another tokenizer; retrain "
                       f"it with --config.data.tokenizer_path=<the model's tokenizer.model>.")
    judges.append(baseline)
  data = config.data
  texts = data_lib.load_corpus(data.corpus, "validation", text_field=data.text_field,
                               validation_fraction=data.validation_fraction)
  length = data.prompt_length + data.num_canvases * weights.model_config.canvas_length
  prompts, following = generative.validation_prompts(texts, tokenizer, num_samples,
                                                     prompt_length=data.prompt_length, length=length)
  make_sampler = functools.partial(models.sampler, config, weights.model_config)
  return generative.GenerativeEval(make_sampler, weights.variables, tokenizer, judges, prompts, following,
                                   max_new_tokens=models.max_new_tokens(config), source=weights.source,
                                   batch_size=batch_size, seed=seed)

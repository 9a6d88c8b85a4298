"""The ml_collections layout shared by every config file and binary.

`configs/*.py` call `base_config(**model_fields)` and override what they need; `diffusiongemma.build` is the
one place that turns a config into objects (model config, noise, loss, sampler, training task). Every key
a binary may override is declared here: the sampler section holds `SamplerConfig`'s fields, the names of
its components and every registered component's parameters (`build/registry.py`).
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections

from diffusiongemma.build import registry
from diffusiongemma.sampling.config import SamplerConfig


def base_config(**model) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # quantize: 'int8' quantises a float checkpoint's matmul weights when it is loaded, for inference.
  config.model = ml_collections.ConfigDict({"quantize": "none", **model})

  config.data = ml_collections.ConfigDict()
  config.data.task = "lm"  # 'lm' (packed corpus) | 'sft' (prompt/response pairs) | 'projects.<name>.task'
  # 'stdlib', a folder of text files, a .jsonl / .parquet file, a datasets save_to_disk folder, or a folder
  # prepared by scripts/prepare_data.py (anything else is prepared into workdir/data_cache/prepared first)
  config.data.corpus = "stdlib"
  config.data.text_field = "text"  # for JSONL, parquet and datasets corpora
  config.data.tokenizer_path = ""  # empty: train one on the corpus into workdir/tokenizer.model
  config.data.vocab_size = 4096  # of a tokenizer trained here; must equal model.vocab_size
  config.data.prompt_length = 32
  config.data.num_canvases = 2
  config.data.validation_fraction = 0.02

  config.diffusion = ml_collections.ConfigDict()
  config.diffusion.noise = "uniform"  # 'uniform' (released) | 'masked' (absorbing state)
  config.diffusion.eps = 1e-4  # t ~ U(eps, 1 - eps)
  config.diffusion.self_conditioning_prob = 0.5
  config.diffusion.ar_loss_weight = 1.0
  config.diffusion.diffusion_loss_weight = 1.0  # 0: train the encoder alone (configs/small_ar.py)
  config.diffusion.ar_loss_on_prompt = True  # False: the AR loss on response targets only (SFT)
  config.diffusion.all_canvases = False  # train every canvas in one block-causal pass (BD3-LM style)
  config.diffusion.loss_weighting = "elbo"  # 'elbo' (masked noise: 1/t, a bound) | 'flat' (masked tokens alike)
  config.diffusion.certainty_weight = 0.0  # > 0: certainty forcing (entropy of right predictions, dParallel)
  config.diffusion.suffix_fraction = 0.0  # masked noise: share of examples whose canvases mask a suffix
  config.diffusion.mask_token_id = -1  # masked noise: -1 means model.vocab_size - 1

  config.train = ml_collections.ConfigDict()
  config.train.num_steps = 1000
  config.train.batch_size = 16  # global: split over every device
  config.train.learning_rate = 3e-3  # peak, after linear warmup; cosine decay to the end
  config.train.warmup_steps = 50
  config.train.final_learning_rate_ratio = 0.1  # the cosine ends at learning_rate * this
  config.train.adam_b1 = 0.9
  config.train.adam_b2 = 0.95
  config.train.weight_decay = 0.01  # decoupled (AdamW), matrices and embeddings only
  config.train.grad_clip = 1.0  # global norm; 0 disables
  # Precision policy: master weights (`param_dtype`) and Adam's moments float32; the model computes in
  # `compute_dtype`; `mu_dtype='bfloat16'` keeps Adam's first moment in bfloat16 (opt-in, saves memory).
  config.train.compute_dtype = "float32"  # or 'bfloat16'
  config.train.param_dtype = "float32"  # the master weights training keeps, whatever config.model.param_dtype
  config.train.mu_dtype = ""  # '' : the parameters' dtype; 'bfloat16': Adam's first moment in bfloat16
  config.train.grad_accum_steps = 1  # > 1: the batch in this many micro-batches, one update (exactly equal)
  config.train.nan_policy = "error"  # 'error' (stop, naming step and metric) | 'skip' (drop update)
  config.train.log_every = 10
  config.train.eval_every = 200  # also at step 0 of a fresh run; 0 disables
  config.train.eval_batches = 8
  config.train.checkpoint_every = 200
  config.train.keep_checkpoints = 3
  config.train.async_checkpointing = True
  config.train.time_budget_s = 0.0  # stop (and save) once time/train_s, summed over resumes, reaches this; 0: none
  config.train.seed = 0
  config.train.profile_steps = ""  # 'a,b': a jax.profiler trace of steps a..b into workdir/profile (TensorBoard)
  # Fine-tuning: start from these weights (a training workdir's latest checkpoint or a transformers
  # checkpoint folder; config.model must describe them) instead of a random initialisation.
  config.train.init_from = ""
  config.train.lora_rank = 0  # > 0: train LoRA adapters of this rank; the init_from weights stay frozen
  config.train.lora_alpha = 16.0  # the adapters' update is lora_alpha / lora_rank x A @ B

  config.sampler = sampler_section()

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # -1: every device not used by the other axes
  config.mesh.fsdp = 1
  config.mesh.expert = 1
  config.mesh.tensor = 1
  return config


def sampler_section() -> ml_collections.ConfigDict:
  """`config.sampler`: the released sampler (SamplerConfig's defaults, its components by name) and the
  parameters of every registered component, so each can be chosen and tuned from flags."""
  section = ml_collections.ConfigDict()
  for field in dataclasses.fields(SamplerConfig):
    if field.default is not None:  # None-valued fields cannot be overridden from flags
      section[field.name] = field.default
  section.stop_tokens = (1,)
  section.max_new_tokens = 64
  for kind, name in registry.RELEASED.items():
    section[kind] = name
  for key, default in registry.component_defaults().items():
    section[key] = default
  return section


def to_json(config) -> dict:
  """A ConfigDict (or mapping) as plain JSON values (tuples become lists)."""
  if hasattr(config, "to_json"):
    return json.loads(config.to_json())
  return json.loads(json.dumps(dict(config)))


def load_config_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file, outside absl (tests, notebooks)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top

  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"No config file {str(path)!r}.")
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)

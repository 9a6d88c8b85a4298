"""The lm-evaluation-harness model `diffusiongemma` (lm-eval 0.4.x: `pip install -e '.[eval]'`).

Importing this module registers the class; `scripts/lm_eval_harness.py` imports it and runs the harness's
own command line (lm-eval 0.4.13 finds no out-of-tree model through entry points, so a bare `lm_eval
--model diffusiongemma` cannot see it):

  python scripts/lm_eval_harness.py --model diffusiongemma \
      --model_args hf_checkpoint=DIR,batch_size=4 --tasks arc_easy

`--model_args` (comma-separated key=value; unknown keys are an error naming the known ones):
  hf_checkpoint=DIR             a transformers checkpoint folder: weights, tokenizer, generation defaults
  config=FILE[:ARG],workdir=W   a training config file and its workdir (latest checkpoint, its tokenizer);
                                workdir=W alone reads the config the run saved there
  preset=NAME                   sampler preset (`sampling.presets`: default, code, creative)
  dtype=auto|float32|bfloat16   weights and compute. auto, the default (as lm-eval's own HF model): a
                                checkpoint's own dtype (config.json's `dtype`, else its first floating-
                                point tensor's), a training run's config.train.compute_dtype
  batch_size=N, max_length=N, max_gen_toks=N, seed=N, likelihood=exact|elbo, elbo_samples=N, elbo_eps=X
                                (`evaluation.harness.HarnessSettings`)
  any SamplerConfig field       e.g. t_max=1.0,max_denoising_steps=16,entropy_bound=0.08
The harness always passes its own batch_size (--batch_size, default 1), device and max_batch_size:
model_args win over them; device and max_batch_size are ignored (JAX places the work on its default
device); batch_size=auto is refused (give a number).

`--apply_chat_template` renders the conversation in the project's Gemma 4 chat format
(`chat.format.render_prompt`), prefilling an empty thought when the checkpoint's template does; with
`add_generation_prompt=False` the last (model) turn is left open to be continued.

Projects with their own token layout add a `GenerationAdapter` factory to `ADAPTERS`
(`register_adapter`); a task then names it with `adapter: NAME` in its generation_kwargs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import lm_eval.models  # pylint: disable=unused-import  (the harness's own models stay registered)
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from safetensors import safe_open

from diffusiongemma import build
from diffusiongemma.build.config import load_config_file
from diffusiongemma.chat import format as chat_format
from diffusiongemma.evaluation import harness as harness_lib
from diffusiongemma.sampling import presets
from diffusiongemma.sampling.config import SamplerConfig
from diffusiongemma.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

# adapter name -> factory(model, tokenizer) -> evaluation.harness.GenerationAdapter
ADAPTERS: dict[str, Callable[[Any, Any], harness_lib.GenerationAdapter]] = {}
SETTINGS = tuple(f.name for f in dataclasses.fields(harness_lib.HarnessSettings))
SOURCES = ("hf_checkpoint", "config", "workdir")
IGNORED = ("device", "max_batch_size")
SAMPLER_FIELDS = tuple(f.name for f in dataclasses.fields(SamplerConfig))


def register_adapter(name: str, factory: Callable[[Any, Any], harness_lib.GenerationAdapter]) -> None:
  """Makes `adapter: name` in a task's generation_kwargs use `factory(model, tokenizer)`."""
  ADAPTERS[name] = factory


def _batch_size(value) -> int:
  if isinstance(value, str) and value.strip().isdigit():
    return int(value)
  if isinstance(value, int) and not isinstance(value, bool):
    return value
  raise ValueError(f"batch_size={value!r} is not supported: give a positive integer (no 'auto').")


def _config(path: str, workdir):
  """The config of `path` (FILE or FILE:ARG), or, with no path, the one a run saved in `workdir`."""
  if path is None:
    config = build.workdir_config(workdir)
    if config is None:
      raise FileNotFoundError(f"{workdir} holds no config.json of a training run: pass config=FILE too.")
    return config
  if pathlib.Path(path).is_file():
    return load_config_file(path)
  file, _, arg = str(path).partition(":")  # FILE:ARG, as config_flags takes it
  return load_config_file(file, arg or None)


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def checkpoint_dtype(folder) -> str:
  """The dtype a transformers checkpoint folder is computed in by default (transformers' and lm-eval's
  `dtype="auto"`): config.json's `dtype` (`torch_dtype` in older files), else the dtype of its first
  floating-point tensor."""
  folder = pathlib.Path(folder)
  if not folder.is_dir():
    raise FileNotFoundError(f"Checkpoint folder {str(folder)!r} does not exist.")
  config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
  for source in (config, config.get("text_config", {})):
    named = source.get("dtype") or source.get("torch_dtype")
    if isinstance(named, str) and named != "auto":
      return named.removeprefix("torch.")
  for file in sorted(folder.glob("*.safetensors")):
    with safe_open(file, "numpy") as handle:
      for key in handle.keys():
        stored = handle.get_slice(key).get_dtype()
        if stored in _SAFETENSORS_DTYPES:
          return _SAFETENSORS_DTYPES[stored]
  raise ValueError(f"dtype=auto: {folder} names no dtype in config.json and holds no floating-point tensor; "
                   "give dtype=float32 or dtype=bfloat16.")


@dataclasses.dataclass(frozen=True)
class Loaded:
  """What the harness runs: the model, its variables, tokenizer, sampler, a factory of samplers with
  changed settings, whether the chat template prefills an empty thought, and where it came from."""

  model: Any
  variables: Any
  tokenizer: Any
  sampler: Sampler
  make_sampler: Callable[..., Sampler]
  empty_thought: bool
  source: str


def load(*, hf_checkpoint=None, config=None, workdir=None, preset: str = "default", dtype: str = "auto",
         **sampler_overrides) -> Loaded:
  """The objects for `--model_args` (module docstring)."""
  auto = dtype in (None, "auto")
  if hf_checkpoint is not None and (config is not None or workdir is not None):
    raise ValueError("Give hf_checkpoint=DIR or config=FILE,workdir=W, not both.")
  if hf_checkpoint is not None:
    folder = str(hf_checkpoint)
    pretrained = build.pretrained(folder, preset=preset, dtype=checkpoint_dtype(folder) if auto else dtype,
                                  **sampler_overrides)
    sampler = pretrained.sampler
    make = lambda **changes: sampler.replace(config=sampler.config.replace(**changes))
    return Loaded(sampler.model, pretrained.weights.variables, pretrained.tokenizer, sampler, make,
                  chat_format.template_prefills_empty_thought(folder), pretrained.weights.source)
  if workdir is None:
    raise ValueError("--model_args needs hf_checkpoint=DIR, or config=FILE with workdir=W (or workdir=W "
                     "of a training run).")
  cfg = _config(config, workdir)
  if not auto:
    cfg.train.compute_dtype = dtype
  weights = build.load(cfg, workdir=workdir)
  overrides = {**presets.preset_overrides(preset), **sampler_overrides}
  sampler = build.sampler(cfg, weights.model_config, **overrides)
  make = lambda **changes: build.sampler(cfg, weights.model_config, **{**overrides, **changes})
  return Loaded(sampler.model, weights.variables, build.tokenizer(cfg, workdir), sampler, make, False,
                weights.source)


def render_chat(history, tokenizer, *, add_generation_prompt: bool = True, empty_thought: bool = False) -> str:
  """A harness conversation in the Gemma 4 chat format (module docstring)."""
  missing = [t for t in (chat_format.TURN_OPEN, chat_format.TURN_CLOSE) if t not in getattr(tokenizer, "control_ids", {})]
  if missing:
    raise ValueError(f"--apply_chat_template needs a tokenizer with the Gemma 4 control tokens; {tokenizer!r} "
                     f"lacks {missing} (a training workdir's tokenizer has none).")
  bos = tokenizer.special_tokens.get(tokenizer.bos_id, "<bos>")
  messages = list(history)
  last = messages[-1] if messages else {}
  if add_generation_prompt or last.get("role") not in ("model", "assistant"):
    return chat_format.render_prompt(messages, add_generation_prompt=add_generation_prompt,
                                     empty_thought=empty_thought, bos_token=bos)
  head = chat_format.render_prompt(messages[:-1], add_generation_prompt=False, bos_token=bos) if messages[:-1] else bos
  return f"{head}{chat_format.TURN_OPEN}model\n{last['content'].strip()}"


@register_model("diffusiongemma")
class DiffusionGemmaLM(LM):
  """lm-eval's model interface on `evaluation.harness.Harness` (module docstring)."""

  def __init__(self, **model_args):
    super().__init__()
    known = SOURCES + ("preset", "dtype") + SETTINGS + SAMPLER_FIELDS + IGNORED
    unknown = sorted(set(model_args) - set(known))
    if unknown:
      raise ValueError(f"Unknown diffusiongemma model_args {unknown}; known: {sorted(known)}.")
    args = {k: v for k, v in model_args.items() if k not in IGNORED}
    if "batch_size" in args:
      args["batch_size"] = _batch_size(args["batch_size"])
    settings = harness_lib.HarnessSettings(**{k: args.pop(k) for k in SETTINGS if k in args})
    sampler_args = {k: (tuple(v) if isinstance(v, list) else v) for k, v in args.items() if k in SAMPLER_FIELDS}
    if isinstance(sampler_args.get("stop_tokens"), str):  # several ids: stop_tokens=1|106
      sampler_args["stop_tokens"] = tuple(int(t) for t in sampler_args["stop_tokens"].split("|"))
    self.loaded = loaded = load(**{k: v for k, v in args.items() if k not in SAMPLER_FIELDS}, **sampler_args)
    adapters = {name: factory(loaded.model, loaded.tokenizer) for name, factory in ADAPTERS.items()}
    self.harness = harness_lib.Harness(loaded.model, loaded.variables, loaded.tokenizer, loaded.sampler, settings,
                                       make_sampler=loaded.make_sampler, adapters=adapters)
    logger.info("diffusiongemma: %s; sampler %s", loaded.source, loaded.sampler.settings())

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: Mapping | None = None):
    return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: Mapping, additional_config: Mapping | None = None):
    """model_args win over the harness's own batch_size/device/max_batch_size (which it always passes)."""
    harness_args = {k: v for k, v in (additional_config or {}).items() if v is not None}
    return cls(**{**harness_args, **arg_dict})

  # --- the harness's properties
  @property
  def max_length(self) -> int:
    return self.harness.max_length

  @property
  def max_gen_toks(self) -> int:
    return self.harness.settings.max_gen_toks

  @property
  def batch_size(self) -> int:
    return self.harness.settings.batch_size

  @property
  def tokenizer_name(self) -> str:
    return f"diffusiongemma:{self.loaded.source}"

  def chat_template(self, chat_template: bool | str = False) -> str:
    return "Gemma 4 chat format (diffusiongemma.chat.format)"

  def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
    return render_chat(chat_history, self.loaded.tokenizer, add_generation_prompt=add_generation_prompt,
                       empty_thought=self.loaded.empty_thought)

  # --- requests
  def _answer(self, kind: str, requests, results):
    for request, result in zip(requests, results):
      self.cache_hook.add_partial(kind, request.args, result)
    return results

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    return self._answer("loglikelihood", requests, self.harness.loglikelihood([r.args for r in requests]))

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    texts = [r.args[0] for r in requests]
    return self._answer("loglikelihood_rolling", requests, self.harness.loglikelihood_rolling(texts))

  def generate_until(self, requests, disable_tqdm: bool = False):
    return self._answer("generate_until", requests, self.harness.generate_until([r.args for r in requests]))

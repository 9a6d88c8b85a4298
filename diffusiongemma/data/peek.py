r"""What a process trains on: the windows process I of N reads in the first K steps, decoded.

  python -m diffusiongemma.data.peek --config=configs/tiny.py --config.data.corpus=/data/prepared \
      --process_index=0 --process_count=4 --steps=2 --output=peek.json

writes `{"steps": [{"step": k, "windows": [global window index per row], "text": [...]}], ...}`: the audit of
what a run saw. The corpus must be prepared (`config.data.corpus` a prepared folder, or a `--workdir` whose
training prepared it); the batch size, seed and sequence layout are the config's.
"""

import json
import pathlib
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from diffusiongemma import _files
from diffusiongemma.data import hf_tokenizer
from diffusiongemma.data import pipeline
from diffusiongemma.data import prepared
from diffusiongemma.data import tokenizer as sp_tokenizer
from diffusiongemma.model import ModelConfig

_CONFIG = config_flags.DEFINE_config_file("config", None, "The training config.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "A workdir whose training prepared a raw corpus (data_cache).")
_PROCESS_INDEX = flags.DEFINE_integer("process_index", 0, "The process to show.")
_PROCESS_COUNT = flags.DEFINE_integer("process_count", 1, "Processes in the run.")
_STEPS = flags.DEFINE_integer("steps", 1, "Steps from the start.")
_SPLIT = flags.DEFINE_enum("split", "train", ["train", "validation"], "The split.")
_OUTPUT = flags.DEFINE_string("output", None, "Write the JSON here (default: print it).")
flags.mark_flags_as_required(["config"])


def _folder(data, workdir):
  if prepared.is_prepared(data.corpus):
    return _files.as_path(data.corpus, "config.data.corpus")
  if workdir and prepared.is_prepared(_files.as_path(workdir, "--workdir") / "data_cache" / "prepared"):
    return _files.as_path(workdir, "--workdir") / "data_cache" / "prepared"
  raise ValueError(f"config.data.corpus={data.corpus!r} is not a prepared folder and no --workdir holds its "
                   "preparation: run scripts/prepare_data.py, or train once in --workdir.")


def _tokenizer(data, folder, manifest: dict):
  if data.tokenizer_path:
    path = pathlib.Path(data.tokenizer_path)
    if path.name == hf_tokenizer.TOKENIZER_JSON:
      return hf_tokenizer.CheckpointTokenizer(path.parent)
    return sp_tokenizer.Tokenizer(path)
  if "file" in manifest["tokenizer"]:
    return sp_tokenizer.Tokenizer(folder / manifest["tokenizer"]["file"])
  raise ValueError(f"{folder} was made with a checkpoint's tokenizer: name it, --config.data.tokenizer_path=FILE.")


def peek(config, *, process_index: int, process_count: int, steps: int, split: str = "train",
         workdir=None) -> dict:
  """The windows (and their text) that process `process_index` of `process_count` reads at steps 0..steps-1."""
  data = config.data
  if data.get("task", "lm") != "lm":
    raise ValueError(f"peek shows windows of the packed corpus (config.data.task='lm'), not {data.task!r}.")
  if config.train.batch_size % process_count:
    raise ValueError(f"config.train.batch_size={config.train.batch_size} is not divisible by "
                     f"process_count={process_count}.")
  folder = _folder(data, workdir)
  manifest = prepared.read_manifest(folder)
  tokenizer = _tokenizer(data, folder, manifest)
  prepared.read_manifest(folder, tokenizer)
  canvas = config.model.get("canvas_length", ModelConfig.__dataclass_fields__["canvas_length"].default)
  batches = pipeline.make_dataset(
      prepared.open_split(folder, split, manifest=manifest), None, prompt_length=data.prompt_length,
      canvas_length=canvas, num_canvases=data.num_canvases, batch_size=config.train.batch_size // process_count,
      seed=config.train.seed, train=split == "train", shard_index=process_index, shard_count=process_count)
  out = []
  for step, batch in zip(range(steps), iter(batches)):
    out.append({"step": step, "windows": batches.items(step).tolist(),
                "text": [tokenizer.decode(row) for row in batch["tokens"]]})
  return {"corpus": str(folder), "split": split, "process_index": process_index, "process_count": process_count,
          "global_batch_size": config.train.batch_size, "seed": config.train.seed,
          "num_windows": batches.num_items, "steps": out}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    result = peek(_CONFIG.value, process_index=_PROCESS_INDEX.value, process_count=_PROCESS_COUNT.value,
                  steps=_STEPS.value, split=_SPLIT.value, workdir=_WORKDIR.value)
  except (ValueError, OSError) as e:
    sys.exit(f"peek: {e}")
  text = json.dumps(result, indent=1, ensure_ascii=False)
  if _OUTPUT.value:
    pathlib.Path(_OUTPUT.value).write_text(text, encoding="utf-8")
  else:
    print(text)


if __name__ == "__main__":
  app.run(main)

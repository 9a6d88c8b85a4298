r"""The distillation targets of the text project: the model's own autoregressive greedy continuations of
corpus prompts, made in batches by `dg.ARSampler` (temperature 0) and cached on disk with their provenance.

A teacher folder holds, per split, `<split>-<part>.npz` files (`prompts` [n, P] and `continuations`
[n, M], int32; a continuation is pad after its first stop token, as `ARSampler` returns it) and one
`provenance.json`: the teacher's weights (workdir, step, a hash of the parameters), the prompts' source
(split, seed, length), the decoding, the commit and the seconds each part took. A run that stops part-way
resumes at the first missing part; a folder made by other weights or settings is refused, never mixed.

  python -m projects.text.teacher --workdir=W --output=DIR [--num_prompts=N] [--num_validation=N]
"""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import subprocess
import time

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np

import diffusiongemma as dg
from diffusiongemma import _files
from diffusiongemma import build
from diffusiongemma import data as data_lib

PROVENANCE = "provenance.json"
SPLITS = ("train", "validation")


def params_hash(variables) -> str:
  """sha256 (first 16 hex digits) of every parameter's bytes, in path order."""
  digest = hashlib.sha256()
  for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(variables)[0], key=lambda x: str(x[0])):
    digest.update(str(path).encode())
    digest.update(np.asarray(leaf).tobytes())
  return digest.hexdigest()[:16]


def corpus_prompts(stream: np.ndarray, num_prompts: int, prompt_length: int, seed: int) -> np.ndarray:
  """`num_prompts` windows of `prompt_length` tokens [N, P] at seeded random offsets of a token stream."""
  if stream.size < prompt_length + 1:
    raise ValueError(f"The token stream has {stream.size} tokens, too few for prompts of {prompt_length}.")
  starts = np.random.default_rng(seed).integers(0, stream.size - prompt_length, size=num_prompts)
  return np.stack([stream[s:s + prompt_length] for s in starts]).astype(np.int32)


def greedy_continuations(sampler: dg.ARSampler, variables, prompts: np.ndarray, max_new_tokens: int,
                         batch_size: int) -> np.ndarray:
  """`sampler`'s greedy continuations [N, M] of `prompts` [N, P], `batch_size` rows at a time (the last
  batch padded with copies of its last row, so one program serves every batch)."""
  out = []
  for start in range(0, len(prompts), batch_size):
    chunk = prompts[start:start + batch_size]
    real = len(chunk)
    if real < batch_size:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, axis=0)])
    result = sampler.generate(variables, chunk, jax.random.key(0), max_new_tokens, temperature=0.0)
    out.append(np.asarray(result.tokens)[:real])
  return np.concatenate(out).astype(np.int32)


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                          cwd=pathlib.Path(__file__).parent).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def make(workdir, output, *, num_prompts: int, num_validation: int = 256, max_new_tokens: int | None = None,
         batch_size: int = 64, part_size: int = 1024, seed: int = 0) -> dict:
  """Writes (or completes) the teacher folder `output` for the latest checkpoint of `workdir`; returns its
  provenance. Prompts have the run's `config.data.prompt_length` tokens; continuations
  `num_canvases * canvas_length` (the training layout) unless `max_new_tokens` says otherwise."""
  config = build.workdir_config(workdir)
  if config is None:
    raise FileNotFoundError(f"{workdir!r} holds no training run (no config.json): train the teacher first.")
  weights = build.load(config, workdir=workdir)
  model = dg.DiffusionGemma(weights.model_config)
  tok = build.tokenizer(config, workdir)
  prompt_length = int(config.data.prompt_length)
  max_new_tokens = max_new_tokens or int(config.data.num_canvases) * weights.model_config.canvas_length
  sizes = {"train": num_prompts, "validation": num_validation}
  provenance = {
      "teacher": {"workdir": str(workdir), "weights": weights.source, "params_sha256": params_hash(weights.variables)},
      "decoding": {"sampler": "ARSampler", "temperature": 0.0, "max_new_tokens": max_new_tokens,
                   "stop_tokens": [int(tok.eos_id)], "batch_size": batch_size},
      "prompts": {"source": f"config.data.corpus={config.data.corpus!r}", "prompt_length": prompt_length,
                  "seed": seed, "sizes": sizes, "part_size": part_size},
      "commit": _commit(), "parts": {}}
  output = pathlib.Path(output)
  output.mkdir(parents=True, exist_ok=True)
  path = output / PROVENANCE
  if path.is_file():
    saved = json.loads(path.read_text())
    for key in ("teacher", "decoding", "prompts"):
      if saved.get(key) != provenance[key]:
        raise ValueError(f"{output} holds a teacher set made with other {key} ({saved.get(key)} != "
                         f"{provenance[key]}): use another --output.")
    provenance["parts"] = saved.get("parts", {})
  sampler = dg.ARSampler(model, stop_tokens=(tok.eos_id,), prompt_bucket=prompt_length)
  texts = {split: data_lib.load_corpus(config.data.corpus, split, text_field=config.data.text_field,
                                       validation_fraction=config.data.validation_fraction)
           for split in SPLITS}
  for split in SPLITS:
    stream = data_lib.tokenize_corpus(texts[split], tok, pathlib.Path(workdir) / "data_cache")
    prompts = corpus_prompts(stream, sizes[split], prompt_length, seed + SPLITS.index(split))
    for part, start in enumerate(range(0, sizes[split], part_size)):
      name = f"{split}-{part:05d}.npz"
      if name in provenance["parts"] and (output / name).is_file():
        continue
      begin = time.perf_counter()
      chunk = prompts[start:start + part_size]
      continuations = greedy_continuations(sampler, weights.variables, chunk, max_new_tokens, batch_size)
      buffer = io.BytesIO()
      np.savez(buffer, prompts=chunk, continuations=continuations)
      _files.atomic_write(output / name, buffer.getvalue())
      provenance["parts"][name] = {"rows": len(chunk), "seconds": round(time.perf_counter() - begin, 2)}
      _files.atomic_write(path, (json.dumps(provenance, indent=2) + "\n").encode())
      logging.info("%s: %d greedy continuations in %.1f s", name, len(chunk), provenance["parts"][name]["seconds"])
  return provenance


def load(folder, split: str) -> tuple[np.ndarray, np.ndarray]:
  """(prompts [N, P], continuations [N, M]) of `split` of a teacher folder, in part order."""
  folder = pathlib.Path(folder)
  if split not in SPLITS:
    raise ValueError(f"Unknown split {split!r}; expected one of {SPLITS}.")
  if not (folder / PROVENANCE).is_file():
    raise FileNotFoundError(f"{folder} is not a teacher folder (no {PROVENANCE}): make one with "
                            "`python -m projects.text.teacher --workdir=W --output=DIR`.")
  parts = sorted(json.loads((folder / PROVENANCE).read_text())["parts"])
  parts = [p for p in parts if p.startswith(f"{split}-")]
  if not parts:
    raise ValueError(f"{folder} has no {split} continuations.")
  arrays = [np.load(folder / p) for p in parts]
  return (np.concatenate([a["prompts"] for a in arrays]), np.concatenate([a["continuations"] for a in arrays]))


def provenance(folder) -> dict:
  return json.loads((pathlib.Path(folder) / PROVENANCE).read_text())


def main(argv):
  del argv
  f = flags.FLAGS
  result = make(f.workdir, f.output, num_prompts=f.num_prompts, num_validation=f.num_validation,
                batch_size=f.batch_size, seed=f.seed)
  rows = sum(p["rows"] for p in result["parts"].values())
  seconds = sum(p["seconds"] for p in result["parts"].values())
  print(f"{f.output}: {rows} greedy continuations in {seconds:.0f} s")


if __name__ == "__main__":  # flags only here: the task imports this module inside scripts/train.py
  flags.DEFINE_string("workdir", None, "The teacher: a training workdir (its latest checkpoint).")
  flags.DEFINE_string("output", None, "The teacher folder to write or complete.")
  flags.DEFINE_integer("num_prompts", 10240, "Training prompts.")
  flags.DEFINE_integer("num_validation", 256, "Validation prompts.")
  flags.DEFINE_integer("batch_size", 64, "Rows per ARSampler call.")
  flags.DEFINE_integer("seed", 0, "Seed of the prompts' offsets.")
  flags.mark_flags_as_required(["workdir", "output"])
  app.run(main)

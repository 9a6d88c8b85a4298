r"""The text project's held-out prompt sets, written once as JSONL (`projects/text/prompts/`).

Each prompt is a run of whole lines (at least `min_chars` characters, ending with a newline) from a file
that no training run reads:
- `validation.jsonl`: files of the corpus's validation split (Python's standard library, `data.corpus`'s
  seeded split), the even-numbered ones;
- `packages.jsonl`: Python files of installed packages outside the standard library (numpy, jax, flax,
  optax, absl, ml_collections), with the package's version;
- `dev.jsonl`: the odd-numbered validation files and two other packages (setuptools, pip): the set the
  decoding settings are chosen on, so the two test sets above are never used to choose anything.
Each record is `{"prompt": text, "source": where it came from}`.

  python -m projects.text.heldout [--output=projects/text/prompts]
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
import sysconfig

from absl import app
from absl import flags
import numpy as np

from diffusiongemma.data import corpus

TEST_PACKAGES = ("numpy", "jax", "flax", "optax", "absl", "ml_collections")
DEV_PACKAGES = ("setuptools", "pip")


def snippet(text: str, rng: np.random.Generator, min_chars: int = 320, max_lines: int = 40) -> str | None:
  """Consecutive whole lines of `text` from a random line, until `min_chars` (None if the text is short)."""
  lines = text.splitlines(keepends=True)
  if len(text) < 2 * min_chars or len(lines) < 8:
    return None
  start = int(rng.integers(0, max(1, len(lines) - max_lines)))
  out = ""
  for line in lines[start:start + max_lines]:
    out += line
    if len(out) >= min_chars and line.endswith("\n"):
      return out
  return None


def _package_files(name: str) -> tuple[list[pathlib.Path], str]:
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    raise ValueError(f"Package {name!r} is not installed.")
  root = pathlib.Path(list(spec.submodule_search_locations)[0])
  files = sorted(p for p in root.rglob("*.py") if "test" not in str(p.relative_to(root)).lower())
  try:
    version = importlib.metadata.version(name.replace("_", "-"))
  except importlib.metadata.PackageNotFoundError:
    version = "unknown"
  return files, f"{name} {version}"


def _from_files(files, label, count, rng, root=None, rounds: int = 8) -> list[dict]:
  """`count` distinct snippets of `files`, one per file per round in a seeded order (a small set of files
  gives several snippets each)."""
  out, seen = [], set()
  for _ in range(rounds):
    for index in rng.permutation(len(files)):
      if len(out) == count:
        return out
      path = files[int(index)]
      try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
      except (UnicodeDecodeError, OSError):
        continue
      piece = snippet(text, rng)
      if piece is not None and piece not in seen:
        seen.add(piece)
        where = pathlib.Path(path).relative_to(root) if root else pathlib.Path(path).name
        out.append({"prompt": piece, "source": f"{label}: {where}"})
  return out


def prompt_sets(seed: int = 0, per_set: int = 64) -> dict[str, list[dict]]:
  rng = np.random.default_rng(seed)
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])  # the split of data.load_corpus("stdlib", ...)
  _, paths = corpus.split_files(corpus.stdlib_files(), root=root)
  sets = {"validation": _from_files(paths[0::2], "stdlib validation split", per_set, rng, root)}
  packages, dev = [], _from_files(paths[1::2], "stdlib validation split", per_set // 4, rng, root)
  for name in TEST_PACKAGES:
    files, label = _package_files(name)
    packages += _from_files(files, label, per_set // len(TEST_PACKAGES) + 1, rng)
  for name in DEV_PACKAGES:
    files, label = _package_files(name)
    dev += _from_files(files, label, per_set // 4, rng)
  sets["packages"] = packages[:per_set]
  sets["dev"] = dev
  return sets


def main(argv):
  del argv
  out = pathlib.Path(flags.FLAGS.output)
  out.mkdir(parents=True, exist_ok=True)
  for name, records in prompt_sets().items():
    (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{out / name}.jsonl: {len(records)} prompts")


if __name__ == "__main__":
  flags.DEFINE_string("output", str(pathlib.Path(__file__).parent / "prompts"), "Where the JSONL files go.")
  app.run(main)

"""Prints, as JSON, the absl flags each binary named on the command line defines (`scripts/x.py` or a
module name), importing them one after another in this process: null for a binary that defines none (it
parses its own arguments), else its flags and those it requires; under "*" the libraries' flags, which every
absl binary parses too. Used by tests/test_docs_commands.py."""

import importlib
import importlib.util
import json
import pathlib
import sys

from absl import flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
_LIBRARIES = ("absl", "grain", "array_record", "orbax", "jax", "etils", "lm_eval")


def _import(binary: str):
  if binary.endswith(".py"):
    path = ROOT / binary
    spec = importlib.util.spec_from_file_location("_doc_binary_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would (dataclasses look their module up there)
    spec.loader.exec_module(module)  # its `if __name__ == "__main__"` part does not run
  else:
    importlib.import_module(binary)


def main(binaries):
  sys.path.insert(0, str(ROOT))
  found = {}
  for binary in binaries:
    before = set(flags.FLAGS)
    _import(binary)
    new = {name: flags.FLAGS.find_module_defining_flag(name) or "" for name in set(flags.FLAGS) - before}
    ours = sorted(n for n, module in new.items() if not module.startswith(_LIBRARIES))
    required = sorted(n for n in ours if any("must have a value other than None" in getattr(v, "message", "")
                                             for v in flags.FLAGS[n].validators))
    found[binary] = {"flags": ours, "required": required} if ours else None
    for name in ours:  # the next binary may define flags of the same names
      delattr(flags.FLAGS, name)
  found["*"] = sorted(flags.FLAGS)  # absl's, grain's, ...: every binary parses these too
  print(json.dumps(found))


if __name__ == "__main__":
  main(sys.argv[1:])

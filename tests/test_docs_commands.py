"""Every `python ...` command in README.md, docs/*.md and projects/*/README.md names a binary that exists, flags
it defines, the flags it requires, a config file that loads (with its `:ARG`) and `--config.a.b` overrides that
are fields of that config, with `--config` given wherever an override is. The commands are parsed, not run:
running them is the other tests' work (train, sample, serve, convert, ... at tiny size); this keeps each
documented spelling from drifting away from the code."""

import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from diffusiongemma.build.config import load_config_file

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("projects/*/README.md"))]
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE = re.compile(r"`(python [^`]+)`")
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def _split(line: str) -> list[list[str]]:
  """The words of each command of a shell line (split at unquoted `&&`, `;` and `|`; comments dropped)."""
  lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
  lexer.whitespace_split = True
  commands, words = [], []
  for token in lexer:
    if set(token) <= set(";&|"):
      commands, words = commands + [words], []
    else:
      words.append(token)
  return [c for c in commands + [words] if c]


def _commands(text: str) -> list[str]:
  """The `python ...` commands of a page: in code blocks (backslash continuations joined) and in inline
  code spans; the environment assignments before them dropped."""
  lines = []
  for block in _FENCE.findall(text):
    lines += re.sub(r"\\\n\s*", " ", "\n".join(block.splitlines()[1:-1])).splitlines()
  lines += _INLINE.findall(_FENCE.sub("", text))
  commands = []
  for line in lines:
    if "python " not in line or line.lstrip().startswith((">>>", "import ", "from ")):
      continue
    for words in _split(line):
      while words and _ENV.match(words[0]):
        words = words[1:]
      if words[:1] == ["python"] and words[1:3] not in (["-m", "pytest"], ["-m", "pip"]):
        commands.append(shlex.join(words))
  return commands


def _binary(words: list[str]) -> tuple[str, list[str]]:
  """(the binary: a file path or a module name, its arguments) of `python ...`."""
  if words[1] == "-m":
    return words[2], words[3:]
  return words[1], words[2:]


def _exists(binary: str) -> bool:
  if binary.endswith(".py"):
    return (ROOT / binary).is_file()
  path = ROOT / binary.replace(".", "/")
  return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


DOCUMENTED = [(page.relative_to(ROOT).as_posix(), command) for page in PAGES for command in _commands(page.read_text())]


@pytest.fixture(scope="module")
def binary_flags():
  binaries = sorted({_binary(shlex.split(c))[0] for _, c in DOCUMENTED if _exists(_binary(shlex.split(c))[0])})
  result = subprocess.run([sys.executable, str(ROOT / "tests" / "_binary_flags.py"), *binaries],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env={"JAX_PLATFORMS": "cpu",
                                                                                      "PATH": "/usr/bin:/bin"})
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def _options(args: list[str]) -> dict[str, str | None]:
  """`--name[=value]` options of `args`, by name (the value, or None for a bare flag)."""
  options = {}
  for arg in args:
    if arg.startswith("-") and not re.fullmatch(r"-?\d+(\.\d+)?", arg):
      name, eq, value = arg.lstrip("-").partition("=")
      options[name] = value if eq else None
  return options


def _field(config, path: str) -> bool:
  node = config
  for key in path.split("."):
    if not hasattr(node, "keys") or key not in node.keys():
      return False
    node = node[key]
  return True


def test_the_pages_document_commands():
  pages = {page for page, _ in DOCUMENTED}
  assert len(DOCUMENTED) > 60 and {"README.md", "docs/training.md", "docs/serving.md"} <= pages, pages


@pytest.mark.parametrize("page, command", DOCUMENTED, ids=[f"{p}:{c[:60]}" for p, c in DOCUMENTED])
def test_a_documented_command_names_real_flags_and_config_fields(page, command, binary_flags):
  binary, args = _binary(shlex.split(command))
  assert _exists(binary), f"{page}: {command!r}: no {binary}"
  found = binary_flags.get(binary)
  if found is None:  # it parses its own arguments (lm-eval's command line, a test's --measure)
    return
  options = _options(args)
  known = set(found["flags"]) | set(binary_flags["*"])
  for name in options:
    if name.startswith("config."):
      continue
    bare = name[2:] if name.startswith("no") else name
    assert name in known or (options[name] is None and bare in known), (
        f"{page}: {command!r}: {binary} has no flag --{name}")
  if "help" not in options and "helpfull" not in options:
    missing = [f"--{n}" for n in found["required"] if n not in options]
    assert not missing, f"{page}: {command!r}: {binary} requires {missing}"
  overrides = [n[len("config."):] for n in options if n.startswith("config.")]
  if overrides:
    assert options.get("config"), f"{page}: {command!r}: --config.* overrides without --config"
  file, _, arg = (options.get("config") or "").partition(":")
  if not file or file.endswith(".json") or not (ROOT / file).parent.is_dir() or file.startswith("/"):
    return  # none, a run's saved config.json, or a placeholder path of the reader's
  assert (ROOT / file).is_file(), f"{page}: {command!r}: no config file {file}"
  config = load_config_file(ROOT / file, arg or None)
  unknown = [o for o in overrides if not _field(config, o)]
  assert not unknown, f"{page}: {command!r}: {file} has no field {unknown}"

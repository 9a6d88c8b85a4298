"""Checks that each number the README, the docs pages and the projects' READMEs take from an artefact equals the
value in that JSON, and that their relative links lead somewhere.

The convention: such a number is written as a link to its JSON under `results/` (from a page in docs/,
`../results/...`), with a JSON pointer to the value as the fragment, e.g. in a table cell

    | 16 fixed steps | 1 | [141](results/benchmark_vs_transformers.json#/runs/0/ours_tokens_per_second) |

- the pointer's segments are dict keys and list indices, or `key=value[,key=value...]` to pick the one list
  element with those values (`#/runs/kind=16%20fixed,batch_size=8/ratio2`); %-escapes are decoded;
- an optional `*factor` at the end scales the value (`#/decoders/diffusion/solve_rate*100` for "3.5%",
  `#/model/total_parameters*1e-9` for "25.25B");
- the first number of the link text (thousands separators allowed) must equal the value rounded to the
  decimals written: 8.0 stands for anything in [7.95, 8.05], 18 for [17.5, 18.5].

`python tests/check_readme_numbers.py [PAGE.md ...]` (default: every page of `pages()`) prints every linked
number with its value and exits 1 if any is wrong (a missing file or key, a value that does not round to the
number) or if a relative link leads to no file or heading; `--unbacked` also lists table rows with numbers
but no link (the rows still to convert). tests/test_readme_numbers.py runs the check on every page in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import sys
import urllib.parse

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s#]+\.json)#([^)\s]+)\)")
ANY_LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.M)
ROOT = pathlib.Path(__file__).parent.parent
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:[eE][-+]?\d+)?")
FACTOR = re.compile(r"^(.*?)\*([-+]?[\d.]+(?:[eE][-+]?\d+)?)$")
RESULTS = "results"


@dataclasses.dataclass
class Linked:
  """One linked number: where it is, what it says, and what its JSON holds (or why it could not be read)."""

  line: int
  text: str
  path: str
  pointer: str
  written: float | None = None
  value: float | None = None
  error: str | None = None

  def __str__(self):
    where = f"line {self.line}: [{self.text}]({self.path}#{self.pointer})"
    return f"{where}: {self.error}" if self.error else f"{where} = {self.value!r}"


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  """The pages whose numbers and links are checked: README.md, docs/*.md and each project's README.md."""
  return [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "projects").glob("*/README.md"))]


def written_number(text: str) -> tuple[float, int]:
  """(the first number of `text`, its decimals)."""
  match = NUMBER.search(text)
  if match is None:
    raise ValueError(f"the link text {text!r} holds no number")
  return float(match[0].replace(",", "")), len(match[1] or "")


def resolve(data, pointer: str) -> float:
  """The number at `pointer` (see the module docstring), times its factor."""
  factor_match = FACTOR.match(pointer)
  pointer, factor = (factor_match[1], float(factor_match[2])) if factor_match else (pointer, 1.0)
  if not pointer.startswith("/"):
    raise ValueError(f"the pointer {pointer!r} does not start with '/'")
  node = data
  for raw in pointer[1:].split("/"):
    segment = urllib.parse.unquote(raw)
    if isinstance(node, list) and "=" in segment:
      wants = [part.split("=", 1) for part in segment.split(",")]
      hits = [x for x in node if isinstance(x, dict) and all(k in x and _same(x[k], v) for k, v in wants)]
      if len(hits) != 1:
        raise KeyError(f"{len(hits)} elements have {segment!r}")
      node = hits[0]
    elif isinstance(node, list):
      if not segment.isdigit() or int(segment) >= len(node):
        raise KeyError(f"no element {segment!r} in a list of {len(node)}")
      node = node[int(segment)]
    elif isinstance(node, dict) and segment in node:
      node = node[segment]
    else:
      raise KeyError(f"no key {segment!r} (keys: {sorted(node) if isinstance(node, dict) else type(node).__name__})")
  if isinstance(node, bool) or not isinstance(node, (int, float)):
    raise ValueError(f"the value there is {node!r}, not a number")
  return node * factor


def _same(value, text: str) -> bool:
  try:
    return value == json.loads(text)
  except json.JSONDecodeError:
    return str(value) == text


def matches(written: float, decimals: int, value: float) -> bool:
  """Whether `value` rounds to `written` at `decimals` decimals (half a unit of the last digit either way)."""
  return math.isfinite(value) and abs(written - value) <= 0.5 * 10.0 ** -decimals * (1 + 1e-9) + 1e-12


def check(readme: pathlib.Path) -> list[Linked]:
  """Every linked number of `readme`, each with its value or its error."""
  readme = pathlib.Path(readme)
  loaded: dict[pathlib.Path, object] = {}
  found = []
  for number, line in enumerate(readme.read_text().splitlines(), 1):
    for text, path, pointer in LINK.findall(line):
      item = Linked(number, text, path, pointer)
      found.append(item)
      target = (readme.parent / path).resolve()
      try:
        parts = [p for p in pathlib.PurePosixPath(path).parts if p != ".."]  # docs/ pages link ../results/
        if parts[0] != RESULTS:
          raise ValueError(f"the JSON is not under {RESULTS}/")
        if target not in loaded:
          loaded[target] = json.loads(target.read_text())
        item.written, decimals = written_number(text)
        item.value = resolve(loaded[target], pointer)
        if not matches(item.written, decimals, item.value):
          raise ValueError(f"the README says {text!r} but the JSON holds {item.value!r}")
      except (OSError, ValueError, KeyError) as error:
        item.error = error.args[0] if isinstance(error, KeyError) else str(error)
  return found


def anchor(heading: str) -> str:
  """The fragment a Markdown heading gets (GitHub's rule: lower case, punctuation dropped, spaces to '-')."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: pathlib.Path) -> list[str]:
  """'line N: target' for each relative link of `page` whose file, or heading (#fragment of a .md), is missing."""
  page = pathlib.Path(page)
  out = []
  for number, line in enumerate(page.read_text().splitlines(), 1):
    for target in ANY_LINK.findall(line):
      if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        continue
      path, _, fragment = target.partition("#")
      file = (page.parent / path).resolve() if path else page
      if not file.exists():
        out.append(f"line {number}: {target} (no such file)")
      elif fragment and file.suffix == ".md" and fragment not in {anchor(h) for h in HEADING.findall(file.read_text())}:
        out.append(f"line {number}: {target} (no such heading in {file.name})")
  return out


def unbacked(readme: pathlib.Path) -> list[tuple[int, str]]:
  """Table rows (not headers or rules) with a digit in a cell after the first and no linked number."""
  rows = []
  lines = pathlib.Path(readme).read_text().splitlines()
  for number, line in enumerate(lines, 1):
    cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
    is_header = number < len(lines) and re.fullmatch(r"\s*\|?[\s:|-]+\|?\s*", lines[number]) is not None
    if (len(cells) > 1 and not is_header and not re.fullmatch(r"[\s:|-]+", line)
        and any(NUMBER.search(c) for c in cells[1:]) and not LINK.search(line)):
      rows.append((number, line.strip()))
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("readmes", nargs="*", default=[str(p) for p in pages()])
  parser.add_argument("--unbacked", action="store_true", help="also list table rows without linked numbers")
  args = parser.parse_args(argv)
  failed = 0
  for readme in args.readmes:
    items = check(readme)
    broken = broken_links(readme)
    failed += sum(item.error is not None for item in items) + len(broken)
    print(f"{readme}: {len(items)} linked numbers, {sum(i.error is not None for i in items)} wrong; "
          f"{len(broken)} broken links")
    for item in items:
      print(("  WRONG " if item.error else "  ok    ") + str(item))
    for link in broken:
      print(f"  BROKEN {link}")
    if args.unbacked:
      for number, row in unbacked(readme):
        print(f"  no artefact, line {number}: {row}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())

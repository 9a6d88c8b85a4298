"""Import graphs from the source (every import, function-local ones included) and the layering rules they must
follow (docs/architecture.md): inside the package each subpackage imports only subpackages of lower layers,
and nothing imports `build`, the composition root; around it, each area of the tree (a project, benchmarks,
scripts, ...) imports only areas of lower rank; and no module of the tree is part of an import cycle."""

from __future__ import annotations

import ast
import collections
from collections.abc import Iterator
import json
import pathlib

# Layer of each unit (a subpackage, or a top-level module) of the package: imports go strictly downwards.
LAYERS = {
    "_files": 0, "timing": 0, "parallel": 0,  # timing: timers, in-run peaks, provenance (imports JAX only)
    "model": 1,
    "diffusion": 2,
    "data": 3, "convert": 3,
    "sampling": 4, "training": 4,
    "chat": 5, "evaluation": 5,
    "serving": 6,  # above chat: it serves conversations in the chat format
    "build": 7,
}

# Rank of each area of the tree (an area: the package, each project `projects.<name>`, and each other top-level
# folder); an area imports only areas of lower rank, so projects never import benchmarks and two projects never
# import each other. colabs/ notebooks are read cell by cell.
AREAS = {"diffusiongemma": 0, "projects": 1, "benchmarks": 2, "experiments": 3, "scripts": 3, "colabs": 3,
         "tests": 4}


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = list(path.relative_to(root).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
  """Absolute names an import statement brings in: `from a import b` gives 'a.b' (a module or a name in a)."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if isinstance(node, ast.ImportFrom):
    if node.level:
      base = module.split(".")
      base = base[:len(base) - node.level + (1 if is_package else 0)]
      prefix = ".".join(base + ([node.module] if node.module else []))
    else:
      prefix = node.module or ""
    return [f"{prefix}.{alias.name}" for alias in node.names]
  return []


def _sources(root: pathlib.Path, folders) -> Iterator[tuple[str, bool, str]]:
  """(module name, is a package __init__, source) of every .py file (and notebook code cell) in `folders`."""
  for folder in folders:
    for path in sorted((root / folder).rglob("*.py")):
      yield _module_name(path, root), path.name == "__init__.py", path.read_text()
    for path in sorted((root / folder).rglob("*.ipynb")):
      cells = json.loads(path.read_text())["cells"]
      code = ["".join(line for line in ("".join(c["source"]) + "\n").splitlines(keepends=True)
                      if not line.lstrip().startswith(("!", "%")))
              for c in cells if c["cell_type"] == "code"]
      yield _module_name(path, root), False, "\n".join(code)


def _imports(root: pathlib.Path, folders) -> Iterator[tuple[str, str]]:
  """(importing module, imported name) for every import statement in `folders`."""
  for module, is_package, source in _sources(root, folders):
    for node in ast.walk(ast.parse(source, module)):
      for name in _imported(node, module, is_package):
        yield module, name


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
  """unit -> units it imports (units: `package.X` for each subpackage or top-level module X)."""
  graph: dict[str, set[str]] = collections.defaultdict(set)
  for module, name in _imports(root, [package]):
    unit = module.split(".")[1] if "." in module else ""
    parts = name.split(".")
    if parts[0] != package or len(parts) < 2:
      continue
    target = parts[1]
    if target != unit:
      graph[unit].add(target)
  return dict(graph)


def _area(module: str) -> str | None:
  parts = module.split(".")
  if parts[0] not in AREAS:
    return None
  return ".".join(parts[:2]) if parts[0] == "projects" and len(parts) > 1 else parts[0]


def area_graph(root: pathlib.Path, areas: dict[str, int] = AREAS) -> dict[str, set[str]]:
  """area -> areas it imports (an area: see `AREAS`; `projects/__init__.py` is the area `projects`)."""
  graph: dict[str, set[str]] = collections.defaultdict(set)
  for module, name in _imports(root, [a for a in areas if (root / a).is_dir()]):
    source, target = _area(module), _area(name)
    if target is not None and target != source:
      graph[source].add(target)
  return dict(graph)


def area_violations(graph: dict[str, set[str]], areas: dict[str, int] = AREAS) -> list[str]:
  """Every import of an area of the same or a higher rank, and every cycle between areas."""
  rank = lambda area: areas[area.split(".")[0]]
  out = [f"{unit} (rank {rank(unit)}) imports {target} (rank {rank(target)})"
         for unit, targets in sorted(graph.items()) for target in sorted(targets) if rank(target) >= rank(unit)]
  return out + [f"cycle: {' -> '.join(c)}" for c in cycles(graph)]


def module_graph(root: pathlib.Path, folders) -> dict[str, set[str]]:
  """module -> modules of the tree it imports (`from a import b` is the module a.b if there is one, else a)."""
  sources = {module: is_package for module, is_package, _ in _sources(root, folders)}
  graph: dict[str, set[str]] = collections.defaultdict(set)
  for module, name in _imports(root, folders):
    target = name if name in sources else name.rpartition(".")[0]
    if target in sources and target != module:
      graph[module].add(target)
  return dict(graph)


def violations(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS) -> list[str]:
  """Every import that breaks the layering (or involves a unit with no layer), and every cycle."""
  out = []
  for unit, targets in sorted(graph.items()):
    for target in sorted(targets):
      if unit == "":
        out.append(f"the package __init__ imports {target} (the public API resolves lazily)")
      elif unit not in layers or target not in layers:
        out.append(f"{unit} -> {target}: a unit with no layer (add it to LAYERS and docs/architecture.md)")
      elif layers[target] >= layers[unit]:
        out.append(f"{unit} (layer {layers[unit]}) imports {target} (layer {layers[target]})")
  return out + [f"cycle: {' -> '.join(c)}" for c in cycles(graph)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle through each strongly connected component of more than one unit (or a self-loop)."""
  found, state = [], {}

  def visit(node, stack):
    state[node] = "active"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "active":
        found.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, stack)
    stack.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node, [])
  return found

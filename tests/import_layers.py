"""The package's import graph from its source (every import, function-local ones included) and the layering
rule it must follow (docs/architecture.md): each subpackage imports only subpackages of lower layers, and
nothing imports `build`, the composition root."""

from __future__ import annotations

import ast
import collections
import pathlib

# Layer of each unit (a subpackage, or a top-level module) of the package: imports go strictly downwards.
LAYERS = {
    "_files": 0, "parallel": 0,
    "model": 1,
    "diffusion": 2,
    "data": 3, "convert": 3,
    "sampling": 4, "training": 4,
    "chat": 5, "evaluation": 5,
    "serving": 6,  # above chat: it serves conversations in the chat format
    "build": 7,
}


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


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
  """unit -> units it imports (units: `package.X` for each subpackage or top-level module X)."""
  graph: dict[str, set[str]] = collections.defaultdict(set)
  for path in sorted((root / package).rglob("*.py")):
    module = _module_name(path, root)
    unit = module.split(".")[1] if "." in module else ""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      for name in _imported(node, module, path.name == "__init__.py"):
        parts = name.split(".")
        if parts[0] != package or len(parts) < 2:
          continue
        target = parts[1]
        if target != unit:
          graph[unit].add(target)
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

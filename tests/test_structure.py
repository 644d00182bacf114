"""The tree stays small and acyclic (#53): no source file over MAX_LINES lines, no import
circle among the project's modules.

A module over ~550 lines holds more than one concept (/work/shared/STYLE.md aims at ~400);
an import circle means two modules cannot be understood, tested or loaded one without
the other. Both checks read source files only (ast), so this test imports nothing it
checks. Imports count at any level: a lazy import inside a function is still a
dependency (it only moves the failure from import time to call time); imports under
`if TYPE_CHECKING:` do not (they never run). tests/test_layering.py checks the direction
of imports between the rooms of hisparse_jax; this file checks that no modules, in a
room or across packages, import each other round.
"""

from __future__ import annotations

import ast
import collections
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 550
SIZED_DIRS = ("hisparse_jax", "kernels_pallas", "models", "tests", "examples")
PACKAGES = ("hisparse_jax", "kernels_pallas", "models")  # the import graph's modules
LAZY_EXPORTS_PACKAGE = "hisparse_jax"  # `from hisparse_jax import LLM`: its _EXPORTS


def long_files(root: pathlib.Path) -> list[str]:
  """'path: N lines' of every .py file under SIZED_DIRS with more than MAX_LINES lines."""
  found = []
  for top in SIZED_DIRS:
    for path in sorted((root / top).rglob("*.py")):
      if ".venv" in path.parts or "__pycache__" in path.parts:
        continue
      num_lines = len(path.read_text().splitlines())
      if num_lines > MAX_LINES:
        found.append(f"{path.relative_to(root)}: {num_lines} lines")
  return found


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
  parts = list(path.relative_to(root).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _lazy_exports(root: pathlib.Path) -> dict[str, str]:
  """The lazy-export package's _EXPORTS (public name -> defining module), from its source
  (as tests/test_layering.py reads it); {} where the package has none."""
  init = root / LAZY_EXPORTS_PACKAGE / "__init__.py"
  if not init.exists():
    return {}
  for node in ast.parse(init.read_text()).body:
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
      return ast.literal_eval(node.value)
  return {}


def _is_type_checking(test: ast.expr) -> bool:
  """`TYPE_CHECKING` or `typing.TYPE_CHECKING` (an `if` whose body never runs)."""
  return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
          or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST):
  """Every Import / ImportFrom node at any depth, except inside `if TYPE_CHECKING:` bodies
  (their `else:` branch still counts)."""
  stack = [tree]
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
      continue
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      stack.extend(node.orelse)
      continue
    stack.extend(ast.iter_child_nodes(node))


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
                    exports: dict[str, str]) -> list[str]:
  """The dotted names one import statement brings in: `from pkg import sub` as pkg.sub
  (resolved against the known modules later), relative imports made absolute, a name of
  the lazy-export package as the module that defines it."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if node.level:
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    name = ".".join(base + ([node.module] if node.module else []))
  else:
    name = node.module or ""
  if name == LAZY_EXPORTS_PACKAGE:
    return [exports.get(alias.name, f"{name}.{alias.name}") for alias in node.names]
  return [f"{name}.{alias.name}" for alias in node.names]


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
  """Module -> the project modules it imports (anywhere in its file), over PACKAGES. An
  imported name resolves to the longest dotted prefix that is a module: `from models
  import loader` -> models.loader, `from models.loader import load_config` ->
  models.loader, `import jax` -> nothing (not ours)."""
  paths = {}
  for top in PACKAGES:
    for path in sorted((root / top).rglob("*.py")):
      if "__pycache__" not in path.parts:
        paths[_module_name(root, path)] = path
  exports = _lazy_exports(root)

  def resolve(name: str) -> str | None:
    while name and name not in paths:
      name = name.rpartition(".")[0]
    return name or None

  graph: dict[str, set[str]] = {module: set() for module in paths}
  for module, path in paths.items():
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in _import_nodes(tree):
      for name in _imported_names(node, module, path.name == "__init__.py", exports):
        target = resolve(name)
        if target is not None and target != module:
          graph[module].add(target)
  return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
  seen, stack = set(), [start]
  while stack:
    for nxt in graph[stack.pop()]:
      if nxt not in seen:
        seen.add(nxt)
        stack.append(nxt)
  return seen


def _shortest_cycle(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
  """start -> ... -> start, the fewest edges, through `members` only (breadth first)."""
  parent: dict[str, str] = {}
  queue = collections.deque([start])
  while queue:
    node = queue.popleft()
    for nxt in sorted(graph[node] & members):
      if nxt == start:
        path = [node]
        while path[-1] != start:
          path.append(parent[path[-1]])
        return [*reversed(path), start]
      if nxt not in parent:
        parent[nxt] = node
        queue.append(nxt)
  raise AssertionError(f"{start} is on no cycle")


def import_cycles(root: pathlib.Path) -> list[str]:
  """Each strongly connected component of more than one module (modules that import each
  other round, directly or through others), as 'N modules {a, b, ...}; e.g. a -> b -> a'.
  The graph has a few hundred modules: reachability from each is cheap enough."""
  graph = import_graph(root)
  reach = {module: _reachable(graph, module) for module in graph}
  found, placed = [], set()
  for module in sorted(graph):
    if module in placed or module not in reach[module]:
      continue
    members = {m for m in reach[module] if module in reach[m]}
    placed |= members
    cycle = _shortest_cycle(graph, module, members)
    found.append(f"{len(members)} modules {{{', '.join(sorted(members))}}}; "
                 f"e.g. {' -> '.join(cycle)}")
  return found


def test_no_file_over_the_line_limit():
  found = long_files(REPO)
  assert not found, (f"{len(found)} files over {MAX_LINES} lines (split each by concept):\n"
                     + "\n".join(found))


def test_no_import_cycle():
  found = import_cycles(REPO)
  assert not found, (f"{len(found)} import circles (move what the modules share into a "
                     "module both import, or invert one import):\n" + "\n".join(found))


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return root


def test_the_cycle_check_resolves_every_import_form(tmp_path):
  """A made-up tree: a circle through a lazy import, `from pkg import sub` and a relative
  import is found (one component, its example cycle); an import under TYPE_CHECKING, one
  of a name the package defines, and imports of other packages make no edge."""
  root = _write(tmp_path, {
      "models/__init__.py": "X = 1\n",
      "models/a.py": "def f():\n  from models import b\n  return b\n",
      "models/b.py": "from .sub import c\n",
      "models/sub/__init__.py": "",
      "models/sub/c.py": ("from typing import TYPE_CHECKING\nimport models.a\n"
                          "if TYPE_CHECKING:\n  from models import d\nelse:\n  import jax\n"),
      "models/d.py": "from models import X\nfrom models.a import f\n",
      "kernels_pallas/__init__.py": "",
      "kernels_pallas/k.py": "import numpy\nfrom models import d\n",
      "hisparse_jax/__init__.py": "_EXPORTS = {'F': 'hisparse_jax.e'}\n",
      "hisparse_jax/e.py": "from hisparse_jax import g\n",
      "hisparse_jax/g.py": "from hisparse_jax import F\n",
  })
  graph = import_graph(root)
  assert graph["models.a"] == {"models.b"}
  assert graph["models.b"] == {"models.sub.c"}
  assert graph["models.sub.c"] == {"models.a"}
  assert graph["models.d"] == {"models", "models.a"}
  assert graph["kernels_pallas.k"] == {"models.d"}
  assert graph["hisparse_jax.g"] == {"hisparse_jax.e"}  # the lazy export's module
  assert graph["hisparse_jax.e"] == {"hisparse_jax.g"}  # not an export: the submodule
  assert import_cycles(root) == [
      "2 modules {hisparse_jax.e, hisparse_jax.g}; e.g. hisparse_jax.e -> hisparse_jax.g "
      "-> hisparse_jax.e",
      "3 modules {models.a, models.b, models.sub.c}; e.g. models.a -> models.b -> "
      "models.sub.c -> models.a"]


def test_the_size_check_names_each_long_file(tmp_path):
  root = _write(tmp_path, {
      "models/ok.py": "x = 1\n" * MAX_LINES,
      "tests/long.py": "x = 1\n" * (MAX_LINES + 1),
      "scripts/ignored.py": "x = 1\n" * 1000,  # not a checked folder
  })
  for top in SIZED_DIRS:
    (root / top).mkdir(exist_ok=True)
  assert long_files(root) == [f"tests/long.py: {MAX_LINES + 1} lines"]

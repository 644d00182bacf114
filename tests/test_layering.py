"""The rooms of hisparse_jax import downward only, as their `__init__` docstrings say.

    entrypoints -> engine -> sparse -> kv_cache -> distributed, observability
    bench (measures everything)          models, kernels_pallas (never import hisparse_jax)

Every import counts, module-level or inside a function (a lazy import is still a
dependency), and `from hisparse_jax import NAME` counts as an import of the module that
defines NAME (the package's lazy exports). The checker reads source files only (ast), so
this test imports nothing it checks.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shutil

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "hisparse_jax"
OUTSIDE = ("models", "kernels_pallas", "configs")  # top-level packages beside hisparse_jax

# Room -> the rooms and outside packages it may import (its own room always).
ALLOWED: dict[str, set[str]] = {
    "observability": set(),
    "distributed": {"models"},
    "kv_cache": {"distributed", "observability", "kernels_pallas"},
    "sparse": {"kv_cache", "distributed", "observability", "kernels_pallas", "models"},
    "engine": {"sparse", "kv_cache", "distributed", "observability", "kernels_pallas",
               "models", "configs"},
    "entrypoints": {"engine", "sparse", "kv_cache", "distributed", "observability",
                    "kernels_pallas", "models", "configs"},
    "bench": {"entrypoints", "engine", "sparse", "kv_cache", "distributed", "observability",
              "kernels_pallas", "models", "configs"},
    # The package's own files: __init__ (lazy exports), __main__ (the CLI).
    "root": {"entrypoints"},
    "root_lazy": set(),  # _lazy: the lazy-export helper (stdlib only)
}
# Single modules allowed one more room than their own room is (and why).
MODULE_EXCEPTIONS: dict[str, set[str]] = {
    f"{PACKAGE}.entrypoints.cli.bench": {"bench"},  # `hisparse-jax bench` runs the suites
}
ALWAYS = {"root_lazy"}  # hisparse_jax._lazy: the lazy-export helper every room may use


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
  parts = list(path.relative_to(root).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _exports(root: pathlib.Path) -> dict[str, str]:
  """hisparse_jax/__init__.py's _EXPORTS (public name -> module), read from its source."""
  tree = ast.parse((root / PACKAGE / "__init__.py").read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
      return ast.literal_eval(node.value)
  raise AssertionError("hisparse_jax/__init__.py has no _EXPORTS")


def _room(module: str) -> str | None:
  """The room of a module name: a room of hisparse_jax, 'root', an outside package's
  name, or None (not ours: jax, numpy, ...)."""
  parts = module.split(".")
  if parts[0] in OUTSIDE:
    return parts[0]
  if parts[0] != PACKAGE:
    return None
  if len(parts) == 1:
    return "root"
  if parts[1] == "_lazy":
    return "root_lazy"
  if parts[1] in ("__init__", "__main__"):
    return "root"
  return parts[1] if parts[1] in ALLOWED else "root"


def _imports(path: pathlib.Path, module: str, exports: dict[str, str]):
  """(line, imported module) of every import in a file, relative ones resolved."""
  tree = ast.parse(path.read_text(), filename=str(path))
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        name = ".".join(base + ([node.module] if node.module else []))
      else:
        name = node.module or ""
      if name == PACKAGE:  # the lazy exports: the module that defines each name
        for alias in node.names:
          yield node.lineno, exports.get(alias.name, f"{PACKAGE}.{alias.name}")
      else:
        yield node.lineno, name


def violations(root: pathlib.Path) -> list[str]:
  """Every import of a file under `root` that its room may not make, as
  'path:line: ROOM imports MODULE (room TARGET; allowed: ...)'."""
  exports = _exports(root)
  found = []
  for top in (PACKAGE, *OUTSIDE):
    for path in sorted((root / top).rglob("*.py")):
      module = _module_name(root, path)
      room = _room(module)
      if top in OUTSIDE:
        allowed = set(OUTSIDE)  # models, kernels_pallas, configs: anything but hisparse_jax
      else:
        allowed = ALLOWED[room] | MODULE_EXCEPTIONS.get(module, set())
      for line, imported in _imports(path, module, exports):
        target = _room(imported)
        if target is None or target == room or target in ALWAYS:
          continue
        if top in OUTSIDE:
          if target in OUTSIDE:
            continue
        elif target in allowed:
          continue
        found.append(f"{path.relative_to(root)}:{line}: {room} imports {imported} "
                     f"(room {target}; allowed: {', '.join(sorted(allowed)) or 'none'})")
  return found


def test_rooms_import_downward_only():
  assert violations(REPO) == []


def test_every_room_says_what_it_may_import():
  for room in ALLOWED:
    if room.startswith("root"):
      continue
    doc = ast.get_docstring(ast.parse((REPO / PACKAGE / room / "__init__.py").read_text()))
    assert doc and "May import" in doc, room


def test_every_module_lives_in_a_room():
  """Only the package's own files sit at its top (no module grows back beside the rooms)."""
  top = sorted(p.name for p in (REPO / PACKAGE).glob("*.py"))
  assert top == ["__init__.py", "__main__.py", "_lazy.py"], top
  rooms = sorted(p.name for p in (REPO / PACKAGE).iterdir()
                 if p.is_dir() and (p / "__init__.py").exists())
  assert rooms == sorted(r for r in ALLOWED if not r.startswith("root")), rooms


def _copy_tree(tmp_path: pathlib.Path) -> pathlib.Path:
  for top in (PACKAGE, *OUTSIDE):
    shutil.copytree(REPO / top, tmp_path / top,
                    ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
  return tmp_path


def _add_line(path: pathlib.Path, line: str) -> None:
  text = path.read_text()
  head, sep, rest = text.partition("\nfrom __future__ import annotations\n")
  path.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)


def test_the_check_catches_a_forbidden_import(tmp_path):
  """A copy of the tree with upward imports added (module-level, inside a function, via
  the package's lazy exports, and from models) fails the check, naming each."""
  root = _copy_tree(tmp_path)
  _add_line(root / PACKAGE / "kv_cache" / "block_pool.py",
            "from hisparse_jax.engine.scheduler import Scheduler  # noqa")
  sparse = root / PACKAGE / "sparse" / "indexer.py"
  sparse.write_text(sparse.read_text() + "\n\ndef _f():\n  from hisparse_jax import LLM\n"
                    "  return LLM\n")
  _add_line(root / "models" / "tokenizer.py", "import hisparse_jax.engine.engine  # noqa")
  found = violations(root)
  assert len(found) == 3, found
  by_file = {f.split(":")[0]: f for f in found}
  assert "kv_cache imports hisparse_jax.engine.scheduler (room engine" in by_file[
      os.path.join(PACKAGE, "kv_cache", "block_pool.py")]
  assert "sparse imports hisparse_jax.entrypoints.llm (room entrypoints" in by_file[
      os.path.join(PACKAGE, "sparse", "indexer.py")]
  assert "models imports hisparse_jax.engine.engine" in by_file[
      os.path.join("models", "tokenizer.py")]

"""Lazy public names of a package: `from hisparse_jax.kv_cache import BlockManager`
imports only the module that defines it, on first use (the rooms' `__init__` stay
cheap, and importing one module of a room never imports the whole room)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
  """(`__getattr__`, `__dir__`) of `package` for `exports` (public name -> module)."""

  def __getattr__(name: str):
    module = exports.get(name)
    if module is None:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value  # later lookups skip this function
    return value

  def __dir__():
    return sorted(set(namespace) | set(exports))

  return __getattr__, __dir__

"""The persistent XLA compilation cache of a process: compiled step programs on disk.

Owns turning JAX's persistent compilation cache on for the CLI commands that build an
engine (`generate`, `demo`, `serve`; `--compilation_cache_dir`), and for embedders that
ask (`enable`). A fresh process then loads the programs an earlier run compiled instead
of compiling them again: on the real model (30 layers) each step program takes ~15-40 s
to compile on the 2-core machine, which a CLI user paid on every start (WORKSPACE.md has
the measured fresh-process times).

JAX keys each entry by the program's HLO, the compile options, the jax/jaxlib version
and the devices, so an entry is only reused for the same program on the same platform;
only programs that took at least `MIN_COMPILE_SECONDS` to compile are written (the step
programs, not the small helpers). The cache is a directory of files that any process may
read or delete; nothing here evicts entries (`hisparse-jax ... --compilation_cache_dir=`
turns it off; deleting the directory empties it).

Not on by default in the library (`LLM`, `Engine`) or the bench: JAX's cache is a process-
wide setting an embedder owns, and the bench measures compilation as it is.
"""

from __future__ import annotations

import os

from absl import logging

ENV = "HISPARSE_COMPILATION_CACHE_DIR"  # the CLI default's override ("" turns it off)
MIN_COMPILE_SECONDS = 1.0  # JAX's own default: programs faster to compile are not written
# Overrides MIN_COMPILE_SECONDS (0 writes every program: the tests, whose toy programs may
# compile in under a second on a fast machine).
MIN_SECONDS_ENV = "HISPARSE_COMPILATION_CACHE_MIN_SECONDS"


def default_dir() -> str:
  """$HISPARSE_COMPILATION_CACHE_DIR if set (may be "": off), else
  $XDG_CACHE_HOME/hisparse_jax/xla (~/.cache/hisparse_jax/xla)."""
  if ENV in os.environ:
    return os.environ[ENV]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "hisparse_jax", "xla")


def min_compile_seconds() -> float:
  """MIN_COMPILE_SECONDS, or $HISPARSE_COMPILATION_CACHE_MIN_SECONDS (a number >= 0)."""
  raw = os.environ.get(MIN_SECONDS_ENV, "")
  if not raw:
    return MIN_COMPILE_SECONDS
  try:
    value = float(raw)
  except ValueError:
    value = -1.0
  if not value >= 0:  # also NaN
    raise ValueError(f"${MIN_SECONDS_ENV}={raw!r}: expected a number of seconds >= 0")
  return value


def entries(path: str) -> tuple[int, int]:
  """(files, bytes) in the cache directory (0, 0 when it does not exist)."""
  try:
    names = os.listdir(path)
  except OSError:
    return 0, 0
  sizes = []
  for name in names:
    try:
      sizes.append(os.path.getsize(os.path.join(path, name)))
    except OSError:
      continue
  return len(sizes), sum(sizes)


_pending: list[str] = []  # enable(announce=False)'s line, until log_pending()


def enable(path: str | None, flag: str = "compilation_cache_dir",
           announce: bool = True) -> str | None:
  """Turns the persistent compilation cache on at `path` (created if missing) before any
  program compiles; None or "" leaves JAX as it is. Returns the path in use (None: off).
  ValueError naming `flag` when the directory cannot be created or written.
  Logs the cache's line (its directory and the programs in it now); `announce=False` keeps
  that line for `log_pending()`: the CLI logs it once the engine is built, so that a bad
  checkpoint's or device count's one-line error is the only line before the exit."""
  if not path:
    return None
  import jax  # noqa: PLC0415 (the CLI imports jax late)

  path = os.path.abspath(os.path.expanduser(path))
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--{flag}={path}: cannot create the directory: {e.strerror}") from None
  if not os.access(path, os.W_OK):
    raise ValueError(f"--{flag}={path}: the directory is not writable")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds())
  files, size = entries(path)
  line = (f"XLA compilation cache: {path} ({files} programs, {size / 2**20:.1f} MiB); "
          "--compilation_cache_dir= turns it off")
  _pending.clear()
  if announce:
    logging.info("%s", line)
  else:
    _pending.append(line)
  return path


def log_pending() -> None:
  """Logs the line `enable(announce=False)` kept (once; nothing when there is none)."""
  while _pending:
    logging.info("%s", _pending.pop())

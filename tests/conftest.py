"""Shared test set-up: CPU only, deterministic, compiled programs released per module."""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
# XLA's GPU autotuner off for the deviceless H200 compiles (tests/hisparse_jax/engine/
# test_aot_*.py, the `compile` CLI): with no GPU it times nothing, yet it took ~40% of a
# HiSparse step's compile (measured: 12 -> 7.5 s a step; test_aot_h200.py 344 -> 212 s).
# What the suite checks there (the host offloader's verdict, the Pallas kernels' Triton /
# Mosaic GPU compile, copies, temporaries) does not depend on it; README's `compile` lines
# (the default model's decode, dense and HiSparse) run with it on (test_readme_commands.py).
if "--xla_gpu_autotune_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_gpu_autotune_level=0"
# The CLI's persistent compilation cache: never ~/.cache (a test must not depend on what an
# earlier run left there); the session's own directory below when that is on, else off.
_CLI_CACHE_GIVEN = "HISPARSE_COMPILATION_CACHE_DIR" in os.environ
os.environ.setdefault("HISPARSE_COMPILATION_CACHE_DIR", "")
# XLA's backend optimizations off (LLVM at -O0, its expensive passes skipped; the HLO passes
# still run, so every fusion, layout and host-offload decision is the one a user gets): the
# suite is dominated by compiling small programs it runs a few times, and this cut
# compile-bound tests by 25-45% (measured: an offloaded HiSparse engine pair 32 -> 21 s, a
# deviceless H200 engine compile 12.5 -> 10.8 s). Subprocesses (the CLI and server tests)
# inherit it. Speed is measured by the benchmarks, never here. =0 turns it off.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# JAX's persistent compilation cache, in a directory of this session only (removed at
# exit): the suite builds many engines of the same configuration, whose step programs are
# the same; each is compiled once and loaded from the cache afterwards (also across
# modules, whose in-memory programs are dropped). Under pytest-xdist the workers share one
# directory, named after their parent (the controlling pytest process, which removes it at
# its exit), so a program one worker compiled is loaded by the other. No size limit: that
# would turn on JAX's file lock and an eviction scan of the whole directory on every
# write (0.3 s at ~4,000 entries, measured: it slowed the suite by minutes); a read of an
# entry the other worker is still writing fails JAX's decompression, which JAX reports as
# a warning and then compiles the program itself.
# HISPARSE_TEST_COMPILATION_CACHE=0 turns it off.
_CACHE_PREFIX = os.path.join(tempfile.gettempdir(), "hisparse_test_xla_")
if os.environ.get("HISPARSE_TEST_COMPILATION_CACHE", "1") != "0":
  if os.environ.get("PYTEST_XDIST_WORKER"):
    _CACHE_DIR = f"{_CACHE_PREFIX}{os.getppid()}"
    os.makedirs(_CACHE_DIR, exist_ok=True)
  else:  # alone, or xdist's controller (whose workers use this directory)
    _CACHE_DIR = f"{_CACHE_PREFIX}{os.getpid()}"
    os.makedirs(_CACHE_DIR, exist_ok=True)
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if not _CLI_CACHE_GIVEN:
    os.environ["HISPARSE_COMPILATION_CACHE_DIR"] = _CACHE_DIR
    os.environ["HISPARSE_COMPILATION_CACHE_MIN_SECONDS"] = "0"

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True)
settings.load_profile("ci")


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program after each test module.

  XLA:CPU maps the code of each compiled program into memory mappings of its own, and
  JAX keeps every program for the life of the process: the whole suite in one process
  compiles enough programs to pass Linux's default vm.max_map_count (65,530), and the
  next compile then aborts inside LLVM (seen as "Fatal Python error: Aborted" or a
  segfault in an unrelated test). A module's programs are rarely reused by the next one.
  """
  yield
  jax.clear_caches()
  gc.collect()

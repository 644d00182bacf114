"""The CLI's persistent compilation cache: a second process loads what the first compiled."""

import os
import re
import subprocess
import sys

import pytest
from absl.testing import flagsaver

from hisparse_jax.engine import compilation_cache
from hisparse_jax.entrypoints.cli import main as cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
ARGS = ("generate", "--prompt=bafu ka", "--max_new_tokens=6", "--hisparse")


def _generate(cache_dir):
  # Every program written: the toy's step programs may compile in under a second (CI).
  env = dict(os.environ, JAX_PLATFORMS="cpu", **{compilation_cache.MIN_SECONDS_ENV: "0"})
  r = subprocess.run([sys.executable, "-m", "hisparse_jax", *ARGS,
                      f"--compilation_cache_dir={cache_dir}"], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  line = re.search(r"XLA compilation cache: (\S+) \((\d+) programs", r.stderr)
  texts = [t for t in r.stdout.splitlines() if t.startswith("[")]  # "[i] completion"
  assert texts
  return texts, line


def test_second_process_reuses_the_first_ones_programs(tmp_path):
  cache = tmp_path / "xla"
  first, line = _generate(cache)
  assert line and line.group(1) == str(cache) and line.group(2) == "0"
  written, _ = compilation_cache.entries(str(cache))
  assert written >= 1  # the step programs (and the small helpers, with no minimum time)
  second, line = _generate(cache)
  assert line.group(2) == str(written)
  assert compilation_cache.entries(str(cache))[0] == written  # nothing compiled anew
  assert second == first  # same tokens from the loaded programs
  _, off = _generate("")
  assert off is None  # empty: no cache line, JAX left as it is


def test_default_dir_and_bad_dir(tmp_path, monkeypatch):
  monkeypatch.delenv(compilation_cache.ENV, raising=False)
  monkeypatch.delenv(compilation_cache.MIN_SECONDS_ENV, raising=False)  # (conftest's)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert compilation_cache.default_dir() == str(tmp_path / "hisparse_jax" / "xla")
  monkeypatch.setenv(compilation_cache.ENV, "")
  assert compilation_cache.default_dir() == ""
  assert compilation_cache.enable("") is None
  assert compilation_cache.min_compile_seconds() == compilation_cache.MIN_COMPILE_SECONDS
  monkeypatch.setenv(compilation_cache.MIN_SECONDS_ENV, "0.5")
  assert compilation_cache.min_compile_seconds() == 0.5
  for bad in ("-1", "soon", "nan"):
    monkeypatch.setenv(compilation_cache.MIN_SECONDS_ENV, bad)
    with pytest.raises(ValueError, match=r"^\$HISPARSE_COMPILATION_CACHE_MIN_SECONDS="):
      compilation_cache.min_compile_seconds()
  monkeypatch.delenv(compilation_cache.MIN_SECONDS_ENV)
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(ValueError, match=r"^--compilation_cache_dir=.*file/xla: cannot create"):
    compilation_cache.enable(str(blocker / "xla"))


def test_flag_belongs_to_the_engine_commands():
  for command in ("generate", "demo", "serve"):
    assert "compilation_cache_dir" in cli.command_flags(command)
  assert "compilation_cache_dir" not in cli.command_flags("bench")
  with flagsaver.flagsaver():
    assert cli.FLAGS["compilation_cache_dir"].default is None

"""The CLI's contract for bad invocations: exit status 2 and one line, no traceback."""

import subprocess
import sys

import pytest


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "hisparse_jax", *args], capture_output=True,
                        text=True, timeout=120)


@pytest.mark.parametrize("args,needle", [
    (("frobnicate",), "unknown command 'frobnicate'"),
    (("capacity", "--no_such_flag=1"), "no_such_flag"),
    (("capacity", "--block_size=abc"), "block_size"),
])
def test_bad_invocation_exits_2_with_one_line(args, needle):
  r = _cli(*args)
  assert r.returncode == 2, r.stderr
  lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1, r.stderr
  assert needle in lines[0]
  assert "Traceback" not in r.stderr


def test_no_command_prints_usage():
  r = _cli()
  assert r.returncode == 2
  assert "usage: hisparse-jax COMMAND" in r.stderr


def test_engine_flag_defaults_are_the_engine_config_defaults():
  # cli.py does not import the engine (so `--help` stays light): its defaults are copies.
  import dataclasses

  from absl import flags

  from hisparse_jax.engine.engine import EngineConfig
  from hisparse_jax.entrypoints.cli import main as cli  # noqa: F401 (defines the flags)

  fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
  shared = [name for name in fields if name in flags.FLAGS]
  assert {"max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
          "host_pool_gib", "dtype"} <= set(shared)
  # (a bool flag; a preset name; a per-command default, test_step_shapes checks it)
  for name in set(shared) - {"hisparse", "model", "compile_in_background"}:
    assert flags.FLAGS[name].default == fields[name], name

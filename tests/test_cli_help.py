"""`hisparse-jax --help` / `-h` / `COMMAND --help`: the commands, then a command's own
flags by group, on stdout, exit 0."""

import subprocess
import sys

from absl import flags

from hisparse_jax import cli


def _help(*args):
  return subprocess.run([sys.executable, "-m", "hisparse_jax", *args], capture_output=True,
                        text=True, timeout=120)


def test_help_lists_the_commands_and_exits_0():
  for flag in ("--help", "-h"):
    r = _help(flag)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: hisparse-jax COMMAND [--flags]")
    for command in cli.COMMANDS:
      assert f"\n  {command} " in r.stdout


def test_command_help_shows_its_own_flags():
  r = _help("serve", "--help")
  assert r.returncode == 0, r.stderr
  assert "server:\n  --host (default: 127.0.0.1)" in r.stdout
  assert "--max_model_len (default: 2048)" in r.stdout and "--[no]hisparse" in r.stdout
  assert "--suite" not in r.stdout and "--temperature" not in r.stdout  # not serve's
  r = _help("generate", "-h")
  assert "sampling:\n  --max_new_tokens (default: 16)" in r.stdout
  assert "--n (default: 1)" in r.stdout


def test_every_project_flag_belongs_to_a_command():
  """The groups name real flags, and every flag cli.py defines is in some command's help."""
  grouped = {n for groups in cli.COMMAND_FLAGS.values() for _, names in groups for n in names}
  assert set(cli.COMMAND_FLAGS) == set(cli.COMMANDS)
  ours = {name for name, flag in flags.FLAGS._flags().items()
          if name == flag.name and flags.FLAGS.find_module_defining_flag(name) == cli.__name__}
  assert grouped == ours, (grouped ^ ours)


def test_helpfull_lists_the_project_flags_first_and_exits_0():
  r = _help("--helpfull")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("usage: hisparse-jax COMMAND [--flags]")
  ours, absl_logging = r.stdout.index("hisparse_jax.cli:"), r.stdout.index("absl.logging:")
  assert ours < absl_logging
  assert "--top_k_tokens: HiSparse:" in r.stdout and "--verbosity" in r.stdout

"""Every integer flag of the CLI has a declared range (main.INT_RANGES), checked with the
float flags' before any command runs: a value below or above it exits 2 with one stderr
line naming the flag, for every command that reads it (in this process through main's
check, plus subprocess runs of the whole CLI for a few); values in range still pass.
(`capacity --max_num_seqs=0` printed a plan; 2**63 reached int32 arrays.)
"""

import os
import subprocess
import sys

import pytest
from absl import flags

from hisparse_jax.entrypoints.cli import main as cli

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
FLAGS = flags.FLAGS


INT_FLAGS = cli.cli_flags(flags.IntegerParser)
PAIRS = [(command, name) for name in INT_FLAGS for command in sorted(cli.COMMANDS)
         if name in cli.command_flags(command)]


def _run(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "hisparse_jax", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=60)


def test_every_integer_flag_has_a_range_and_a_command():
  assert len(INT_FLAGS) >= 30, INT_FLAGS
  assert sorted(cli.INT_RANGES) == INT_FLAGS
  for name in INT_FLAGS:
    assert any(c == name for _, c in PAIRS), f"--{name} is read by no command"


def _check(command: str, name: str, value) -> None:
  """main's check of `hisparse-jax command --name=value`, parsed in this process."""
  FLAGS(["hisparse-jax"] + ([] if value is None else [f"--{name}={value}"]))
  try:
    cli.check_int_flags(command)
  finally:
    FLAGS.unparse_flags()


@pytest.mark.parametrize("command, name", PAIRS, ids=[f"{c} --{n}" for c, n in PAIRS])
def test_values_in_range_pass_and_values_outside_are_refused(command, name):
  span = cli.INT_RANGES[name]
  for value in (FLAGS[name].default, span.lo, span.hi, (span.lo + span.hi) // 2):
    _check(command, name, value)  # no error
  for value in (span.lo - 1, span.hi + 1, 2**63):
    with pytest.raises(ValueError) as info:
      _check(command, name, value)
    message = str(info.value)
    assert message.startswith(f"--{name} must be "), message
    assert message.endswith(f"got {value}"), message
    if value > span.hi or span.below is None:
      assert str(span) in message, message


@pytest.mark.parametrize("args, line", [
    (("capacity", "--max_num_seqs=0"), "--max_num_seqs must be >= 1, got 0"),
    (("generate", "--prompt=hi", f"--max_model_len={2**63}"),
     f"--max_model_len must be in [1, 2**24], got {2**63}"),
    (("serve", "--max_waiting_requests=-3"), "--max_waiting_requests must be >= 1, got -3"),
])
def test_the_cli_exits_2_with_one_line(args, line):
  r = _run(*args)
  assert r.returncode == 2 and r.stdout == "", r.stderr
  assert r.stderr.splitlines() == [f"hisparse-jax {args[0]}: error: {line}"]

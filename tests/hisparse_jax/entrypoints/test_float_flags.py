"""Every float flag of the CLI has a declared range (main.FLOAT_RANGES), checked before any
command runs: nan, inf, -inf and 1e308 exit 2 with one stderr line naming the flag, for every
command that reads it (a subprocess each, 8 at a time: the check comes before the command's
imports, so each run takes an interpreter start and no jax); values in range still pass.
"""

import concurrent.futures
import os
import subprocess
import sys

import pytest
from absl import flags

from hisparse_jax.entrypoints.cli import main as cli

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BAD = ("nan", "inf", "-inf", "1e308")
FLAGS = flags.FLAGS


FLOAT_FLAGS = cli.cli_flags(flags.FloatParser)
# (command, flag) for every command that reads the flag.
PAIRS = [(command, name) for name in FLOAT_FLAGS for command in sorted(cli.COMMANDS)
         if name in cli.command_flags(command)]


def _run(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "hisparse_jax", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=60)


def test_every_float_flag_has_a_range_and_a_command():
  assert len(FLOAT_FLAGS) >= 8, FLOAT_FLAGS  # (device/host/disk GiB, seconds, sampling)
  assert sorted(cli.FLOAT_RANGES) == FLOAT_FLAGS
  for name in FLOAT_FLAGS:
    assert any(c == name for _, c in PAIRS), f"--{name} is read by no command"


def test_non_finite_and_huge_values_exit_2_naming_the_flag():
  runs = [(command, name, bad) for command, name in PAIRS for bad in BAD]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    results = list(pool.map(lambda r: _run(r[0], f"--{r[1]}={r[2]}"), runs))
  failures = []
  for (command, name, bad), r in zip(runs, results, strict=True):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    prefix = f"hisparse-jax {command}: error: --{name} must be "
    if (r.returncode != 2 or len(lines) != 1 or "Traceback" in r.stderr
        or not lines[0].startswith(prefix) or str(cli.FLOAT_RANGES[name]) not in lines[0]):
      failures.append(f"{command} --{name}={bad}: exit {r.returncode}, stderr {r.stderr!r}")
  assert not failures, "\n".join(failures)


def test_host_pool_gib_nan_names_the_flag_and_its_range():
  r = _run("capacity", "--host_pool_gib=nan")
  assert r.returncode == 2 and r.stdout == ""
  assert r.stderr.splitlines() == [
      "hisparse-jax capacity: error: --host_pool_gib must be a finite number in [0, 1e6], "
      "got nan"]


def test_the_check_comes_before_jax_and_the_model():
  code = ("import atexit, sys\n"
          "atexit.register(lambda: print(sorted(m for m in ('jax', 'models.loader') "
          "if m in sys.modules)))\n"
          "sys.argv = ['hisparse-jax', 'generate', '--prompt=hi', '--temperature=nan']\n"
          "from hisparse_jax.entrypoints.cli.main import run\n"
          "run()\n")
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                     timeout=60, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 2, r.stderr
  assert r.stdout.strip() == "[]"
  assert "--temperature must be a finite number in [0, 100], got nan" in r.stderr


def _in_range(name: str) -> list[float | None]:
  """Values of --name its range takes: the default, the closed bounds, a middle one."""
  span = cli.FLOAT_RANGES[name]
  values = [FLAGS[name].default, (span.lo + span.hi) / 2]  # (None: the flag not given)
  values += [] if span.lo_open else [span.lo]
  values += [] if span.hi_open else [span.hi]
  return values


def _out_of_range(name: str) -> list[float]:
  span = cli.FLOAT_RANGES[name]
  values = [span.lo - 1, span.hi * 2 + 1] + ([span.lo] if span.lo_open else []) + (
      [span.hi] if span.hi_open else [])
  return [float(v) for v in values]


def _check(command: str, name: str, value) -> None:
  """main's check of `hisparse-jax command --name=value`, parsed in this process."""
  FLAGS(["hisparse-jax"] + ([] if value is None else [f"--{name}={value!r}"]))
  try:
    cli.check_float_flags(command)
  finally:
    FLAGS.unparse_flags()


@pytest.mark.parametrize("command, name", PAIRS, ids=[f"{c} --{n}" for c, n in PAIRS])
def test_values_in_range_pass_and_finite_ones_outside_are_refused(command, name):
  for value in _in_range(name):
    _check(command, name, value)  # no error
  for value in _out_of_range(name):
    with pytest.raises(ValueError, match=f"^--{name} must be ") as info:
      _check(command, name, value)
    assert str(info.value).endswith(f", got {value!r}")

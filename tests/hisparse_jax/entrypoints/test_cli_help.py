"""`hisparse-jax --help` / `-h` / `COMMAND --help`: the commands, then a command's own
flags by group, on stdout, exit 0; a command starts without jax's CUDA plugin traceback
on a machine with no NVIDIA driver."""

import ctypes
import importlib.util
import os
import subprocess
import sys

import pytest
from absl import flags

from hisparse_jax.entrypoints.cli import flag_defs
from hisparse_jax.entrypoints.cli import main as cli


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
  """The groups name real flags, and every flag flag_defs.py defines is in some command's
  help."""
  grouped = {n for groups in cli.COMMAND_FLAGS.values() for _, names in groups for n in names}
  assert set(cli.COMMAND_FLAGS) == set(cli.COMMANDS)
  defined_in = flags.FLAGS.find_module_defining_flag
  ours = {name for name, flag in flags.FLAGS._flags().items()
          if name == flag.name and defined_in(name) == flag_defs.__name__}
  assert grouped == ours, (grouped ^ ours)


def test_helpfull_lists_the_project_flags_first_and_exits_0():
  r = _help("--helpfull")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("usage: hisparse-jax COMMAND [--flags]")
  ours = r.stdout.index("hisparse_jax.entrypoints.cli.flag_defs:")
  absl_logging = r.stdout.index("absl.logging:")
  assert ours < absl_logging
  assert "--top_k_tokens: HiSparse:" in r.stdout and "--verbosity" in r.stdout


def test_a_flag_the_command_does_not_read_is_refused():
  r = _help("serve", "--prometheus_port=1234")  # serve's metrics are on --port /metrics
  assert r.returncode == 2
  assert r.stderr.strip() == ("hisparse-jax serve: error: --prometheus_port is not a flag of "
                              "serve (ignored there); `hisparse-jax serve --help` lists its "
                              "flags")
  r = _help("capacity", "--temperature=0.5", "--n=2")
  assert r.returncode == 2
  assert r.stderr.startswith("hisparse-jax capacity: error: --n, --temperature are not "
                             "flags of capacity")
  assert cli.command_flags("demo") >= {"temperature", "max_new_tokens", "hisparse"}


def _flags_read(source: str) -> set[str]:
  import re

  from hisparse_jax.entrypoints.cli import generate as generate_cmd
  read = {a or b for a, b in re.findall(r'FLAGS\.([a-z_]+)|FLAGS\["([a-z_]+)"\]', source)}
  if "in HISPARSE_FLAGS" in source:  # FLAGS[name] over that tuple
    read |= set(generate_cmd.HISPARSE_FLAGS)
  return read


def test_each_command_lists_every_flag_it_reads():
  """The read-sets the refusal uses are exact: every flag a command module reads, or a
  generate_cmd helper it calls reads, is in its groups, and no group names a flag it
  never reads (so no command refuses a flag it uses, or accepts one it ignores)."""
  import importlib
  import inspect
  import re

  from hisparse_jax.entrypoints.cli import generate as generate_cmd
  ours = {f.name for f in flags.FLAGS.get_flags_for_module(flag_defs)}
  helpers = {name: _flags_read(inspect.getsource(fn)) for name, fn in vars(generate_cmd).items()
             if inspect.isfunction(fn) and fn.__module__ == generate_cmd.__name__}
  for command, (module_name, _) in cli.COMMANDS.items():
    source = inspect.getsource(importlib.import_module(module_name))
    read = _flags_read(source)
    # generate_cmd's helpers it calls (as generate_cmd.NAME or imported by name); for
    # generate_cmd itself, what its main calls
    imported = re.findall(r"from hisparse_jax\.entrypoints\.cli\.generate import ([a-z_, ]+)",
                          source)
    called = (set(re.findall(r"generate_cmd\.([a-z_]+)\(", source))
              | {n.strip() for line in imported for n in line.split(",")})
    if module_name == generate_cmd.__name__:
      called = {"main"}
    changed = True
    while changed:  # helpers calling helpers
      changed = False
      for name in list(called):
        for other in re.findall(r"(?<![.\w])([a-z_]+)\(",
                                inspect.getsource(vars(generate_cmd)[name])):
          if other in helpers and other not in called:
            called.add(other)
            changed = True
    for name in called:
      read |= helpers[name]
    # the dispatcher joins multi-host processes (compile runs on one: it uses no device)
    if command not in ("serve", "bench", "convert", "compile"):
      read |= _flags_read(inspect.getsource(cli._join_processes))
    read &= ours
    assert read == cli.command_flags(command), (command, read ^ cli.command_flags(command))


def _has_nvidia_driver() -> bool:
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    return False
  return True


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None
                    or _has_nvidia_driver(),
                    reason="needs jax's CUDA plugin installed on a machine without a driver")
def test_a_command_starts_quietly_with_the_cuda_plugin_and_no_driver():
  """Without JAX_PLATFORMS, jax's CUDA plugin (installed by make setup for the deviceless
  compile) fails its version check at cuInit and jax logs the traceback at ERROR before it
  falls back to the CPU: the CLI skips that check where no driver loads."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
  r = subprocess.run([sys.executable, "-m", "hisparse_jax", "capacity"], capture_output=True,
                     text=True, timeout=120, env=env)
  assert r.returncode == 0, r.stderr
  assert "Traceback" not in r.stderr and "plugin configuration error" not in r.stderr, r.stderr
  assert r.stdout.startswith("KV cache capacity [memory_kind=device]")

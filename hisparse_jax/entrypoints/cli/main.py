"""The `hisparse-jax` command line: a thin absl layer over the library.

Usage: ``hisparse-jax COMMAND [--flag=value ...]`` (or ``python -m hisparse_jax``).
Each command lives in its own module and exposes ``main(argv)``; this file registers
the commands, prints the help and dispatches. The flags are flag_defs.py's (with
COMMAND_FLAGS: which command reads which; a flag a command does not read is refused
here). Bad input (a ValueError from the command) exits with status 2 and one line naming
the flag or field; `--verbosity=1` or higher prints the traceback before that line.
Every float flag is held to its range (flag_ranges.FLOAT_RANGES: finite, within bounds)
and every integer flag to its own (INT_RANGES) before the command's module is imported.
"""

from __future__ import annotations

import ctypes
import importlib
import logging as std_logging
import os
import sys
import traceback

from absl import app, flags, logging

from hisparse_jax.entrypoints.cli import flag_defs
from hisparse_jax.entrypoints.cli.flag_defs import COMMAND_FLAGS, command_flags
from hisparse_jax.entrypoints.cli.flag_ranges import FLOAT_RANGES, INT_RANGES

FLAGS = flags.FLAGS

# command name -> (module, one-line help). Modules are imported lazily so that
# `--help` and flag errors stay fast.
COMMANDS: dict[str, tuple[str, str]] = {}


def register(name: str, module: str, help_text: str) -> None:
  COMMANDS[name] = (module, help_text)


register("capacity", "hisparse_jax.entrypoints.cli.capacity",
         "Load the model, allocate the KV pools, print the KV capacity of each memory kind.")
register("generate", "hisparse_jax.entrypoints.cli.generate",
         "Generate for --prompt / --prompts_file prompts; mark expected answers RIGHT/WRONG.")
register("demo", "hisparse_jax.entrypoints.cli.demo",
         "Long retrieval prompts on the default model with a small device KV budget.")
register("serve", "hisparse_jax.entrypoints.cli.serve",
         "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics).")
register("bench", "hisparse_jax.entrypoints.cli.bench",
         "Benchmark suites (--suite=NAME|all): side-by-side ratios, table + --out JSON.")
register("compile", "hisparse_jax.entrypoints.cli.compile",
         "Compile every program the engine builds for these flags for a GPU (--target), "
         "without one: a table + JSON, exit 2 if the config cannot run there.")
register("convert", "hisparse_jax.entrypoints.cli.convert",
         "Write --model (a GGUF file, preset or directory) as a Hugging Face directory --out.")


HELP_FLAGS = ("-h", "--help", "-help", "--helpshort")


def cli_flags(parser_type: type) -> list[str]:
  """The flags the CLI defines (flag_defs.py and every command module) whose parser is a
  `parser_type` (flags.FloatParser, flags.IntegerParser), from absl's registry: not
  absl's own nor those of the standalone bench scripts (python -m hisparse_jax.bench.X)."""
  for module, _ in COMMANDS.values():
    importlib.import_module(module)
  names = set()
  for module, module_flags in FLAGS.flags_by_module_dict().items():
    if module.startswith("hisparse_jax.entrypoints.cli"):
      names |= {f.name for f in module_flags if isinstance(f.parser, parser_type)}
  return sorted(names)


def check_int_flags(command: str) -> None:
  """Raises ValueError (one line naming the flag and its range) for the first integer
  flag `command` reads whose value is outside INT_RANGES."""
  for name in sorted(command_flags(command)):
    if isinstance(FLAGS[name].parser, flags.IntegerParser):
      error = INT_RANGES[name].error(name, FLAGS[name].value)
      if error is not None:
        raise ValueError(error)


def check_float_flags(command: str) -> None:
  """Raises ValueError (one line naming the flag and its range) for the first float flag
  `command` reads whose value is outside FLOAT_RANGES."""
  for name in sorted(command_flags(command)):
    if isinstance(FLAGS[name].parser, flags.FloatParser):
      error = FLOAT_RANGES[name].error(name, FLAGS[name].value)
      if error is not None:
        raise ValueError(error)


def help_text(command: str | None = None) -> str:
  """`hisparse-jax --help`: the commands; `hisparse-jax COMMAND --help`: that command's
  flags by group, each with its default and help."""
  if command not in COMMANDS:
    return (_usage() + "\n\n`hisparse-jax COMMAND --help` lists a command's flags; "
            "`--helpfull` lists every flag (absl's included).")
  lines = [f"usage: hisparse-jax {command} [--flags]", "", COMMANDS[command][1]]
  for group, names in COMMAND_FLAGS.get(command, ()):
    lines += ["", f"{group}:"]
    for name in names:
      flag = FLAGS[name]
      default = flag.default
      shown = ("none" if default is None else str(default).lower()
               if isinstance(default, bool) else str(default))
      lines.append(f"  --{'[no]' if isinstance(default, bool) else ''}{name} "
                   f"(default: {shown})")
      lines.append(f"      {flag.help.split(';' + chr(10))[0]}")  # (not absl's list note)
  return "\n".join(lines)


class UsageError(ValueError):
  """Bad input from the command line; reported as one line, exit status 2."""


def _usage() -> str:
  lines = ["usage: hisparse-jax COMMAND [--flags]", "commands:"]
  for name, (_, help_text) in sorted(COMMANDS.items()):
    lines.append(f"  {name:<10} {help_text}")
  return "\n".join(lines)


def _main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(_usage(), file=sys.stderr)
    return 2
  name, rest = argv[1], argv[2:]
  if name not in COMMANDS:
    print(f"hisparse-jax: unknown command {name!r}; choose one of: "
          f"{', '.join(sorted(COMMANDS))}", file=sys.stderr)
    return 2
  if rest:
    print(f"hisparse-jax {name}: unexpected argument {rest[0]!r}", file=sys.stderr)
    return 2
  unread = unread_flags(name)
  if unread:
    print(f"hisparse-jax {name}: error: {', '.join('--' + f for f in unread)} "
          f"{'is not a flag' if len(unread) == 1 else 'are not flags'} of {name} (ignored "
          f"there); `hisparse-jax {name} --help` lists its flags", file=sys.stderr)
    return 2
  try:
    check_float_flags(name)  # before the command's imports (jax): a fast refusal
    check_int_flags(name)
    module = importlib.import_module(COMMANDS[name][0])
    _join_processes(name)
    return int(module.main(argv[1:]) or 0)
  except ValueError as e:  # bad input: one line, exit 2; the traceback only when verbose
    if logging.get_verbosity() >= logging.DEBUG:
      traceback.print_exc()
    print(f"hisparse-jax {name}: error: {error_line(e)}", file=sys.stderr)
    return 2


def unread_flags(command: str) -> list[str]:
  """Flags of flag_defs.py given on the command line that `command` does not read (absl's
  own flags, --verbosity and the like, are every command's)."""
  ours = [f.name for f in FLAGS.get_flags_for_module(flag_defs.__name__)]
  return sorted(n for n in ours if FLAGS[n].present and n not in command_flags(command))


def _join_processes(command: str) -> None:
  """Multi-host (--coordinator_address or --num_processes > 1): joins the other
  processes before any command touches jax; processes other than 0 run silently (they
  compute the same steps; process 0 writes the results)."""
  if FLAGS.coordinator_address is None and FLAGS.num_processes == 1:
    return
  from hisparse_jax.distributed import parallel  # noqa: PLC0415 (imports jax)

  if FLAGS.coordinator_address is None:
    raise ValueError(f"--num_processes={FLAGS.num_processes} needs --coordinator_address")
  if command in ("serve", "bench"):  # every process must see the same requests
    raise ValueError(f"--coordinator_address: {command} runs on one process (requests reach "
                     "one host); generate, demo and capacity run on several")
  parallel.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                  FLAGS.process_id, FLAGS.coordinator_timeout_s)
  if FLAGS.process_id != 0:
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)


def error_line(error: ValueError) -> str:
  """The one line a bad-input error is reported as. A checkpoint the loader refuses is
  the --model flag's fault (its message names the file and tensor)."""
  loader = sys.modules.get("models.loader")  # not loaded: the error cannot come from it
  message = " ".join(str(error).split())
  if loader is not None and isinstance(error, loader.CheckpointError):
    return f"--model: {message}"
  return message


def helpfull_text() -> str:
  """`--helpfull`: the commands, then every flag by module, the project's first."""
  modules = FLAGS.flags_by_module_dict()
  ours = sorted(m for m in modules if m.split(".")[0] in ("hisparse_jax", "kernels_pallas",
                                                          "models", "configs"))
  others = sorted(set(modules) - set(ours))
  return "\n\n".join([_usage()] + [FLAGS.module_help(m) for m in ours + others])


def quiet_cuda_plugin_without_a_driver() -> None:
  """`make setup` installs jax[cuda13] everywhere (its GPU compiler serves `compile`
  without a GPU). On a machine with no NVIDIA driver the CUDA plugin's version check fails
  at cuInit when jax starts, and jax logs that traceback at ERROR on every command before
  it falls back to the CPU. With no driver (libcuda.so.1 does not load) there is no device
  to check: the check is skipped (JAX_SKIP_CUDA_CONSTRAINTS_CHECK) and the plugin, finding
  no device, leaves jax on the CPU quietly. With a driver, or JAX_PLATFORMS set, nothing
  changes."""
  if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
    return
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"


def run() -> None:
  """Console-script entry point."""
  quiet_cuda_plugin_without_a_driver()  # before anything imports jax
  if "--helpfull" in sys.argv[1:]:  # absl's own --helpfull exits 1, its flags first
    print(helpfull_text())
    sys.exit(0)
  if any(a in HELP_FLAGS for a in sys.argv[1:]):  # help on stdout, exit 0
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    print(help_text(command))
    sys.exit(0)

  def main(argv):
    sys.exit(_main(argv))
  # jax logs at INFO that it found no TPU library on every start: not this tool's news.
  std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)
  app.run(main, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f"hisparse-jax: error: {e}", file=sys.stderr)
    sys.exit(2)

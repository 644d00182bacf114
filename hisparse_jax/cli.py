"""The `hisparse-jax` command line: a thin absl layer over the library.

Usage: ``hisparse-jax COMMAND [--flag=value ...]`` (or ``python -m hisparse_jax``).
Each command lives in its own module and exposes ``main(argv)``; this file only
defines the shared flags and dispatches. Bad input exits with status 2 and one
line naming the flag or field.
"""

from __future__ import annotations

import importlib
import sys

from absl import app, flags, logging

# command name -> (module, one-line help). Modules are imported lazily so that
# `--help` and flag errors stay fast.
COMMANDS: dict[str, tuple[str, str]] = {}


def register(name: str, module: str, help_text: str) -> None:
  COMMANDS[name] = (module, help_text)


register("capacity", "hisparse_jax.capacity_cmd",
         "Load the model, allocate the KV pools, log the KV capacity of each memory kind.")


FLAGS = flags.FLAGS

# Model and memory flags shared by every command.
flags.DEFINE_string(
    "model", None,
    "Path of a Hugging Face-format checkpoint directory (config.json, model.safetensors, "
    "tokenizer.json). Default: the embedded hisparse-tiny model.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "Dtype of the weights and of the KV cache.")
flags.DEFINE_integer("block_size", 16, "Tokens per KV block (a power of two).")
flags.DEFINE_float(
    "device_kv_gib", None,
    "Device (accelerator) KV budget in GiB. Default: a fraction of free device memory "
    "where memory_stats() exists, else 0.25 GiB.")
flags.DEFINE_float("host_pool_gib", 1.0,
                   "Pinned-host KV pool in GiB (refused above 95% of available RAM).")
flags.DEFINE_integer("max_model_len", 2048, "Longest request (prompt + output) in tokens.")


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
  module = importlib.import_module(COMMANDS[name][0])
  try:
    return int(module.main(argv[1:]) or 0)
  except ValueError as e:  # bad input: one line, no traceback unless verbose
    if logging.get_verbosity() >= logging.DEBUG:
      raise
    print(f"hisparse-jax {name}: error: {e}", file=sys.stderr)
    return 2


def run() -> None:
  """Console-script entry point."""
  def main(argv):
    sys.exit(_main(argv))
  app.run(main, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f"hisparse-jax: error: {e}", file=sys.stderr)
    sys.exit(2)

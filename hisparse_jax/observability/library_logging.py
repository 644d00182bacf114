"""The engine's log lines for library users (the capacity lines at model load, the status
lines): shown at INFO as vLLM's logger shows its own."""

from __future__ import annotations

import os

from absl import logging


def configure_library_logging() -> None:
  """Shows this engine's INFO lines (the capacity of each memory kind at model load, the
  status lines) to a library user, as vLLM's logger does: when no absl app parsed the
  flags (the CLI and absl apps set their own verbosity) and the verbosity is below INFO,
  it becomes INFO. `HISPARSE_CONFIGURE_LOGGING=0` leaves logging alone."""
  import logging as std_logging  # noqa: PLC0415

  from absl import flags  # noqa: PLC0415

  if os.environ.get("HISPARSE_CONFIGURE_LOGGING", "1") == "0" or flags.FLAGS.is_parsed():
    return
  if logging.get_verbosity() < logging.INFO:
    logging.set_verbosity(logging.INFO)
    # jax logs at INFO that it found no TPU library: not the embedder's news.
    std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)

"""The values each float and integer flag of `hisparse-jax` takes (FLOAT_RANGES,
INT_RANGES), checked by main.py before a command's module is imported: absl parses nan,
inf and 1e308 as floats and takes any integer, which reached the commands as tracebacks,
overflows or nonsense plans. Each refusal is one line naming the flag and its range.
tests/hisparse_jax/entrypoints/test_float_flags.py and test_int_flags.py hold every flag
of its type to an entry here. Pure data: imports nothing of the CLI.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class FloatRange:
  """The values a float flag takes: a finite number from `lo` to `hi` (`lo_open` /
  `hi_open`: that bound itself refused), or None where `none_ok` (a default of None: the
  command picks the value). `below`: the wording a finite value under `lo` is refused
  with, kept from the check that predates this table (None: the range)."""
  lo: float
  hi: float
  lo_open: bool = False
  hi_open: bool = False
  none_ok: bool = False
  below: str | None = None

  def __str__(self) -> str:
    return (f"{'(' if self.lo_open else '['}{_number(self.lo)}, {_number(self.hi)}"
            f"{')' if self.hi_open else ']'}")

  def error(self, name: str, value: float | None) -> str | None:
    """The one line refusing `value` for --`name`, or None when it is in range."""
    if value is None:
      return None if self.none_ok else f"--{name} must be a finite number in {self}, got None"
    if not math.isfinite(value):
      return f"--{name} must be a finite number in {self}, got {value}"
    below = value < self.lo or (self.lo_open and value == self.lo)
    if below and self.below is not None:
      return f"--{name} must be {self.below}, got {value}"
    if below or value > self.hi or (self.hi_open and value == self.hi):
      return f"--{name} must be in {self}, got {value}"
    return None


def _number(x: float) -> str:
  """A bound as people write it: 0, 86400, 1e6."""
  if x == int(x) and abs(x) < 1e5:
    return str(int(x))
  return f"{x:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


# Every float flag's range, checked before any command runs (tests/hisparse_jax/
# entrypoints/test_float_flags.py holds each float flag to an entry): absl parses nan, inf
# and 1e308 as floats, which reached int() (GiB to bytes, seconds to jax's int timeout) as
# a traceback or were taken as a budget or a wait.
FLOAT_RANGES: dict[str, FloatRange] = {
    # GiB budgets: 1e6 GiB (a PiB) is past any machine; the host pool is also held to 95%
    # of the available RAM, the device budget to the device's memory, by the commands.
    "device_kv_gib": FloatRange(0, 1e6, lo_open=True, none_ok=True, below="positive"),
    "host_pool_gib": FloatRange(0, 1e6, below=">= 0"),
    "disk_cache_gib": FloatRange(0, 1e6, lo_open=True, below="a positive number"),
    # Seconds: a day at most (jax.distributed takes whole seconds; a linger or a drain of
    # more than a day is a typo).
    "coordinator_timeout_s": FloatRange(0, 86400, lo_open=True, below="> 0"),
    "dashboard_linger_s": FloatRange(0, 86400),
    "drain_timeout_s": FloatRange(0, 86400, below=">= 0"),
    "request_timeout_s": FloatRange(0, 86400, lo_open=True, below="a positive number"),
    # Sampling: at temperature 100 the draw is near uniform already (and 1e308 overflows
    # the float32 the step samples in); top_p as its help says.
    "temperature": FloatRange(0, 100, below=">= 0"),
    "top_p": FloatRange(0, 1, lo_open=True),
}


@dataclasses.dataclass(frozen=True)
class IntRange:
  """The values an integer flag takes: `lo` to `hi` inclusive, or None where `none_ok`.
  `below`: the wording a value under `lo` is refused with (kept from the command's own
  check, which this one now runs before; None: the range)."""
  lo: int
  hi: int
  none_ok: bool = False
  below: str | None = None

  def __str__(self) -> str:
    return f"[{_int_bound(self.lo)}, {_int_bound(self.hi)}]"

  def error(self, name: str, value: int | None) -> str | None:
    """The one line refusing `value` for --`name`, or None when it is in range."""
    if value is None:
      return None if self.none_ok else f"--{name} must be an integer in {self}, got None"
    if value < self.lo and self.below is not None:
      return f"--{name} must be {self.below}, got {value}"
    if not self.lo <= value <= self.hi:
      return f"--{name} must be in {self}, got {value}"
    return None


def _int_bound(x: int) -> str:
  """A bound as people write it: 65535, 2**24."""
  if x >= 2**16 and x & (x - 1) == 0:
    return f"2**{x.bit_length() - 1}"
  if x >= 2**16 and (x + 1) & x == 0:
    return f"2**{x.bit_length()}-1"
  return str(x)


_TOKENS = 2**24  # 16M tokens: past any context this engine runs (int32 positions hold it)
# Every integer flag's range, checked with the float flags' (tests/hisparse_jax/
# entrypoints/test_int_flags.py holds each integer flag to an entry): absl takes any
# integer, and a count of 0 or 2**63 went on as a plan (`capacity --max_num_seqs=0`) or
# reached an int32 array as an OverflowError.
INT_RANGES: dict[str, IntRange] = {
    # Sizes of the engine.
    "block_size": IntRange(1, 2**16, none_ok=True, below="a power of two"),
    "max_model_len": IntRange(1, _TOKENS, below=">= 1"),
    "max_num_batched_tokens": IntRange(1, _TOKENS, none_ok=True, below=">= 1"),
    "max_num_seqs": IntRange(1, 2**16, below=">= 1"),
    "tensor_parallel_size": IntRange(1, 2**16, below="a positive integer"),
    "max_step_programs": IntRange(1, 2**12, below=">= 1"),
    "num_processes": IntRange(1, 2**16, below=">= 1"),
    "process_id": IntRange(0, 2**16 - 1, below=">= 0"),
    # HiSparse (HiSparseConfig checks them against each other).
    "top_k_tokens": IntRange(1, _TOKENS, none_ok=True, below="positive"),
    "hot_buffer_tokens": IntRange(1, _TOKENS, none_ok=True, below="positive"),
    "sparse_threshold_tokens": IntRange(1, _TOKENS, none_ok=True, below="positive"),
    "sink_tokens": IntRange(0, _TOKENS, none_ok=True, below=">= 0"),
    "local_tokens": IntRange(0, _TOKENS, none_ok=True, below=">= 0"),
    "resident_sparse_min_tokens": IntRange(0, _TOKENS, none_ok=True, below=">= 0"),
    # Sampling and the run.
    "max_new_tokens": IntRange(1, _TOKENS, below=">= 1"),
    "n": IntRange(1, 2**16, below="at least 1"),
    "top_k": IntRange(-1, 2**31 - 1, below=">= 0 (0 or -1 disables it)"),
    "logprobs": IntRange(0, 2**16, none_ok=True, below=">= 0 or None"),
    "seed": IntRange(0, 2**32 - 1, below=">= 0"),
    "demo_seed": IntRange(0, 2**32 - 1, below=">= 0"),
    "demo_num_prompts": IntRange(1, 2**16, none_ok=True, below=">= 1"),
    "demo_context_len": IntRange(1, _TOKENS, none_ok=True, below=">= 1"),
    "log_every_steps": IntRange(0, 2**31 - 1, below=">= 0"),
    # Ports (0: any free port, where the flag allows it).
    "port": IntRange(0, 65535),
    "dashboard_port": IntRange(0, 65535),
    "prometheus_port": IntRange(1, 65535, none_ok=True),
    # The third tier: ten years at most.
    "remote_cache_ttl_s": IntRange(1, 10 * 365 * 86400, below="a positive integer"),
    # serve's limits.
    "max_request_bytes": IntRange(1, 2**40, below=">= 1"),
    "max_prompts_per_request": IntRange(1, 2**20, below=">= 1"),
    "max_request_prompt_tokens": IntRange(1, 2**31 - 1, below=">= 1"),
    "max_logprobs": IntRange(0, 2**16, below=">= 0"),
    "max_waiting_requests": IntRange(1, 2**24, below=">= 1"),
    "max_concurrent_streams": IntRange(1, 2**20, below=">= 1"),
    "max_stream_buffer": IntRange(1, 2**24, below=">= 1"),
}

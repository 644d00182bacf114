"""What every `hisparse-jax bench` suite shares: side-by-side timing, the machine, tables.

The machines these benches run on are shared and noisy, so a suite never compares two
figures taken at different times: `interleaved` runs the contenders in turn, one
repetition each, rotating who goes first, and every ratio is of the medians of one such
run. Absolute figures carry the machine they were taken on (`machine`: CPU model, cores,
accelerator, jax version, load average before and after).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import jax

from kernels_pallas import bench as kernel_bench


@dataclasses.dataclass
class Impl:
  """One implementation of a benchmarked kernel call (gpu-bench's cases and peers)."""
  fn: Callable  # called as fn(*args); a jitted function (or a partial of one)
  args: tuple | Callable[[], tuple]  # or a thunk giving them (built when the impl runs)
  note: str = ""
  # gpu-bench: what this impl moves and its check(out, ref) when not its case's (an impl
  # over another storage of the same inputs: the select over int8 bounds)
  bytes: int | None = None
  check: Callable | None = None


def block(out):
  """Waits for every jax array in `out` (numpy results are ready already)."""
  return jax.block_until_ready(out)


def interleaved(thunks: Mapping[str, Callable[[], object]], reps: int,
                warmup: int = 1) -> dict[str, list[float]]:
  """Seconds of each thunk over `reps` rounds; each round runs every thunk once.

  Thunks are warmed up (compiled) first. The order rotates every round, so no contender
  always runs right after the same neighbour (caches, turbo, a noisy co-tenant).
  """
  if reps < 1:
    raise ValueError(f"reps must be >= 1, got {reps}")
  names = list(thunks)
  for _ in range(warmup):
    for name in names:
      block(thunks[name]())
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(reps):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      block(thunks[name]())
      times[name].append(time.perf_counter() - start)
  return times


class CallTimer:
  """Wraps a bound method on its instance (`obj.f = CallTimer(obj.f)`): `seconds` collects
  each call's duration, `last_args` the latest arguments. Measures a component without
  modifying it."""

  def __init__(self, fn: Callable):
    self.fn = fn
    self.seconds: list[float] = []
    self.last_args: tuple = ()

  def __call__(self, *args, **kwargs):
    self.last_args = args
    start = time.perf_counter()
    try:
      return self.fn(*args, **kwargs)
    finally:
      self.seconds.append(time.perf_counter() - start)

  def take(self) -> float:
    """Total seconds since the last take."""
    total = sum(self.seconds)
    self.seconds = []
    return total


def median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs))


def geomean(xs: Sequence[float]) -> float:
  xs = list(xs)
  prod = 1.0
  for x in xs:
    prod *= x
  return prod ** (1.0 / len(xs))


def machine() -> dict:
  """The machine a run was measured on (kernels_pallas.bench's description) plus the
  load average and RAM: an absolute figure means nothing without them."""
  out = kernel_bench._machine()  # one description of a machine for every bench
  out["load_avg_1_5_15"] = list(os.getloadavg())
  try:
    out["ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
  except (ValueError, OSError):
    out["ram_gib"] = None
  return out


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  """A plain-text table: floats with 3 significant decimals, columns right-aligned."""

  def cell(x):
    if isinstance(x, float):
      return f"{x:,.3f}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)

  cells = [[cell(x) for x in row] for row in rows]
  widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
  lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
  lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
  return "\n".join(lines)

"""The periodic status line of a running engine, in the spirit of vLLM's.

Owns what a user watching a long run sees every `every_steps` engine steps, one absl
INFO line built from the engine's metrics (rates are over the interval since the
previous line):

  step 200: running 3, swapped 2, waiting 3 reqs; KV usage device 93.8%, host 1.2%;
  prefix-cache hit rate 0.0%, hot-buffer hit rate -; h2d 0.41 GB/s, d2h 0.52 GB/s;
  generation 181.3 tokens/s; preemptions 5

The hot-buffer hit rate is hot / (hot + host) blocks selected: the share of the
blocks attention needed from outside the device-resident set that the hot buffer
already held ("-" until HiSparse selects any).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from absl import logging

GB = 1e9


def _get(metrics: dict[str, float], key: str) -> float:
  return float(metrics.get(key, 0.0))


def status_line(step: int, now: dict[str, float], before: dict[str, float],
                seconds: float) -> str:
  """One status line from two metric snapshots `seconds` apart (`before` may be {})."""
  def delta(key: str) -> float:
    return _get(now, key) - _get(before, key)

  def rate(key: str, scale: float = 1.0) -> float:
    return delta(key) / scale / seconds if seconds > 0 else 0.0

  queries = _get(now, "hisparse_prefix_cache_queries_total")
  hits = (_get(now, 'hisparse_prefix_cache_hits_total{memory_kind="device"}')
          + _get(now, 'hisparse_prefix_cache_hits_total{memory_kind="pinned_host"}'))
  prefix = f"{100.0 * hits / queries:.1f}%" if queries else "-"
  hot = _get(now, 'hisparse_blocks_selected_total{source="hot"}')
  host = _get(now, 'hisparse_blocks_selected_total{source="host"}')
  hot_rate = f"{100.0 * hot / (hot + host):.1f}%" if hot + host else "-"
  running, swapped, waiting = (_get(now, f'hisparse_num_requests{{state="{s}"}}')
                               for s in ("running", "swapped", "waiting"))
  device_usage = 100.0 * _get(now, 'hisparse_kv_usage_ratio{memory_kind="device"}')
  host_usage = 100.0 * _get(now, 'hisparse_kv_usage_ratio{memory_kind="pinned_host"}')
  h2d = rate('hisparse_transfer_bytes_total{direction="h2d"}', GB)
  d2h = rate('hisparse_transfer_bytes_total{direction="d2h"}', GB)
  return (f"step {step}: running {running:.0f}, swapped {swapped:.0f}, waiting {waiting:.0f} "
          f"reqs; KV usage device {device_usage:.1f}%, host {host_usage:.1f}%; "
          f"prefix-cache hit rate {prefix}, hot-buffer hit rate {hot_rate}; "
          f"h2d {h2d:.2f} GB/s, d2h {d2h:.2f} GB/s; "
          f"generation {rate('hisparse_generation_tokens_total'):.1f} tokens/s; "
          f"preemptions {_get(now, 'hisparse_preemptions_total'):.0f}")


class StatusLogger:
  """Logs `status_line` every `every_steps` steps of `engine` (0 disables it).

  Invariant: each line's rates cover exactly the steps since the previous line.
  """

  def __init__(self, engine, every_steps: int,
               clock: Callable[[], float] = time.perf_counter):
    if every_steps < 0:
      raise ValueError(f"log_every_steps must be >= 0, got {every_steps}")
    self.engine = engine
    self.every_steps = every_steps
    self._clock = clock
    self._last_step = engine.num_steps
    self._last_time = clock()
    self._last_metrics: dict[str, float] = engine.metrics() if every_steps else {}

  def maybe_log(self) -> str | None:
    """Call after each `engine.step()`; logs and returns the line when one is due."""
    if not self.every_steps or self.engine.num_steps - self._last_step < self.every_steps:
      return None
    now_time = self._clock()
    now = self.engine.metrics()
    line = status_line(self.engine.num_steps, now, self._last_metrics,
                       now_time - self._last_time)
    self._last_step, self._last_time, self._last_metrics = (self.engine.num_steps, now_time,
                                                            now)
    logging.info("%s", line)
    return line

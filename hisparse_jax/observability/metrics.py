"""The engine's metrics registry: counters, gauges and histograms with labels.

Owns the one place every part of the engine records numbers. A `MetricsRegistry`
holds named metrics; each labelled series is addressed by its label values. The
registry has two read-outs:

- `to_dict()`: a flat ``{key: float}`` dict (for `--metrics_json` and `llm.metrics()`),
  where a labelled series is keyed like ``hisparse_transfer_bytes_total{direction="h2d"}``
  and a histogram contributes ``<name>_count``, ``<name>_sum``, ``<name>_p50`` and
  ``<name>_p99`` (labels appended the same way);
- Prometheus: each registry owns its own `prometheus_client.CollectorRegistry` (one per
  engine, so two engines in one process never collide) and mirrors every update into
  it; `serve(port)` starts prometheus-client's HTTP server on that registry.

Metric names follow the engine's public list (issue 6); the ones this module defines
for other modules are the constants below.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import numpy as np
import prometheus_client

# Transfers between the device pool and the host pool (hisparse_jax.kv_cache.transfer).
TRANSFERS_TOTAL = "hisparse_transfers_total"  # {direction}: jitted transfer calls
TRANSFER_BLOCKS_TOTAL = "hisparse_transfer_blocks_total"  # {direction}: blocks moved
TRANSFER_BYTES_TOTAL = "hisparse_transfer_bytes_total"  # {direction}: K+V bytes, all layers
TRANSFER_SECONDS = "hisparse_transfer_seconds"  # histogram {direction}: dispatch -> done
# Capacity (hisparse_jax.kv_cache.capacity).
KV_CAPACITY_TOKENS = "hisparse_kv_capacity_tokens"  # {memory_kind}
# {memory_kind, device}: tensor parallel only, each device's live KV shard bytes
KV_CAPACITY_BYTES = "hisparse_kv_capacity_bytes"

# The third KV tier (hisparse_jax.engine.tier_connector), labelled {tier}: disk, remote.
# Named after vLLM's external prefix cache (queries / hits in tokens) and SGLang HiCache's
# storage metrics (bytes and seconds each way, failures).
TIER_USED_BYTES = "hisparse_kv_tier_used_bytes"  # stored bytes (residency)
TIER_USED_TOKENS = "hisparse_kv_tier_used_tokens"
TIER_CAPACITY_BYTES = "hisparse_kv_tier_capacity_bytes"  # configured cap; 0: server-bounded
TIER_PENDING_STORES = "hisparse_kv_tier_pending_stores"  # blocks queued for a store
TIER_LOADING_REQUESTS = "hisparse_kv_tier_loading_requests"  # requests waiting on a load
TIER_LOOKUP_TOKENS = "hisparse_kv_tier_lookup_tokens_total"  # after device+host misses
TIER_HIT_TOKENS = "hisparse_kv_tier_hit_tokens_total"
TIER_LOADED_BLOCKS = "hisparse_kv_tier_loaded_blocks_total"
TIER_GATE_REFUSALS = "hisparse_kv_tier_gate_refusals_total"  # load slower than recompute
TIER_LOAD_BYTES = "hisparse_kv_tier_load_bytes_total"
TIER_LOAD_SECONDS = "hisparse_kv_tier_load_seconds_total"
TIER_STORE_BYTES = "hisparse_kv_tier_store_bytes_total"
TIER_STORE_SECONDS = "hisparse_kv_tier_store_seconds_total"
TIER_EVICTIONS = "hisparse_kv_tier_evictions_total"  # by the tier's byte cap
TIER_FAILURES = "hisparse_kv_tier_failures_total"  # {tier, reason}: blocks (or an open)

DIRECTION_H2D = "h2d"  # host pool -> device pool (swap in)
DIRECTION_D2H = "d2h"  # device pool -> host pool (swap out / write-back)

# Seconds; spans 10 us .. 10 s, enough for a block transfer and for a long prefill.
DEFAULT_SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0,
                           3.0, 10.0)
# Histogram quantiles are computed over the most recent observations of a series.
QUANTILE_WINDOW = 4096

LabelValues = tuple[str, ...]


def series_key(name: str, labelnames: Sequence[str], values: Sequence[str]) -> str:
  """`name{a="x",b="y"}` (or just `name` without labels), the key used by `to_dict()`."""
  if not labelnames:
    return name
  inner = ",".join(f'{k}="{v}"' for k, v in zip(labelnames, values))
  return f"{name}{{{inner}}}"


class _Metric:
  """A named metric with a fixed tuple of label names; series keyed by label values."""

  kind = ""

  def __init__(self, name: str, help_text: str, labelnames: Sequence[str],
               prom_registry: prometheus_client.CollectorRegistry):
    self.name = name
    self.help = help_text
    self.labelnames: tuple[str, ...] = tuple(labelnames)
    self._lock = threading.Lock()
    self._prom = self._make_prom(prom_registry)

  def _make_prom(self, prom_registry):
    raise NotImplementedError

  def _values(self, labels: dict[str, str]) -> LabelValues:
    if set(labels) != set(self.labelnames):
      raise ValueError(f"metric {self.name}: labels {sorted(labels)} given, "
                       f"expected {sorted(self.labelnames)}")
    return tuple(str(labels[k]) for k in self.labelnames)

  def _prom_child(self, values: LabelValues):
    return self._prom.labels(*values) if self.labelnames else self._prom


class _ScalarMetric(_Metric):
  """A metric with one float per label-value tuple (counters and gauges)."""

  def __init__(self, *args):
    super().__init__(*args)
    self._series: dict[LabelValues, float] = {}
    if not self.labelnames:
      self._series[()] = 0.0

  def _add(self, amount: float, labels: dict[str, str]) -> None:
    values = self._values(labels)
    with self._lock:
      self._series[values] = self._series.get(values, 0.0) + float(amount)
    self._prom_child(values).inc(amount)

  def value(self, **labels: str) -> float:
    return self._series.get(self._values(labels), 0.0)

  def items(self) -> list[tuple[LabelValues, float]]:
    with self._lock:
      return list(self._series.items())


class Counter(_ScalarMetric):
  """Monotonic counter. Invariant: every series only grows; `inc` refuses amounts < 0."""

  kind = "counter"

  def _make_prom(self, prom_registry):
    return prometheus_client.Counter(self.name, self.help, self.labelnames,
                                     registry=prom_registry)

  def inc(self, amount: float = 1.0, **labels: str) -> None:
    if amount < 0:
      raise ValueError(f"counter {self.name}: cannot add a negative amount ({amount})")
    self._add(amount, labels)


class Gauge(_ScalarMetric):
  """A value that goes up and down (usage ratios, capacities)."""

  kind = "gauge"

  def _make_prom(self, prom_registry):
    return prometheus_client.Gauge(self.name, self.help, self.labelnames,
                                   registry=prom_registry)

  def set(self, value: float, **labels: str) -> None:
    values = self._values(labels)
    with self._lock:
      self._series[values] = float(value)
    self._prom_child(values).set(value)

  def inc(self, amount: float = 1.0, **labels: str) -> None:
    self._add(amount, labels)


class _HistogramSeries:
  __slots__ = ("count", "sum", "window")

  def __init__(self):
    self.count = 0
    self.sum = 0.0
    self.window: collections.deque[float] = collections.deque(maxlen=QUANTILE_WINDOW)


class Histogram(_Metric):
  """Distribution of observations: count and sum over all of them, p50/p99 over the
  last `QUANTILE_WINDOW` (linear interpolation, numpy's default). Prometheus sees
  cumulative buckets."""

  kind = "histogram"

  def __init__(self, name, help_text, labelnames, prom_registry,
               buckets: Sequence[float] = DEFAULT_SECONDS_BUCKETS):
    self._buckets = tuple(buckets)
    super().__init__(name, help_text, labelnames, prom_registry)
    self._series: dict[LabelValues, _HistogramSeries] = {}

  def _make_prom(self, prom_registry):
    return prometheus_client.Histogram(self.name, self.help, self.labelnames,
                                       registry=prom_registry, buckets=self._buckets)

  def observe(self, value: float, **labels: str) -> None:
    values = self._values(labels)
    with self._lock:
      series = self._series.setdefault(values, _HistogramSeries())
      series.count += 1
      series.sum += float(value)
      series.window.append(float(value))
    self._prom_child(values).observe(value)

  def observe_many(self, values: Sequence[float], **labels: str) -> None:
    """`observe` of each value, the label lookups and the lock taken once."""
    key = self._values(labels)
    values = [float(v) for v in values]
    with self._lock:
      series = self._series.setdefault(key, _HistogramSeries())
      series.count += len(values)
      series.sum += sum(values)
      series.window.extend(values)
    child = self._prom_child(key)
    for value in values:
      child.observe(value)

  def count(self, **labels: str) -> int:
    series = self._series.get(self._values(labels))
    return series.count if series else 0

  def quantile(self, q: float, **labels: str) -> float:
    """The q-quantile (0 <= q <= 1) of the recent observations; NaN when there are none."""
    series = self._series.get(self._values(labels))
    if not series or not series.window:
      return float("nan")
    return float(np.quantile(np.asarray(series.window), q))

  def items(self) -> list[tuple[LabelValues, dict[str, float]]]:
    with self._lock:
      snapshot = [(v, s.count, s.sum, np.asarray(s.window)) for v, s in self._series.items()]
    return [(v, {"count": float(c), "sum": total, "p50": float(np.quantile(w, 0.5)),
                 "p99": float(np.quantile(w, 0.99))}) for v, c, total, w in snapshot]


class MetricsRegistry:
  """The metrics of one engine.

  Invariants: a name maps to exactly one metric of one kind and one tuple of label
  names (asking again for the same name, kind and labels returns the same object; any
  other combination raises `ValueError`); the Prometheus registry holds exactly the
  metrics of this registry and no process-global collectors.
  """

  def __init__(self, prometheus_port: int | None = None):
    """`prometheus_port`: when given (`--prometheus_port`), serve this registry there."""
    self.prometheus_registry = prometheus_client.CollectorRegistry(auto_describe=True)
    self._metrics: dict[str, _Metric] = {}
    self._lock = threading.Lock()
    self._server = None
    if prometheus_port is not None:
      self.serve(prometheus_port)

  def _get_or_create(self, cls, name: str, help_text: str, labelnames: Sequence[str],
                     **kwargs) -> _Metric:
    with self._lock:
      metric = self._metrics.get(name)
      if metric is not None:
        if type(metric) is not cls or metric.labelnames != tuple(labelnames):
          raise ValueError(f"metric {name} already registered as a {metric.kind} with "
                           f"labels {metric.labelnames}")
        return metric
      metric = cls(name, help_text, labelnames, self.prometheus_registry, **kwargs)
      self._metrics[name] = metric
      return metric

  def counter(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Counter:
    return self._get_or_create(Counter, name, help_text, labelnames)

  def gauge(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> Gauge:
    return self._get_or_create(Gauge, name, help_text, labelnames)

  def histogram(self, name: str, help_text: str, labelnames: Sequence[str] = (),
                buckets: Sequence[float] = DEFAULT_SECONDS_BUCKETS) -> Histogram:
    return self._get_or_create(Histogram, name, help_text, labelnames, buckets=buckets)

  def get(self, name: str) -> _Metric:
    return self._metrics[name]

  def to_dict(self) -> dict[str, float]:
    """All series as a flat dict, keys sorted; see the module docstring for the keys."""
    out: dict[str, float] = {}
    for name, metric in self._metrics.items():
      if isinstance(metric, Histogram):
        for values, stats in metric.items():
          for stat, x in stats.items():
            out[series_key(f"{name}_{stat}", metric.labelnames, values)] = x
      else:
        for values, x in metric.items():
          out[series_key(name, metric.labelnames, values)] = x
    return dict(sorted(out.items()))

  def prometheus_text(self) -> str:
    """The Prometheus exposition text of this registry (what the HTTP server serves)."""
    return prometheus_client.generate_latest(self.prometheus_registry).decode()

  def serve(self, port: int, addr: str = "127.0.0.1") -> None:
    """Serves this registry over HTTP on `port` (prometheus-client's server thread)."""
    if self._server is not None:
      raise ValueError("metrics server already started for this registry")
    self._server = prometheus_client.start_http_server(
        port, addr=addr, registry=self.prometheus_registry)

  def close(self) -> None:
    """Stops the HTTP server started by `serve`, if any."""
    if self._server is not None:
      server = self._server[0] if isinstance(self._server, tuple) else None
      if server is not None:
        server.shutdown()
        server.server_close()
      self._server = None

"""MetricsRegistry: labelled series, histogram quantiles, flat dict keys, Prometheus export."""

import urllib.request

import numpy as np
import pytest

from hisparse_jax.observability import metrics as m


def test_labelled_counter_keys_and_values():
  reg = m.MetricsRegistry()
  c = reg.counter(m.TRANSFER_BYTES_TOTAL, "bytes", ("direction",))
  c.inc(4096, direction="h2d")
  c.inc(1024, direction="h2d")
  c.inc(512, direction="d2h")
  assert reg.to_dict() == {
      'hisparse_transfer_bytes_total{direction="d2h"}': 512.0,
      'hisparse_transfer_bytes_total{direction="h2d"}': 5120.0,
  }
  assert c.value(direction="h2d") == 5120.0


def test_unlabelled_metrics_start_at_zero_and_gauges_go_down():
  reg = m.MetricsRegistry()
  reg.counter("hisparse_preemptions_total", "preemptions")
  g = reg.gauge("hisparse_kv_usage_ratio", "usage", ("memory_kind",))
  g.set(0.75, memory_kind="device")
  g.inc(-0.25, memory_kind="device")
  assert reg.to_dict() == {"hisparse_preemptions_total": 0.0,
                           'hisparse_kv_usage_ratio{memory_kind="device"}': 0.5}


def test_histogram_count_sum_and_quantiles():
  reg = m.MetricsRegistry()
  h = reg.histogram(m.TRANSFER_SECONDS, "latency", ("direction",))
  for x in range(1, 101):
    h.observe(x, direction="d2h")
  d = reg.to_dict()
  assert d['hisparse_transfer_seconds_count{direction="d2h"}'] == 100
  assert d['hisparse_transfer_seconds_sum{direction="d2h"}'] == 5050
  assert d['hisparse_transfer_seconds_p50{direction="d2h"}'] == pytest.approx(50.5)
  assert d['hisparse_transfer_seconds_p99{direction="d2h"}'] == pytest.approx(99.01)
  assert h.count(direction="h2d") == 0 and np.isnan(h.quantile(0.5, direction="h2d"))


def test_quantiles_cover_the_recent_window_only():
  reg = m.MetricsRegistry()
  h = reg.histogram("x_seconds", "x")
  for _ in range(m.QUANTILE_WINDOW):
    h.observe(100.0)
  for _ in range(m.QUANTILE_WINDOW):
    h.observe(1.0)
  assert h.quantile(0.99) == 1.0
  assert h.count() == 2 * m.QUANTILE_WINDOW


def test_bad_use_is_refused():
  reg = m.MetricsRegistry()
  c = reg.counter("a_total", "a", ("direction",))
  with pytest.raises(ValueError, match="labels"):
    c.inc(1, source="host")
  with pytest.raises(ValueError, match="negative"):
    c.inc(-1, direction="h2d")
  assert reg.counter("a_total", "a", ("direction",)) is c
  with pytest.raises(ValueError, match="already registered as a counter"):
    reg.gauge("a_total", "a", ("direction",))


def test_each_registry_has_its_own_prometheus_registry():
  a, b = m.MetricsRegistry(), m.MetricsRegistry()
  a.counter(m.TRANSFERS_TOTAL, "calls", ("direction",)).inc(3, direction="h2d")
  b.counter(m.TRANSFERS_TOTAL, "calls", ("direction",))  # same name: no collision
  assert 'hisparse_transfers_total{direction="h2d"} 3.0' in a.prometheus_text()
  assert 'direction="h2d"' not in b.prometheus_text()


def test_http_server_serves_the_registry():
  reg = m.MetricsRegistry()
  reg.counter(m.TRANSFER_BLOCKS_TOTAL, "blocks", ("direction",)).inc(7, direction="d2h")
  reg.serve(0, addr="127.0.0.1")  # port 0: any free port
  try:
    port = reg._server[0].server_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
      body = r.read().decode()
    assert 'hisparse_transfer_blocks_total{direction="d2h"} 7.0' in body
  finally:
    reg.close()


def test_a_port_given_at_construction_is_served():
  import socket  # noqa: PLC0415

  with socket.socket() as s:  # find a free port
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  reg = m.MetricsRegistry(prometheus_port=port)
  try:
    reg.gauge(m.KV_CAPACITY_TOKENS, "tokens", ("memory_kind",)).set(4096, memory_kind="device")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
      assert 'hisparse_kv_capacity_tokens{memory_kind="device"} 4096.0' in r.read().decode()
  finally:
    reg.close()

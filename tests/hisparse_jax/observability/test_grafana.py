"""The Grafana dashboard (observability/grafana.py) follows the engine's metrics: its
PromQL reads only families an engine exports, every exported family is on a panel (or
skipped with a reason), and the committed dashboards/ JSON is what the script writes,
laid out without overlap."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.observability import grafana

REPO = pathlib.Path(__file__).resolve().parents[3]
COMMITTED = REPO / grafana.DEFAULT_OUT
ROWS = ["Overview", "Device pool", "Host pool", "Third tier", "HiSparse top-k", "Transfers",
        "Failures"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
  """The families of the engine that registers the most: host pool, HiSparse, disk tier,
  after one sparse request (its metrics() brings the lazily updated series up to date)."""
  engine = Engine(EngineConfig(
      block_size=16, max_model_len=512, device_kv_gib=0.01, host_pool_gib=0.01,
      disk_cache_dir=str(tmp_path_factory.mktemp("disk_tier")),
      hisparse=HiSparseConfig(top_k_tokens=32, hot_buffer_tokens=32, sink_tokens=16,
                              local_tokens=16, sparse_threshold_tokens=48,
                              resident_sparse_min_tokens=0)))
  try:
    prompt = np.random.default_rng(0).integers(5, 251, 200).tolist()
    engine.add_request(prompt_token_ids=prompt,
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=8))
    while engine.has_unfinished_requests():
      engine.step()
    engine.metrics()
    return grafana.exported_metric_families(engine)
  finally:
    engine.close()


def _panel_names() -> dict[str, set[str]]:
  """Family -> the panels (and variables) whose PromQL reads it."""
  out: dict[str, set[str]] = {}
  for where, expr in grafana.dashboard_expressions(grafana.build_dashboard()):
    names = grafana.promql_metric_names(expr)
    assert names, f"{where}: {expr!r} reads no metric"
    for name in names:
      out.setdefault(name, set()).add(where)
  return out


def test_panels_read_only_exported_families(exported):
  unknown = {name: sorted(where) for name, where in _panel_names().items()
             if name not in exported and name not in grafana.CONDITIONAL}
  assert not unknown, f"panels read metrics no engine exports: {unknown}"
  # A conditional family the test's engine exports needs no entry.
  assert not set(grafana.CONDITIONAL) & exported
  assert not set(grafana.SKIPPED) & set(_panel_names()), "a skipped family is on a panel"


def test_every_exported_family_is_on_a_panel_or_skipped(exported):
  missing = sorted(exported - set(_panel_names()) - set(grafana.SKIPPED))
  assert not missing, (f"exported families on no panel (add a panel or a SKIPPED reason): "
                      f"{missing}")
  assert set(grafana.SKIPPED) <= exported, "SKIPPED names a family no engine exports"
  assert all(reason.strip() for reason in grafana.SKIPPED.values())


def test_counter_and_histogram_names_normalize_to_families():
  assert grafana.promql_metric_names(
      'histogram_quantile(0.99, sum by (le, direction) '
      '(rate(hisparse_transfer_seconds_bucket{instance=~"$instance"}[1m])))') == {
          "hisparse_transfer_seconds"}
  assert grafana.promql_metric_names(
      'sum(rate(hisparse_kv_tier_load_seconds_total{tier="disk"}[1m])) / '
      'sum(hisparse_step_seconds_count) + vllm:num_requests_running') == {
          "hisparse_kv_tier_load_seconds", "hisparse_step_seconds", "vllm:num_requests_running"}
  # Label values and names that look like metric names are not read.
  assert grafana.promql_metric_names(
      'sum by (hisparse_x) (hisparse_num_requests{state="hisparse_y"})') == {
          "hisparse_num_requests"}


def test_committed_dashboard_is_generated(tmp_path):
  dashboard = grafana.build_dashboard()
  assert COMMITTED.read_text() == grafana.render(dashboard), (
      f"{COMMITTED} is stale; regenerate: python -m hisparse_jax.observability.grafana "
      f"--out {grafana.DEFAULT_OUT}")
  assert json.loads(COMMITTED.read_text()) == dashboard
  assert grafana.main(["--check", "--out", str(COMMITTED)]) == 0
  stale = tmp_path / "stale.json"
  stale.write_text("{}\n")
  assert grafana.main(["--check", "--out", str(stale)]) == 1
  assert grafana.main(["--out", str(stale)]) == 0
  assert grafana.main(["--check", "--out", str(stale)]) == 0


def test_dashboard_model_rows_layout_and_datasource():
  d = grafana.build_dashboard()
  assert (d["uid"], d["title"], d["schemaVersion"]) == (
      "hisparse-jax-kv", "hisparse-jax: tiered KV cache", 39)
  panels = d["panels"]
  assert [p["title"] for p in panels if p["type"] == "row"] == ROWS
  assert panels[0]["type"] == "row"
  assert {p["type"] for p in panels} == {"row", "timeseries", "stat"}
  ids = [p["id"] for p in panels]
  assert len(ids) == len(set(ids))
  cells: dict[tuple[int, int], str] = {}
  for p in panels:
    g = p["gridPos"]
    assert g["x"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
    for x in range(g["x"], g["x"] + g["w"]):
      for y in range(g["y"], g["y"] + g["h"]):
        assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
        cells[(x, y)] = p["title"]
  assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
  assert d["__inputs"][0]["pluginId"] == "prometheus"
  assert {r["id"] for r in d["__requires"]} >= {"grafana", "prometheus", "timeseries", "stat"}
  datasource = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
  for p in panels:
    if p["type"] != "row":
      assert p["targets"] and p["datasource"] == datasource, p["title"]
      assert all(t["datasource"] == datasource and t["expr"] for t in p["targets"])

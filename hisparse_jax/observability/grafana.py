"""The Grafana dashboard of the tiered KV cache, generated from the engine's metric names.

Owns the dashboard as data (`ROWS`: rows of panels whose targets are PromQL over the
engine's Prometheus series), its rendering into a Grafana dashboard JSON model
(`build_dashboard`), and the two name sets the tests compare so the dashboard follows the
metrics: the metric families an engine exports (`exported_metric_families`) and the ones
an expression reads (`promql_metric_names`).

    python -m hisparse_jax.observability.grafana --out dashboards/hisparse_jax_kv_cache.json
    python -m hisparse_jax.observability.grafana --check   # exit 1: the committed file is stale

Family names. prometheus_client exports a counter `x_total` as the family `x` (samples
`x_total`, `x_created`) and a histogram `h` as the family `h` (samples `h_bucket`,
`h_sum`, `h_count`, `h_created`); gauges keep their name. Both name sets go through
`family_name`, which drops one trailing `_bucket`, `_sum`, `_count` or `_total`, so a
counter, a histogram's samples and a gauge each compare by one name.

The datasource is the import input `DS_PROMETHEUS` (Grafana asks for it on import); the
`instance` variable narrows every panel to some scraped engines (all by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
from collections.abc import Iterator, Sequence

from hisparse_jax.observability import engine_metrics as em
from hisparse_jax.observability import metrics as m

UID = "hisparse-jax-kv"
TITLE = "hisparse-jax: tiered KV cache"
SCHEMA_VERSION = 39
DEFAULT_OUT = "dashboards/hisparse_jax_kv_cache.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
RATE_WINDOW = "1m"  # rate() window: four scrapes at Prometheus's default 15 s interval
GRID_WIDTH = 24  # Grafana's grid columns
INSTANCE = 'instance=~"$instance"'

# Exported families deliberately on no panel: name -> why.
SKIPPED: dict[str, str] = {}
# Families on a panel that an engine exports only in some configurations (so the test's
# engine does not): name -> when.
CONDITIONAL: dict[str, str] = {
    m.KV_CAPACITY_BYTES: "tensor parallel only (--tensor_parallel_size > 1)",
}

_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


# --- PromQL helpers ----------------------------------------------------------------


def _sel(name: str, **labels: str) -> str:
  """`name{instance=~"$instance",k="v",...}`; a value starting with `~` is a regex match."""
  matchers = [INSTANCE]
  for key, value in labels.items():
    matchers.append(f'{key}=~"{value[1:]}"' if value.startswith("~") else f'{key}="{value}"')
  return f"{name}{{{','.join(matchers)}}}"


def _by(by: Sequence[str]) -> str:
  return f"sum by ({', '.join(by)}) " if by else "sum"


def _gauge(name: str, by: Sequence[str] = (), agg: str = "sum", **labels: str) -> str:
  """A gauge summed (or `agg`: avg, max) over the scraped engines, kept apart by `by`."""
  head = f"{agg} by ({', '.join(by)}) " if by else agg
  return f"{head}({_sel(name, **labels)})"


def _rate(name: str, by: Sequence[str] = (), **labels: str) -> str:
  """Per-second rate of a counter (`name` ends with `_total`), summed over engines."""
  return f"{_by(by)}(rate({_sel(name, **labels)}[{RATE_WINDOW}]))"


def _quantile(q: float, histogram: str, by: Sequence[str] = ()) -> str:
  """The q-quantile of a histogram over the last `RATE_WINDOW`, from its buckets."""
  return (f"histogram_quantile({q}, sum by ({', '.join(('le', *by))}) "
          f"(rate({_sel(histogram + '_bucket')}[{RATE_WINDOW}])))")


def _ratio(numerator: str, denominator: str) -> str:
  return f"{numerator} / {denominator}"


# --- The dashboard as data -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
  """One PromQL query of a panel and its legend (`{{label}}` templates)."""

  expr: str
  legend: str = ""


@dataclasses.dataclass(frozen=True)
class Panel:
  """A timeseries or stat panel: its queries, unit (a Grafana unit id) and grid size."""

  title: str
  targets: tuple[Target, ...]
  unit: str = "short"
  kind: str = "timeseries"  # or "stat"
  w: int = 8
  h: int = 8
  description: str = ""
  thresholds: tuple[tuple[str, float | None], ...] = (("green", None),)


@dataclasses.dataclass(frozen=True)
class Row:
  """A Grafana row: a title bar and the panels laid out under it."""

  title: str
  panels: tuple[Panel, ...]


def _ts(title: str, *targets: Target, **kwargs) -> Panel:
  return Panel(title, tuple(targets), **kwargs)


def _stat(title: str, expr: str, **kwargs) -> Panel:
  return Panel(title, (Target(expr),), kind="stat", **{"w": 4, "h": 4, **kwargs})


def _latency(title: str, histogram: str, description: str, by: Sequence[str] = (),
             **kwargs) -> Panel:
  tail = "".join(f" {{{{{label}}}}}" for label in by)
  return _ts(title, Target(_quantile(0.5, histogram, by), "p50" + tail),
             Target(_quantile(0.99, histogram, by), "p99" + tail), unit="s",
             description=description, **kwargs)


_USAGE_THRESHOLDS = (("green", None), ("orange", 0.8), ("red", 0.95))


def _pool_panels(kind: str, label: str) -> tuple[Panel, ...]:
  """Usage, capacity and prefix-cache hit ratio of one pool (`memory_kind`)."""
  hits = _rate(em.PREFIX_CACHE_HITS_TOTAL, memory_kind=kind)
  return (
      _ts(f"{label} KV usage", Target(_gauge(em.KV_USAGE_RATIO, agg="avg", memory_kind=kind),
                                      "owned / usable blocks"),
          unit="percentunit", thresholds=_USAGE_THRESHOLDS,
          description=f"Blocks owned by requests or the prefix cache / usable blocks of the "
                      f"{label.lower()} pool."),
      _stat(f"{label} KV capacity", _gauge(m.KV_CAPACITY_TOKENS, memory_kind=kind), h=8,
            description=f"Tokens the {label.lower()} pool holds (set at load)."),
      _ts(f"{label} prefix-cache hit ratio",
          Target(_ratio(hits, _rate(em.PREFIX_CACHE_QUERIES_TOTAL)), "hits / lookups"),
          unit="percentunit", w=6,
          description=f"Full-block prefix lookups served from the {label.lower()} pool."),
  )


ROWS: tuple[Row, ...] = (
    Row("Overview", (
        _stat("Running", _gauge(em.NUM_REQUESTS, state="running")),
        _stat("Waiting", _gauge(em.NUM_REQUESTS, state="waiting")),
        _stat("Swapped", _gauge(em.NUM_REQUESTS, state="swapped")),
        _stat("Finished requests / s", _rate(em.REQUESTS_TOTAL), unit="reqps"),
        _stat("Generated tokens / s", _rate(em.GENERATION_TOKENS_TOTAL)),
        _stat("Step shapes compiled", _gauge(em.STEP_SHAPES, agg="max"),
              description="Distinct padded step shapes run so far; a rise while serving "
                          "is a compile."),
        _ts("Requests by state", Target(_gauge(em.NUM_REQUESTS, ("state",)), "{{state}}")),
        _ts("Tokens / s", Target(_rate(em.PROMPT_TOKENS_TOTAL), "prompt"),
            Target(_rate(em.GENERATION_TOKENS_TOTAL), "generated")),
        _ts("Finished requests / s", Target(_rate(em.REQUESTS_TOTAL, ("finish_reason",)),
                                            "{{finish_reason}}"), unit="reqps"),
        _latency("Time to first token", em.TTFT_SECONDS, "Arrival to first token."),
        _latency("Inter-token latency", em.INTER_TOKEN_SECONDS,
                 "Seconds between a request's output tokens."),
        _latency("Step time", em.STEP_SECONDS, "Seconds of one jitted engine step."),
    )),
    Row("Device pool", (
        *_pool_panels("device", "Device"),
        _ts("KV bytes per device (tensor parallel)",
            Target(_gauge(m.KV_CAPACITY_BYTES, ("memory_kind", "device")),
                   "{{memory_kind}} {{device}}"),
            unit="bytes", w=6, description="Each device's live KV shard bytes; tensor "
                                           "parallel only."),
    )),
    Row("Host pool", (
        *_pool_panels("pinned_host", "Host"),
        _ts("Swapped requests", Target(_gauge(em.NUM_REQUESTS, state="swapped"), "swapped"),
            w=6, description="Preempted requests whose KV waits in the host pool."),
    )),
    Row("Third tier", (
        _ts("Stored bytes",
            Target(_gauge(m.TIER_USED_BYTES, ("tier",)), "{{tier}} used"),
            Target(_gauge(m.TIER_CAPACITY_BYTES, ("tier",)), "{{tier}} capacity"),
            unit="bytes", description="Capacity 0: bounded by the server (remote tier)."),
        _ts("Stored tokens", Target(_gauge(m.TIER_USED_TOKENS, ("tier",)), "{{tier}}")),
        _ts("Hit ratio (tokens)",
            Target(_ratio(_rate(m.TIER_HIT_TOKENS, ("tier",)),
                          _rate(m.TIER_LOOKUP_TOKENS, ("tier",))), "{{tier}}"),
            unit="percentunit",
            description="Prompt tokens the tier held / tokens looked up after device and "
                        "host prefix misses."),
        _ts("Lookup and hit tokens / s",
            Target(_rate(m.TIER_LOOKUP_TOKENS, ("tier",)), "{{tier}} looked up"),
            Target(_rate(m.TIER_HIT_TOKENS, ("tier",)), "{{tier}} hit")),
        _ts("Load / store bandwidth",
            Target(_rate(m.TIER_LOAD_BYTES, ("tier",)), "{{tier}} load"),
            Target(_rate(m.TIER_STORE_BYTES, ("tier",)), "{{tier}} store"), unit="Bps"),
        _ts("Load / store speed while busy",
            Target(_ratio(_rate(m.TIER_LOAD_BYTES, ("tier",)),
                          _rate(m.TIER_LOAD_SECONDS, ("tier",))), "{{tier}} load"),
            Target(_ratio(_rate(m.TIER_STORE_BYTES, ("tier",)),
                          _rate(m.TIER_STORE_SECONDS, ("tier",))), "{{tier}} store"),
            unit="Bps", description="Bytes per second of load / store job time."),
        _ts("Blocks loaded and evicted / s",
            Target(_rate(m.TIER_LOADED_BLOCKS, ("tier",)), "{{tier}} loaded"),
            Target(_rate(m.TIER_EVICTIONS, ("tier",)), "{{tier}} evicted (byte cap)")),
        _ts("Loads refused by the gate / s",
            Target(_rate(m.TIER_GATE_REFUSALS, ("tier",)), "{{tier}}"),
            description="Loads not issued: expected slower than recomputing."),
        _ts("Queues", Target(_gauge(m.TIER_PENDING_STORES, ("tier",)), "{{tier}} pending stores"),
            Target(_gauge(m.TIER_LOADING_REQUESTS), "requests waiting on a load")),
    )),
    Row("HiSparse top-k", (
        _ts("Blocks attention read / s",
            Target(_rate(em.BLOCKS_SELECTED_TOTAL, ("source",)), "{{source}}"),
            description="device: resident; hot: HiSparse hot buffer; host: loaded from the "
                        "host pool."),
        _ts("Hot-buffer hit rate",
            Target(_ratio(_rate(em.HOT_HITS_TOTAL), _rate(em.HOT_LOOKUPS_TOTAL)),
                   f"last {RATE_WINDOW}"),
            Target(_gauge(em.HOT_HIT_RATE, agg="avg"), "since start"), unit="percentunit"),
        _ts("Hot-buffer block-layers / s",
            Target(_rate(em.HOT_LOOKUPS_TOTAL), "lookups"),
            Target(_rate(em.HOT_HITS_TOTAL), "hits"),
            Target(_rate(em.HOT_LOADS_TOTAL), "loads (misses)"),
            Target(_rate(em.HOT_EVICTIONS_TOTAL), "evictions")),
        _ts("Thrash / s", Target(_rate(em.THRASH_TOTAL), "thrash"), w=12,
            description="Blocks loaded again soon after leaving the hot buffer."),
        _ts("Offloads / s", Target(_rate(em.OFFLOADS_TOTAL), "offloads"), w=12,
            description="Sparse requests that dropped their written-through device blocks."),
    )),
    Row("Transfers", (
        _ts("Transfer bandwidth",
            Target(_rate(m.TRANSFER_BYTES_TOTAL, ("direction",)), "{{direction}}"),
            unit="Bps", w=6, description="h2d: host pool to device; d2h: device to host."),
        _ts("Blocks moved / s",
            Target(_rate(m.TRANSFER_BLOCKS_TOTAL, ("direction",)), "{{direction}}"), w=6),
        _ts("Transfer calls / s",
            Target(_rate(m.TRANSFERS_TOTAL, ("direction",)), "{{direction}}"), w=6),
        _latency("Transfer latency", m.TRANSFER_SECONDS, "Dispatch to observed completion.",
                 by=("direction",), w=6),
    )),
    Row("Failures", (
        _ts("Third-tier failures / s",
            Target(_rate(m.TIER_FAILURES, ("tier", "reason")), "{{tier}} {{reason}}"),
            description="Blocks (or an open) that failed; the engine recomputes them."),
        _stat("Third-tier failures", f"sum({_sel(m.TIER_FAILURES)}) or vector(0)", h=8,
              thresholds=(("green", None), ("red", 1.0))),
        _ts("Preemptions / s", Target(_rate(em.PREEMPTIONS_TOTAL), "preemptions"), w=6),
        _ts("Aborted and failed requests / s",
            Target(_rate(em.REQUESTS_TOTAL, ("finish_reason",), finish_reason="~abort|error"),
                   "{{finish_reason}}"), unit="reqps", w=6),
        _ts("Step programs compiled",
            Target(_gauge(em.STEP_COMPILES, ("where",), agg="max"), "{{where}}"),
            Target(_gauge(em.STEP_SHAPES, agg="max"), "shapes run"),
            Target(_gauge(em.STEPS_ON_COVERING_SHAPE, agg="max"), "steps on a covering shape"),
            w=24, description="foreground: the step waited for a compile (a stall)."),
    )),
)


# --- Rendering -----------------------------------------------------------------------


def _fieldconfig(panel: Panel) -> dict:
  steps = [{"color": color, "value": value} for color, value in panel.thresholds]
  defaults = {"unit": panel.unit, "min": 0,
              "thresholds": {"mode": "absolute", "steps": steps}}
  if panel.kind == "stat":
    defaults["color"] = {"mode": "thresholds"}
  else:
    defaults["color"] = {"mode": "palette-classic"}
    defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                          "showPoints": "never", "spanNulls": False}
  return {"defaults": defaults, "overrides": []}


def _options(panel: Panel) -> dict:
  if panel.kind == "stat":
    return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value", "graphMode": "area", "justifyMode": "auto",
            "orientation": "auto", "textMode": "auto"}
  return {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True,
                     "calcs": []},
          "tooltip": {"mode": "multi", "sort": "none"}}


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
  targets = [{"datasource": DATASOURCE, "editorMode": "code", "expr": t.expr,
              "legendFormat": t.legend, "range": True, "refId": chr(ord("A") + i)}
             for i, t in enumerate(panel.targets)]
  return {"type": panel.kind, "id": panel_id, "title": panel.title,
          "description": panel.description, "datasource": DATASOURCE,
          "gridPos": {"h": panel.h, "w": panel.w, "x": x, "y": y},
          "fieldConfig": _fieldconfig(panel), "options": _options(panel), "targets": targets}


def _layout(rows: Sequence[Row]) -> list[dict]:
  """Row panels and their panels, left to right in lines of `GRID_WIDTH` columns; a line
  is as tall as its tallest panel, so no two panels overlap."""
  out: list[dict] = []
  y = 0
  for row in rows:
    out.append({"type": "row", "id": len(out) + 1, "title": row.title, "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "panels": []})
    y += 1
    x = line_height = 0
    for panel in row.panels:
      if x + panel.w > GRID_WIDTH:
        y, x, line_height = y + line_height, 0, 0
      out.append(_panel_json(panel, len(out) + 1, x, y))
      x += panel.w
      line_height = max(line_height, panel.h)
    y += line_height
  return out


def _instance_variable() -> dict:
  query = f"label_values({em.NUM_REQUESTS}, instance)"
  return {"name": "instance", "label": "instance", "type": "query", "datasource": DATASOURCE,
          "definition": query, "query": {"query": query, "refId": "instance"},
          "includeAll": True, "allValue": ".*", "multi": True, "current": {}, "options": [],
          "refresh": 2, "regex": "", "sort": 1, "hide": 0}


def build_dashboard() -> dict:
  """The Grafana dashboard JSON model of `ROWS`, with `__inputs`/`__requires` for import."""
  return {
      "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus",
                    "description": "The Prometheus that scrapes hisparse-jax's /metrics.",
                    "type": "datasource", "pluginId": "prometheus",
                    "pluginName": "Prometheus"}],
      "__elements": {},
      "__requires": [
          {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.4.0"},
          {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
          {"type": "panel", "id": "stat", "name": "Stat", "version": ""},
          {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
      ],
      "annotations": {"list": [{
          "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
          "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
          "name": "Annotations & Alerts", "type": "dashboard"}]},
      "description": "Where the KV cache lives (device pool, host pool, third tier), HiSparse "
                     "top-k traffic, transfers and failures of hisparse-jax engines. "
                     "Generated by hisparse_jax.observability.grafana.",
      "editable": True,
      "fiscalYearStartMonth": 0,
      "graphTooltip": 1,
      "id": None,
      "links": [],
      "panels": _layout(ROWS),
      "refresh": "30s",
      "schemaVersion": SCHEMA_VERSION,
      "tags": ["hisparse-jax", "kv-cache"],
      "templating": {"list": [_instance_variable()]},
      "time": {"from": "now-1h", "to": "now"},
      "timepicker": {},
      "timezone": "",
      "title": TITLE,
      "uid": UID,
      "version": 1,
      "weekStart": "",
  }


def render(dashboard: dict) -> str:
  """The dashboard as written to disk: sorted keys, 2-space indent, trailing newline."""
  return json.dumps(dashboard, sort_keys=True, indent=2) + "\n"


def dashboard_expressions(dashboard: dict) -> Iterator[tuple[str, str]]:
  """(where, PromQL) of every panel target and of every query variable of `dashboard`."""
  for panel in dashboard["panels"]:
    for target in panel.get("targets", ()):
      yield panel["title"], target["expr"]
  for variable in dashboard["templating"]["list"]:
    if variable.get("type") == "query":
      yield f"${variable['name']}", variable["definition"]


# --- Metric names --------------------------------------------------------------------


def family_name(name: str) -> str:
  """`name` less one trailing `_bucket`, `_sum`, `_count` or `_total`: the family a sample
  or a counter's exported name belongs to (see the module docstring)."""
  for suffix in _SUFFIXES:
    if name.endswith(suffix):
      return name[:-len(suffix)]
  return name


def exported_metric_families(engine) -> set[str]:
  """The metric families (`family_name`s) in the Prometheus registry that an engine's
  /metrics serves: `engine.metrics_registry.prometheus_registry` (an engine), or a
  `MetricsRegistry` itself. Every registered metric counts, with or without series yet;
  nothing is brought up to date here (`engine.metrics()` does that)."""
  registry = getattr(engine, "metrics_registry", engine)
  registry = getattr(registry, "prometheus_registry", registry)
  return {family_name(family.name) for family in registry.collect()}


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_METRIC = re.compile(r"(?<![\w:])(?:hisparse_|vllm:)[A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
  """The metric families (`family_name`s) a PromQL expression reads: identifiers named
  like the engine's (`hisparse_...`) or vLLM's (`vllm:...`) metrics, outside strings,
  label matchers (`{...}`) and label lists (`by (le, ...)`); functions and label names
  never count."""
  for pattern in (_STRING, _MATCHERS, _LABEL_LIST):
    expr = pattern.sub(" ", expr)
  return {family_name(name) for name in _METRIC.findall(expr)}


# --- Command line --------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
  """Writes the dashboard to `--out`; with `--check`, exits 1 when the file there differs."""
  parser = argparse.ArgumentParser(prog="python -m hisparse_jax.observability.grafana",
                                   description="Writes the Grafana dashboard JSON.")
  parser.add_argument("--out", default=DEFAULT_OUT, help=f"path (default {DEFAULT_OUT})")
  parser.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 when --out differs from the generated JSON")
  args = parser.parse_args(argv)
  text = render(build_dashboard())
  out = pathlib.Path(args.out)
  if args.check:
    current = out.read_text() if out.exists() else None
    if current != text:
      state = "is missing" if current is None else "differs from the generated dashboard"
      print(f"{out} {state}; regenerate it with: python -m hisparse_jax.observability.grafana "
            f"--out {out}", file=sys.stderr)
      return 1
    print(f"{out} is up to date")
    return 0
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(text)
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

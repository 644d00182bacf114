"""The live dashboard: one JSON snapshot of where the KV lives and how the tiers do, and the
self-contained page (dashboard.html beside this file) that polls it and draws it.

    GET /dashboard        the page (no CDN, no external script: plain SVG and CSS)
    GET /dashboard/data   `snapshot(engine)` as JSON, polled by the page every second

`snapshot` reads only what the engine already keeps: its capacity report (fixed at load),
its metrics registry (updated by the engine at every step) and the third tier's counters
(each tier's own lock). It never touches the scheduler or the block manager, so a server
thread may take it while another thread steps the engine. Counters come as totals with
the snapshot's time; the page turns consecutive snapshots into rates (bytes/s, tokens/s,
events/s), so no state is kept here.
"""

from __future__ import annotations

import importlib.resources
import time

_HISTOGRAM_STATS = ("p50", "p99", "count", "sum")


def page() -> str:
  """The dashboard page (HTML, CSS and JS in one file)."""
  return importlib.resources.files("hisparse_jax.observability").joinpath(
      "dashboard.html").read_text()


def _series(metrics: dict[str, float], name: str) -> dict[str, float]:
  """{label value: value} of a metric with one label (`name{label="value"}` keys)."""
  out = {}
  prefix = name + "{"
  for key, value in metrics.items():
    if key.startswith(prefix):
      label = key[len(prefix):-1].split("=", 1)[1].strip('"')
      out[label] = value
  return out


def _histogram(metrics: dict[str, float], name: str, label: str = "") -> dict[str, float]:
  return {stat: metrics.get(f"{name}_{stat}{label}", 0.0) for stat in _HISTOGRAM_STATS}


def _registry_dict(registry) -> dict[str, float]:
  for _ in range(3):  # a series added by the engine thread mid-read: read again
    try:
      return registry.to_dict()
    except RuntimeError:
      continue
  return registry.to_dict()


def snapshot(engine) -> dict:
  """Everything the page draws, from one read of the engine's metrics (see above)."""
  from hisparse_jax.observability import engine_metrics as em  # noqa: PLC0415
  from hisparse_jax.observability import metrics as m  # noqa: PLC0415

  metrics = _registry_dict(engine.metrics_registry)
  usage = _series(metrics, em.KV_USAGE_RATIO)
  tiers = []
  for t in engine.capacity.tiers:
    ratio = usage.get(t.memory_kind, 0.0)
    tiers.append({"name": t.memory_kind, "kind": "memory_kind",
                  "capacity_tokens": t.num_tokens, "capacity_bytes": t.kv_bytes,
                  "used_tokens": round(ratio * t.num_tokens),
                  "used_bytes": round(ratio * t.kv_bytes), "used_ratio": ratio})
  used_bytes = _series(metrics, m.TIER_USED_BYTES)
  used_tokens = _series(metrics, m.TIER_USED_TOKENS)
  for t in engine.capacity.third_tiers:
    cap_tokens = t.num_tokens
    cap_bytes = getattr(t, "capacity_bytes", None)
    tiers.append({"name": t.kind, "kind": "tier", "where": t.where,
                  "available": not hasattr(t, "error"),
                  "capacity_tokens": cap_tokens, "capacity_bytes": cap_bytes,
                  "used_tokens": used_tokens.get(t.kind, 0.0),
                  "used_bytes": used_bytes.get(t.kind, 0.0),
                  "used_ratio": (used_bytes.get(t.kind, 0.0) / cap_bytes if cap_bytes
                                 else None)})
  requests = _series(metrics, em.NUM_REQUESTS)
  hot_lookups = metrics.get(em.HOT_LOOKUPS_TOTAL, 0.0)
  hot_hits = metrics.get(em.HOT_HITS_TOTAL, 0.0)
  return {
      "time": time.time(),
      "hisparse": engine.config.hisparse is not None,
      "block_size": engine.config.block_size,
      "tiers": tiers,
      "requests": {state: requests.get(state, 0.0)
                   for state in ("running", "waiting", "swapped", "loading", "offloaded")},
      "hot_buffer": {"lookups": hot_lookups, "hits": hot_hits,
                     "hit_ratio": hot_hits / hot_lookups if hot_lookups else None,
                     "loads": metrics.get(em.HOT_LOADS_TOTAL, 0.0),
                     "evictions": metrics.get(em.HOT_EVICTIONS_TOTAL, 0.0)},
      "prefix_cache": {"queries": metrics.get(em.PREFIX_CACHE_QUERIES_TOTAL, 0.0),
                       "hits": _series(metrics, em.PREFIX_CACHE_HITS_TOTAL)},
      "blocks_selected": _series(metrics, em.BLOCKS_SELECTED_TOTAL),
      "transfers": {
          direction: {"bytes": metrics.get(
                          f'{m.TRANSFER_BYTES_TOTAL}{{direction="{direction}"}}', 0.0),
                      "blocks": metrics.get(
                          f'{m.TRANSFER_BLOCKS_TOTAL}{{direction="{direction}"}}', 0.0),
                      "seconds": _histogram(metrics, m.TRANSFER_SECONDS,
                                            f'{{direction="{direction}"}}')}
          for direction in (m.DIRECTION_H2D, m.DIRECTION_D2H)},
      "third_tier": {
          kind: {"loaded_bytes": metrics.get(f'{m.TIER_LOAD_BYTES}{{tier="{kind}"}}', 0.0),
                 "stored_bytes": metrics.get(f'{m.TIER_STORE_BYTES}{{tier="{kind}"}}', 0.0),
                 "hit_tokens": metrics.get(f'{m.TIER_HIT_TOKENS}{{tier="{kind}"}}', 0.0),
                 "lookup_tokens": metrics.get(f'{m.TIER_LOOKUP_TOKENS}{{tier="{kind}"}}',
                                              0.0),
                 "failures": sum(v for k, v in metrics.items()
                                 if k.startswith(m.TIER_FAILURES + "{")
                                 and f'tier="{kind}"' in k)}
          for kind in used_bytes},
      "events": {"preemptions": metrics.get(em.PREEMPTIONS_TOTAL, 0.0),
                 "thrash": metrics.get(em.THRASH_TOTAL, 0.0),
                 "offloads": metrics.get(em.OFFLOADS_TOTAL, 0.0)},
      "steps": {"shapes_compiled": metrics.get(em.STEP_SHAPES, 0.0),
                "seconds": _histogram(metrics, em.STEP_SECONDS),
                "ttft": _histogram(metrics, em.TTFT_SECONDS),
                "inter_token": _histogram(metrics, em.INTER_TOKEN_SECONDS)},
      "tokens": {"prompt": metrics.get(em.PROMPT_TOKENS_TOTAL, 0.0),
                 "generated": metrics.get(em.GENERATION_TOKENS_TOTAL, 0.0)},
      "finished": sum(_series(metrics, em.REQUESTS_TOTAL).values()),
  }


class DashboardServer:
  """The dashboard of an in-process engine (`generate` / `demo --serve_dashboard`) on a
  loopback port, from a stdlib HTTP server in a daemon thread: GET /dashboard and
  /dashboard/data only. It reads `snapshot(engine)` (no engine state beyond the
  registry), so it never blocks the thread that steps the engine. `serve` has the same
  two routes in its FastAPI app (openai_server.py), behind its API key."""

  def __init__(self, engine, port: int = 0, host: str = "127.0.0.1"):
    import http.server  # noqa: PLC0415
    import json  # noqa: PLC0415
    import threading  # noqa: PLC0415

    html = page().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_GET(self):  # noqa: N802 (the stdlib's name)
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/dashboard":
          body, kind = html, "text/html; charset=utf-8"
        elif path == "/dashboard/data":
          body, kind = json.dumps(snapshot(engine)).encode(), "application/json"
        else:
          self.send_error(404, "the dashboard is at /dashboard")
          return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

      def log_message(self, *args):  # quiet: no line per poll on stderr
        pass

    try:
      self._server = http.server.ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
      raise ValueError(f"--dashboard_port={port}: cannot listen on {host}: "
                       f"{e.strerror or e}") from None
    self._server.daemon_threads = True
    bound_host, bound_port = self._server.server_address[:2]
    self.url = f"http://{bound_host}:{bound_port}/dashboard"
    self._thread = threading.Thread(target=self._server.serve_forever, name="dashboard",
                                    daemon=True)
    self._thread.start()

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()

"""Observability: what the engine says about itself, and how people read it.

  metrics.py           MetricsRegistry: counters, gauges, histograms; JSON and Prometheus
  engine_metrics.py    the engine's runtime series (blocks per tier, hot buffer, transfers,
                       preemptions, latency) and the hooks that feed them once per step
  status.py            the periodic status line
  library_logging.py   INFO logging for library users (the capacity lines at model load)
  dashboard.py         the live dashboard: snapshot(engine) (JSON from the registry and the
                       capacity report), page() (dashboard.html: one self-contained page),
                       DashboardServer (generate / demo --serve_dashboard; serve has the
                       same routes in its app)
  grafana.py           the Grafana dashboard JSON (dashboards/), generated from the metric
                       names; its test checks every query against what an engine exports

May import: nothing of hisparse_jax (every other room may import it), nor models or
kernels_pallas. What it reports arrives as plain numbers or through the objects the
engine passes to its hooks.
"""

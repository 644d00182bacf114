"""Benchmarks: scripts that print a table and write JSON (never timed assertions in tests).

Each suite module has `run(size_name) -> dict` and `format_table(dict) -> str`
(`hisparse-jax bench --suite=NAME` runs them); `gpu_check.py` is `make gpu-check`.

May import anything in hisparse_jax (it measures the whole engine, the server included);
nothing imports it but the `bench` command (entrypoints/cli/bench.py).
"""

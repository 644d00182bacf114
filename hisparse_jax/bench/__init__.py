"""Benchmarks: scripts that print a table and write JSON (never timed assertions in tests)."""

"""What test_bench.py and test_bench_named_suites.py share: the repository root, the PNG
signature a written plot starts with, and the check that a figure is a positive finite
number (a benchmark's figures are reported, never compared with a time)."""

import math
import os

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def positive(*xs) -> bool:
  """Every x a finite int or float > 0."""
  return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)

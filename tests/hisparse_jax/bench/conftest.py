"""Makes bench_helpers (helpers beside these tests) importable by test_bench.py and
test_bench_named_suites.py under any pytest import mode."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

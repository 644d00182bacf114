"""Makes bench_helpers (helpers beside these tests) importable by the tests beside it under
any pytest import mode."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

"""Makes engine_fixtures (helpers beside these tests) importable under any pytest import mode."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

"""Makes the scheduler and lowering tests' helpers importable by their siblings
(test_scheduler_hisparse, test_lowering_mgpu) under any pytest import mode."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

"""Makes hisparse_engine_fixtures (helpers beside these tests) importable under any pytest
import mode, and shares the dense reference tokens of the HiSparse engine tests."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from engine_fixtures import reference_greedy, tiny_model  # noqa: E402
from hisparse_engine_fixtures import NUM_TOKENS, PROMPTS  # noqa: E402


@pytest.fixture(scope="module")
def reference():
  """The full-recompute dense greedy tokens of PROMPTS (NUM_TOKENS each) on the tiny model."""
  return reference_greedy(tiny_model(), PROMPTS, NUM_TOKENS)

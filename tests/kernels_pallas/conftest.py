"""Makes kernels_testlib (helpers beside these tests) importable under any pytest import
mode, and gives the Mosaic GPU kernels' tests their interpreter."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture
def gpu_interpreter():
  """jax's Mosaic GPU interpreter (InterpretGPUParams, race detection on) on fresh
  interpreter state: the `interpret` of the test_mgpu_* files' kernels on this CPU."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # noqa: PLC0415
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: PLC0415

  gpu_callbacks.reset_gpu_interpret_mode_state()
  yield InterpretGPUParams(detect_races=True)
  gpu_callbacks.reset_gpu_interpret_mode_state()

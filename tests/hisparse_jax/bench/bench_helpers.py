"""What the bench tests share: the repository root, the PNG signature a written plot starts
with, the check that a figure is a positive finite number (a benchmark's figures are
reported, never compared with a time), and what `make gpu-bench`'s kernel part must
report (test_gpu_bench.py, test_gpu_bench_kernels.py)."""

import math
import os

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def positive(*xs) -> bool:
  """Every x a finite int or float > 0."""
  return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


# make gpu-bench's kernel part (test_gpu_bench.py, test_gpu_bench_kernels.py)
GPU_BENCH_ROW_FIELDS = {"kernel", "impl", "shape", "median_ms", "min_ms", "bytes", "flops",
                        "gb_per_s", "tflop_per_s", "hbm_fraction", "flop_fraction",
                        "roofline_fraction", "max_abs_err", "ok", "note"}
GPU_BENCH_GPU_ONLY = {"ours-mgpu", "cudnn", "jax-mgpu-attention", "torch-flash", "torch-cudnn",
                      "tokamax-mosaic", "tokamax-triton", "jla-mgpu-attention"}
# What each kernel must report (as a row or a skip with a reason), written out here so the
# module's own list cannot drift unnoticed.
GPU_BENCH_EXPECTED = {
    "paged": {"ours-triton", "ours-mgpu", "xla-reference", "xla-sdpa", "jax-pallas-paged",
              "jax-pallas-decode", "jax-mgpu-attention", "cudnn", "torch-flash",
              "torch-cudnn", "tokamax-mosaic", "tokamax-triton", "tokamax-xla",
              "jla-mgpu-attention"},
    "paged_8bit": {"ours-triton", "ours-mgpu", "xla-reference", "jax-pallas-paged"},
    "ragged": {"ours-triton", "ours-mgpu", "xla-reference"},
    "prefill": {"ours-triton", "xla-sdpa", "cudnn", "jax-mgpu-attention", "torch-flash",
                "torch-cudnn", "tokamax-mosaic", "tokamax-triton", "tokamax-xla",
                "jla-mgpu-attention"},
    "sparse_mla": {"ours-triton", "ours-mgpu", "xla-reference", "jla-dsa"},
    "select": {"ours-triton", "ours-triton-int8", "ours-triton-fp8", "ours-jnp", "cpp-cpu"},
}

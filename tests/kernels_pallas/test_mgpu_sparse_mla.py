"""The Mosaic GPU sparse MLA decode: run on CPU by jax's GPU interpreter against the Triton
kernel's reference (sparse_mla_decode_reference), and lowered + compiled for an H200
(sm_90a) without a GPU at the DSA sizes (128 heads, 512 + 64, top-k 2048).

The interpreter simulates SMEM (unwritten SMEM is NaN), barriers and TMA copies, and its
race detection checks the slots' reuse (p written into the rope tile the QK WGMMAs read).
What only a Hopper GPU can check: the numbers of the compiled kernel and its speed.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import time

import chex
import jax
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from test_mgpu_paged_attention import MGPU_CALL, TRITON_CALL

from kernels_pallas.sparse_mla import sparse_mla_decode_reference
from kernels_pallas.sparse_mla_mgpu import (
  SMEM_BYTES,
  default_num_splits,
  smem_bytes,
  sparse_mla_decode_mgpu,
)

NUM_BLOCKS = 24
ROPE = 64
SCALE = 0.07
S = jax.ShapeDtypeStruct


def _case(rng, num_queries, num_heads, rank, block_size, topk, dtype):
  """(q, kv_pages, indices) as test_sparse_mla's: tokens of blocks 1.. (one listed twice),
  20% -1 padding, the null block 0 poisoned with NaN and never listed, the last row all
  padding (zeros), the first row's first 64 ids padding (a whole step of padding)."""
  width = rank + ROPE
  pages = rng.standard_normal((NUM_BLOCKS, block_size, 1, width)).astype(np.float32)
  pages[0] = np.nan
  idx = rng.integers(block_size, NUM_BLOCKS * block_size, size=(num_queries, topk))
  idx[rng.random(idx.shape) < 0.2] = -1
  idx[:, 1] = idx[:, 0]
  idx[0, :64] = -1
  idx[-1] = -1
  q = rng.standard_normal((num_queries, num_heads, width)).astype(np.float32)
  return (jnp.asarray(q, dtype), jnp.asarray(pages, dtype), jnp.asarray(idx, jnp.int32))


GRID = [  # (queries, heads, rank, block_size, topk, dtype, num_splits)
    (3, 16, 64, 16, 100, jnp.bfloat16, None),
    (2, 64, 128, 8, 200, jnp.bfloat16, 2),  # both slots reused, two splits
    (2, 80, 64, 4, 70, jnp.float16, None),  # two head tiles, the second padded
    (2, 1, 256, 16, 130, jnp.bfloat16, 3),  # one head; three splits of one step
    (2, 8, 320, 16, 64, jnp.bfloat16, 1),  # rank 320: PV in WGMMAs of 64 columns
    (2, 72, 512, 64, 192, jnp.bfloat16, None),  # DeepSeek's 512 + 64: PV in two of 256
]


@pytest.mark.parametrize(("queries", "heads", "rank", "block_size", "topk", "dtype",
                          "num_splits"), GRID)
def test_interpreted_kernel_matches_reference(gpu_interpreter, rng, queries, heads, rank,
                                              block_size, topk, dtype, num_splits):
  q, pages, idx = _case(rng, queries, heads, rank, block_size, topk, dtype)
  out = sparse_mla_decode_mgpu(q, pages, idx, sm_scale=SCALE, kv_lora_rank=rank,
                               interpret=gpu_interpreter, num_splits=num_splits)
  ref = sparse_mla_decode_reference(q, pages, idx, sm_scale=SCALE, kv_lora_rank=rank)
  chex.assert_shape(out, (queries, heads, rank))
  assert out.dtype == q.dtype
  out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(out32).all()  # the NaN block never read
  assert lib.max_abs_err(out32, ref32) <= 2e-2
  np.testing.assert_array_equal(out32[-1], 0.0)  # nothing listed -> zeros
  assert not gpu_callbacks.get_races().races_found


def test_refuses_what_wgmma_and_tma_cannot_take(rng):
  q, pages, idx = _case(rng, 2, 16, 64, 16, 64, jnp.bfloat16)
  kw = dict(sm_scale=SCALE, kv_lora_rank=64)
  with pytest.raises(ValueError, match="bfloat16 or float16 .* got q float32"):
    sparse_mla_decode_mgpu(q.astype(jnp.float32), pages.astype(jnp.float32), idx, **kw)
  with pytest.raises(ValueError, match="kv_lora_rank a multiple of 64 and rope 64, got 96 "
                     r"\+ 32"):
    sparse_mla_decode_mgpu(q, pages, idx, sm_scale=SCALE, kv_lora_rank=96)
  with pytest.raises(ValueError, match="tokens_per_step must be 64 .* got 128"):
    sparse_mla_decode_mgpu(q, pages, idx, tokens_per_step=128, **kw)
  with pytest.raises(ValueError, match="interpret=True"):
    sparse_mla_decode_mgpu(q, pages, idx, interpret=True, **kw)
  with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
    sparse_mla_decode_mgpu(q, pages, idx, num_splits=0, **kw)
  with pytest.raises(ValueError, match=r"needs \d+ bytes of SMEM"):
    wide = jnp.zeros((2, 16, 1024 + ROPE), jnp.bfloat16)
    sparse_mla_decode_mgpu(wide, jnp.zeros((4, 16, 1, 1024 + ROPE), jnp.bfloat16), idx,
                           sm_scale=SCALE, kv_lora_rank=1024)


def test_smem_budget_and_default_splits_at_the_dsa_sizes():
  # DeepSeek's 512 + 64 at 64 tokens per step fits one block's 227 KiB (module docstring).
  assert smem_bytes(jnp.bfloat16, 512, 64, 64, num_splits=2) == 221952 <= SMEM_BYTES
  # batch 32 x 2 head tiles = 64 programs over 32 steps: 3 splits of 11 steps.
  assert default_num_splits(32, 2, 32) == 3
  assert default_num_splits(132, 1, 32) == 1  # the batch fills the SMs
  assert default_num_splits(1, 1, 3) == 1  # too few steps to split


DSA_ARGS = (S((32, 128, 576), jnp.bfloat16), S((4096, 64, 1, 576), jnp.bfloat16),
            S((32, 2048), jnp.int32))


def test_kernel_lowers_for_cuda_to_one_mosaic_gpu_call_at_the_dsa_sizes():
  _, lowered = lib.lower_for_h200(
      functools.partial(sparse_mla_decode_mgpu, sm_scale=SCALE, kv_lora_rank=512), *DSA_ARGS)
  text = lowered.as_text()
  calls = re.findall(r"custom_call @([\w$.]+)\(", text)
  assert calls.count(MGPU_CALL) == 1 and TRITON_CALL not in calls, calls


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="XLA's GPU compiler is not installed (jax[cuda13])")
def test_kernel_compiles_for_an_h200_at_the_dsa_sizes():
  t = time.perf_counter()
  target, lowered = lib.lower_for_h200(
      functools.partial(sparse_mla_decode_mgpu, sm_scale=SCALE, kv_lora_rank=512), *DSA_ARGS)
  assert target.compile(lowered) is not None
  print(f"lowered + compiled for {target.sm} in {time.perf_counter() - t:.1f} s")

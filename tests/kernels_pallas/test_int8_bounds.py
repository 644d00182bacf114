"""int8 key bounds (`QuantizedBounds`): outward quantization, the block_key_bounds update
(the Pallas kernel in interpret mode and compiled deviceless for an H200, and the jnp
reference)."""

import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

from kernels_pallas import block_key_bounds, block_key_bounds_reference
from kernels_pallas.block_key_bounds import (
  QuantizedBounds,
  empty_bounds,
  quantize_bounds,
)
from kernels_pallas.quant import QuantizedPages, quantize

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 10, 8, 2, 64
BOUNDS = {"pallas": block_key_bounds, "xla": block_key_bounds_reference}
IMPLS = ["pallas", "xla"]


def _keys(rng, shape):
  """Keys whose channels differ in scale by 1e4 (a model's outlier channels beside small
  ones), and one head of all-equal keys."""
  k = rng.standard_normal(shape) * rng.choice([0.01, 1.0, 40.0], size=shape[-1])
  k[..., 0, :] = k[..., :1, 0, :]  # head 0: every token equal (min == max)
  return k.astype(np.float32)


def test_quantized_bounds_contain_every_key_and_are_tight(rng):
  k = _keys(rng, (64, 16, 4, 128))
  k_min, k_max = k.min(axis=1), k.max(axis=1)
  q = quantize_bounds(jnp.asarray(k_min), jnp.asarray(k_max))
  assert q.values.dtype == jnp.int8 and q.values.shape == (64, 2, 4, 128)
  assert q.scales.dtype == jnp.float32 and q.scales.shape == (64, 2, 4, 1)
  values = np.asarray(q.values, np.float32)
  assert np.abs(values).max() == 127 and values.min() >= -127  # no -128, no clipping
  lo, hi = np.asarray(q.dequantize()).transpose(1, 0, 2, 3)
  assert (lo <= k_min).all() and (hi >= k_max).all()
  # Within one step of the (block, side, head)'s scale: amax / 127, a hair more.
  step = np.asarray(q.scales)[..., 0]  # [64, 2, 4]
  assert (k_min - lo <= step[:, 0, :, None] * 1.0001).all()
  assert (hi - k_max <= step[:, 1, :, None] * 1.0001).all()
  np.testing.assert_allclose(step[:, 1], np.abs(k_max).max(-1) / 127, rtol=1e-3)
  # Each value is the tightest outward integer: one step inward would cut a key off.
  s = np.asarray(q.scales, np.float32)
  inward_lo = (values[:, 0] + 1) * s[:, 0]
  inward_hi = (values[:, 1] - 1) * s[:, 1]
  assert (inward_lo > k_min).all() and (inward_hi < k_max).all()


def test_quantized_bounds_of_edge_values(rng):
  # Zeros, values at exactly amax, negative-only and positive-only sides, tiny values.
  k_min = np.array([[0.0, 0.0, 0.0], [-3.0, -1.5, -3.0], [1e-20, 2e-20, 3e-20],
                    [0.5, 1.0, 127.0]], np.float32)[:, None]
  k_max = k_min + np.array([0.0, 1e-7, 1.0], np.float32)
  q = quantize_bounds(jnp.asarray(k_min), jnp.asarray(k_max))
  lo, hi = np.asarray(q.dequantize()).transpose(1, 0, 2, 3)
  assert (lo <= k_min).all() and (hi >= k_max).all()
  np.testing.assert_array_equal(np.asarray(q.values[0, 0]), 0)  # an all-zero side
  assert (np.asarray(q.scales) > 0).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_bounds_track_written_blocks_in_place(rng, impl, dtype):
  k = jnp.asarray(_keys(rng, (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)),
                  lib.DTYPES[dtype])
  k_np = np.asarray(k.astype(jnp.float32))
  rows = NUM_BLOCKS + 3  # rows past the pages' blocks stay as they are
  sentinel = QuantizedBounds(jnp.full((rows, 2, NUM_KV_HEADS, HEAD_DIM), 5, jnp.int8),
                             jnp.full((rows, 2, NUM_KV_HEADS, 1), 0.5, jnp.float32))
  ptrs = (sentinel.values.unsafe_buffer_pointer(), sentinel.scales.unsafe_buffer_pointer())
  # Block 3 full, 3 tokens of block 6 (its last write first), padding, a slot past the pool.
  slots = ([3 * BLOCK_SIZE + i for i in range(BLOCK_SIZE)]
           + [6 * BLOCK_SIZE + 2, 6 * BLOCK_SIZE, 6 * BLOCK_SIZE + 1, -1,
              NUM_BLOCKS * BLOCK_SIZE])
  out = BOUNDS[impl](sentinel, k, jnp.asarray(slots, jnp.int32))
  assert isinstance(out, QuantizedBounds)
  assert (out.values.unsafe_buffer_pointer(), out.scales.unsafe_buffer_pointer()) == ptrs
  got = np.asarray(out.dequantize())
  for block_id, num_valid in [(3, BLOCK_SIZE), (6, 3)]:
    keys = k_np[block_id, :num_valid]
    want = quantize_bounds(jnp.asarray(keys.min(0)), jnp.asarray(keys.max(0)))
    np.testing.assert_array_equal(np.asarray(out.values[block_id]), np.asarray(want.values))
    np.testing.assert_allclose(np.asarray(out.scales[block_id]), np.asarray(want.scales),
                               rtol=1e-6)
    assert (got[block_id, 0] <= keys.min(0)).all()
    assert (got[block_id, 1] >= keys.max(0)).all()
  untouched = [i for i in range(rows) if i not in (3, 6)]
  np.testing.assert_array_equal(np.asarray(out.values)[untouched], 5)
  np.testing.assert_array_equal(np.asarray(out.scales)[untouched], 0.5)


@pytest.mark.parametrize("impl", IMPLS)
def test_int8_bounds_of_int8_keys(rng, impl):
  # An int8 KV cache: the bounds are those of the dequantized keys, then quantized again.
  k = jnp.asarray(_keys(rng, (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)))
  values, scales = quantize(k, "int8")
  pages = QuantizedPages(values, scales, "float32")
  deq = np.asarray(pages[jnp.arange(NUM_BLOCKS)], np.float32)
  slots = jnp.arange(NUM_BLOCKS * BLOCK_SIZE, dtype=jnp.int32)
  out = BOUNDS[impl](empty_bounds((NUM_BLOCKS, 2, NUM_KV_HEADS, HEAD_DIM), "int8"), pages,
                     slots)
  got = np.asarray(out.dequantize())
  assert (got[:, 0] <= deq.min(1)).all() and (got[:, 1] >= deq.max(1)).all()


def test_quantized_bounds_of_the_wrong_layout_are_refused(rng):
  k = jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
  bad = QuantizedBounds(jnp.zeros((NUM_BLOCKS, 2, NUM_KV_HEADS, HEAD_DIM), jnp.int8),
                        jnp.zeros((NUM_BLOCKS, 2, NUM_KV_HEADS), jnp.float32))
  with pytest.raises(ValueError, match="QuantizedBounds must be int8 values"):
    block_key_bounds_reference(bad, k, jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="int8: QuantizedBounds"):
    block_key_bounds_reference(jnp.zeros((NUM_BLOCKS, 2, NUM_KV_HEADS, HEAD_DIM), jnp.int8),
                               k, jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("impl", IMPLS)
def test_int8_bounds_at_a_head_dim_that_is_not_a_power_of_2(rng, impl):
  # The kernel tiles head_dim 96 at 128: the padding columns are neither read (they would
  # change the amax, hence every value) nor written (the next KV head's row on a GPU).
  head_dim = 96
  k = jnp.asarray(_keys(rng, (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim)), jnp.bfloat16)
  k_np = np.asarray(k.astype(jnp.float32))
  sentinel = QuantizedBounds(jnp.full((NUM_BLOCKS, 2, NUM_KV_HEADS, head_dim), 5, jnp.int8),
                             jnp.full((NUM_BLOCKS, 2, NUM_KV_HEADS, 1), 0.5, jnp.float32))
  slots = np.array([3 * 8 + 0, 3 * 8 + 1, -1, 79, 9], np.int32)  # blocks 3 (2), 9 (8), 1 (2)
  out = BOUNDS[impl](sentinel, k, jnp.asarray(slots))
  assert out.values.shape == (NUM_BLOCKS, 2, NUM_KV_HEADS, head_dim)
  for block_id, num_valid in [(3, 2), (9, 8), (1, 2)]:
    keys = k_np[block_id, :num_valid]
    want = quantize_bounds(jnp.asarray(keys.min(0)), jnp.asarray(keys.max(0)))
    np.testing.assert_array_equal(np.asarray(out.values[block_id]), np.asarray(want.values))
    np.testing.assert_array_equal(np.asarray(out.scales[block_id]), np.asarray(want.scales))
  untouched = [0, 2, 4, 5, 6, 7, 8]
  np.testing.assert_array_equal(np.asarray(out.values)[untouched], 5)
  np.testing.assert_array_equal(np.asarray(out.scales)[untouched], 0.5)


S = jax.ShapeDtypeStruct


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="XLA's GPU compiler is not installed (jax[cuda13])")
@pytest.mark.parametrize("head_dim", [128, 96])
def test_the_int8_update_compiles_for_an_h200_as_one_triton_call_in_place(head_dim):
  bounds = QuantizedBounds(S((4097, 2, 8, head_dim), jnp.int8), S((4097, 2, 8, 1), jnp.float32))
  args = (bounds, S((4096, 16, 8, head_dim), jnp.bfloat16), S((32,), jnp.int32))
  target, lowered = lib.lower_for_h200(functools.partial(block_key_bounds, interpret=False),
                                       *args)
  text = lowered.as_text()
  assert re.findall(r"custom_call @([\w$.]+)\(", text) == ["__gpu$xla.gpu.triton"]
  # Both arrays are the kernel's outputs aliased to its inputs (updated in place).
  assert text.count("stablehlo.output_operand_alias<") == 2
  executable = target.compile(lowered)
  assert executable.get_compiled_memory_stats().temp_size_in_bytes < 2**20

"""The C++ "union" selection for XLA:CPU (kernels_pallas/cpu_select.cc) against the jnp path
it replaces on CPU (`indexer.select_blocks(indexer.union_priority(...))`): the same blocks,
counts and lengths, ties within and across heads included, for every batch row at once
(rows of different lengths, empty rows, rows past the top-k and rows within it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.sparse import indexer
from hisparse_jax.sparse.config import HiSparseBlocks
from kernels_pallas import cpu_kernels
from kernels_pallas.block_key_bounds import (
  _SCALE_MARGIN,
  INT8_MAX,
  empty_bounds,
  quantize_bounds,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="the C++ CPU kernels are not built (no C++ compiler)")


def _blocks(block_size, top_k, sink, local):
  return HiSparseBlocks(block_size=block_size, top_k_blocks=top_k, hot_buffer_blocks=2 * top_k,
                        sink_blocks=sink, local_blocks=local, sparse_threshold_blocks=top_k)


def _both(scores, lens, blocks):
  scores, lens = jnp.asarray(scores), jnp.asarray(lens, jnp.int32)
  ref = jax.jit(lambda s, n: indexer.select_blocks(indexer.union_priority(s, n, blocks), n,
                                                   blocks))(scores, lens)
  k = min(blocks.top_k_blocks, scores.shape[-1])
  got = jax.jit(lambda s, n: cpu_kernels.union_select(
      s, n, k=k, block_size=blocks.block_size, sink_blocks=blocks.sink_blocks,
      local_blocks=blocks.local_blocks))(scores, lens)
  return ref, got


def _assert_equal(ref, got):
  ids, num, lens = (np.asarray(x) for x in got)
  np.testing.assert_array_equal(ids, np.asarray(ref.logical_ids))
  np.testing.assert_array_equal(num, np.asarray(ref.num_selected))
  np.testing.assert_array_equal(lens, np.asarray(ref.kv_lens))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), heads=st.sampled_from([1, 2, 3, 8, 9]),
       max_blocks=st.sampled_from([1, 5, 12, 40]), block_size=st.sampled_from([1, 4, 16]),
       top_k=st.sampled_from([1, 2, 4, 8, 16]), sink=st.sampled_from([0, 1, 2]),
       local=st.sampled_from([1, 2]), ties=st.booleans())
def test_matches_the_jnp_selection(seed, heads, max_blocks, block_size, top_k, sink, local,
                                   ties):
  if sink + local > top_k:
    return
  rng = np.random.default_rng(seed)
  batch = 5
  scores = rng.standard_normal((batch, heads, max_blocks)).astype(np.float32)
  if ties:
    scores = np.round(scores)  # ties within and across heads
  scores[0, 0, 0] = -np.inf  # a valid block no head can list
  capacity = max_blocks * block_size
  lens = [0, 1, capacity, int(rng.integers(1, capacity + 1)), int(rng.integers(1, capacity + 1))]
  _assert_equal(*_both(scores, lens, _blocks(block_size, top_k, sink, local)))


def test_engine_sized_rows():
  # The hot-buffer bench's shape: 8 rows x 4,096 blocks, 8 query heads, k = 128 blocks.
  rng = np.random.default_rng(0)
  scores = rng.standard_normal((8, 8, 4096)).astype(np.float32)
  lens = [65536, 65530, 4096, 2049, 16, 0, 40000, 100]
  _assert_equal(*_both(scores, lens, _blocks(16, 128, 4, 16)))


def test_select_takes_the_kernel_on_cpu_only_when_asked(monkeypatch):
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
  bounds = jnp.asarray(np.sort(rng.standard_normal((3, 20, 2, 2, 8)), axis=2), jnp.float32)
  lens = jnp.array([300, 17, 0], jnp.int32)
  blocks = _blocks(16, 8, 1, 2)
  calls = []
  real = cpu_kernels.union_select
  monkeypatch.setattr(cpu_kernels, "union_select",
                      lambda *a, **kw: calls.append(1) or real(*a, **kw))
  jnp_sel = indexer.select(q, bounds, lens, blocks, "union")
  assert not calls
  cpp_sel = indexer.select(q, bounds, lens, blocks, "union", cpu_kernel=True)
  assert calls
  for a, b in zip(jax.tree.leaves(jnp_sel), jax.tree.leaves(cpp_sel), strict=True):
    np.testing.assert_array_equal(a, b)


def _dyadic(rng, shape, scale=8):
  """Multiples of 1/8 below 32 in size: every sum of their products is exact in float32,
  in any order, so the C++ and XLA scores are equal and so are their selections."""
  return (rng.integers(-4 * scale, 4 * scale, size=shape) / scale).astype(np.float32)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), group=st.sampled_from([1, 3, 4]),
       kv_heads=st.sampled_from([1, 2, 3]), max_blocks=st.sampled_from([3, 17, 40]),
       top_k=st.sampled_from([2, 4, 8]), dtype=st.sampled_from(["float32", "bfloat16"]),
       coarse=st.booleans())
def test_in_place_scores_select_what_the_gathered_copy_selects(seed, group, kv_heads,
                                                              max_blocks, top_k, dtype,
                                                              coarse):
  rng = np.random.default_rng(seed)
  batch, head_dim, num_rows, block_size = 4, 8, 64, 4
  q = jnp.asarray(_dyadic(rng, (batch, group * kv_heads, head_dim), 1 if coarse else 8))
  bounds = np.sort(_dyadic(rng, (num_rows, 2, kv_heads, head_dim), 1 if coarse else 8),
                   axis=1)  # coarse: many equal scores (ties within and across heads)
  bounds = jnp.asarray(bounds).astype(dtype)
  rows = jnp.asarray(rng.integers(0, num_rows, size=(batch, max_blocks)), jnp.int32)
  capacity = max_blocks * block_size
  lens = jnp.asarray([0, 1, capacity, int(rng.integers(1, capacity + 1))], jnp.int32)
  blocks = _blocks(block_size, top_k, 1, 1)
  ref = jax.jit(lambda q, b, r, n: indexer.select(q, b[r], n, blocks, "union"))(
      q, bounds, rows, lens)
  k = min(top_k, max_blocks)
  got = jax.jit(lambda q, b, r, n: cpu_kernels.union_select_bounds(
      q, b, r, n, k=k, block_size=block_size, sink_blocks=1, local_blocks=1))(
          q, bounds, rows, lens)
  _assert_equal(ref, got)
  via = indexer.select_rows(q, bounds, rows, lens, blocks, "union", cpu_kernel=True)
  _assert_equal(ref, (via.logical_ids, via.num_selected, via.kv_lens))
  if dtype == "bfloat16":  # the engine's CPU storage: the same bounds as uint16 bits
    bits = jax.lax.bitcast_convert_type(bounds, jnp.uint16)
    got = cpu_kernels.union_select_bounds(q, bits, rows, lens, k=k, block_size=block_size,
                                          sink_blocks=1, local_blocks=1)
    _assert_equal(ref, got)
    for cpu in (True, False):  # the kernel, and the gather (bits read as bfloat16)
      via = indexer.select_rows(q, bits, rows, lens, blocks, "union", cpu_kernel=cpu)
      _assert_equal(ref, (via.logical_ids, via.num_selected, via.kv_lens))


def test_in_place_scores_at_engine_size():
  # 8 rows x 4,096 blocks of 16 tokens (rows split into scoring tasks), 8 query heads on
  # 2 KV heads of 64, bfloat16 bounds, rows spread over a pool of 40,000.
  rng = np.random.default_rng(2)
  q = jnp.asarray(_dyadic(rng, (8, 8, 64)))
  bounds = jnp.asarray(np.sort(_dyadic(rng, (40000, 2, 2, 64)), axis=1)).astype(jnp.bfloat16)
  rows = jnp.asarray(rng.integers(0, 40000, size=(8, 4096)), jnp.int32)
  lens = jnp.asarray([65536, 65530, 4096, 2049, 16, 0, 40000, 100], jnp.int32)
  blocks = _blocks(16, 128, 4, 16)
  ref = indexer.select(q, bounds[rows], lens, blocks, "union")
  via = indexer.select_rows(q, bounds, rows, lens, blocks, "union", cpu_kernel=True)
  _assert_equal(ref, (via.logical_ids, via.num_selected, via.kv_lens))


def test_select_rows_takes_the_gather_where_the_kernel_does_not_apply(monkeypatch):
  # Other selections, tensor parallelism, or not asked: the gathered copy and `select`.
  rng = np.random.default_rng(3)
  q = jnp.asarray(_dyadic(rng, (2, 4, 8)))
  bounds = jnp.asarray(np.sort(_dyadic(rng, (30, 2, 2, 8)), axis=1))
  rows = jnp.asarray(rng.integers(0, 30, size=(2, 12)), jnp.int32)
  lens = jnp.asarray([40, 7], jnp.int32)
  blocks = _blocks(4, 4, 1, 1)
  calls = []
  real = cpu_kernels.union_select_bounds
  monkeypatch.setattr(cpu_kernels, "union_select_bounds",
                      lambda *a, **kw: calls.append(1) or real(*a, **kw))
  for selection, cpu in (("union", False), ("shared", True), ("per_kv_head", True)):
    got = indexer.select_rows(q, bounds, rows, lens, blocks, selection, cpu_kernel=cpu)
    want = indexer.select(q, bounds[rows], lens, blocks, selection)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_array_equal(a, b)
  assert not calls
  indexer.select_rows(q, bounds, rows, lens, blocks, "union", cpu_kernel=True)
  assert calls


def _power_of_two_amax(e: int) -> np.float32:
  """A float32 largest magnitude whose `quantize_bounds` scale is exactly 2^-e."""
  c, want = np.float32(_SCALE_MARGIN / INT8_MAX), np.float32(2.0 ** -e)
  a = np.float32(want / c)
  for direction in (np.inf, -np.inf):
    x = a
    for _ in range(4):
      if np.float32(x * c) == want:
        return x
      x = np.nextafter(x, np.float32(direction), dtype=np.float32)
  raise AssertionError(f"no float32 amax for scale 2^-{e}")


def _int8_bounds(rng, num_rows, kv_heads, head_dim, coarse=False):
  """`quantize_bounds` of random key minima and maxima (in [-1, 1]; coarse: multiples of
  1/2, many equal scores) whose (row, side, KV head) has one extreme element of a
  magnitude that makes its scale 2^-e, e in [2, 6]: the values are any int8, and with
  dyadic queries every score is exact in float32 in any order and factoring (the C++
  kernel's scale * (q . values) and the jnp path's q . (values * scale) are equal), so
  are the selections, ties included."""
  base = rng.uniform(-1, 1, size=(num_rows, 2, kv_heads, head_dim))
  if coarse:
    base = np.round(base * 2) / 2
  lo, hi = np.sort(base, axis=1).astype(np.float32).transpose(1, 0, 2, 3)
  e = rng.integers(2, 7, size=(2, num_rows, kv_heads))
  amax = np.vectorize(_power_of_two_amax, otypes=[np.float32])(e)
  col = rng.integers(0, head_dim, size=(2, num_rows, kv_heads))
  r, h = np.meshgrid(np.arange(num_rows), np.arange(kv_heads), indexing="ij")
  lo[r, h, col[0]] = -amax[0]  # each side's largest magnitude: below every other min,
  hi[r, h, col[1]] = amax[1]  # above every other max
  qb = quantize_bounds(jnp.asarray(lo), jnp.asarray(hi))
  mantissa, _ = np.frexp(np.asarray(qb.scales))
  assert (mantissa == 0.5).all(), "scales must be powers of 2"
  return qb


def _select_int8(q, qb, rows, lens, blocks):
  """(the jnp selection on the gathered, dequantized bounds, the C++ kernel's on `qb`)."""
  ref = jax.jit(lambda q, qb, r, n: indexer.select(q, qb.rows(r).dequantize(), n, blocks,
                                                   "union"))(q, qb, rows, lens)
  k = min(blocks.top_k_blocks, rows.shape[1])
  got = jax.jit(lambda q, qb, r, n: cpu_kernels.union_select_bounds(
      q, qb, r, n, k=k, block_size=blocks.block_size, sink_blocks=blocks.sink_blocks,
      local_blocks=blocks.local_blocks))(q, qb, rows, lens)
  return ref, got


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), group=st.sampled_from([1, 4]),
       kv_heads=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([8, 64, 128]),
       max_blocks=st.sampled_from([3, 17, 40]), top_k=st.sampled_from([2, 4, 8]),
       coarse=st.booleans())
def test_int8_bounds_select_what_the_dequantized_copy_selects(seed, group, kv_heads, head_dim,
                                                              max_blocks, top_k, coarse):
  rng = np.random.default_rng(seed)
  batch, num_rows, block_size = 4, 64, 4
  q = jnp.asarray(_dyadic(rng, (batch, group * kv_heads, head_dim), 1 if coarse else 8))
  qb = _int8_bounds(rng, num_rows, kv_heads, head_dim, coarse)
  rows = jnp.asarray(rng.integers(0, num_rows, size=(batch, max_blocks)), jnp.int32)
  capacity = max_blocks * block_size
  lens = jnp.asarray([0, 1, capacity, int(rng.integers(1, capacity + 1))], jnp.int32)
  blocks = _blocks(block_size, top_k, 1, 1)
  ref, got = _select_int8(q, qb, rows, lens, blocks)
  _assert_equal(ref, got)
  assert cpu_kernels.union_select_bounds_target(qb) == "hisparse_union_select_bounds_i8"
  via = indexer.select_rows(q, qb, rows, lens, blocks, "union", cpu_kernel=True)
  _assert_equal(ref, (via.logical_ids, via.num_selected, via.kv_lens))


@pytest.mark.parametrize("group,kv_heads,head_dim", [(4, 8, 128), (1, 8, 64), (4, 2, 64)])
def test_int8_bounds_at_engine_size(group, kv_heads, head_dim):
  # 4 rows x 2,048 blocks of 16 (rows split into scoring tasks), rows of a pool of 6,000
  # repeated and out of order.
  rng = np.random.default_rng(4)
  q = jnp.asarray(_dyadic(rng, (4, group * kv_heads, head_dim)))
  qb = _int8_bounds(rng, 6000, kv_heads, head_dim)
  rows = jnp.asarray(rng.integers(0, 6000, size=(4, 2048)), jnp.int32)
  lens = jnp.asarray([32768, 32760, 2049, 0], jnp.int32)
  _assert_equal(*_select_int8(q, qb, rows, lens, _blocks(16, 128, 4, 16)))


@pytest.mark.parametrize("group,head_dim", [(4, 128), (1, 64)])
def test_int8_bounds_of_real_valued_keys(group, head_dim):
  # Scales of any value and real-valued queries: the scores are equal up to float32
  # rounding (scale times each side's sum against the sum of scaled values); with these
  # seeds no two blocks are that close at a head's k-th place.
  rng = np.random.default_rng(5)
  kv_heads, num_rows = 2, 500
  keys = rng.standard_normal((num_rows, 8, kv_heads, head_dim)) * rng.choice(
      [0.05, 1.0, 10.0], size=head_dim)
  qb = quantize_bounds(jnp.asarray(keys.min(1), jnp.float32),
                       jnp.asarray(keys.max(1), jnp.float32))
  q = jnp.asarray(rng.standard_normal((3, group * kv_heads, head_dim)), jnp.float32)
  rows = jnp.asarray(rng.permutation(np.tile(np.arange(num_rows), 2))[:3 * 300].reshape(
      3, 300), jnp.int32)
  lens = jnp.asarray([4800, 1000, 33], jnp.int32)
  _assert_equal(*_select_int8(q, qb, rows, lens, _blocks(16, 32, 1, 2)))


def test_union_select_bounds_target():
  qb = empty_bounds((4, 2, 1, 8), jnp.int8)
  assert cpu_kernels.union_select_bounds_target(qb) == "hisparse_union_select_bounds_i8"
  for dtype, target in cpu_kernels.UNION_SELECT_BOUNDS_TARGETS.items():
    assert cpu_kernels.union_select_bounds_target(jnp.zeros((4, 2, 1, 8), dtype)) == target
  assert cpu_kernels.union_select_bounds_target(jnp.zeros((4, 2, 1, 8), jnp.float16)) is None
  assert cpu_kernels.union_select_bounds_target(qb._replace(scales=qb.scales.astype(
      jnp.bfloat16))) is None

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

"""Ragged paged attention (prefill, chunked prefill, decode rows): kernel vs reference."""

import chex
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

from kernels_pallas import ragged_paged_attention, ragged_paged_attention_reference

NUM_BLOCKS = 40


def _seqs(block_size):
  """(q_len, kv_len): decode rows, whole prefills, chunked prefills, an empty query."""
  bs, long = block_size, 5 * block_size + 3
  return [(1, 1), (bs - 1, bs - 1), (1, bs), (3, bs + 1), (0, 5), (bs + 5, long), (1, long)]


def _case(rng, ratio, block_size, head_dim, dtype, seqs, pad_rows=2, num_kv_heads=None):
  num_kv_heads = num_kv_heads or (2 if ratio < 8 else 1)
  q_lens, kv_lens = zip(*seqs)
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, num_kv_heads, head_dim, lib.DTYPES[dtype])
  max_blocks = -(-max(kv_lens) // block_size)
  tables = lib.make_tables(rng, kv_lens, block_size, max_blocks, NUM_BLOCKS)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((cu[-1] + pad_rows, ratio * num_kv_heads, head_dim)),
                  lib.DTYPES[dtype])
  args = (q, pool.k_pages, pool.v_pages, jnp.asarray(tables), jnp.asarray(kv_lens, jnp.int32),
          jnp.asarray(cu))
  return args, pool, tables, cu


# Every value of every grid axis once (the pairwise grid is run on decode; the kernel's inner
# loop is the same, and each ragged compile costs seconds in interpret mode).
RAGGED_GRID = ((1, 8, 64, "float32"), (4, 16, 128, "bfloat16"), (8, 32, 128, "float32"))


@pytest.mark.parametrize("ratio,block_size,head_dim,dtype", RAGGED_GRID)
def test_kernel_matches_reference_on_grid(rng, ratio, block_size, head_dim, dtype):
  args, _, _, cu = _case(rng, ratio, block_size, head_dim, dtype, _seqs(block_size))
  kw = {}
  if ratio == 8:
    kw["sliding_window"] = block_size + 3
  if ratio == 4:
    kw["soft_cap"] = 10.0
  out = ragged_paged_attention(*args, **kw)
  ref = ragged_paged_attention_reference(*args, **kw)
  chex.assert_shape(out, args[0].shape)
  assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= lib.TOL[dtype]
  np.testing.assert_array_equal(np.asarray(out[cu[-1]:], np.float32), 0.0)  # padding rows


# GQA groups and head_dims that are not powers of 2: the group padded to block_h rows per
# token, head_dim tiled at the next power of 2 with the pages' padding columns masked.
RAGGED_ODD = ((20, 1, 8, 80, "float32"), (5, 2, 16, 96, "bfloat16"), (3, 2, 8, 112, "float32"))


@pytest.mark.parametrize("ratio,num_kv_heads,block_size,head_dim,dtype", RAGGED_ODD)
def test_odd_group_and_head_dim_match_reference(rng, ratio, num_kv_heads, block_size, head_dim,
                                                dtype):
  args, _, _, cu = _case(rng, ratio, block_size, head_dim, dtype, _seqs(block_size),
                         num_kv_heads=num_kv_heads)
  out = ragged_paged_attention(*args)
  chex.assert_shape(out, args[0].shape)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  ref = ragged_paged_attention_reference(*args)
  assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= lib.TOL[dtype]
  np.testing.assert_array_equal(np.asarray(out[cu[-1]:], np.float32), 0.0)  # padding rows


@pytest.mark.parametrize("fn", [ragged_paged_attention, ragged_paged_attention_reference])
def test_bad_shapes_raise_with_shapes(rng, fn):
  args, _, _, _ = _case(rng, 4, 8, 64, "float32", [(2, 5), (1, 9)])
  q, k, v, tables, kv_lens, cu = args
  with pytest.raises(ValueError, match=r"\(3,\)"):
    fn(q, k, v, tables, kv_lens, cu[:2])
  with pytest.raises(ValueError, match=r"\(3, 2\)"):
    fn(q, k, v, jnp.zeros((3, 2), jnp.int32), kv_lens, cu)
  with pytest.raises(ValueError, match=r"sliding_window"):
    fn(q, k, v, tables, kv_lens, cu, sliding_window=0)
  with pytest.raises(ValueError, match=r"dtype"):
    fn(q.astype(jnp.bfloat16), k, v, tables, kv_lens, cu)

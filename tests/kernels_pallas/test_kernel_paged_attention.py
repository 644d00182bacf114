"""Decode paged attention: the Pallas kernel (interpret mode) against its reference."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_testlib as lib
from kernels_pallas import paged_attention, paged_attention_reference

NUM_BLOCKS, MAX_BLOCKS = 40, 8


def _case(rng, ratio, block_size, head_dim, dtype, lengths, max_blocks=MAX_BLOCKS):
  num_kv_heads = 2 if ratio < 8 else 1
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, num_kv_heads, head_dim, lib.DTYPES[dtype])
  tables = lib.make_tables(rng, lengths, block_size, max_blocks, NUM_BLOCKS)
  q = jnp.asarray(rng.standard_normal((len(lengths), ratio * num_kv_heads, head_dim)),
                  lib.DTYPES[dtype])
  return (q, pool.k_pages, pool.v_pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("ratio,block_size,head_dim,dtype", lib.PAIRWISE_GRID)
def test_kernel_matches_reference_on_grid(rng, ratio, block_size, head_dim, dtype):
  lengths = lib.grid_lengths(block_size)
  args = _case(rng, ratio, block_size, head_dim, dtype, lengths)
  num_splits = 3 if block_size != 16 else 1  # split-K boundaries inside the long rows
  out = paged_attention(*args, num_splits=num_splits)
  ref = paged_attention_reference(*args)
  chex.assert_shape(out, args[0].shape)
  assert out.dtype == args[0].dtype
  assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= lib.TOL[dtype]
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)  # length 0 -> zeros


def test_long_sequence_default_split_k(rng):
  # 64 blocks -> the default picks 4 splits; lengths end in different splits, one split empty.
  lengths = [8 * 64, 8 * 40 + 3, 17, 0]
  pool = lib.make_pool(rng, 200, 8, 2, 64, jnp.float32)
  tables = lib.make_tables(rng, lengths, 8, 64, 200)
  q = jnp.asarray(rng.standard_normal((len(lengths), 8, 64)), jnp.float32)
  args = (q, pool.k_pages, pool.v_pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))
  out = paged_attention(*args)
  assert lib.max_abs_err(out, paged_attention_reference(*args)) <= 1e-5
  np.testing.assert_array_equal(np.asarray(out[-1]), 0.0)


def test_gpu_tile_shapes_in_interpret_mode(rng):
  # The layout a GPU compile uses: query heads padded to 16 rows, 4 blocks per dot.
  args = _case(rng, 4, 8, 64, "float32", lib.grid_lengths(8))
  out = paged_attention(*args, block_h=16, blocks_per_step=4, num_splits=2)
  assert lib.max_abs_err(out, paged_attention_reference(*args)) <= 1e-5


def test_soft_cap_and_scale(rng):
  args = _case(rng, 8, 16, 64, "float32", [3, 40, 100])
  q = args[0] * 4
  kw = dict(sm_scale=0.3, soft_cap=5.0)
  out = paged_attention(q, *args[1:], **kw)
  assert lib.max_abs_err(out, paged_attention_reference(q, *args[1:], **kw)) <= 1e-5
  assert lib.max_abs_err(out, paged_attention_reference(q, *args[1:], sm_scale=0.3)) > 1e-3


def test_sparse_table_equals_attention_over_selected_tokens(rng):
  """A table listing a subset of blocks == plain softmax over exactly those blocks' tokens."""
  block_size, num_kv_heads, head_dim = 16, 2, 64
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, num_kv_heads, head_dim, jnp.float32)
  seq_blocks = rng.choice(np.arange(1, NUM_BLOCKS), size=12, replace=False)  # a 192-token seq
  picks = [np.array([0, 5, 11]), np.array([11, 2, 7, 3]), np.array([4])]  # top-k, any order
  max_blocks = 4
  tables = np.zeros((len(picks), max_blocks), np.int32)
  for b, p in enumerate(picks):
    tables[b, :len(p)] = seq_blocks[p]
  lengths = np.array([len(p) * block_size for p in picks], np.int32)
  q = rng.standard_normal((len(picks), 4 * num_kv_heads, head_dim)).astype(np.float32)
  out = paged_attention(jnp.asarray(q), pool.k_pages, pool.v_pages, jnp.asarray(tables),
                        jnp.asarray(lengths))
  for b, p in enumerate(picks):
    # Independent: the sequence's tokens in position order, keep those of the picked blocks.
    seq_k = pool.k_np[seq_blocks].reshape(-1, num_kv_heads, head_dim)
    seq_v = pool.v_np[seq_blocks].reshape(-1, num_kv_heads, head_dim)
    keep = np.isin(np.arange(12 * block_size) // block_size, p)
    want = lib.naive_attention(q[b:b + 1], seq_k[keep], seq_v[keep])
    assert lib.max_abs_err(out[b:b + 1], want) <= 1e-5, b


@pytest.mark.parametrize("fn", [paged_attention, paged_attention_reference])
def test_bad_shapes_raise_with_shapes(rng, fn):
  q, k, v, tables, lengths = _case(rng, 4, 8, 64, "float32", [3, 9])
  with pytest.raises(ValueError, match=r"\(2, 8, 32\)"):
    fn(q[..., :32], k, v, tables, lengths)
  with pytest.raises(ValueError, match=r"multiple of num_kv_heads"):
    fn(q[:, :7], k, v, tables, lengths)
  with pytest.raises(ValueError, match=r"\(3, 8\)"):
    fn(q, k, v, jnp.zeros((3, 8), jnp.int32), lengths)
  with pytest.raises(ValueError, match=r"int32"):
    fn(q, k, v, tables, lengths.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"same shape"):
    fn(q, k, v[:-1], tables, lengths)

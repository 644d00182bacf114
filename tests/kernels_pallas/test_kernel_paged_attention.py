"""Decode paged attention: the Pallas kernel (interpret mode) against its reference."""

import chex
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

from kernels_pallas import paged_attention, paged_attention_reference

NUM_BLOCKS, MAX_BLOCKS = 40, 8


def _case(rng, ratio, block_size, head_dim, dtype, lengths, max_blocks=MAX_BLOCKS,
          num_kv_heads=None):
  num_kv_heads = num_kv_heads or (2 if ratio < 8 else 1)
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, num_kv_heads, head_dim, lib.DTYPES[dtype])
  tables = lib.make_tables(rng, lengths, block_size, max_blocks, NUM_BLOCKS)
  q = jnp.asarray(rng.standard_normal((len(lengths), ratio * num_kv_heads, head_dim)),
                  lib.DTYPES[dtype])
  return (q, pool.k_pages, pool.v_pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))


def _knobs(ratio, block_size):
  """Per grid row: split-K count, the GPU tile layout for ratio 4, soft cap/scale for ratio 8."""
  kw = {"num_splits": 3 if block_size != 16 else 1}
  if ratio == 4:  # What a GPU compile uses: q heads padded to 16 rows, 4 blocks per dot.
    kw.update(block_h=16, blocks_per_step=4)
  return kw


def _attn_kw(ratio):
  return {"sm_scale": 0.2, "soft_cap": 3.0} if ratio == 8 else {}


@pytest.mark.parametrize("ratio,block_size,head_dim,dtype", lib.PAIRWISE_GRID)
def test_kernel_matches_reference_on_grid(rng, ratio, block_size, head_dim, dtype):
  lengths = lib.grid_lengths(block_size)
  args = _case(rng, ratio, block_size, head_dim, dtype, lengths)
  out = paged_attention(*args, **_knobs(ratio, block_size), **_attn_kw(ratio))
  ref = paged_attention_reference(*args, **_attn_kw(ratio))
  chex.assert_shape(out, args[0].shape)
  assert out.dtype == args[0].dtype
  assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= lib.TOL[dtype]
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)  # length 0 -> zeros


# GQA groups and head_dims that are not powers of 2 (jax's own GPU paged-attention test has
# 20 q heads per KV head; phi-2 has head_dim 80, phi-3 96): the group is padded to block_h
# rows, or split over several programs when block_h is set below it; head_dim is tiled at
# the next power of 2 with the pages' padding columns masked (interpret mode pads them
# with NaN, so a missing mask fails here).
ODD_SHAPES = (
    (20, 1, 80, "float32", {}),  # default block_h 32, width 128
    (20, 2, 96, "bfloat16", {"block_h": 16, "num_splits": 2}),  # 2 programs of 16 rows per group
    (5, 2, 112, "float32", {"block_h": 2}),  # 3 programs of 2 rows, one row of padding
)


@pytest.mark.parametrize("ratio,num_kv_heads,head_dim,dtype,knobs", ODD_SHAPES)
def test_odd_group_and_head_dim_match_reference(rng, ratio, num_kv_heads, head_dim, dtype,
                                                knobs):
  lengths = lib.grid_lengths(8)
  args = _case(rng, ratio, 8, head_dim, dtype, lengths, num_kv_heads=num_kv_heads)
  out = paged_attention(*args, **knobs)
  chex.assert_shape(out, args[0].shape)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  ref = paged_attention_reference(*args)
  assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= lib.TOL[dtype]
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


def test_sparse_table_equals_attention_over_selected_tokens(rng):
  """A table listing a subset of blocks == plain softmax over exactly those blocks' tokens."""
  block_size, num_kv_heads, head_dim = 16, 2, 64  # the (4, 16, 64, float32) grid row's shapes
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, num_kv_heads, head_dim, jnp.float32)
  seq_blocks = rng.choice(np.arange(1, NUM_BLOCKS), size=20, replace=False)  # a 320-token seq
  picks = [[0, 5, 11], [11, 2, 7, 3], [4], [19, 0, 9, 1, 12, 6, 3, 17], [8, 8 + 2], [13]]
  tables = np.zeros((len(picks), MAX_BLOCKS), np.int32)
  for b, p in enumerate(picks):
    tables[b, :len(p)] = seq_blocks[p]
  lengths = np.array([len(p) * block_size for p in picks], np.int32)
  q = rng.standard_normal((len(picks), 4 * num_kv_heads, head_dim)).astype(np.float32)
  out = paged_attention(jnp.asarray(q), pool.k_pages, pool.v_pages, jnp.asarray(tables),
                        jnp.asarray(lengths), **_knobs(4, block_size))
  # Independent: the sequence's tokens in position order, keep those of the picked blocks.
  seq_k = pool.k_np[seq_blocks].reshape(-1, num_kv_heads, head_dim)
  seq_v = pool.v_np[seq_blocks].reshape(-1, num_kv_heads, head_dim)
  for b, p in enumerate(picks):
    keep = np.isin(np.arange(len(seq_blocks) * block_size) // block_size, p)
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

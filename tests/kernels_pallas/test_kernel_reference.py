"""The references against naive numpy softmax attention, so kernel == reference means something."""

import chex
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

from kernels_pallas import paged_attention_reference, ragged_paged_attention_reference


def test_pairwise_grid_covers_every_pair():
  assert lib.missing_pairs(lib.PAIRWISE_GRID) == set()
  assert lib.missing_pairs(lib.PAIRWISE_GRID[:-1]) != set()  # the check can fail


@pytest.mark.parametrize("ratio,block_size,head_dim,dtype", lib.PAIRWISE_GRID)
def test_paged_reference_matches_naive(rng, ratio, block_size, head_dim, dtype):
  num_kv_heads = 2 if ratio < 8 else 1
  lengths = lib.grid_lengths(block_size)
  pool = lib.make_pool(rng, 40, block_size, num_kv_heads, head_dim, lib.DTYPES[dtype])
  tables = lib.make_tables(rng, lengths, block_size, 8, 40)
  q = jnp.asarray(rng.standard_normal((len(lengths), ratio * num_kv_heads, head_dim)),
                  lib.DTYPES[dtype])
  out = paged_attention_reference(q, pool.k_pages, pool.v_pages, jnp.asarray(tables),
                                  jnp.asarray(lengths, jnp.int32))
  chex.assert_shape(out, q.shape)
  q_np = np.array(q.astype(jnp.float32))
  for b, n in enumerate(lengths):
    k = lib.gather_tokens(pool.k_np, tables[b], n)
    v = lib.gather_tokens(pool.v_np, tables[b], n)
    want = lib.naive_attention(q_np[b:b + 1], k, v)
    assert lib.max_abs_err(out[b:b + 1].astype(jnp.float32), want) <= lib.TOL[dtype], (b, n)
  np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)  # length 0


@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (5, 3.0)])
def test_ragged_reference_matches_naive_causal(rng, sliding_window, soft_cap):
  block_size, num_kv_heads, ratio, head_dim = 8, 2, 4, 64
  q_lens, kv_lens = [3, 1, 17, 0, 9], [3, 30, 20, 5, 40]
  pool = lib.make_pool(rng, 40, block_size, num_kv_heads, head_dim, jnp.float32)
  tables = lib.make_tables(rng, kv_lens, block_size, 5, 40)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.standard_normal((cu[-1] + 2, ratio * num_kv_heads, head_dim)).astype(np.float32)
  out = ragged_paged_attention_reference(
      jnp.asarray(q), pool.k_pages, pool.v_pages, jnp.asarray(tables),
      jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu), sliding_window=sliding_window,
      soft_cap=soft_cap)
  for b, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
    k = lib.gather_tokens(pool.k_np, tables[b], nk)
    v = lib.gather_tokens(pool.v_np, tables[b], nk)
    want = lib.naive_attention(q[cu[b]:cu[b + 1]], k, v, soft_cap=soft_cap,
                               mask=lib.causal_mask(nq, nk, sliding_window))
    assert lib.max_abs_err(out[cu[b]:cu[b + 1]], want) <= 1e-5, b
  np.testing.assert_array_equal(np.asarray(out[cu[-1]:]), 0.0)  # padding rows


def test_paged_reference_soft_cap_and_scale(rng):
  pool = lib.make_pool(rng, 6, 8, 1, 64, jnp.float32)
  tables = np.array([[3, 1, 5]], np.int32)
  q = rng.standard_normal((1, 2, 64)).astype(np.float32) * 4
  out = paged_attention_reference(jnp.asarray(q), pool.k_pages, pool.v_pages,
                                  jnp.asarray(tables), jnp.asarray([20], jnp.int32),
                                  sm_scale=0.5, soft_cap=2.0)
  k = lib.gather_tokens(pool.k_np, tables[0], 20)
  v = lib.gather_tokens(pool.v_np, tables[0], 20)
  want = lib.naive_attention(q, k, v, sm_scale=0.5, soft_cap=2.0)
  assert lib.max_abs_err(out, want) <= 1e-5
  plain = lib.naive_attention(q, k, v, sm_scale=0.5)
  assert lib.max_abs_err(plain, want) > 1e-2  # the cap changed the answer

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


@pytest.mark.parametrize("per", ["query_head", "kv_head"])
@pytest.mark.parametrize("quantized", [False, True])
def test_per_head_paged_attention_matches_naive_per_head(rng, per, quantized):
  # Each head (a query head, or a KV head and its group) attends over its own table and
  # length; the reference is naive attention of that head alone over its tokens.
  from kernels_pallas import paged_attention_per_head
  from kernels_pallas.quant import QuantizedPages, quantize

  block_size, num_kv_heads, group, head_dim = 4, 2, 3, 16
  num_q_heads = num_kv_heads * group
  num_heads = num_q_heads if per == "query_head" else num_kv_heads
  pool = lib.make_pool(rng, 30, block_size, num_kv_heads, head_dim, jnp.float32)
  lengths = np.array([[13, 1, 0, 20, 7, 16], [5, 9, 12, 3, 1, 2]])[:, :num_heads]
  tables = np.stack([lib.make_tables(rng, lengths[:, h], block_size, 5, 30)
                     for h in range(num_heads)], axis=1)  # [batch, heads, 5]
  q = rng.standard_normal((2, num_q_heads, head_dim)).astype(np.float32)
  k_pages, v_pages, k_np, v_np = pool.k_pages, pool.v_pages, pool.k_np, pool.v_np
  if quantized:
    (kv, ks), (vv, vs) = quantize(k_pages, "int8"), quantize(v_pages, "int8")
    k_pages, v_pages = QuantizedPages(kv, ks), QuantizedPages(vv, vs)
    k_np, v_np = np.asarray(k_pages.dequantize()), np.asarray(v_pages.dequantize())
  out = paged_attention_per_head(jnp.asarray(q), k_pages, v_pages, jnp.asarray(tables),
                                 jnp.asarray(lengths, jnp.int32))
  chex.assert_shape(out, q.shape)
  per_table = num_q_heads // num_heads
  for b in range(2):
    for h in range(num_q_heads):
      t = h // per_table
      kv_head = h // group
      n = lengths[b, t]
      k = lib.gather_tokens(k_np, tables[b, t], n)[:, kv_head:kv_head + 1]
      v = lib.gather_tokens(v_np, tables[b, t], n)[:, kv_head:kv_head + 1]
      got = np.asarray(out[b, h], np.float32)
      if n == 0:
        np.testing.assert_array_equal(got, 0.0)
        continue
      want = lib.naive_attention(q[b:b + 1, h:h + 1], k, v)[0, 0]
      np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)

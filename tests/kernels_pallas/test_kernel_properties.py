"""Hypothesis: random shapes and contents, kernels against naive numpy attention.

Each example is a fresh interpret-mode compile (seconds), so the example counts are small;
the shapes come from small sets so that GQA padding (3 q heads per KV head), several
splits and empty rows all turn up.
"""

import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas import paged_attention, ragged_paged_attention


@st.composite
def layouts(draw):
  return dict(
      num_kv_heads=draw(st.sampled_from([1, 2])),
      group=draw(st.sampled_from([1, 3, 4])),
      head_dim=draw(st.sampled_from([16, 32])),
      block_size=draw(st.sampled_from([2, 4, 8])),
      max_blocks=draw(st.integers(1, 6)),
      seed=draw(st.integers(0, 2**16)),
  )


@settings(max_examples=4)
@given(layout=layouts(), batch=st.integers(1, 4), num_splits=st.integers(1, 3), data=st.data())
def test_paged_attention_random_shapes(layout, batch, num_splits, data):
  rng = np.random.default_rng(layout["seed"])
  bs, max_blocks, num_kv_heads = layout["block_size"], layout["max_blocks"], layout["num_kv_heads"]
  num_blocks = batch * max_blocks + 1
  lengths = data.draw(st.lists(st.integers(0, bs * max_blocks), min_size=batch, max_size=batch))
  pool = lib.make_pool(rng, num_blocks, bs, num_kv_heads, layout["head_dim"], jnp.float32)
  tables = lib.make_tables(rng, lengths, bs, max_blocks, num_blocks)
  q = rng.standard_normal((batch, layout["group"] * num_kv_heads, layout["head_dim"]))
  q = q.astype(np.float32)
  out = paged_attention(jnp.asarray(q), pool.k_pages, pool.v_pages, jnp.asarray(tables),
                        jnp.asarray(lengths, jnp.int32), num_splits=num_splits)
  for b, n in enumerate(lengths):
    k = lib.gather_tokens(pool.k_np, tables[b], n)
    v = lib.gather_tokens(pool.v_np, tables[b], n)
    assert lib.max_abs_err(out[b:b + 1], lib.naive_attention(q[b:b + 1], k, v)) <= 1e-5


@settings(max_examples=3)
@given(layout=layouts(), seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)),
                                       min_size=1, max_size=3),
       sliding_window=st.one_of(st.none(), st.integers(1, 10)))
def test_ragged_attention_random_shapes(layout, seqs, sliding_window):
  rng = np.random.default_rng(layout["seed"])
  bs, num_kv_heads = layout["block_size"], layout["num_kv_heads"]
  q_lens = [q for q, _ in seqs]
  kv_lens = [q + extra for q, extra in seqs]  # kv_len >= q_len
  max_blocks = max(1, -(-max(kv_lens) // bs))
  num_blocks = len(seqs) * max_blocks + 1
  pool = lib.make_pool(rng, num_blocks, bs, num_kv_heads, layout["head_dim"], jnp.float32)
  tables = lib.make_tables(rng, kv_lens, bs, max_blocks, num_blocks)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.standard_normal((cu[-1] + 1, layout["group"] * num_kv_heads, layout["head_dim"]))
  q = q.astype(np.float32)
  out = ragged_paged_attention(jnp.asarray(q), pool.k_pages, pool.v_pages, jnp.asarray(tables),
                               jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu),
                               sliding_window=sliding_window)
  for b, (nq, nk) in enumerate(zip(q_lens, kv_lens)):
    k = lib.gather_tokens(pool.k_np, tables[b], nk)
    v = lib.gather_tokens(pool.v_np, tables[b], nk)
    want = lib.naive_attention(q[cu[b]:cu[b + 1]], k, v,
                               mask=lib.causal_mask(nq, nk, sliding_window))
    assert lib.max_abs_err(out[cu[b]:cu[b + 1]], want) <= 1e-5, b
  np.testing.assert_array_equal(np.asarray(out[cu[-1]:]), 0.0)

"""Prefill chunks of a streamed prompt (one longer than the device pool, some of whose
earlier blocks live only in the host pool; sparse/attention.py).

streamed_prefill="exact" (the default): the chunk attends over all its earlier blocks,
loaded in groups through its hot buffer (`_exact_chunks`), and causally over its own: its
output equals dense attention over the whole, all-resident sequence whatever the top-k,
the hot-buffer size (the groups) and the blocks dropped to the host.

streamed_prefill="sparse": it attends over the selected earlier blocks, loaded into its
hot buffer, and densely over its own (`chunk_tables`). Checked against the dense path:
with a top-k that covers every earlier block, the chunk's output equals dense attention,
whichever of its blocks were dropped to the host; with a smaller top-k, it equals exact
attention over the blocks the indexer chose plus the chunk's own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from hisparse_jax import HiSparseConfig
from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, memory_sharding
from hisparse_jax.sparse import attention, indexer, resolver
from kernels_pallas.quant import QuantizedPages, quantize
from models.config import ModelConfig

BS, KV_HEADS, HEAD_DIM, Q_HEADS = 4, 2, 8, 4
NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS, WIDTH, ROWS = 16, 12, 12, 2


def test_chunk_tables_put_the_distinct_selected_blocks_before_the_chunks_own():
  # Row 0: 6 earlier full blocks (chunk of 10 from token 26: block 6 holds 2 earlier
  # tokens), 3 selected (one twice, as per-head selections give); row 1: the chunk starts
  # on a block boundary (token 8), 2 earlier blocks, both selected; row 2: no earlier block.
  tables = np.zeros((3, WIDTH), np.int32)
  tables[0, :9] = [0, 0, 3, 0, 5, 0, 7, 8, 9]
  tables[1, :4] = [11, 12, 13, 14]
  tables[2, :2] = [4, 6]
  selected = np.array([[9, 3, 20, 3, 0], [11, 12, 0, 0, 0], [0, 0, 0, 0, 0]], np.int32)
  valid = np.array([[False, True, True, True, False], [True, True, False, False, False],
                    [False] * 5])
  kv_lens = np.array([36, 12, 7], np.int32)
  q_lens = np.array([10, 4, 7], np.int32)
  out, lens = attention.chunk_tables(jnp.asarray(selected), jnp.asarray(valid),
                                     jnp.asarray(tables), jnp.asarray(kv_lens),
                                     jnp.asarray(q_lens), BS)
  expected = np.zeros((3, WIDTH), np.int32)
  expected[0, :5] = [3, 20, 7, 8, 9]  # selected (sorted, distinct), then blocks 6, 7, 8
  expected[1, :4] = [11, 12, 13, 14]
  expected[2, :2] = [4, 6]
  np.testing.assert_array_equal(np.asarray(out), expected)
  # 2 selected blocks + the 12 tokens from block 6 on; 2 blocks + 4; 0 + 7.
  np.testing.assert_array_equal(np.asarray(lens), [2 * BS + 12, 2 * BS + 4, 7])


def _config():
  return ModelConfig(model_type="llama", vocab_size=8, hidden_size=Q_HEADS * HEAD_DIM,
                     intermediate_size=8, num_hidden_layers=1, num_attention_heads=Q_HEADS,
                     num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                     max_position_embeddings=64)


def _sparse_static(hisparse):
  device = jax.devices("cpu")[0]
  return attention.SparseStatic(
      blocks=hisparse.blocks(BS), selection=hisparse.selection, thrash_window_steps=4,
      device_sharding=memory_sharding(device, DEVICE),
      host_sharding=memory_sharding(device, PINNED_HOST), one_memory=True,
      bounds_dtype="float32", streamed_prefill=hisparse.streamed_prefill)


def _chunk_case(rng, hisparse, dropped, chunk_queries=1):
  """One sequence: 26 earlier tokens (6 full blocks + 2 tokens of block 6) and a chunk of
  10 new tokens (26..35), blocks 6-8 on the device. Earlier blocks in `dropped` are only
  in the host pool (table entry 0, a host copy); the others are resident. Returns
  (sparse output, dense output over the all-resident sequence, the earlier keys and
  values [26, kv heads, d], the chunk's q [10, heads, d], k, v)."""
  start, n = 26, 10
  keys = rng.standard_normal((start + n, KV_HEADS, HEAD_DIM)).astype(np.float32)
  values = rng.standard_normal((start + n, KV_HEADS, HEAD_DIM)).astype(np.float32)
  q = rng.standard_normal((n, Q_HEADS, HEAD_DIM)).astype(np.float32) * 2
  ops = kernels_pallas.ops("xla")
  config = _config()

  def pages_with(table):
    k = np.zeros((NUM_DEVICE_BLOCKS, BS, KV_HEADS, HEAD_DIM), np.float32)
    v = np.zeros_like(k)
    for i, block in enumerate(table):
      if block and i * BS < start:
        rows = slice(i * BS, min((i + 1) * BS, start))
        k[block, :rows.stop - rows.start], v[block, :rows.stop - rows.start] = (
            keys[rows], values[rows])
    return jnp.asarray(k), jnp.asarray(v)

  dense_table = np.zeros(WIDTH, np.int32)
  dense_table[:9] = np.arange(1, 10)
  slot_ids = jnp.asarray(dense_table[np.arange(start, start + n) // BS] * BS
                         + np.arange(start, start + n) % BS, jnp.int32)
  meta = dict(slot_ids=slot_ids, kv_lens=jnp.array([start + n, 0], jnp.int32),
              cu_q_lens=jnp.array([0, n, n], jnp.int32))
  dense_meta = attention.StepMetadata(
      block_tables=jnp.asarray(np.stack([dense_table, np.zeros(WIDTH, np.int32)])),
      sparse_rows=jnp.array([False, False]), **meta)
  k_new, v_new = jnp.asarray(keys[start:])[None], jnp.asarray(values[start:])[None]
  dense, _ = attention.attend(ops, "float32", jnp.float32, None, jnp.asarray(q)[None], k_new,
                              v_new, layer_idx=0, kv_cache=pages_with(dense_table),
                              metadata=dense_meta, config=config)

  # The sparse row: the same blocks, the dropped ones only on the host (host ids 1..6).
  table = dense_table.copy()
  table[list(dropped)] = 0
  host_table = np.zeros(WIDTH, np.int32)
  host_table[:6] = np.arange(1, 7)
  host_k = np.zeros((NUM_HOST_BLOCKS, BS, KV_HEADS, HEAD_DIM), np.float32)
  host_v = np.zeros_like(host_k)
  host_k[1:7] = keys[:24].reshape(6, BS, KV_HEADS, HEAD_DIM)
  host_v[1:7] = values[:24].reshape(6, BS, KV_HEADS, HEAD_DIM)
  k_pages, v_pages = pages_with(table)
  all_k = np.concatenate([np.asarray(pages_with(dense_table)[0]), host_k])
  bounds = np.stack([all_k.min(1), all_k.max(1)], axis=1)  # every block's (host: nd + id)
  slots = hisparse.blocks(BS).hot_buffer_blocks
  hot_slots = np.zeros((2, slots), np.int32)
  hot_slots[0] = np.arange(10, 10 + slots)
  cache = dict(pages=(k_pages, v_pages), bounds=jnp.asarray(bounds),
               host=(jnp.asarray(host_k), jnp.asarray(host_v)),
               state=(jnp.full((ROWS, slots), -1, jnp.int32),
                      jnp.full((ROWS, slots), resolver.NEVER, jnp.int32),
                      jnp.full((ROWS, WIDTH), resolver.NEVER, jnp.int32)))
  sparse_meta = attention.StepMetadata(
      block_tables=jnp.asarray(np.stack([table, np.zeros(WIDTH, np.int32)])),
      sparse_rows=jnp.array([True, False]),
      host_tables=jnp.asarray(np.stack([host_table, np.zeros(WIDTH, np.int32)])),
      hot_slots=jnp.asarray(hot_slots), hot_rows=jnp.array([0, ROWS], jnp.int32),
      hot_reset=jnp.array([True, False]), step=jnp.int32(0), num_sparse_rows=8,
      chunk_queries=chunk_queries, **meta)
  sparse, new_cache = attention.attend(
      ops, "float32", jnp.float32, _sparse_static(hisparse), jnp.asarray(q)[None], k_new,
      v_new, layer_idx=0, kv_cache=cache, metadata=sparse_meta, config=config)
  return np.asarray(sparse[0]), np.asarray(dense[0]), new_cache, (keys, values, q, bounds)


@pytest.mark.parametrize("hot_buffer_blocks", [1, 2, 4, 8])
@pytest.mark.parametrize("dropped", [(0, 1, 2, 3, 4, 5), (1, 2, 5), ()])
@pytest.mark.parametrize("query_tile", [256, 4, 3])
def test_exact_chunk_equals_dense_whatever_the_top_k_and_hot_buffer(
    monkeypatch, hot_buffer_blocks, dropped, query_tile):
  # The 36 keys in groups of the hot buffer's size (1, 2, 4 or 8 blocks: the 6 earlier
  # ones, loaded or read in place, then the chunk's own), the chunk's 10 queries in tiles
  # of 10, 4 or 3 (partial last tiles; a tile skips the groups after it), a top-k of
  # one block: the output is the dense one.
  monkeypatch.setattr(attention, "EXACT_QUERY_TILE", query_tile)
  hisparse = HiSparseConfig(top_k_tokens=BS, hot_buffer_tokens=hot_buffer_blocks * BS,
                            sink_tokens=0, local_tokens=BS)
  assert hisparse.streamed_prefill == "exact"
  sparse, dense, cache, _ = _chunk_case(np.random.default_rng(len(dropped) + 10), hisparse,
                                        dropped)
  np.testing.assert_allclose(sparse, dense, rtol=2e-5, atol=2e-5)
  counts = np.asarray(cache["counts"])[0]  # device, hot, host, evictions, thrash
  # The earlier blocks read in place or loaded once each (its own are the engine's count).
  np.testing.assert_array_equal(counts, [6 - len(dropped), 0, len(dropped), 0, 0])
  assert int(cache["loaded"]) == len(dropped)
  assert not np.asarray(cache["counts"])[1].any()  # the padding row: nothing
  # Its hot-buffer slots were overwritten: the row's state is empty again.
  slot_block, last_used, evicted_at = (np.asarray(a) for a in cache["state"])
  assert (slot_block[0] == -1).all() and (last_used[0] == resolver.NEVER).all()
  assert (evicted_at[0] == resolver.NEVER).all()


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "bfloat16"])
def test_exact_chunk_reads_blocks_of_every_cache_dtype(kind):
  # The groups' blocks as the dense kernels read them: an 8-bit cache's dequantized (its
  # values and scales gathered by block), a bfloat16 cache's widened to float32.
  rng = np.random.default_rng(5)
  x = [jnp.asarray(rng.standard_normal((6, BS, KV_HEADS, HEAD_DIM)), jnp.float32)
       for _ in range(2)]
  ids = jnp.array([4, 1, 1, 0], jnp.int32)
  if kind == "bfloat16":
    pages = tuple(a.astype(jnp.bfloat16) for a in x)
    expected = [np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32))[ids] for a in x]
  else:
    (kq, ks), (vq, vs) = quantize(x[0], kind), quantize(x[1], kind)
    pages = (kq, vq, ks, vs)
    expected = [np.asarray(QuantizedPages(q, s, jnp.float32).dequantize())[ids]
                for q, s in ((kq, ks), (vq, vs))]
  k, v = attention._gather_blocks(pages, ids, jnp.bfloat16 if kind == "bfloat16"
                                  else jnp.float32)
  for got, want in zip((k, v), expected):
    assert got.dtype == jnp.float32 and got.shape == (4 * BS, KV_HEADS, HEAD_DIM)
    np.testing.assert_array_equal(np.asarray(got), want.reshape(-1, KV_HEADS, HEAD_DIM))


@pytest.mark.parametrize("selection", ["union", "per_kv_head"])
@pytest.mark.parametrize("dropped", [(0, 1, 2, 3, 4, 5), (0, 2, 4), ()])
def test_chunk_over_every_earlier_block_equals_dense(selection, dropped):
  # top-k 8 blocks >= the 6 earlier full blocks: every one is selected.
  hisparse = HiSparseConfig(top_k_tokens=8 * BS, hot_buffer_tokens=8 * BS, sink_tokens=BS,
                            local_tokens=BS, selection=selection, streamed_prefill="sparse")
  sparse, dense, cache, _ = _chunk_case(np.random.default_rng(len(dropped)), hisparse,
                                        dropped)
  np.testing.assert_allclose(sparse, dense, rtol=2e-5, atol=2e-5)
  counts = np.asarray(cache["counts"])[0]  # device, hot, host, evictions, thrash
  assert counts[2] == len(dropped)  # each dropped block loaded once, for every head
  assert int(cache["loaded"]) == len(dropped)


@pytest.mark.parametrize("chunk_queries", [1, 5])
def test_chunk_with_a_small_top_k_attends_over_the_selection_and_its_own_blocks(
    chunk_queries):
  # top-k 3 blocks: the sink (block 0), the newest earlier one (5) and one scored; the
  # chunk's queries see exactly those 12 tokens, then tokens 24..35 causally.
  hisparse = HiSparseConfig(top_k_tokens=3 * BS, hot_buffer_tokens=3 * BS, sink_tokens=BS,
                            local_tokens=BS, streamed_prefill="sparse")
  sparse, _, cache, (keys, values, q, bounds) = _chunk_case(
      np.random.default_rng(7), hisparse, (0, 1, 2, 3, 4, 5), chunk_queries)
  # The indexer's choice over the 6 earlier blocks: by the chunk's last query, or by its
  # queries 1, 3, 5, 7 and 9 of 10 (each query head's 5, together).
  picks = [9] if chunk_queries == 1 else [1, 3, 5, 7, 9]
  q_select = np.swapaxes(q[picks], 0, 1).reshape(1, -1, HEAD_DIM)
  rows = jnp.asarray(NUM_DEVICE_BLOCKS + np.arange(1, 13)[None, :6])
  sel = indexer.select_rows(jnp.asarray(q_select), jnp.asarray(bounds), rows,
                            jnp.array([24], jnp.int32), hisparse.blocks(BS), "union")
  chosen = sorted(np.asarray(sel.logical_ids[0])[np.asarray(sel.valid[0])].tolist())
  assert len(chosen) == 3 and chosen[0] == 0 and chosen[-1] == 5
  earlier = np.concatenate([np.arange(b * BS, (b + 1) * BS) for b in chosen])
  group = Q_HEADS // KV_HEADS
  for i in range(10):  # query i is token 26 + i
    toks = np.concatenate([earlier, np.arange(24, 27 + i)])
    for h in range(Q_HEADS):
      s = keys[toks, h // group] @ q[i, h] / np.sqrt(HEAD_DIM)
      p = np.exp(s - s.max())
      np.testing.assert_allclose(sparse[i, h], (p / p.sum()) @ values[toks, h // group],
                                 rtol=2e-5, atol=2e-5)
  assert np.asarray(cache["counts"])[0][2] == 3  # all three from the host


@pytest.mark.parametrize("selection", ["union", "shared", "per_kv_head"])
def test_a_repeated_query_selects_as_one(selection):
  # A decode row in a step with a sparse chunk is selected by its one query repeated
  # CHUNK_QUERIES times per head: the same blocks as by the query alone.
  rng = np.random.default_rng(11)
  blocks = HiSparseConfig(top_k_tokens=5 * BS, hot_buffer_tokens=8 * BS, sink_tokens=BS,
                          local_tokens=BS).blocks(BS)
  keys = rng.standard_normal((3, 10, BS, KV_HEADS, HEAD_DIM)).astype(np.float32)
  bounds = jnp.asarray(np.stack([keys.min(2), keys.max(2)], axis=2).reshape(
      30, 2, KV_HEADS, HEAD_DIM))
  rows = jnp.arange(30, dtype=jnp.int32).reshape(3, 10)
  kv_lens = jnp.array([38, 21, 7], jnp.int32)
  q = rng.standard_normal((3, Q_HEADS, HEAD_DIM)).astype(np.float32)
  repeated = np.repeat(q, attention.CHUNK_QUERIES, axis=1)  # head h's copies together
  one = indexer.select_rows(jnp.asarray(q), bounds, rows, kv_lens, blocks, selection)
  many = indexer.select_rows(jnp.asarray(repeated), bounds, rows, kv_lens, blocks, selection)
  np.testing.assert_array_equal(np.asarray(many.logical_ids), np.asarray(one.logical_ids))
  np.testing.assert_array_equal(np.asarray(many.kv_lens), np.asarray(one.kv_lens))

"""Indexer: block scores bound q.k; selection order, sinks/locals, padding, per-head shapes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import kernels_pallas
from hisparse_jax.sparse import indexer
from hisparse_jax.sparse.config import HiSparseConfig

BATCH, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, MAX_BLOCKS = 2, 4, 2, 8, 4, 6


def _blocks(top_k_tokens, sink_tokens=0, local_tokens=0):
  return HiSparseConfig(top_k_tokens=top_k_tokens, sink_tokens=sink_tokens,
                        local_tokens=local_tokens).blocks(BLOCK_SIZE)


@jax.jit
def _bounds_of(k_pages, kv_lens):
  """Bounds of each sequence's blocks, computed by the kernels' reference updater.

  Sequence b owns device blocks 1 + b * MAX_BLOCKS + i (block table order = logical)."""
  num_blocks = k_pages.shape[0]
  bounds = jnp.full((num_blocks, 2, NUM_KV_HEADS, HEAD_DIM), jnp.nan, jnp.float32)
  pos = jnp.arange(MAX_BLOCKS * BLOCK_SIZE)
  slots = (1 + jnp.arange(BATCH)[:, None] * MAX_BLOCKS) * BLOCK_SIZE + pos[None, :]
  slots = jnp.where(pos[None, :] < kv_lens[:, None], slots, -1).reshape(-1)
  bounds = kernels_pallas.block_key_bounds_reference(bounds, k_pages, slots.astype(jnp.int32))
  tables = 1 + jnp.arange(BATCH)[:, None] * MAX_BLOCKS + jnp.arange(MAX_BLOCKS)[None, :]
  return bounds[tables]  # [batch, max_blocks, 2, num_kv_heads, head_dim]


@given(seed=st.integers(0, 2**31 - 1), len0=st.integers(1, MAX_BLOCKS * BLOCK_SIZE),
       len1=st.integers(1, MAX_BLOCKS * BLOCK_SIZE), scale=st.floats(0.01, 100.0))
def test_block_score_bounds_the_true_max_of_qk(seed, len0, len1, scale):
  rng = np.random.default_rng(seed)
  num_blocks = 1 + BATCH * MAX_BLOCKS
  k_pages = (scale * rng.standard_normal((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
             ).astype(np.float32)
  q = rng.standard_normal((BATCH, NUM_Q_HEADS, HEAD_DIM)).astype(np.float32)
  kv_lens = np.array([len0, len1], np.int32)
  scores = np.asarray(indexer.block_scores(jnp.asarray(q), _bounds_of(k_pages, kv_lens)))
  chex.assert_shape(scores, (BATCH, NUM_KV_HEADS, MAX_BLOCKS))
  group = NUM_Q_HEADS // NUM_KV_HEADS
  for b in range(BATCH):
    for i in range(-(-kv_lens[b] // BLOCK_SIZE)):
      num_valid = min(BLOCK_SIZE, kv_lens[b] - i * BLOCK_SIZE)
      keys = k_pages[1 + b * MAX_BLOCKS + i, :num_valid]  # [tokens, kv heads, head_dim]
      for h in range(NUM_KV_HEADS):
        qk = q[b, h * group:(h + 1) * group].astype(np.float64) @ keys[:, h].T
        tol = 1e-5 * (np.abs(q[b]).sum() * np.abs(keys).max() + 1)
        assert scores[b, h, i] >= qk.max() - tol, (b, h, i)
        if num_valid == 1:  # a single key: the bound is tight
          assert abs(scores[b, h, i] - qk.max()) <= tol


def test_top_k_covering_all_blocks_selects_all_in_order():
  scores = jnp.asarray(np.random.default_rng(1).standard_normal((3, 8)), jnp.float32)
  kv_lens = jnp.array([32, 13, 1], jnp.int32)  # 8 full; 3 full + 1 token; 1 token
  sel = indexer.select_blocks(scores, kv_lens, _blocks(32, 4, 4))
  chex.assert_shape(sel.logical_ids, (3, 8))
  np.testing.assert_array_equal(sel.logical_ids[0], np.arange(8))
  np.testing.assert_array_equal(sel.logical_ids[1], [0, 1, 2, 3, -1, -1, -1, -1])
  np.testing.assert_array_equal(sel.logical_ids[2], [0] + [-1] * 7)
  np.testing.assert_array_equal(sel.num_selected, [8, 4, 1])
  np.testing.assert_array_equal(sel.kv_lens, [32, 13, 1])


def test_sinks_and_locals_always_selected_then_best_scores():
  # 10 blocks; the sink (0) and local (8, 9) blocks score lowest, padding scores highest.
  scores = np.array([[-9, 5, 1, 7, 2, 6, 0, 3, -8, -9, 99, 99]], np.float32)
  scores[0, 11] = np.nan
  sel = indexer.select_blocks(jnp.asarray(scores), jnp.array([38], jnp.int32),
                              _blocks(top_k_tokens=20, sink_tokens=4, local_tokens=5))
  # budget 5 blocks = sink 1 + local 2 (ceil(5/4)) + the two best others (3: 7, 5: 6)
  np.testing.assert_array_equal(sel.logical_ids, [[0, 3, 5, 8, 9]])
  np.testing.assert_array_equal(sel.num_selected, [5])
  np.testing.assert_array_equal(sel.kv_lens, [4 * BLOCK_SIZE + 2])  # block 9 holds 2 tokens


def test_padding_never_selected_and_empty_sequence_attends_nothing():
  scores = jnp.full((2, 6), 1e30, jnp.float32)
  sel = indexer.select_blocks(scores, jnp.array([5, 0], jnp.int32), _blocks(16, 0, 0))
  np.testing.assert_array_equal(sel.logical_ids, [[0, 1, -1, -1], [-1, -1, -1, -1]])
  np.testing.assert_array_equal(sel.num_selected, [2, 0])
  np.testing.assert_array_equal(sel.kv_lens, [5, 0])
  np.testing.assert_array_equal(sel.valid, [[1, 1, 0, 0], [0, 0, 0, 0]])


def test_shared_selection_keeps_each_heads_best_block():
  # Head 0 has large raw scores; head 1's single critical block (2) is small in raw terms.
  raw = np.array([[[50, 40, 0, 30, 45, 10], [0.1, 0.1, 0.9, 0.1, 0.1, 0.1]]], np.float32)
  shared = indexer.shared_scores(jnp.asarray(raw), jnp.array([24], jnp.int32), BLOCK_SIZE)
  chex.assert_shape(shared, (1, 6))
  np.testing.assert_allclose(shared[0], [1, 0.8, 1, 0.6, 0.9, 0.2], rtol=1e-6)
  sel = indexer.select_blocks(shared, jnp.array([24], jnp.int32), _blocks(12, 0, 0))
  np.testing.assert_array_equal(sel.logical_ids, [[0, 2, 5]])  # a raw max would drop 2


def test_per_kv_head_selection_shapes_and_rows():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((BATCH, NUM_Q_HEADS, HEAD_DIM)), jnp.float32)
  bounds = jnp.asarray(np.sort(rng.standard_normal(
      (BATCH, MAX_BLOCKS, 2, NUM_KV_HEADS, HEAD_DIM)), axis=2), jnp.float32)
  kv_lens = jnp.array([23, 9], jnp.int32)
  blocks = _blocks(12, 4, 0)
  per_head = indexer.select(q, bounds, kv_lens, blocks, "per_kv_head")
  chex.assert_shape(per_head.logical_ids, (BATCH, NUM_KV_HEADS, 3))
  chex.assert_shape([per_head.num_selected, per_head.kv_lens], (BATCH, NUM_KV_HEADS))
  scores = indexer.block_scores(q, bounds)
  for h in range(NUM_KV_HEADS):
    row = indexer.select_blocks(scores[:, h], kv_lens, blocks)
    chex.assert_trees_all_equal(row.logical_ids, per_head.logical_ids[:, h])
    chex.assert_trees_all_equal(row.kv_lens, per_head.kv_lens[:, h])
  shared = indexer.select(q, bounds, kv_lens, blocks, "shared")
  chex.assert_shape(shared.logical_ids, (BATCH, 3))
  np.testing.assert_array_equal(shared.kv_lens, [2 * BLOCK_SIZE + 3, 2 * BLOCK_SIZE + 1])


def test_select_is_jittable_with_the_same_result():
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((BATCH, NUM_Q_HEADS, HEAD_DIM)), jnp.float32)
  bounds = jnp.asarray(np.sort(rng.standard_normal(
      (BATCH, MAX_BLOCKS, 2, NUM_KV_HEADS, HEAD_DIM)), axis=2), jnp.float32)
  kv_lens = jnp.array([24, 17], jnp.int32)
  blocks = _blocks(16, 4, 4)
  jitted = jax.jit(indexer.select, static_argnums=(3, 4))(q, bounds, kv_lens, blocks, "shared")
  chex.assert_trees_all_equal(jitted, indexer.select(q, bounds, kv_lens, blocks, "shared"))


def test_per_query_head_scores_are_the_group_rows_before_their_max():
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((BATCH, NUM_Q_HEADS, HEAD_DIM)), jnp.float32)
  bounds = jnp.asarray(np.sort(rng.standard_normal(
      (BATCH, MAX_BLOCKS, 2, NUM_KV_HEADS, HEAD_DIM)), axis=2), jnp.float32)
  per_q = indexer.block_scores(q, bounds, per_query_head=True)
  chex.assert_shape(per_q, (BATCH, NUM_Q_HEADS, MAX_BLOCKS))
  group = NUM_Q_HEADS // NUM_KV_HEADS
  np.testing.assert_array_equal(per_q.reshape(BATCH, NUM_KV_HEADS, group, MAX_BLOCKS).max(2),
                                indexer.block_scores(q, bounds))
  # Query head h's row bounds q_h . k over the keys of its own KV head h // group.
  for h in range(NUM_Q_HEADS):
    one = indexer.block_scores(q[:, h:h + 1], bounds[:, :, :, h // group:h // group + 1])
    np.testing.assert_allclose(per_q[:, h], one[:, 0], rtol=1e-6)


def _union_reference(scores, kv_len, blocks, union):
  """numpy: per-head selections of one sequence under select_blocks' union rule."""
  heads, max_blocks = scores.shape
  n = -(-kv_len // blocks.block_size)
  k = min(blocks.top_k_blocks, max_blocks)
  idx = np.arange(max_blocks)
  forced = (idx < blocks.sink_blocks) | (idx >= n - blocks.local_blocks)
  prio = np.where(idx < n, np.where(forced, np.inf, scores), -np.inf)
  # best-first per head; ties (the forced +inf) by the lower index, as lax.top_k
  tops = [np.argsort(-prio[h], kind="stable")[:k] for h in range(heads)]
  allowed = np.ones(max_blocks, bool)
  if heads * k > union and union < max_blocks:
    best, votes = np.full(max_blocks, k), np.zeros(max_blocks, int)
    for h, top in enumerate(tops):
      for r, b in enumerate(top):
        if prio[h, b] > -np.inf:
          best[b] = min(best[b], r)
          votes[b] += 1
    key = np.where(best < k, (k - best) * (heads + 1) + votes, -1)
    kept = np.argsort(-key, kind="stable")[:union]
    allowed = np.zeros(max_blocks, bool)
    allowed[kept[key[kept] >= 0]] = True
  out = []
  for h in range(heads):
    p = np.where(allowed, prio[h], -np.inf)  # forced blocks stay +inf where allowed
    top = np.argsort(-p, kind="stable")[:k]
    out.append(sorted(int(b) for b in top if p[b] > -np.inf))
  return out


@given(seed=st.integers(0, 2**31 - 1), kv_len=st.integers(1, 40),
       top_k=st.sampled_from([8, 12, 16, 20]), extra=st.integers(0, 16),
       heads=st.sampled_from([1, 2, 3, 6]))
def test_per_head_selection_keeps_the_heads_union_within_the_hot_buffer(
    seed, kv_len, top_k, extra, heads):
  rng = np.random.default_rng(seed)
  max_blocks = 10
  blocks = HiSparseConfig(top_k_tokens=top_k, hot_buffer_tokens=top_k + extra, sink_tokens=4,
                          local_tokens=4).blocks(BLOCK_SIZE)
  scores = rng.standard_normal((1, heads, max_blocks)).astype(np.float32)
  if seed % 3 == 0:  # ties between blocks of a head
    scores = np.round(scores)
  sel = indexer.select_blocks(jnp.asarray(scores), jnp.array([kv_len], jnp.int32), blocks,
                              max_union_blocks=blocks.hot_buffer_blocks)
  ids, num = np.asarray(sel.logical_ids)[0], np.asarray(sel.num_selected)[0]
  got = [sorted(ids[h, :num[h]].tolist()) for h in range(heads)]
  assert got == _union_reference(scores[0], kv_len, blocks, blocks.hot_buffer_blocks)
  union = set().union(*map(set, got))
  assert len(union) <= blocks.hot_buffer_blocks
  n = -(-kv_len // BLOCK_SIZE)
  forced = {b for b in range(n) if b < blocks.sink_blocks or b >= n - blocks.local_blocks}
  assert all(forced <= set(g) for g in got)  # every head keeps the sink and local blocks
  assert all(g[-1] == n - 1 for g in got)  # the newest block last, as attention needs


@given(seed=st.integers(0, 2**31 - 1), kv_len=st.integers(1, 40),
       heads=st.sampled_from([1, 3, 4]), top_k=st.sampled_from([12, 20, 40]),
       sink=st.sampled_from([0, 4, 8]), local=st.sampled_from([0, 4]))
def test_union_selection_follows_best_rank_then_highest_score(seed, kv_len, heads, top_k,
                                                              sink, local):
  # numpy reference of the rule: sink and local blocks, then the free blocks by (best rank
  # in any head over all valid blocks, highest score in any head, lower block).
  rng = np.random.default_rng(seed)
  max_blocks = 10
  scores = rng.standard_normal((1, heads, max_blocks)).astype(np.float32)
  if seed % 2:
    scores = np.round(scores)  # ties within and across heads
  blocks = _blocks(top_k, sink, local)
  lens = jnp.array([kv_len], jnp.int32)
  sel = indexer.select_blocks(indexer.union_priority(jnp.asarray(scores), lens, blocks), lens,
                              blocks)
  n = -(-kv_len // BLOCK_SIZE)
  k = min(blocks.top_k_blocks, max_blocks)
  s = np.where(np.arange(max_blocks) < n, scores[0], -np.inf)
  rank = np.stack([np.argsort(np.argsort(-s[h], kind="stable"), kind="stable")
                   for h in range(heads)])
  best, highest = rank.min(axis=0), s.max(axis=0)
  forced = [b for b in range(n) if b < blocks.sink_blocks or b >= n - blocks.local_blocks]
  free = sorted((b for b in range(n) if b not in forced),
                key=lambda b: (best[b], -highest[b], b))
  want = sorted(forced[:k] + free[:max(0, k - len(forced))])
  num = int(sel.num_selected[0])
  assert np.asarray(sel.logical_ids)[0, :num].tolist() == want


def test_union_keeps_each_query_heads_first_choice_whatever_its_scale():
  # Query head 0's scores are 1,000x head 1's: a max of raw scores (or of scores spread
  # over [0, 1] where head 0's are flat at the top) picks head 0's blocks only; the union
  # takes each head's 1st choice first.
  scores = np.array([[[900., 1000., 990., 980., 0., 0.],  # head 0: 1, 2, 3 ...
                      [0.1, 0.2, 0.0, 0.0, 0.0, 0.9]]], np.float32)  # head 1: block 5
  blocks = _blocks(8, 0, 0)  # 2 blocks, no sink; the newest (5, kv_len 22) is forced
  lens = jnp.array([22], jnp.int32)
  sel = indexer.select_blocks(indexer.union_priority(jnp.asarray(scores), lens, blocks), lens,
                              blocks)
  np.testing.assert_array_equal(sel.logical_ids, [[1, 5]])
  # 3 blocks: the 1st choices (1; 5, the newest, forced anyway), then the 2nd choices:
  # head 0's is 2, head 1's is 1 (taken already).
  blocks = _blocks(12, 0, 0)
  lens = jnp.array([22], jnp.int32)
  sel = indexer.select_blocks(indexer.union_priority(jnp.asarray(scores), lens, blocks), lens,
                              blocks)
  np.testing.assert_array_equal(sel.logical_ids, [[1, 2, 5]])

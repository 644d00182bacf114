"""BlockPool and kv_hash: exact block ids of one tier's free queue and prefix cache."""

import pytest

from hisparse_jax.kv_cache.block_pool import BlockPool
from hisparse_jax.kv_cache.kv_hash import NONE_HASH, hash_block_tokens, hash_full_blocks


def test_hashes_chain_full_blocks_only():
  tokens = list(range(10))
  h0 = hash_block_tokens(None, tokens[0:4])
  h1 = hash_block_tokens(h0, tokens[4:8])
  # The partial block (tokens 8, 9) gets no hash.
  assert hash_full_blocks(tokens, 4) == [h0, h1]
  assert hash_block_tokens(NONE_HASH, tokens[0:4]) == h0
  # Same block tokens after a different parent: a different prefix, a different key.
  assert hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), tokens[4:8]) != h1
  assert hash_block_tokens(None, tokens[0:4], ("adapter-a",)) != h0
  # Stable across calls (and processes: no use of Python's salted hash()).
  assert hash_block_tokens(None, [0, 1, 2, 3]) == h0
  assert h0 < 2**128
  with pytest.raises(ValueError, match="block_size"):
    hash_full_blocks(tokens, 0)


def test_allocation_order_and_null_block():
  pool = BlockPool(6, "device")
  assert pool.null_block_id == 0
  assert pool.free_block_ids() == [1, 2, 3, 4, 5]
  assert pool.allocate(3) == [1, 2, 3]
  assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (2, 3, 0)
  assert pool.usage == pytest.approx(3 / 5)
  assert pool.allocate(2) == [4, 5]
  with pytest.raises(ValueError, match="cannot allocate 1 device blocks: 0 free"):
    pool.allocate(1)
  with pytest.raises(ValueError, match="null block"):
    pool.free([0])
  with pytest.raises(ValueError, match="null block"):
    pool.touch([0])
  pool.check_invariants()


def test_host_tier_without_null_block_hands_out_block_zero():
  pool = BlockPool(3, "pinned_host", reserve_null_block=False)
  assert pool.null_block_id is None
  assert pool.allocate(3) == [0, 1, 2]
  assert pool.usage == 1.0
  with pytest.raises(ValueError, match="memory_kind"):
    BlockPool(4, "unpinned_host")
  with pytest.raises(ValueError, match="at least 2 blocks"):
    BlockPool(1, "device")


def test_free_in_reverse_keeps_hashes_and_evicts_lazily_from_the_head():
  pool = BlockPool(6, "device")
  seq = pool.allocate(3)  # [1, 2, 3]: a prefix chain h0 -> h1 -> h2.
  hashes = hash_full_blocks(list(range(12)), 4)
  for block_id, block_hash in zip(seq, hashes):
    pool.cache_block(block_id, block_hash)
  # Freed tail first: the chain's tail is the first to be evicted.
  pool.free(reversed(seq))
  assert pool.free_block_ids() == [4, 5, 3, 2, 1]
  assert pool.cached_block_ids_lru() == [3, 2, 1]
  assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (5, 0, 3)
  # Lazy eviction: still findable while free.
  assert pool.get_cached_block(hashes[2]) == 3
  # Plain free blocks go first, then block 3 loses its hash h2; 2 and 1 stay cached.
  assert pool.allocate(3) == [4, 5, 3]
  assert pool.peek_cached_block(hashes[2]) is None
  assert pool.block_hash(3) is None
  assert pool.peek_cached_block(hashes[0]) == 1
  assert pool.num_cached_blocks == 2
  assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (1, 1)
  pool.check_invariants()


def test_touch_takes_a_cached_block_out_of_the_middle_of_the_queue():
  pool = BlockPool(5, "device")
  a, b, c = pool.allocate(3)  # 1, 2, 3
  pool.cache_block(b, 1234)
  pool.free([a, b, c])
  assert pool.free_block_ids() == [4, 1, 2, 3]
  pool.touch([pool.get_cached_block(1234)])  # A prefix hit on block 2.
  assert pool.ref_cnt(2) == 1
  assert pool.free_block_ids() == [4, 1, 3]
  pool.touch([2])  # A second sequence shares it.
  assert pool.ref_cnt(2) == 2
  pool.free([2])
  assert pool.ref_cnt(2) == 1 and 2 not in pool.free_block_ids()
  pool.free([2])
  assert pool.free_block_ids() == [4, 1, 3, 2]
  with pytest.raises(ValueError, match="freed with ref_cnt 0"):
    pool.free([2])  # Ref counts never go below zero.
  assert pool.ref_cnt(2) == 0
  pool.check_invariants()


def test_duplicate_hashes_and_explicit_eviction():
  pool = BlockPool(4, "pinned_host")
  a, b = pool.allocate(2)
  pool.cache_block(a, 77)
  pool.cache_block(b, 77)  # Equal content that became full separately.
  assert pool.peek_cached_block(77) == 1
  with pytest.raises(ValueError, match="already has another hash"):
    pool.cache_block(a, 78)
  with pytest.raises(ValueError, match="is owned; cannot evict"):
    pool.evict(a)
  pool.free([a, b])
  assert pool.evict(a) is True
  assert pool.peek_cached_block(77) == 2
  assert pool.evict(a) is False
  assert pool.num_cached_blocks == 1
  with pytest.raises(ValueError, match="not owned; cannot cache"):
    pool.cache_block(a, 79)
  pool.check_invariants()

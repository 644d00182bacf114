"""BlockManager, narrated with exact block ids (block_size 4 throughout).

Device and host pools reserve block 0 as the null block, so ids start at 1.
"""

import numpy as np
import pytest

from hisparse_jax.kv_cache.block_manager import BlockManager
from hisparse_jax.kv_cache.kv_hash import hash_full_blocks

BS = 4


def _ids(plan_ids):
  return np.asarray(plan_ids).tolist()


def test_allocation_order_and_slot_ids():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  result = bm.allocate("a", list(range(10)))  # 2 full blocks + 2 tokens.
  assert _ids(result.block_ids) == [1, 2, 3]
  assert result.block_ids.dtype == np.int32
  assert result.num_cached_tokens == 0
  # slot = block_id * block_size + offset: blocks 1, 2 whole, then 12, 13 of block 3.
  assert _ids(result.slot_ids) == list(range(4, 14))
  assert result.swap_in.num_blocks == 0
  assert (bm.device_pool.num_free_blocks, bm.device_pool.num_used_blocks) == (6, 3)
  assert _ids(bm.allocate("b", [7]).block_ids) == [4]
  assert _ids(bm.block_tables(["a", "b"], 4)) == [[1, 2, 3, 0], [4, 0, 0, 0]]
  assert _ids(bm.slot_ids("a", 8, 10)) == [12, 13]
  bm.check_invariants()


def test_prefix_hit_reuses_full_blocks_but_not_the_partial_last_block():
  bm = BlockManager(10, 8, BS)
  bm.allocate("a", list(range(10)))  # [1, 2, 3]
  # b shares the first 8 tokens: blocks 1 and 2 are hits; its own tail gets block 4.
  b = bm.allocate("b", list(range(8)) + [100, 101, 102])
  assert _ids(b.block_ids) == [1, 2, 4]
  assert b.num_cached_tokens == 8
  assert _ids(b.slot_ids) == [16, 17, 18]
  assert [bm.device_pool.ref_cnt(i) for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
  # c repeats a's 10 tokens: a's partial block 3 carries no hash, so c gets block 5.
  c = bm.allocate("c", list(range(10)))
  assert _ids(c.block_ids) == [1, 2, 5]
  assert bm.device_pool.block_hash(3) is None
  # Lookups, in blocks: a 1 (a device miss, a host miss, then the chain is broken),
  # b 2 hits, c 2 hits.
  dev, host = bm.device_pool, bm.host_pool
  assert (dev.prefix_cache_queries, dev.prefix_cache_hits) == (5, 4)
  assert (host.prefix_cache_queries, host.prefix_cache_hits) == (1, 0)
  bm.check_invariants()


def test_the_last_prompt_token_is_always_computed():
  bm = BlockManager(10, 8, BS)
  bm.allocate("a", list(range(8)))  # [1, 2], both full and cached.
  # The same 8 tokens again: only block 1 may hit, block 2 is recomputed into block 3.
  b = bm.allocate("b", list(range(8)))
  assert _ids(b.block_ids) == [1, 3]
  assert b.num_cached_tokens == 4
  assert _ids(b.slot_ids) == [12, 13, 14, 15]


def test_lazy_eviction_evicts_chain_tails_first():
  bm = BlockManager(num_device_blocks=6, num_host_blocks=4, block_size=BS)
  a_tokens = list(range(12))
  bm.allocate("a", a_tokens)  # [1, 2, 3]
  bm.free("a")  # Freed in reverse: queue [4, 5, 3, 2, 1].
  assert bm.device_pool.free_block_ids() == [4, 5, 3, 2, 1]
  assert bm.device_pool.num_cached_blocks == 3
  assert _ids(bm.allocate("b", list(range(50, 58))).block_ids) == [4, 5]
  # c needs one block: block 3 (a's chain tail) is reused and its hash evicted.
  assert _ids(bm.allocate("c", [90, 91, 92, 93]).block_ids) == [3]
  bm.free("b")  # queue [2, 1, 5, 4]
  assert bm.device_pool.free_block_ids() == [2, 1, 5, 4]
  # a's prompt again: hits 1, 2; the new block evicts b's tail (5), not b's head (4).
  d = bm.allocate("d", a_tokens)
  assert _ids(d.block_ids) == [1, 2, 5]
  assert d.num_cached_tokens == 8
  b_hashes = hash_full_blocks(list(range(50, 58)), BS)
  assert bm.device_pool.peek_cached_block(b_hashes[0]) == 4
  assert bm.device_pool.peek_cached_block(b_hashes[1]) is None
  bm.check_invariants()
  bm.free("c")
  bm.free("d")
  assert bm.device_pool.num_used_blocks == 0
  assert bm.device_pool.num_free_blocks == 5


def test_copy_on_write_of_a_shared_partial_block():
  bm = BlockManager(10, 8, BS)
  bm.allocate("a", list(range(6)))  # [1, 2]; block 2 holds 2 tokens.
  bm.fork("a", "b")
  assert [bm.device_pool.ref_cnt(i) for i in (1, 2)] == [2, 2]
  assert bm.can_append("b")  # One free block is enough for the copy.
  # b writes into the shared block 2: it gets a private copy in block 3 first.
  r = bm.append_slot("b", 6)
  assert r.copy == (2, 3)
  assert r.slot_id == 3 * BS + 2
  assert bm.block_table("b") == [1, 3]
  assert [bm.device_pool.ref_cnt(i) for i in (1, 2, 3)] == [2, 1, 1]
  # a is the only owner of block 2 now: no copy.
  r = bm.append_slot("a", 60)
  assert (r.slot_id, r.copy) == (2 * BS + 2, None)
  # b fills block 3, then moves on to a new block 4.
  assert bm.append_slot("b", 7).slot_id == 15
  r = bm.append_slot("b", 8)
  assert (r.slot_id, r.copy) == (16, None)
  assert bm.block_table("b") == [1, 3, 4]
  assert bm.num_tokens("b") == 9
  # b's block 3 is full: it is cached under the hash of b's tokens.
  assert bm.device_pool.block_hash(3) == hash_full_blocks(bm.token_ids("b"), BS)[1]
  bm.check_invariants()


def test_fork_at_a_block_boundary_needs_no_copy():
  bm = BlockManager(10, 8, BS)
  bm.allocate("a", list(range(8)))  # [1, 2]
  bm.fork("a", "b")
  r = bm.append_slot("b", 8)
  assert (r.slot_id, r.copy) == (12, None)
  assert bm.block_table("b") == [1, 2, 3]
  bm.free("a")
  bm.free("b")
  # b freed its tail first: 3, 2, 1; a's references were dropped before.
  assert bm.device_pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 3, 2, 1]


def test_swap_out_and_swap_in_plans():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(10)))  # [1, 2, 3]
  bm.allocate("b", list(range(20, 26)))  # [4, 5]
  out = bm.swap_out("a")
  assert (_ids(out.device_ids), _ids(out.host_ids)) == ([1, 2, 3], [1, 2, 3])
  assert out.device_ids.dtype == out.host_ids.dtype == np.int32
  assert bm.is_swapped("a") and bm.host_block_table("a") == [1, 2, 3]
  # Device blocks freed tail first; the full ones (1, 2) stay cached.
  assert bm.device_pool.free_block_ids() == [6, 7, 8, 9, 3, 2, 1]
  assert bm.device_pool.cached_block_ids_lru() == [2, 1]
  with pytest.raises(ValueError, match="swapped out"):
    bm.append_slot("a", 0)
  # c takes 6 blocks, evicting block 2's hash; b finishes.
  assert _ids(bm.allocate("c", list(range(100, 124))).block_ids) == [6, 7, 8, 9, 3, 2]
  bm.free("b")  # queue [1, 5, 4]
  assert bm.can_swap_in("a")
  plan = bm.swap_in("a")
  # Block 1 is still cached on the device: reused without a copy. The rest is copied.
  assert bm.block_table("a") == [1, 5, 4]
  assert (_ids(plan.host_ids), _ids(plan.device_ids)) == ([2, 3], [5, 4])
  assert bm.num_tokens("a") == 10
  # The host blocks stay pinned until the step's transfers ran.
  assert bm.host_pool.num_used_blocks == 3
  bm.check_invariants()
  bm.finish_step()
  assert bm.host_pool.num_used_blocks == 0
  assert bm.host_pool.cached_block_ids_lru() == [2, 1]  # Full blocks stay as host cache.
  bm.check_invariants()


def test_quick_swap_in_copies_only_the_partial_block():
  bm = BlockManager(10, 8, BS)
  bm.allocate("a", list(range(10)))  # [1, 2, 3]
  bm.swap_out("a")
  plan = bm.swap_in("a")
  assert (_ids(plan.host_ids), _ids(plan.device_ids)) == ([3], [4])
  assert bm.block_table("a") == [1, 2, 4]


def test_host_prefix_hit_gives_a_swap_in_plan():
  bm = BlockManager(num_device_blocks=6, num_host_blocks=8, block_size=BS)
  prompt = list(range(10))
  bm.allocate("a", prompt)  # [1, 2, 3]
  bm.swap_out("a")  # host [1, 2, 3]; hashes of a's two full blocks on host 1, 2.
  bm.finish_step()  # The step's transfer wrote them: the write pins are released.
  bm.allocate("x", list(range(200, 220)))  # [4, 5, 3, 2, 1]: evicts a's device hashes.
  bm.free("x")  # queue [1, 2, 3, 5, 4]
  before = (bm.host_pool.prefix_cache_queries, bm.host_pool.prefix_cache_hits)
  b = bm.allocate("b", prompt[:8] + [99])
  assert _ids(b.block_ids) == [1, 2, 3]
  assert b.num_cached_tokens == 8
  assert (_ids(b.swap_in.host_ids), _ids(b.swap_in.device_ids)) == ([1, 2], [1, 2])
  assert _ids(b.slot_ids) == [12]
  after = (bm.host_pool.prefix_cache_queries, bm.host_pool.prefix_cache_hits)
  assert (after[0] - before[0], after[1] - before[1]) == (2, 2)
  assert bm.host_pool.ref_cnt(1) == 2  # a's copy plus the pin of this step's read.
  bm.check_invariants()
  bm.finish_step()
  assert bm.host_pool.ref_cnt(1) == 1
  # Now cached on the device too: the next request hits there.
  c = bm.allocate("c", prompt[:8] + [5])
  assert _ids(c.block_ids) == [1, 2, 5] and c.swap_in.num_blocks == 0
  bm.check_invariants()


def test_swap_out_shares_host_copies_by_hash():
  bm = BlockManager(num_device_blocks=6, num_host_blocks=6, block_size=BS)
  prompt = list(range(12))
  bm.allocate("a", prompt)  # [1, 2, 3]
  plan = bm.swap_out("a")
  assert (_ids(plan.device_ids), _ids(plan.host_ids)) == ([1, 2, 3], [1, 2, 3])
  bm.finish_step()
  bm.free("a")  # Host blocks freed tail first: a's chain tail (host 3) is evicted first.
  assert bm.host_pool.cached_block_ids_lru() == [3, 2, 1]
  # a's prompt plus one token: device hits 1, 2, 3 (still cached there), new block 4.
  assert _ids(bm.allocate("b", prompt + [12]).block_ids) == [1, 2, 3, 4]
  out = bm.swap_out("b")
  # Blocks 1..3 are full and already on the host (by hash): only block 4 is copied.
  assert (_ids(out.device_ids), _ids(out.host_ids)) == ([4], [4])
  assert bm.host_block_table("b") == [1, 2, 3, 4]
  bm.check_invariants()
  bm.free("b")  # Host blocks freed tail first.
  # Host block 4 is still the target of this step's copy: pinned until finish_step.
  assert bm.host_pool.free_block_ids() == [5, 3, 2, 1]
  bm.finish_step()
  assert bm.host_pool.free_block_ids() == [5, 3, 2, 1, 4]
  assert bm.host_pool.num_used_blocks == 0 and bm.device_pool.num_used_blocks == 0


def test_refusals_name_the_shortage():
  bm = BlockManager(num_device_blocks=3, num_host_blocks=2, block_size=BS)
  assert not bm.can_allocate(list(range(9)))
  with pytest.raises(ValueError, match="3 blocks needed, 2 device blocks free"):
    bm.allocate("a", list(range(9)))
  with pytest.raises(ValueError, match="no tokens"):
    bm.allocate("a", [])
  bm.allocate("a", list(range(8)))  # [1, 2]
  with pytest.raises(ValueError, match="already has blocks"):
    bm.allocate("a", [1])
  assert not bm.can_append("a")
  with pytest.raises(ValueError, match="no free device block"):
    bm.append_slot("a", 8)
  assert not bm.can_swap_out("a")
  with pytest.raises(ValueError, match="2 blocks, 1 host blocks free"):
    bm.swap_out("a")
  with pytest.raises(ValueError, match="not swapped out"):
    bm.swap_in("a")
  with pytest.raises(ValueError, match="unknown sequence 'z'"):
    bm.free("z")
  bm.check_invariants()  # Refusals change nothing.
  assert bm.block_table("a") == [1, 2]


def test_a_copy_source_can_be_a_swap_in_target_of_the_same_step():
  # Why copy-on-write copies run before the host->device transfer (module docstring).
  bm = BlockManager(num_device_blocks=7, num_host_blocks=4, block_size=BS)
  bm.allocate("s", [50, 51])  # [1]
  bm.finish_step()
  assert _ids(bm.swap_out("s").host_ids) == [1]
  bm.finish_step()
  bm.allocate("a", list(range(6)))  # [2, 3]
  bm.fork("a", "b")
  bm.finish_step()
  # One step: b copies block 3 into 4, a finishes, and block 3 is handed out again.
  assert bm.append_slot("b", 6).copy == (3, 4)
  bm.free("a")
  assert _ids(bm.allocate("c", list(range(100, 108))).block_ids) == [5, 6]
  assert _ids(bm.allocate("d", [7]).block_ids) == [1]
  plan = bm.swap_in("s")
  assert (_ids(plan.host_ids), _ids(plan.device_ids)) == ([1], [3])
  bm.check_invariants()


def test_chunked_prefill_caches_only_computed_blocks():
  bm = BlockManager(10, 8, BS)
  prompt = list(range(12))
  # a's first chunk computes 5 tokens: only block 1 is full of computed KV.
  a = bm.allocate("a", prompt, num_new_tokens=5)
  assert _ids(a.block_ids) == [1, 2, 3]
  assert [bm.device_pool.block_hash(i) is not None for i in (1, 2, 3)] == [True, False, False]
  # b shares the prompt but may hit block 1 only: block 2's KV does not exist yet.
  b = bm.allocate("b", prompt + [50])
  assert (_ids(b.block_ids), b.num_cached_tokens) == ([1, 4, 5, 6], 4)
  # a's next chunk (tokens 5..11) is scheduled: blocks 2 and 3 get their hashes, the
  # same as b's blocks 4 and 5 (duplicates; block tables are never rewritten).
  bm.cache_blocks("a", 12)
  assert [bm.device_pool.block_hash(i) for i in (2, 3)] == [
      bm.device_pool.block_hash(i) for i in (4, 5)]
  # Lookups return the block cached first: b's.
  c = bm.allocate("c", prompt + [60])
  assert (_ids(c.block_ids), c.num_cached_tokens) == ([1, 4, 5, 7], 12)
  bm.free("b")
  bm.free("c")
  bm.device_pool.evict(4)  # Once b's copy of the second block is gone, a's is found.
  assert bm.allocate("d", prompt + [70]).block_ids[1] == 2
  bm.check_invariants()


def test_extend_allocates_a_streamed_prompt_chunk_by_chunk():
  # A prompt allocated 6 tokens at a time (HiSparse streams one longer than the device):
  # the partly filled last block is filled first, then new blocks; the table, the slots and
  # the prefix cache (blocks cached as their chunks are scheduled) follow.
  bm = BlockManager(num_device_blocks=7, num_host_blocks=8, block_size=BS)
  prompt = list(range(100, 120))
  bm.allocate("a", prompt[:6], num_new_tokens=0)  # [1, 2]: 4 + 2 tokens
  assert bm.blocks_to_extend("a", 2) == 0 and bm.blocks_to_extend("a", 3) == 1
  bm.cache_blocks("a", 6)
  bm.extend("a", prompt[6:12])  # fills block 2, then block 3
  assert bm.block_table("a") == [1, 2, 3] and bm.num_tokens("a") == 12
  assert _ids(bm.slot_ids("a", 6, 12)) == [10, 11, 12, 13, 14, 15]
  bm.cache_blocks("a", 12)
  bm.check_invariants()
  assert bm.blocks_to_extend("a", 8) == 2 and bm.device_pool.num_free_blocks == 3
  with pytest.raises(ValueError, match="cannot extend 'a': 4 blocks needed, 3 device"):
    bm.extend("a", prompt[12:20] + [1] * 5)
  bm.extend("a", prompt[12:20])
  assert bm.block_table("a") == [1, 2, 3, 4, 5] and bm.token_ids("a") == prompt
  bm.cache_blocks("a", 20)
  bm.check_invariants()
  # The blocks hash as if allocated at once: a second request hits all 4 leading blocks.
  bm.free("a")
  assert bm.allocate("b", prompt + [7]).num_cached_tokens == 20
  bm.append_slot("b", -1)  # a pending token: nothing more may be extended
  with pytest.raises(ValueError, match="pending token"):
    bm.extend("b", [1])

"""BlockManager HiSparse tiering, narrated with exact block ids (block_size 4 throughout).

write_through -> offload -> swap_out -> sparse swap_in -> free, on pools small enough
that every id is predictable. Both pools reserve block 0 as the null block, which is
also the table entry of a dropped block.
"""

import numpy as np
import pytest

from hisparse_jax.kv_cache.block_manager import BlockManager

BS = 4


def _ids(plan_ids):
  return np.asarray(plan_ids).tolist()


def _host_refs(bm):
  return [bm.host_pool.ref_cnt(i) for i in range(bm.host_pool.num_blocks)]


def test_write_through_copies_full_computed_blocks_in_order():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(13)))  # [1, 2, 3, 4]; block 4 holds 1 token.
  # 7 computed tokens: only block 1 is full of computed KV.
  plan = bm.write_through("a", 7)
  assert (_ids(plan.device_ids), _ids(plan.host_ids)) == ([1], [1])
  assert plan.device_ids.dtype == plan.host_ids.dtype == np.int32
  # The next call continues after the blocks that have a copy; the partial block 4
  # never gets one.
  plan = bm.write_through("a", 13)
  assert (_ids(plan.device_ids), _ids(plan.host_ids)) == ([2, 3], [2, 3])
  assert bm.host_copy_ids("a") == [1, 2, 3]
  assert _ids(bm.write_through("a", 13).device_ids) == []
  # Copies carry the hashes of the device blocks they copy.
  assert [bm.host_pool.block_hash(i) for i in (1, 2, 3)] == [
      bm.device_pool.block_hash(i) for i in (1, 2, 3)]
  # Still resident: nothing dropped, no hot buffer.
  assert bm.block_table("a") == [1, 2, 3, 4]
  assert not bm.is_offloaded("a") and bm.hot_slots("a") == []
  assert bm.num_resident_blocks("a") == 4
  bm.check_invariants()
  bm.finish_step()
  # Owned by the sequence once the step's copies ran: one reference each.
  assert _host_refs(bm) == [0, 1, 1, 1, 0, 0, 0, 0]
  # Appended tokens fill block 4: its copy comes once its KV is computed.
  for token in (13, 14, 15):
    bm.append_slot("a", token)
  bm.finish_step()  # Their KV is written by that step's forward.
  plan = bm.write_through("a", 16)
  assert (_ids(plan.device_ids), _ids(plan.host_ids)) == ([4], [4])
  assert _ids(bm.host_tables(["a"], 6)) == [[1, 2, 3, 4, 0, 0]]
  bm.check_invariants()


def test_write_through_shares_a_host_prefix_hit_instead_of_copying():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  prompt = list(range(8))
  bm.allocate("a", prompt)  # [1, 2]
  plan = bm.write_through("a", 8)
  assert (_ids(plan.device_ids), _ids(plan.host_ids)) == ([1, 2], [1, 2])
  # b repeats block 1 and then differs: device hit on 1, own blocks 3, 4.
  b = bm.allocate("b", prompt[:4] + [50, 51, 52, 53, 54])
  assert _ids(b.block_ids) == [1, 3, 4]
  bm.finish_step()
  plan = bm.write_through("b", 9)
  # Host block 1 holds b's first block already (same hash): shared. Block 3 is copied.
  assert (_ids(plan.device_ids), _ids(plan.host_ids)) == ([3], [3])
  assert bm.host_copy_ids("b") == [1, 3]
  bm.finish_step()
  assert _host_refs(bm) == [0, 2, 1, 1, 0, 0, 0, 0]
  bm.check_invariants()
  # Once a is gone its host copies stay CACHED; c finds both of them without a copy.
  bm.free("a")
  assert _host_refs(bm) == [0, 1, 0, 1, 0, 0, 0, 0]
  assert bm.host_pool.num_cached_blocks == 1
  assert _ids(bm.allocate("c", prompt + [9]).block_ids) == [1, 2, 5]  # Device hits.
  bm.finish_step()
  assert _ids(bm.write_through("c", 9).device_ids) == []
  assert bm.host_copy_ids("c") == [1, 2]
  assert _host_refs(bm) == [0, 2, 1, 1, 0, 0, 0, 0]
  bm.check_invariants()


def test_write_through_stops_when_the_host_pool_is_full():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=3, block_size=BS)
  bm.allocate("a", list(range(16)))  # [1, 2, 3, 4]
  plan = bm.write_through("a", 16)
  # Two usable host blocks: blocks 1 and 2 get copies, 3 and 4 none (a prefix only).
  assert (_ids(plan.device_ids), _ids(plan.host_ids)) == ([1, 2], [1, 2])
  assert bm.host_copy_ids("a") == [1, 2]
  assert bm.host_pool.num_free_blocks == 0
  assert _ids(bm.write_through("a", 16).device_ids) == []
  # Only blocks with a copy can be dropped.
  assert bm.offload_gain("a", 1) == 2 - 1
  bm.check_invariants()
  # A prefix hit needs no free host block: b shares a's two copies.
  assert _ids(bm.allocate("b", list(range(8)) + [99]).block_ids) == [1, 2, 5]
  bm.finish_step()
  assert _ids(bm.write_through("b", 9).device_ids) == []
  assert bm.host_copy_ids("b") == [1, 2]
  bm.finish_step()
  assert _host_refs(bm) == [0, 2, 2]
  bm.check_invariants()


def test_write_through_resumes_when_host_blocks_come_free():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=3, block_size=BS)
  bm.allocate("x", list(range(50, 54)))  # [1]
  bm.allocate("a", list(range(12)))  # [2, 3, 4]
  bm.finish_step()
  assert _ids(bm.write_through("x", 4).host_ids) == [1]
  assert _ids(bm.write_through("a", 12).device_ids) == [2]  # Host block 2: full now.
  bm.finish_step()
  bm.free("x")  # Host block 1 is CACHED (x's hash): the head of the free queue.
  plan = bm.write_through("a", 12)
  assert (_ids(plan.device_ids), _ids(plan.host_ids)) == ([3], [1])
  assert bm.host_copy_ids("a") == [2, 1]
  assert bm.host_pool.block_hash(1) == bm.device_pool.block_hash(3)  # x's hash evicted.
  bm.check_invariants()


def test_offload_drops_written_through_blocks_but_not_the_block_being_filled():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(14)))  # [1, 2, 3, 4]; block 4 holds 2 tokens.
  bm.finish_step()
  bm.write_through("a", 14)  # host [1, 2, 3]: the partial block 4 has no copy.
  # Blocks 1..3 can go; two hot-buffer slots are taken from what they free.
  assert bm.offload_gain("a", 2) == 3 - 2
  assert bm.device_pool.free_block_ids() == [5, 6, 7, 8, 9]
  assert bm.offload("a", 2) == 1
  assert bm.block_table("a") == [0, 0, 0, 4]
  # Dropped blocks are freed tail first and keep their hashes (CACHED); the hot slots
  # come from the head of the free queue.
  assert bm.hot_slots("a") == [5, 6]
  assert bm.device_pool.free_block_ids() == [7, 8, 9, 3, 2, 1]
  assert bm.device_pool.cached_block_ids_lru() == [3, 2, 1]
  assert bm.is_offloaded("a")
  assert bm.num_resident_blocks("a") == 1 + 2
  assert _ids(bm.block_tables(["a"], 5)) == [[0, 0, 0, 4, 0]]
  assert _ids(bm.hot_slot_tables(["a"], 3)) == [[5, 6, 0]]
  bm.check_invariants()
  # Offloading again frees nothing and keeps the hot buffer (allocated once).
  assert bm.offload_gain("a", 2) == 0
  assert bm.offload("a", 3) == 0
  assert bm.hot_slots("a") == [5, 6]
  # Decoding fills block 4; once its KV is computed it gets a copy, and, full, it is no
  # longer the block the next token goes into: the next offload drops it too.
  for token in (14, 15):
    bm.append_slot("a", token)
  bm.finish_step()
  assert _ids(bm.write_through("a", 16).device_ids) == [4]
  assert bm.offload_gain("a", 2) == 1
  assert bm.offload("a", 2) == 1
  assert bm.block_table("a") == [0, 0, 0, 0]
  assert bm.num_resident_blocks("a") == 2  # The hot buffer only.
  assert bm.hot_slots("a") == [5, 6]
  bm.check_invariants()
  # The next token opens a new block (the head of the free queue).
  assert bm.device_pool.free_block_ids() == [7, 8, 9, 3, 2, 1, 4]
  result = bm.append_slot("a", 16)
  assert (result.slot_id, result.copy) == (7 * BS, None)
  assert bm.block_table("a") == [0, 0, 0, 0, 7]
  assert _ids(bm.host_tables(["a"], 5)) == [[1, 2, 3, 4, 0]]
  bm.check_invariants()


def test_offload_gain_after_a_table_rewrite_counts_every_block_again():
  """`droppable` skips the leading dropped blocks it found before (an offloaded sequence's
  check costs its new blocks only); a swap-out and full swap-in rewrite the table, and the
  scan starts from the first block again."""
  bm = BlockManager(num_device_blocks=12, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(14)))  # [1, 2, 3, 4]
  bm.finish_step()
  bm.write_through("a", 14)  # host [1, 2, 3]
  assert bm.offload("a", 2) == 1  # [0, 0, 0, 4]
  assert bm.offload_gain("a", 2) == 0  # nothing left to drop: scanned past 3 dropped
  bm.swap_out("a")
  bm.finish_step()
  bm.swap_in("a")  # every block back on the device: the table rewritten
  bm.finish_step()
  assert 0 not in bm.block_table("a") and not bm.is_offloaded("a")
  assert bm.host_copy_ids("a") == [] and bm.offload_gain("a", 2) == 0 - 2
  bm.write_through("a", 14)  # copies again (or host-cache hits)
  bm.finish_step()
  assert len(bm.host_copy_ids("a")) == 3
  # All 3 full blocks can go again, less 2 hot slots.
  assert bm.offload_gain("a", 2) == 3 - 2
  assert bm.offload("a", 2) == 1
  assert bm.block_table("a")[:3] == [0, 0, 0]
  bm.check_invariants()


def test_offload_of_a_shared_block_frees_nothing():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  prompt = list(range(13))
  bm.allocate("a", prompt)  # [1, 2, 3, 4]
  bm.allocate("b", prompt[:4] + [90, 91])  # Device hit on block 1: [1, 5].
  assert bm.device_pool.ref_cnt(1) == 2
  bm.write_through("a", 13)  # host [1, 2, 3]
  # Block 1 is shared with b: dropping it from a's table frees no device block.
  assert bm.offload_gain("a", 1) == 2 - 1
  free_before = bm.device_pool.num_free_blocks
  assert bm.offload("a", 1) == 1
  assert bm.device_pool.num_free_blocks == free_before + 1
  assert bm.block_table("a") == [0, 0, 0, 4]
  assert bm.block_table("b") == [1, 5]
  assert [bm.device_pool.ref_cnt(i) for i in (1, 2, 3)] == [1, 0, 0]
  bm.check_invariants()


def test_offload_gain_is_negative_when_only_shared_blocks_can_go():
  bm = BlockManager(num_device_blocks=6, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(9)))  # [1, 2, 3]
  bm.fork("a", "b")  # b shares [1, 2, 3]
  bm.write_through("a", 9)  # host [1, 2]
  assert bm.host_copy_ids("b") == []  # A fork does not share the host copies.
  assert bm.offload_gain("a", 2) == 0 - 2
  with pytest.raises(ValueError, match="must be >= 1"):
    bm.offload("a", 0)
  bm.allocate("c", list(range(50, 58)))  # [4, 5]: the device pool is full.
  with pytest.raises(ValueError, match="no device blocks for its hot buffer"):
    bm.offload("a", 1)
  assert bm.block_table("a") == [1, 2, 3] and not bm.is_offloaded("a")  # Unchanged.
  bm.free("c")
  assert bm.offload("a", 2) == -2
  assert bm.block_table("a") == [0, 0, 3]
  assert bm.block_table("b") == [1, 2, 3]
  assert [bm.device_pool.ref_cnt(i) for i in (1, 2, 3)] == [1, 1, 2]
  assert bm.hot_slots("a") == [5, 4]
  bm.check_invariants()


def test_dropped_blocks_refuse_slots_and_offloaded_sequences_refuse_forks():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(13)))  # [1, 2, 3, 4]
  bm.write_through("a", 13)
  bm.offload("a", 2)  # [0, 0, 0, 4]
  with pytest.raises(ValueError, match="fall in dropped blocks"):
    bm.slot_ids("a", 0, 13)
  with pytest.raises(ValueError, match="fall in dropped blocks"):
    bm.slot_ids("a", 11, 12)
  assert _ids(bm.slot_ids("a", 12, 16)) == [16, 17, 18, 19]
  with pytest.raises(ValueError, match="offloaded"):
    bm.fork("a", "b")
  assert "b" not in bm
  with pytest.raises(ValueError, match="hot slots > 1"):
    bm.hot_slot_tables(["a"], 1)
  bm.check_invariants()


def test_swap_out_of_an_offloaded_sequence_copies_only_blocks_without_a_host_copy():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(14)))  # [1, 2, 3, 4]
  bm.write_through("a", 14)  # host [1, 2, 3]
  bm.offload("a", 2)  # [0, 0, 0, 4], hot [5, 6]; free queue [7, 8, 9, 3, 2, 1]
  bm.finish_step()
  assert bm.can_swap_out("a")
  out = bm.swap_out("a")
  # Only the partial block 4 has no host copy.
  assert (_ids(out.device_ids), _ids(out.host_ids)) == ([4], [4])
  assert bm.host_block_table("a") == [1, 2, 3, 4]
  # Hot slots, then the table's resident blocks are freed (tail first).
  assert bm.device_pool.num_used_blocks == 0
  assert bm.device_pool.free_block_ids() == [7, 8, 9, 3, 2, 1, 6, 5, 4]
  assert not bm.is_offloaded("a")
  # Host 4 is the target of this step's copy: pinned on top of a's reference.
  assert _host_refs(bm) == [0, 1, 1, 1, 2, 0, 0, 0]
  bm.check_invariants()
  bm.finish_step()
  assert _host_refs(bm) == [0, 1, 1, 1, 1, 0, 0, 0]
  bm.check_invariants()


def test_swap_out_needs_host_blocks_only_for_blocks_without_a_copy():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=5, block_size=BS)
  bm.allocate("a", list(range(13)))  # [1, 2, 3, 4]
  bm.write_through("a", 13)  # host [1, 2, 3]; one host block left.
  assert bm.can_swap_out("a")  # Only the partial block needs one.
  bm.allocate("b", list(range(50, 56)))  # [5, 6]
  assert _ids(bm.write_through("b", 6).host_ids) == [4]
  assert not bm.can_swap_out("a")
  with pytest.raises(ValueError, match="cannot swap out 'a': 4 blocks, 0 host blocks free"):
    bm.swap_out("a")
  assert bm.block_table("a") == [1, 2, 3, 4]  # Unchanged.
  bm.check_invariants()


def test_sparse_swap_in_brings_back_only_the_blocks_past_the_computed_prefix():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(13)))  # [1, 2, 3, 4]
  bm.write_through("a", 13)
  bm.offload("a", 2)
  bm.swap_out("a")  # host [1, 2, 3, 4]; device queue [7, 8, 9, 3, 2, 1, 6, 5, 4]
  bm.finish_step()
  with pytest.raises(ValueError, match="needs num_computed_tokens"):
    bm.swap_in("a", hot_buffer_blocks=2)
  # 13 computed tokens: blocks 1..3 stay on the host as a's copies; only the last
  # block comes back (into 7), then two hot slots (8, 9).
  assert bm.can_swap_in("a", hot_buffer_blocks=2, num_computed_tokens=13)
  plan = bm.swap_in("a", hot_buffer_blocks=2, num_computed_tokens=13)
  assert (_ids(plan.host_ids), _ids(plan.device_ids)) == ([4], [7])
  assert bm.block_table("a") == [0, 0, 0, 7]
  assert bm.host_copy_ids("a") == [1, 2, 3]
  assert bm.hot_slots("a") == [8, 9]
  assert bm.is_offloaded("a") and not bm.is_swapped("a")
  assert bm.num_resident_blocks("a") == 3
  # Host 4 is pinned until the step's transfer ran (its reference became the pin).
  assert _host_refs(bm) == [0, 1, 1, 1, 1, 0, 0, 0]
  bm.check_invariants()
  bm.finish_step()
  assert _host_refs(bm) == [0, 1, 1, 1, 0, 0, 0, 0]
  # The partial block's host copy is FREE (no hash), at the tail of the queue.
  assert bm.host_pool.free_block_ids()[-1] == 4 and bm.host_pool.block_hash(4) is None
  bm.check_invariants()
  # The sequence decodes where it left off.
  assert bm.append_slot("a", 13).slot_id == 7 * BS + 1


def test_sparse_swap_in_reuses_device_cached_blocks_and_keeps_fewer_on_host():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(13)))  # [1, 2, 3, 4]
  bm.write_through("a", 13)
  bm.offload("a", 2)
  bm.swap_out("a")
  bm.finish_step()
  # Only 5 tokens count as computed: block 1 stays on the host. Blocks 2 and 3 are
  # still CACHED on the device (dropped by the offload): reused, no copy.
  plan = bm.swap_in("a", hot_buffer_blocks=2, num_computed_tokens=5)
  assert (_ids(plan.host_ids), _ids(plan.device_ids)) == ([4], [7])
  assert bm.block_table("a") == [0, 2, 3, 7]
  assert bm.host_copy_ids("a") == [1]
  assert bm.hot_slots("a") == [8, 9]
  # Host 2, 3, 4 are pinned sources now, released (2, 3 CACHED) by finish_step.
  assert _host_refs(bm) == [0, 1, 1, 1, 1, 0, 0, 0]
  bm.finish_step()
  assert _host_refs(bm) == [0, 1, 0, 0, 0, 0, 0, 0]
  assert bm.host_pool.cached_block_ids_lru() == [3, 2]
  bm.check_invariants()


def test_swap_in_with_a_hot_buffer_but_nothing_to_keep_comes_back_whole():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(6)))  # [1, 2]
  bm.swap_out("a")
  bm.finish_step()
  # Fewer computed tokens than one block: nothing stays on host, no hot buffer.
  plan = bm.swap_in("a", hot_buffer_blocks=2, num_computed_tokens=3)
  # Device block 1 still holds the full block's hash: reused. The partial one: 3.
  assert bm.block_table("a") == [1, 3]
  assert _ids(plan.device_ids) == [3]
  assert not bm.is_offloaded("a") and bm.host_copy_ids("a") == []
  bm.check_invariants()


def test_sparse_swap_in_needs_fewer_device_blocks():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(100, 116)))  # [1, 2, 3, 4]
  bm.swap_out("a")
  bm.finish_step()
  bm.allocate("x", list(range(24)))  # [5, 6, 7, 8, 9, 4]: a's last block is evicted.
  assert bm.device_pool.free_block_ids() == [3, 2, 1]  # a's first three, CACHED.
  assert not bm.can_swap_in("a")  # 3 device hits + 1 copy: 4 blocks leave the queue.
  with pytest.raises(ValueError, match="cannot swap in 'a': 3 device blocks free"):
    bm.swap_in("a")
  # 15 computed tokens: blocks 1..3 stay on the host; the last block and the hot slots
  # need device blocks.
  assert not bm.can_swap_in("a", hot_buffer_blocks=3, num_computed_tokens=15)
  assert bm.can_swap_in("a", hot_buffer_blocks=2, num_computed_tokens=15)
  plan = bm.swap_in("a", hot_buffer_blocks=2, num_computed_tokens=15)
  assert (_ids(plan.host_ids), _ids(plan.device_ids)) == ([4], [3])
  assert bm.block_table("a") == [0, 0, 0, 3]
  assert bm.host_copy_ids("a") == [1, 2, 3]
  assert bm.hot_slots("a") == [2, 1]
  assert bm.device_pool.num_free_blocks == 0
  bm.check_invariants()


def test_sparse_swap_in_of_full_computed_blocks_keeps_them_all_on_host():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(16)))  # [1, 2, 3, 4]
  bm.swap_out("a")
  bm.finish_step()
  # Every block is full and computed: none comes back; only the hot slots are needed.
  plan = bm.swap_in("a", hot_buffer_blocks=2, num_computed_tokens=16)
  assert plan.num_blocks == 0
  assert bm.block_table("a") == [0, 0, 0, 0]
  assert bm.host_copy_ids("a") == [1, 2, 3, 4]
  assert bm.hot_slots("a") == [5, 6]
  assert bm.num_resident_blocks("a") == 2
  bm.check_invariants()
  bm.finish_step()
  # The next token opens a new block.
  assert bm.append_slot("a", 16).slot_id == 7 * BS
  assert bm.block_table("a") == [0, 0, 0, 0, 7]
  bm.check_invariants()


def test_free_returns_every_device_and_host_block():
  bm = BlockManager(num_device_blocks=10, num_host_blocks=8, block_size=BS)
  bm.allocate("a", list(range(14)))  # [1, 2, 3, 4]
  bm.write_through("a", 14)  # host [1, 2, 3]
  bm.offload("a", 2)  # [0, 0, 0, 4], hot [5, 6]
  bm.finish_step()
  bm.free("a")
  assert bm.device_pool.num_used_blocks == 0 and bm.host_pool.num_used_blocks == 0
  # Device: hot slots, then the last block; host copies tail first (chain tails go
  # first from both tiers).
  assert bm.device_pool.free_block_ids() == [7, 8, 9, 3, 2, 1, 6, 5, 4]
  assert bm.host_pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
  bm.check_invariants()
  # The same after a swap-out and a sparse swap-in (pins released by finish_step).
  bm.allocate("b", list(range(13)))  # Device hits 1, 2, 3.
  bm.write_through("b", 13)  # Host hits 1, 2, 3.
  bm.offload("b", 1)
  bm.swap_out("b")
  bm.swap_in("b", hot_buffer_blocks=1, num_computed_tokens=13)
  assert bm.is_offloaded("b") and bm.host_copy_ids("b") == [1, 2, 3]
  bm.finish_step()
  bm.free("b")
  for pool in bm.pools.values():
    assert pool.num_used_blocks == 0
    assert sorted(pool.free_block_ids()) == list(range(1, pool.num_blocks))
  bm.check_invariants()


def test_write_through_targets_are_not_handed_out_again_in_the_same_step():
  # The scheduler writes a sparse decoder through and may then free it in the same step
  # (a preemption victim the host cannot take). Its host blocks are still targets of
  # this step's batched device->host copy, so, like swap-out targets, they must not be
  # handed out to a second copy of that batch (two writes to one block, undefined order).
  bm = BlockManager(num_device_blocks=10, num_host_blocks=3, block_size=BS)
  bm.allocate("a", list(range(8)))  # [1, 2]
  bm.allocate("b", list(range(50, 58)))  # [3, 4]
  bm.finish_step()
  plan_a = bm.write_through("a", 8)
  assert _ids(plan_a.host_ids) == [1, 2]
  bm.free("a")
  plan_b = bm.write_through("b", 8)
  targets = _ids(plan_a.host_ids) + _ids(plan_b.host_ids)
  assert len(set(targets)) == len(targets), f"host blocks written twice: {targets}"
  bm.check_invariants()
  bm.finish_step()
  # After the step, a's copies are CACHED host blocks that b may take.
  assert sorted(_ids(bm.write_through("b", 8).host_ids) + _ids(plan_b.host_ids)) == [1, 2]
  bm.check_invariants()

"""The BlockManager's class invariants, checked (tests and state machines call it after
every step; the engine never does)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from hisparse_jax.kv_cache.block_pool import BlockPool
from hisparse_jax.kv_cache.kv_hash import hash_full_blocks
from hisparse_jax.kv_cache.kv_pool import NULL_BLOCK_ID
from hisparse_jax.kv_cache.seq_state import SeqState


def check_block_manager(device_pool: BlockPool, host_pool: BlockPool,
                        seqs: Mapping[Hashable, SeqState],
                        pinned_host_groups: Sequence[Sequence[int]], block_size: int,
                        prefix_caching: bool) -> None:
  """Raises AssertionError when an invariant of `BlockManager`'s docstring does not hold
  for this state (the manager passes everything it owns)."""
  device_pool.check_invariants()
  host_pool.check_invariants()
  refs = {"device": np.zeros(device_pool.num_blocks, np.int64),
          "pinned_host": np.zeros(host_pool.num_blocks, np.int64)}
  for group in pinned_host_groups:
    np.add.at(refs["pinned_host"], group, 1)
  for seq_id, seq in seqs.items():
    assert len(seq.block_ids) == -(-len(seq.token_ids) // block_size), seq_id
    if seq.mirror is not None and seq.mirror_version == seq.table_version:
      # The numpy mirror of the table is stale only where `table_row` re-syncs it.
      m = min(seq.mirror_len, len(seq.block_ids))
      assert seq.mirror[:m].tolist() == seq.block_ids[:m], (seq_id, "table mirror")
    assert NULL_BLOCK_ID not in seq.host_ids and NULL_BLOCK_ID not in seq.hot_slots, seq_id
    if seq.swapped:
      assert NULL_BLOCK_ID not in seq.block_ids, seq_id
      assert not seq.host_ids and not seq.hot_slots, seq_id
      np.add.at(refs["pinned_host"], seq.block_ids, 1)
    else:
      dropped = [i for i, b in enumerate(seq.block_ids) if b == NULL_BLOCK_ID]
      assert not dropped or seq.offloaded, (seq_id, dropped)
      assert not dropped or max(dropped) < len(seq.host_ids), (seq_id, dropped)
      # The block the next token goes into is resident: the last one, unless it is full.
      assert seq.block_ids[-1] != NULL_BLOCK_ID or len(seq.token_ids) % block_size == 0, seq_id
      assert len(seq.host_ids) <= len(seq.token_ids) // block_size, seq_id
      resident = [b for b in seq.block_ids if b != NULL_BLOCK_ID]
      np.add.at(refs["device"], resident + seq.hot_slots, 1)
      np.add.at(refs["pinned_host"], seq.host_ids, 1)
    if prefix_caching:
      assert seq.block_hashes == hash_full_blocks(
          seq.token_ids, block_size, seq.extra_keys,
          cache_salt=seq.cache_salt)[:len(seq.block_hashes)], seq_id
      pool = host_pool if seq.swapped else device_pool
      for block_id, block_hash in zip(seq.block_ids, seq.block_hashes):
        if block_id != NULL_BLOCK_ID:
          assert pool.block_hash(block_id) == block_hash, (seq_id, block_id)
      for host_id, block_hash in zip(seq.host_ids, seq.block_hashes):
        assert host_pool.block_hash(host_id) == block_hash, (seq_id, host_id)
  for pool in (device_pool, host_pool):
    actual = [pool.ref_cnt(i) for i in range(pool.num_blocks)]
    expected = refs[pool.memory_kind].tolist()
    assert actual == expected, (pool.memory_kind, actual, expected)

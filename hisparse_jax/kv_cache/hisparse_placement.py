"""HiSparse placement: which blocks of a sparse decoder live where.

It reads and writes the sequences' `host_ids` and `hot_slots` (in `SeqState`).

HiSparse tiering (sequences that decode sparsely, hisparse_jax.sparse.resolver):

    write_through(seq)   full, computed blocks get a host copy as they fill (d2h plan;
                         the host block is owned by the sequence: `host_ids`)
    offload(seq)         under device pressure: device copies of written-through blocks
                         are dropped (table entry -> null block 0, no write needed) and
                         the sequence gets its hot-buffer slots (`hot_slots`, device
                         blocks); selected blocks that are not resident are loaded into
                         those slots inside the step
    swap_out(seq)        blocks with a host copy are not copied again
    swap_in(seq, hot_buffer_blocks=n)   a long sequence comes back offloaded: only its
                         blocks past the written-through prefix are copied back

    offloaded sequence  block_ids [0, 0, 9, 0, 12]   (9: filled since, not dropped yet;
                                                      a full last block may be dropped too)
                        host_ids  [4, 5, 6, 7]       (full, computed blocks)
                        hot_slots [20, 21, ...]      (device blocks of the hot buffer)

A write-through plan is a SwapOutPlan and goes with the step's other d2h plans (first),
so dropping its device blocks in the same step is safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hisparse_jax.kv_cache.block_plans import SwapOutPlan, as_block_ids
from hisparse_jax.kv_cache.block_pool import BlockPool
from hisparse_jax.kv_cache.kv_pool import NULL_BLOCK_ID
from hisparse_jax.kv_cache.seq_state import SeqState
from hisparse_jax.kv_cache.tier_mover import TierMover


class HiSparsePlacement:
  """Write-through, offload, and the host / hot-slot tables of the step's rows.

  It owns no state of its own: it changes the pools (through `BlockPool` calls), the
  `SeqState` it is given (`host_ids`, `hot_slots`, dropped table entries) and pins the
  host blocks of its plans through the `TierMover` (released by `finish_step`). The
  `BlockManager` resolves sequence ids and checks that an offload fits.
  """

  def __init__(self, device_pool: BlockPool, host_pool: BlockPool, block_size: int,
               tier_mover: TierMover):
    self.device_pool = device_pool
    self.host_pool = host_pool
    self.block_size = block_size
    self.tier_mover = tier_mover

  @staticmethod
  def num_resident_blocks(seq: SeqState) -> int:
    """Device blocks a resident sequence holds (table entries that are not null, and hot
    slots)."""
    return sum(b != NULL_BLOCK_ID for b in seq.block_ids) + len(seq.hot_slots)

  @staticmethod
  def host_tables(seqs: Sequence[SeqState], max_num_blocks: int) -> np.ndarray:
    """[num_seqs, max_num_blocks] int32 host copies per logical block (0 = none)."""
    tables = np.full((len(seqs), max_num_blocks), NULL_BLOCK_ID, dtype=np.int32)
    for row, seq in enumerate(seqs):
      host_ids = seq.host_ids[:max_num_blocks]
      tables[row, :len(host_ids)] = host_ids
    return tables

  @staticmethod
  def hot_slot_tables(seqs: Sequence[SeqState], num_slots: int) -> np.ndarray:
    """[num_seqs, num_slots] int32 hot-buffer device blocks (0 rows: not offloaded); the
    caller checks that no sequence holds more than `num_slots`."""
    tables = np.full((len(seqs), num_slots), NULL_BLOCK_ID, dtype=np.int32)
    for row, seq in enumerate(seqs):
      tables[row, :len(seq.hot_slots)] = seq.hot_slots
    return tables

  def write_through(self, seq: SeqState, num_computed_tokens: int) -> SwapOutPlan:
    """Host copies of the full blocks within the first `num_computed_tokens` tokens
    that have none yet, in order (a d2h plan for this step's first batch); see
    BlockManager.write_through."""
    num_full = min(num_computed_tokens, len(seq.token_ids)) // self.block_size
    if len(seq.host_ids) >= num_full:  # every step of a sparse decoder but one in 16
      return _NO_WRITES
    device_src, host_dst = [], []
    for i in range(len(seq.host_ids), num_full):
      block_hash = seq.block_hashes[i] if i < len(seq.block_hashes) else None
      hit = self.host_pool.peek_cached_block(block_hash) if block_hash is not None else None
      if hit is not None:
        self.host_pool.touch([hit])
        seq.host_ids.append(hit)
        continue
      if self.host_pool.num_free_blocks == 0:
        break
      (host_id,) = self.host_pool.allocate(1)
      if block_hash is not None:
        self.host_pool.cache_block(host_id, block_hash)
      seq.host_ids.append(host_id)
      device_src.append(seq.block_ids[i])
      host_dst.append(host_id)
    # Pinned too (as swap_out's targets): if the sequence is freed in this step, its new
    # host blocks must not be handed out to a second transfer of the same batch.
    self.tier_mover.pin_host_blocks(host_dst[::-1], touch=True)
    return SwapOutPlan(as_block_ids(device_src), as_block_ids(host_dst))

  @staticmethod
  def droppable(seq: SeqState) -> list[int]:
    """Table indices of resident blocks with a host copy (full and computed, so never a
    block the next token is written into). The scan starts past the leading dropped
    blocks found before (`seq.dropped_prefix`, valid while no entry of `block_ids` is
    replaced): an offloaded sequence's check costs its few new blocks, not its length."""
    version, start = seq.dropped_prefix
    if version != seq.table_version:
      start = 0
    num_host = len(seq.host_ids)
    block_ids = seq.block_ids
    while start < num_host and block_ids[start] == NULL_BLOCK_ID:
      start += 1
    seq.dropped_prefix = (seq.table_version, start)
    return [i for i in range(start, num_host) if block_ids[i] != NULL_BLOCK_ID]

  def offload_gain(self, seq: SeqState, hot_buffer_blocks: int) -> int:
    """Device blocks `offload` would free, net of the hot-buffer slots it allocates."""
    freed = sum(self.device_pool.ref_cnt(seq.block_ids[i]) == 1 for i in self.droppable(seq))
    return freed - (0 if seq.offloaded else hot_buffer_blocks)

  def offload(self, seq: SeqState, hot_buffer_blocks: int) -> None:
    """Drops the device copies of the sequence's written-through blocks (they keep their
    hashes: CACHED) and gives it `hot_buffer_blocks` hot-buffer slots if it has none."""
    drop = self.droppable(seq)
    self.device_pool.free(seq.block_ids[i] for i in reversed(drop))
    for i in drop:
      seq.block_ids[i] = NULL_BLOCK_ID
    seq.replaced_blocks()
    if not seq.offloaded:
      seq.hot_slots = self.device_pool.allocate(hot_buffer_blocks)


def _empty_plan() -> SwapOutPlan:
  plan = SwapOutPlan(as_block_ids([]), as_block_ids([]))
  plan.device_ids.flags.writeable = plan.host_ids.flags.writeable = False  # shared
  return plan


# What `write_through` returns when a sequence has nothing new to copy.
_NO_WRITES = _empty_plan()

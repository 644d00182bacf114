"""Moves of whole sequences between the tiers: swap-out and swap-in plans, host pins.

A swap-out moves a preempted sequence's blocks to the host
(preemption by swapping, not recomputing); a swap-in brings it back before it runs
again (a long HiSparse sequence comes back offloaded). Full blocks whose hash the
destination tier holds are shared there, not copied (`TierMover.move`).

Plan contract for one engine step. A block freed during the step may be handed out
again in the same step, so the order of the batched moves matters:
  1. all device->host plans (SwapOutPlan), as one batched transfer: they read blocks
     that this step may hand out again;
  2. copy-on-write copies (device -> device): their source may have been freed by the
     copy itself and reused as a swap-in target;
  3. all host->device plans (SwapInPlan), as one batched transfer;
  4. the forward step, which writes the KV of the slots handed out;
  5. `finish_step()`, which releases the host blocks pinned as sources or targets of
     this step's transfers.
A sequence that was allocated, appended to or swapped in during a step is neither
freed nor swapped out before that step's forward has run; only a sequence whose prompt
is computed is appended to. A sequence may be forked in the step that computes the end
of its prompt (the forward writes the shared blocks; neither sequence appends, so
copies them on write, before a later step).
"""

from __future__ import annotations

from collections.abc import Sequence

from hisparse_jax.kv_cache.block_plans import SwapInPlan, SwapOutPlan, as_block_ids
from hisparse_jax.kv_cache.block_pool import BlockPool
from hisparse_jax.kv_cache.kv_pool import NULL_BLOCK_ID
from hisparse_jax.kv_cache.prefix_cache import PrefixCache
from hisparse_jax.kv_cache.seq_state import SeqState


class TierMover:
  """Swap plans between the tiers, and the host blocks pinned by this step's transfers.

  State: `pinned_host_groups`, the host blocks held (one reference each) as sources or
  targets of this step's plans until `finish_step`. Everything else it changes belongs
  to the pools and to the `SeqState` it is given; the `BlockManager` checks that a move
  fits (`can_swap_out` / `can_swap_in`) before asking for it.
  """

  def __init__(self, device_pool: BlockPool, host_pool: BlockPool, block_size: int,
               prefix_cache: PrefixCache):
    self.device_pool = device_pool
    self.host_pool = host_pool
    self.block_size = block_size
    self.prefix_cache = prefix_cache
    self.pinned_host_groups: list[list[int]] = []

  def pin_host_blocks(self, host_ids: Sequence[int], touch: bool) -> None:
    """Holds host blocks until `finish_step`; `host_ids` in eviction order (`touch`:
    take a reference now; otherwise the caller hands over one it holds)."""
    if touch:
      self.host_pool.touch(host_ids)
    if host_ids:
      self.pinned_host_groups.append(list(host_ids))

  def finish_step(self) -> None:
    """Releases the host blocks pinned by this step's plans (call after the forward)."""
    for group in self.pinned_host_groups:
      self.host_pool.free(group)
    self.pinned_host_groups.clear()

  def move(self, seq: SeqState, dst_pool: BlockPool) -> tuple[list[int], list[int], list[int]]:
    """New table of `seq` in `dst_pool`, and the (src, dst) ids of the blocks to copy.

    Full blocks whose hash `dst_pool` holds are shared there, not copied; the others get
    new blocks that take over their hashes.
    """
    hits = self.prefix_cache.hits_in(dst_pool, seq)
    dst_pool.touch([h for h in hits if h is not None])
    new_ids = iter(dst_pool.allocate(sum(h is None for h in hits)))
    table, src_ids, dst_ids = [], [], []
    for i, (src_id, hit_id) in enumerate(zip(seq.block_ids, hits)):
      if hit_id is not None:
        table.append(hit_id)
        continue
      dst_id = next(new_ids)
      table.append(dst_id)
      src_ids.append(src_id)
      dst_ids.append(dst_id)
      if i < len(seq.block_hashes):
        dst_pool.cache_block(dst_id, seq.block_hashes[i])
    return table, src_ids, dst_ids

  @staticmethod
  def tail(seq: SeqState, start: int) -> SeqState:
    """A view of `seq` from block `start` on, for `move` (which reads ids and hashes)."""
    return SeqState([], seq.block_ids[start:], seq.block_hashes[start:], seq.extra_keys,
                    cache_salt=seq.cache_salt)

  def can_swap_out(self, seq: SeqState) -> bool:
    """Whether the host tier can take every block of the resident `seq` now (blocks with
    a written-through host copy need none)."""
    tail = self.tail(seq, len(seq.host_ids))
    return self.prefix_cache.num_needed_in(self.host_pool, tail) <= self.host_pool.num_free_blocks

  def swap_out(self, seq: SeqState) -> SwapOutPlan:
    """Moves a resident sequence's blocks to the host; frees its device blocks (they keep
    their hashes: CACHED). Full blocks whose hash the host tier holds are shared, not
    copied, and written-through blocks keep their host copy."""
    num_copied = len(seq.host_ids)
    host_tail, device_src, host_dst = self.move(self.tail(seq, num_copied), self.host_pool)
    # Pinned too: if the sequence is freed in this step, its host blocks must not be
    # written by a second transfer of the same batch.
    self.pin_host_blocks(host_dst[::-1], touch=True)
    self.device_pool.free(reversed(seq.hot_slots))
    self.device_pool.free(b for b in reversed(seq.block_ids) if b != NULL_BLOCK_ID)
    seq.block_ids = seq.host_ids + host_tail
    seq.replaced_blocks()
    seq.host_ids, seq.hot_slots = [], []
    seq.swapped = True
    return SwapOutPlan(as_block_ids(device_src), as_block_ids(host_dst))

  def num_kept_on_host(self, seq: SeqState, hot_buffer_blocks: int,
                       num_computed_tokens: int | None) -> int:
    """Leading blocks of a swapped-out `seq` that a swap-in with a hot buffer leaves on
    the host: its full, computed blocks (all of them when every block is full: the next
    token opens a new block); 0 without a hot buffer."""
    if hot_buffer_blocks <= 0:
      return 0
    if num_computed_tokens is None:
      raise ValueError("a swap-in with a hot buffer needs num_computed_tokens")
    return min(num_computed_tokens // self.block_size, len(seq.block_ids))

  def can_swap_in(self, seq: SeqState, hot_buffer_blocks: int = 0,
                  num_computed_tokens: int | None = None) -> bool:
    """Whether the device tier has the blocks to bring the swapped-out `seq` back now
    (with `hot_buffer_blocks`, only its blocks past the computed full ones, plus the
    slots)."""
    keep = self.num_kept_on_host(seq, hot_buffer_blocks, num_computed_tokens)
    needed = self.prefix_cache.num_needed_in(self.device_pool, self.tail(seq, keep))
    return needed + (hot_buffer_blocks if keep else 0) <= self.device_pool.num_free_blocks

  def swap_in(self, seq: SeqState, hot_buffer_blocks: int = 0,
              num_computed_tokens: int | None = None) -> SwapInPlan:
    """Brings a swapped-out sequence back to device blocks (see BlockManager.swap_in)."""
    keep = self.num_kept_on_host(seq, hot_buffer_blocks, num_computed_tokens)
    device_tail, host_src, device_dst = self.move(self.tail(seq, keep), self.device_pool)
    self.pin_host_blocks(seq.block_ids[keep:][::-1], touch=False)  # Its refs become pins.
    seq.host_ids = seq.block_ids[:keep]
    seq.hot_slots = self.device_pool.allocate(hot_buffer_blocks) if keep else []
    seq.block_ids = [NULL_BLOCK_ID] * keep + device_tail
    seq.replaced_blocks()
    seq.swapped = False
    return SwapInPlan(as_block_ids(host_src), as_block_ids(device_dst))

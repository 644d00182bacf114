"""Block tables of sequences over two KV tiers: the BlockManager.

The BlockManager owns which KV blocks each sequence holds: device block tables in
attention order, the host blocks of sequences swapped out, prefix-cache lookups in
both tiers, copy-on-write of shared blocks, and the plans of the block moves that
follow from these decisions. It is host bookkeeping only (plain Python and numpy):
the engine executes the plans with the TransferEngine and the jitted step.

    sequence A (device)      table [3, 4, 7]   tokens 0..15 | 16..31 | 32..40
                                      |  |  `-- partial: never cached, copied on write
                                      `--`----- full: chained hash, shareable
    device pool  [0=null][1][2][3][4][5][6][7] ...
                            swap_out |  ^  swap_in, host prefix hit
                                      v  |
    host pool    [0=null][1][2][3][4] ...
    sequence B (swapped out)  host table [2, 4]   (device table empty)

A block's tier-local life (FREE -> OWNED -> CACHED -> evicted) is described in
`hisparse_jax.kv_cache.block_pool`. Across tiers, a block's content moves:
- device -> host: `swap_out(seq)` (preemption by swapping, not recomputing) and
  `write_through(seq)` (HiSparse host copies, below);
- host -> device: `swap_in(seq)` and host-tier prefix hits in `allocate`.

The BlockManager owns its state and the parts that act on it (all host bookkeeping):

    BlockManager            the sequences (`SeqState` by id) and their tables: allocate /
                            append / fork / free, the queries the scheduler and runner read
      .device_pool, .host_pool   BlockPool of each tier (ref counts, LRU free queue, hashes)
      .prefix_cache         PrefixCache (prefix_cache.py): chained hashes, lookups in both
                            tiers
      .tier_mover           TierMover (tier_mover.py): swap-out / swap-in plans, the host
                            blocks pinned by this step's plans, and the plan contract of
                            one engine step
      .placement            HiSparsePlacement (hisparse_placement.py): write-through,
                            offload, hot slots
      .tier_holds           TierHolds (tier_holds.py): host blocks the third tier holds
    seq_state.py            SeqState: one sequence's blocks; PENDING_TOKEN
    block_invariants.py     check_block_manager: the invariants below, over that state
    block_plans.py          the plans it returns
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from hisparse_jax.kv_cache.block_invariants import check_block_manager
from hisparse_jax.kv_cache.block_plans import (  # noqa: F401 (re-exported)
    AllocateResult,
    AppendResult,
    SwapInPlan,
    SwapOutPlan,
    as_block_ids,
)
from hisparse_jax.kv_cache.block_pool import BlockPool
from hisparse_jax.kv_cache.hisparse_placement import HiSparsePlacement
from hisparse_jax.kv_cache.kv_hash import BlockHash
from hisparse_jax.kv_cache.kv_pool import NULL_BLOCK_ID
from hisparse_jax.kv_cache.prefix_cache import PrefixCache
from hisparse_jax.kv_cache.seq_state import PENDING_TOKEN, SeqState
from hisparse_jax.kv_cache.tier_holds import TierHolds
from hisparse_jax.kv_cache.tier_mover import TierMover

__all__ = ["PENDING_TOKEN", "AllocateResult", "AppendResult", "BlockManager", "SwapInPlan",
           "SwapOutPlan"]


class BlockManager:
  """Tiered block manager: device blocks for running sequences, host blocks for the rest.

  State: `device_pool` and `host_pool` (BlockPool), the sequences `_seqs` (SeqState by
  id), and, in its parts, the host blocks pinned by this step's plans
  (`tier_mover.pinned_host_groups`) and held by the third tier (`tier_holds.held`);
  `prefix_cache` and `placement` own none.

  Invariants (checked by `check_invariants`):
  - both pools hold their own invariants (`BlockPool`);
  - a resident sequence holds cdiv(num_tokens, block_size) table entries, each a device
    block, except that an offloaded sequence (hot slots allocated) may hold the null
    block for a block with a host copy (dropped; the last block only when full); it also
    holds its `host_ids` (written-through host copies of its leading blocks) and
    `hot_slots`; a swapped-out sequence holds cdiv(num_tokens, block_size) host blocks
    and no device block;
  - a device block's ref_cnt equals the resident table entries and hot slots naming it;
    a host block's ref_cnt equals the swapped table entries and `host_ids` naming it
    plus the pins of this step's transfers and the third tier's holds;
  - the null block appears in no table otherwise;
  - a block carries a hash only once it is full and its KV is computed (or computed
    in the step that cached it), and the hash is that of the sequence's tokens up to
    it, so a prefix hit never changes what attention reads.
  """

  def __init__(
      self,
      num_device_blocks: int,
      num_host_blocks: int,
      block_size: int,
      *,
      enable_prefix_caching: bool = True,
  ):
    if block_size <= 0:
      raise ValueError(f"block_size must be positive, got {block_size}")
    self.block_size = block_size
    self.enable_prefix_caching = enable_prefix_caching
    self.device_pool = BlockPool(num_device_blocks, "device")
    self.host_pool = BlockPool(num_host_blocks, "pinned_host")
    self._seqs: dict[Hashable, SeqState] = {}
    self.prefix_cache = PrefixCache(self.device_pool, self.host_pool, block_size,
                                    enable_prefix_caching)
    self.tier_mover = TierMover(self.device_pool, self.host_pool, block_size,
                                self.prefix_cache)
    self.placement = HiSparsePlacement(self.device_pool, self.host_pool, block_size,
                                       self.tier_mover)
    self.tier_holds = TierHolds(self.device_pool, self.host_pool, enable_prefix_caching)

  @property
  def pools(self) -> dict[str, BlockPool]:
    """The two tiers by memory kind."""
    return {"device": self.device_pool, "pinned_host": self.host_pool}

  def check_invariants(self) -> None:
    """Raises AssertionError when a class invariant does not hold."""
    check_block_manager(self.device_pool, self.host_pool, self._seqs,
                        [*self.tier_mover.pinned_host_groups, *self.tier_holds.held.values()],
                        self.block_size, self.enable_prefix_caching)

  # --- Queries -------------------------------------------------------------------

  def __contains__(self, seq_id: Hashable) -> bool:
    return seq_id in self._seqs

  @property
  def seq_ids(self) -> list[Hashable]:
    return list(self._seqs)

  def _seq(self, seq_id: Hashable) -> SeqState:
    if seq_id not in self._seqs:
      raise ValueError(f"unknown sequence {seq_id!r}")
    return self._seqs[seq_id]

  def _resident(self, seq_id: Hashable) -> SeqState:
    seq = self._seq(seq_id)
    if seq.swapped:
      raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in first")
    return seq

  def num_tokens(self, seq_id: Hashable) -> int:
    return len(self._seq(seq_id).token_ids)

  def token_ids(self, seq_id: Hashable) -> list[int]:
    return list(self._seq(seq_id).token_ids)

  def is_swapped(self, seq_id: Hashable) -> bool:
    return self._seq(seq_id).swapped

  def num_cached_tokens(self, seq_id: Hashable) -> int:
    return self._seq(seq_id).num_cached_tokens

  def block_table(self, seq_id: Hashable) -> list[int]:
    """Device block ids of a resident sequence, in attention order (the null block 0
    for blocks an offloaded sequence dropped)."""
    return list(self._resident(seq_id).block_ids)

  def host_block_table(self, seq_id: Hashable) -> list[int]:
    """Host block ids of a swapped-out sequence, in attention order."""
    seq = self._seq(seq_id)
    if not seq.swapped:
      raise ValueError(f"sequence {seq_id!r} is resident on the device")
    return list(seq.block_ids)

  def num_table_blocks(self, seq_id: Hashable) -> int:
    """Entries of a resident sequence's device table (O(1))."""
    return len(self._resident(seq_id).block_ids)

  def block_tables(self, seq_ids: Sequence[Hashable], max_num_blocks: int) -> np.ndarray:
    """[num_seqs, max_num_blocks] int32 device tables, padded with the null block.

    Rows are copied from each sequence's numpy mirror (`SeqState.table_row`), so a step
    costs O(batch) Python work whatever the contexts' lengths."""
    tables = np.full((len(seq_ids), max_num_blocks), NULL_BLOCK_ID, dtype=np.int32)
    for row, seq_id in enumerate(seq_ids):
      table = self._resident(seq_id).table_row()
      if len(table) > max_num_blocks:
        raise ValueError(
            f"sequence {seq_id!r} has {len(table)} blocks > max_num_blocks={max_num_blocks}")
      tables[row, :len(table)] = table
    return tables

  def slot_ids(self, seq_id: Hashable, start: int, end: int) -> np.ndarray:
    """[end - start] int32 slots (block_id * block_size + offset) of token positions."""
    block_ids = self._resident(seq_id).block_ids
    positions = np.arange(start, end)
    if start < 0 or end > len(block_ids) * self.block_size:
      raise ValueError(f"positions [{start}, {end}) outside the blocks of {seq_id!r}")
    table = np.asarray(block_ids, dtype=np.int64)
    if np.any(table[positions // self.block_size] == NULL_BLOCK_ID):
      raise ValueError(f"positions [{start}, {end}) of {seq_id!r} fall in dropped blocks")
    return (table[positions // self.block_size] * self.block_size
            + positions % self.block_size).astype(np.int32)

  def _num_blocks(self, num_tokens: int) -> int:
    return -(-num_tokens // self.block_size)

  # --- New sequences -------------------------------------------------------------

  def can_allocate(self, token_ids: Sequence[int], extra_keys: tuple | None = None, *,
                   read_cache: bool = True, hashes: list[BlockHash] | None = None,
                   cache_salt: str | None = None) -> bool:
    """Whether `allocate` of this prompt would find enough device blocks. `hashes`: the
    prompt's full blocks' chained hashes if the caller keeps them (`prefix_cache.hashes`
    of these tokens, under `cache_salt`), so a prompt that waits is not hashed again
    every step."""
    cache = self.prefix_cache
    if read_cache and hashes is None:
      hashes = cache.hashes(token_ids, extra_keys, cache_salt)
    hits = cache.hits(hashes, len(token_ids), count=False) if read_cache else []
    device_hit_ids = [i for kind, i in hits if kind == "device"]
    need = cache.num_device_blocks_needed(self._num_blocks(len(token_ids)), device_hit_ids)
    return need <= self.device_pool.num_free_blocks

  def allocate(self, seq_id: Hashable, token_ids: Sequence[int],
               extra_keys: tuple | None = None, *,
               num_new_tokens: int | None = None, read_cache: bool = True,
               hashes: list[BlockHash] | None = None,
               cache_salt: str | None = None) -> AllocateResult:
    """Device blocks for a new sequence's prompt, reusing cached prefix blocks.

    Device hits are shared (ref_cnt += 1); host hits get a new device block and an
    entry in the returned swap-in plan. `num_new_tokens`: prompt tokens after the
    cached prefix whose KV this step computes (one chunk of a chunked prefill), None
    for all of them. Only blocks that are full within the cached prefix plus these
    tokens are cached for prefix hits: a later request must never hit a block whose KV
    is not computed yet. Call `cache_blocks` as the next chunks are scheduled.
    `read_cache` False: no prefix hits (the whole prompt is computed; its full blocks are
    still cached for later requests). `hashes`: as in `can_allocate`. `cache_salt`: the
    request's (vLLM's): it enters its first block's hash, so its blocks are hit only by
    requests of the same salt (kv_hash.salted_root).
    """
    if seq_id in self._seqs:
      raise ValueError(f"sequence {seq_id!r} already has blocks")
    if len(token_ids) == 0:
      raise ValueError(f"sequence {seq_id!r} has no tokens")
    token_ids = [int(t) for t in token_ids]
    if hashes is None:
      hashes = self.prefix_cache.hashes(token_ids, extra_keys, cache_salt)
    if not self.can_allocate(token_ids, extra_keys, read_cache=read_cache, hashes=hashes,
                             cache_salt=cache_salt):
      raise ValueError(
          f"cannot allocate {seq_id!r}: {self._num_blocks(len(token_ids))} blocks needed, "
          f"{self.device_pool.num_free_blocks} device blocks free")
    hits = self.prefix_cache.hits(hashes, len(token_ids), count=True) if read_cache else []
    num_blocks = self._num_blocks(len(token_ids))
    device_hit_ids = [i for kind, i in hits if kind == "device"]
    self.device_pool.touch(device_hit_ids)  # Before allocating, so they are not evicted.
    new_ids = iter(self.device_pool.allocate(num_blocks - len(device_hit_ids)))
    block_ids, host_src, device_dst = [], [], []
    for i in range(num_blocks):
      kind, hit_id = hits[i] if i < len(hits) else (None, None)
      if kind == "device":
        block_ids.append(hit_id)
        continue
      block_id = next(new_ids)
      block_ids.append(block_id)
      if kind == "pinned_host":
        host_src.append(hit_id)
        device_dst.append(block_id)
    self.tier_mover.pin_host_blocks(host_src[::-1], touch=True)  # Chain tail evicted first.
    num_cached_tokens = len(hits) * self.block_size
    seq = SeqState(token_ids, block_ids, [], extra_keys, num_cached_tokens=num_cached_tokens,
                   cache_salt=cache_salt)
    self._seqs[seq_id] = seq
    num_computed = len(token_ids) if num_new_tokens is None else num_new_tokens
    self.prefix_cache.cache_full_blocks(seq, num_cached_tokens + num_computed, hashes)
    return AllocateResult(
        block_ids=as_block_ids(block_ids),
        num_cached_tokens=num_cached_tokens,
        slot_ids=self.slot_ids(seq_id, num_cached_tokens, len(token_ids)),
        swap_in=SwapInPlan(as_block_ids(host_src), as_block_ids(device_dst)))

  # --- Decoding ------------------------------------------------------------------

  def _needs_new_block(self, seq: SeqState) -> bool:
    if len(seq.token_ids) % self.block_size == 0:
      return True
    return self.device_pool.ref_cnt(seq.block_ids[-1]) > 1  # Shared: copy-on-write.

  def can_append(self, seq_id: Hashable) -> bool:
    """Whether `append_slot` would find the device block it may need."""
    seq = self._resident(seq_id)
    return self.device_pool.num_free_blocks >= self._needs_new_block(seq)

  def append_slot(self, seq_id: Hashable, token_id: int) -> AppendResult:
    """Adds one token; a new block when the last is full, a private copy when shared."""
    seq = self._resident(seq_id)
    needs_block = self._needs_new_block(seq)
    if needs_block and self.device_pool.num_free_blocks < 1:
      raise ValueError(f"cannot append to {seq_id!r}: no free device block")
    position = len(seq.token_ids)
    copy = None
    if position % self.block_size == 0:
      seq.block_ids.extend(self.device_pool.allocate(1))
    elif needs_block:
      src_id = seq.block_ids[-1]
      (dst_id,) = self.device_pool.allocate(1)
      self.device_pool.free([src_id])
      seq.block_ids[-1] = dst_id
      seq.replaced_blocks()
      copy = (src_id, dst_id)
    if token_id == PENDING_TOKEN:
      if seq.pending is not None:
        raise ValueError(f"{seq_id!r} already has a pending token at {seq.pending}")
      seq.pending = position
    seq.token_ids.append(int(token_id))
    self.prefix_cache.cache_full_blocks(seq, len(seq.token_ids))
    slot_id = seq.block_ids[-1] * self.block_size + position % self.block_size
    return AppendResult(slot_id=slot_id, copy=copy)

  def blocks_to_extend(self, seq_id: Hashable, num_tokens: int) -> int:
    """Device blocks `extend` of `num_tokens` more tokens would allocate."""
    seq = self._resident(seq_id)
    return self._num_blocks(len(seq.token_ids) + num_tokens) - len(seq.block_ids)

  def extend(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
    """Appends known tokens (more of a prompt) and the device blocks they fill.

    A prompt longer than the device pool is allocated chunk by chunk (HiSparse streams
    its prefill: `allocate` of its first chunk's tokens, then `extend` before each next
    chunk, while its earlier blocks move to the host pool). The last block, if partly
    filled, is filled first; it is never shared then (a prefix hit is a full block, and
    a sequence forks only after its prefill).
    """
    seq = self._resident(seq_id)
    if seq.pending is not None:
      raise ValueError(f"cannot extend {seq_id!r}: it has a pending token")
    num_new = self.blocks_to_extend(seq_id, len(token_ids))
    if num_new > self.device_pool.num_free_blocks:
      raise ValueError(f"cannot extend {seq_id!r}: {num_new} blocks needed, "
                       f"{self.device_pool.num_free_blocks} device blocks free")
    if len(seq.token_ids) % self.block_size and self.device_pool.ref_cnt(seq.block_ids[-1]) > 1:
      raise ValueError(f"cannot extend {seq_id!r}: its last block is shared")
    seq.block_ids.extend(self.device_pool.allocate(num_new))
    seq.token_ids.extend(int(t) for t in token_ids)

  def pending_position(self, seq_id: Hashable) -> int | None:
    """Position of the sequence's pending token (None: none, or no such sequence)."""
    seq = self._seqs.get(seq_id)
    return None if seq is None else seq.pending

  def set_token(self, seq_id: Hashable, position: int, token_id: int) -> None:
    """Fills in the pending token at `position` (appended as PENDING_TOKEN) once it is
    known; its block is cached then if it is full (its K/V is computed by the step that
    was planned with it, which runs before any later step that could hit it)."""
    seq = self._seq(seq_id)
    if seq.pending != position:
      raise ValueError(f"{seq_id!r} has no pending token at {position} (pending: "
                       f"{seq.pending})")
    seq.token_ids[position] = int(token_id)
    seq.pending = None
    if not seq.swapped:
      self.prefix_cache.cache_full_blocks(seq, len(seq.token_ids))

  def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
    """The child shares all of the parent's device blocks (ref_cnt += 1 each)."""
    parent = self._resident(parent_id)
    if child_id in self._seqs:
      raise ValueError(f"sequence {child_id!r} already has blocks")
    if parent.offloaded:
      raise ValueError(f"sequence {parent_id!r} is offloaded (HiSparse); it cannot be forked")
    if parent.pending is not None:
      raise ValueError(f"sequence {parent_id!r} has a pending token; fork it once it is known")
    self.device_pool.touch(parent.block_ids)
    self._seqs[child_id] = SeqState(
        list(parent.token_ids), list(parent.block_ids), list(parent.block_hashes),
        parent.extra_keys, num_cached_tokens=parent.num_cached_tokens,
        cache_salt=parent.cache_salt)

  def free(self, seq_id: Hashable) -> None:
    """Drops a finished sequence's blocks, tail first (its full blocks stay cached)."""
    self._seq(seq_id)
    seq = self._seqs.pop(seq_id)
    if seq.swapped:
      self.host_pool.free(reversed(seq.block_ids))
      return
    self.device_pool.free(reversed(seq.hot_slots))
    self.device_pool.free(b for b in reversed(seq.block_ids) if b != NULL_BLOCK_ID)
    self.host_pool.free(reversed(seq.host_ids))

  # --- Prefix cache --------------------------------------------------------------

  def cache_blocks(self, seq_id: Hashable, num_computed_tokens: int) -> None:
    """Caches the full blocks within the first `num_computed_tokens` tokens.

    Call it when a prefill chunk that ends at `num_computed_tokens` is scheduled (its
    KV is written in that step's forward, before any later request reads it).
    Idempotent; blocks cached already stay cached.
    """
    self.prefix_cache.cache_full_blocks(self._resident(seq_id), num_computed_tokens)

  # --- The third tier (tier_holds.py; engine/tier_connector.py) --------------------

  def take_host_blocks(self, num_blocks: int) -> list[int]:
    """Host blocks a third-tier load writes into, held until released (TierHolds.take)."""
    return self.tier_holds.take(num_blocks)

  def release_host_blocks(self, host_ids: Sequence[int], hashes: Sequence[BlockHash] | None
                          ) -> None:
    """Drops a hold; verified loaded blocks stay CACHED (TierHolds.release)."""
    self.tier_holds.release(host_ids, hashes)

  def host_copies(self, hashes: Sequence[BlockHash]
                  ) -> tuple[list[int], np.ndarray, np.ndarray, list[int]]:
    """Held host blocks of a chain, for a third-tier store (TierHolds.copies)."""
    return self.tier_holds.copies(hashes)

  # --- Moves between tiers (tier_mover.py: the plan contract of one step) ---------

  def finish_step(self) -> None:
    """Releases the host blocks pinned by this step's plans (call after the forward)."""
    self.tier_mover.finish_step()

  def can_swap_out(self, seq_id: Hashable) -> bool:
    """Whether the host tier can take every block of the sequence now (blocks with a
    written-through host copy need none)."""
    return self.tier_mover.can_swap_out(self._resident(seq_id))

  def swap_out(self, seq_id: Hashable) -> SwapOutPlan:
    """Preempts a sequence by moving its blocks to the host; frees its device blocks.

    Full blocks whose hash the host tier already holds are shared, not copied, and
    written-through blocks keep their host copy. The freed device blocks keep their
    hashes (CACHED), so a quick return finds them.
    """
    seq = self._resident(seq_id)
    if not self.tier_mover.can_swap_out(seq):
      raise ValueError(
          f"cannot swap out {seq_id!r}: {len(seq.block_ids)} blocks, "
          f"{self.host_pool.num_free_blocks} host blocks free")
    return self.tier_mover.swap_out(seq)

  def _swapped(self, seq_id: Hashable) -> SeqState:
    seq = self._seq(seq_id)
    if not seq.swapped:
      raise ValueError(f"sequence {seq_id!r} is not swapped out")
    return seq

  def can_swap_in(self, seq_id: Hashable, hot_buffer_blocks: int = 0,
                  num_computed_tokens: int | None = None) -> bool:
    """Whether the device tier has the blocks to bring the sequence back now (with
    `hot_buffer_blocks`, only its blocks past the computed full ones, plus the slots)."""
    return self.tier_mover.can_swap_in(self._swapped(seq_id), hot_buffer_blocks,
                                       num_computed_tokens)

  def swap_in(self, seq_id: Hashable, hot_buffer_blocks: int = 0,
              num_computed_tokens: int | None = None) -> SwapInPlan:
    """Brings a swapped-out sequence back to device blocks before it runs again.

    Full blocks still cached on the device are reused without a copy. The host blocks
    stay pinned until `finish_step`, then become CACHED host blocks (full ones).
    With `hot_buffer_blocks` > 0 (a HiSparse sequence that decodes), the leading full
    blocks of its first `num_computed_tokens` tokens stay on the host as its host
    copies and it comes back offloaded, with that many hot-buffer slots.
    """
    seq = self._swapped(seq_id)
    if not self.tier_mover.can_swap_in(seq, hot_buffer_blocks, num_computed_tokens):
      raise ValueError(
          f"cannot swap in {seq_id!r}: {self.device_pool.num_free_blocks} device blocks free")
    return self.tier_mover.swap_in(seq, hot_buffer_blocks, num_computed_tokens)

  # --- HiSparse placement (hisparse_placement.py) ---------------------------------

  def is_offloaded(self, seq_id: Hashable) -> bool:
    """Whether a resident sequence has hot-buffer slots (and may have dropped blocks)."""
    return self._seq(seq_id).offloaded

  def host_copy_ids(self, seq_id: Hashable) -> list[int]:
    """Written-through host copies of a resident sequence's leading blocks."""
    return list(self._resident(seq_id).host_ids)

  def hot_slots(self, seq_id: Hashable) -> list[int]:
    """Device blocks of a resident sequence's hot buffer (empty unless offloaded)."""
    return list(self._resident(seq_id).hot_slots)

  def num_resident_blocks(self, seq_id: Hashable) -> int:
    """Device blocks a resident sequence holds (table entries that are not null, and
    hot slots)."""
    return self.placement.num_resident_blocks(self._resident(seq_id))

  def host_tables(self, seq_ids: Sequence[Hashable], max_num_blocks: int) -> np.ndarray:
    """[num_seqs, max_num_blocks] int32 host copies per logical block (0 = none)."""
    return self.placement.host_tables([self._resident(s) for s in seq_ids], max_num_blocks)

  def hot_slot_tables(self, seq_ids: Sequence[Hashable], num_slots: int) -> np.ndarray:
    """[num_seqs, num_slots] int32 hot-buffer device blocks (0 rows: not offloaded)."""
    seqs = [self._resident(s) for s in seq_ids]
    for seq_id, seq in zip(seq_ids, seqs):
      if len(seq.hot_slots) > num_slots:
        raise ValueError(f"sequence {seq_id!r} has {len(seq.hot_slots)} hot slots > "
                         f"{num_slots}")
    return self.placement.hot_slot_tables(seqs, num_slots)

  def write_through(self, seq_id: Hashable, num_computed_tokens: int) -> SwapOutPlan:
    """Host copies of the full blocks within the first `num_computed_tokens` tokens
    that have none yet, in order (a d2h plan for this step's first batch).

    A block whose hash the host tier holds is shared, not copied. Stops early when the
    host pool is full (the sequence then cannot drop those blocks). The caller passes
    the tokens computed by EARLIER steps: the copy runs before this step's forward.
    The new host blocks stay pinned until `finish_step`."""
    return self.placement.write_through(self._resident(seq_id), num_computed_tokens)

  def offload_gain(self, seq_id: Hashable, hot_buffer_blocks: int) -> int:
    """Device blocks `offload` would free, net of the hot-buffer slots it allocates."""
    return self.placement.offload_gain(self._resident(seq_id), hot_buffer_blocks)

  def offload(self, seq_id: Hashable, hot_buffer_blocks: int) -> int:
    """Drops the device copies of the sequence's written-through blocks (no write: the
    host holds them; the last block too when it is full) and gives it
    `hot_buffer_blocks` hot-buffer slots if it has none. Returns the net device blocks
    freed. The dropped blocks keep their hashes (CACHED)."""
    seq = self._resident(seq_id)
    if hot_buffer_blocks < 1:
      raise ValueError(f"hot_buffer_blocks must be >= 1, got {hot_buffer_blocks}")
    gain = self.placement.offload_gain(seq, hot_buffer_blocks)
    if self.device_pool.num_free_blocks + gain < 0:
      raise ValueError(f"cannot offload {seq_id!r}: no device blocks for its hot buffer")
    self.placement.offload(seq, hot_buffer_blocks)
    return gain

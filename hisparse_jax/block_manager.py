"""Block tables of sequences over two KV tiers, with prefix caching and swap plans.

This module owns which KV blocks each sequence holds: device block tables in
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
`hisparse_jax.block_pool`. Across tiers, a block's content moves:
- device -> host: `swap_out(seq)` (preemption by swapping, not recomputing) and
  `write_through(seq)` (HiSparse host copies, below);
- host -> device: `swap_in(seq)` and host-tier prefix hits in `allocate`.

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

HiSparse tiering (sequences that decode sparsely, hisparse_jax.resolver):

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

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from hisparse_jax.block_plans import (  # noqa: F401 (re-exported)
    AllocateResult,
    AppendResult,
    SwapInPlan,
    SwapOutPlan,
    as_block_ids,
)
from hisparse_jax.block_pool import BlockPool
from hisparse_jax.kv_hash import BlockHash, hash_full_blocks
from hisparse_jax.kv_pool import NULL_BLOCK_ID

# The token id of a slot appended before its token is known (the engine's steps overlap:
# a decode is planned while the token it computes is still being sampled); `set_token`
# fills it in. A block holding a pending token is not hashed (cached) until then.
PENDING_TOKEN = -1


@dataclasses.dataclass
class _SeqState:
  token_ids: list[int]
  block_ids: list[int]  # device ids when resident, host ids when swapped out
  block_hashes: list[BlockHash]  # one per full block whose KV is computed (and cached)
  extra_keys: tuple | None
  swapped: bool = False
  num_cached_tokens: int = 0
  # HiSparse (resident sequences only): host copy of each leading full, computed block
  # (written through; owned), and the device blocks of the hot buffer once offloaded.
  host_ids: list[int] = dataclasses.field(default_factory=list)
  hot_slots: list[int] = dataclasses.field(default_factory=list)
  # The numpy mirror of `block_ids` that step arrays are copied from (see `_table_row`):
  # `table_version` changes whenever an entry of `block_ids` is replaced (appends do not
  # change it); the mirror is valid for `mirror_version` and its first `mirror_len`
  # entries.
  pending: int | None = None  # position of the PENDING_TOKEN in token_ids, if any
  table_version: int = 0
  mirror: np.ndarray | None = None
  mirror_len: int = 0
  mirror_version: int = -1

  @property
  def offloaded(self) -> bool:
    return bool(self.hot_slots)

  def replaced_blocks(self) -> None:
    """Records that entries of `block_ids` were replaced (not just appended)."""
    self.table_version += 1


class BlockManager:
  """Tiered block manager: device blocks for running sequences, host blocks for the rest.

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
    plus the pins of this step's transfers;
  - the null block appears in no table otherwise;
  - a block carries a hash only once it is full and its KV is computed (or computed
    in the step that cached it), and the hash is that of the sequence's tokens up to
    it, so a prefix hit never changes what attention reads.
  Prefix lookups use the device tier first, then the host tier (so a host query is
  counted only for a device miss); hits stop at the first miss (hashes are chained)
  and never cover the last prompt token, which must be computed to produce logits.
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
    self._seqs: dict[Hashable, _SeqState] = {}
    self._pinned_host_groups: list[list[int]] = []

  @property
  def pools(self) -> dict[str, BlockPool]:
    """The two tiers by memory kind."""
    return {"device": self.device_pool, "pinned_host": self.host_pool}

  # --- Queries -------------------------------------------------------------------

  def __contains__(self, seq_id: Hashable) -> bool:
    return seq_id in self._seqs

  @property
  def seq_ids(self) -> list[Hashable]:
    return list(self._seqs)

  def _seq(self, seq_id: Hashable) -> _SeqState:
    if seq_id not in self._seqs:
      raise ValueError(f"unknown sequence {seq_id!r}")
    return self._seqs[seq_id]

  def _resident(self, seq_id: Hashable) -> _SeqState:
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
    seq = self._resident(seq_id)
    return sum(b != NULL_BLOCK_ID for b in seq.block_ids) + len(seq.hot_slots)

  def host_tables(self, seq_ids: Sequence[Hashable], max_num_blocks: int) -> np.ndarray:
    """[num_seqs, max_num_blocks] int32 host copies per logical block (0 = none)."""
    tables = np.full((len(seq_ids), max_num_blocks), NULL_BLOCK_ID, dtype=np.int32)
    for row, seq_id in enumerate(seq_ids):
      host_ids = self._resident(seq_id).host_ids[:max_num_blocks]
      tables[row, :len(host_ids)] = host_ids
    return tables

  def hot_slot_tables(self, seq_ids: Sequence[Hashable], num_slots: int) -> np.ndarray:
    """[num_seqs, num_slots] int32 hot-buffer device blocks (0 rows: not offloaded)."""
    tables = np.full((len(seq_ids), num_slots), NULL_BLOCK_ID, dtype=np.int32)
    for row, seq_id in enumerate(seq_ids):
      slots = self._resident(seq_id).hot_slots
      if len(slots) > num_slots:
        raise ValueError(f"sequence {seq_id!r} has {len(slots)} hot slots > {num_slots}")
      tables[row, :len(slots)] = slots
    return tables

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

    Rows are copied from each sequence's numpy mirror, so a step costs O(batch) Python
    work whatever the contexts' lengths."""
    tables = np.full((len(seq_ids), max_num_blocks), NULL_BLOCK_ID, dtype=np.int32)
    for row, seq_id in enumerate(seq_ids):
      table = self._table_row(self._resident(seq_id))
      if len(table) > max_num_blocks:
        raise ValueError(
            f"sequence {seq_id!r} has {len(table)} blocks > max_num_blocks={max_num_blocks}")
      tables[row, :len(table)] = table
    return tables

  @staticmethod
  def _table_row(seq: _SeqState) -> np.ndarray:
    """`seq.block_ids` as int32 numpy (a view of the mirror): entries appended since the
    last call are copied into it; a replaced entry (`table_version`) rewrites it."""
    n = len(seq.block_ids)
    mirror = seq.mirror
    if mirror is None or len(mirror) < n:
      grown = np.zeros(max(16, 2 * n), np.int32)
      if mirror is not None and seq.mirror_version == seq.table_version:
        grown[:seq.mirror_len] = mirror[:seq.mirror_len]
      seq.mirror = mirror = grown
    if seq.mirror_version != seq.table_version or seq.mirror_len > n:
      seq.mirror_len, seq.mirror_version = 0, seq.table_version
    if seq.mirror_len < n:
      mirror[seq.mirror_len:n] = seq.block_ids[seq.mirror_len:n]
      seq.mirror_len = n
    return mirror[:n]

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

  def _prefix_hits(self, hashes: list[BlockHash], num_tokens: int,
                   count: bool) -> list[tuple[str, int]]:
    """(memory_kind, block_id) of the longest cached prefix, device tier first."""
    hits = []
    for block_hash in hashes[:(num_tokens - 1) // self.block_size]:
      for pool in (self.device_pool, self.host_pool):
        lookup = pool.get_cached_block if count else pool.peek_cached_block
        block_id = lookup(block_hash)
        if block_id is not None:
          hits.append((pool.memory_kind, block_id))
          break
      else:
        break
    return hits

  def _hashes(self, token_ids: Sequence[int], extra_keys: tuple | None) -> list[BlockHash]:
    if not self.enable_prefix_caching:
      return []
    return hash_full_blocks(token_ids, self.block_size, extra_keys)

  def _num_device_blocks_needed(self, num_blocks: int, device_hit_ids: list[int]) -> int:
    # A hit on an OWNED block costs nothing; a hit on a CACHED block leaves the free
    # queue just as a new block would.
    return num_blocks - sum(self.device_pool.ref_cnt(i) > 0 for i in device_hit_ids)

  def can_allocate(self, token_ids: Sequence[int], extra_keys: tuple | None = None, *,
                   read_cache: bool = True) -> bool:
    """Whether `allocate` of this prompt would find enough device blocks."""
    hits = (self._prefix_hits(self._hashes(token_ids, extra_keys), len(token_ids), count=False)
            if read_cache else [])
    device_hit_ids = [i for kind, i in hits if kind == "device"]
    need = self._num_device_blocks_needed(self._num_blocks(len(token_ids)), device_hit_ids)
    return need <= self.device_pool.num_free_blocks

  def allocate(self, seq_id: Hashable, token_ids: Sequence[int],
               extra_keys: tuple | None = None, *,
               num_new_tokens: int | None = None, read_cache: bool = True) -> AllocateResult:
    """Device blocks for a new sequence's prompt, reusing cached prefix blocks.

    Device hits are shared (ref_cnt += 1); host hits get a new device block and an
    entry in the returned swap-in plan. `num_new_tokens`: prompt tokens after the
    cached prefix whose KV this step computes (one chunk of a chunked prefill), None
    for all of them. Only blocks that are full within the cached prefix plus these
    tokens are cached for prefix hits: a later request must never hit a block whose KV
    is not computed yet. Call `cache_blocks` as the next chunks are scheduled.
    `read_cache` False: no prefix hits (the whole prompt is computed; its full blocks are
    still cached for later requests).
    """
    if seq_id in self._seqs:
      raise ValueError(f"sequence {seq_id!r} already has blocks")
    if len(token_ids) == 0:
      raise ValueError(f"sequence {seq_id!r} has no tokens")
    token_ids = [int(t) for t in token_ids]
    hashes = self._hashes(token_ids, extra_keys)
    if not self.can_allocate(token_ids, extra_keys, read_cache=read_cache):
      raise ValueError(
          f"cannot allocate {seq_id!r}: {self._num_blocks(len(token_ids))} blocks needed, "
          f"{self.device_pool.num_free_blocks} device blocks free")
    hits = self._prefix_hits(hashes, len(token_ids), count=True) if read_cache else []
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
    self._pin_host_blocks(host_src[::-1], touch=True)  # Chain tail evicted first.
    num_cached_tokens = len(hits) * self.block_size
    seq = _SeqState(token_ids, block_ids, [], extra_keys, num_cached_tokens=num_cached_tokens)
    self._seqs[seq_id] = seq
    num_computed = len(token_ids) if num_new_tokens is None else num_new_tokens
    self._cache_full_blocks(seq, num_cached_tokens + num_computed, hashes)
    return AllocateResult(
        block_ids=as_block_ids(block_ids),
        num_cached_tokens=num_cached_tokens,
        slot_ids=self.slot_ids(seq_id, num_cached_tokens, len(token_ids)),
        swap_in=SwapInPlan(as_block_ids(host_src), as_block_ids(device_dst)))

  def cache_blocks(self, seq_id: Hashable, num_computed_tokens: int) -> None:
    """Caches the full blocks within the first `num_computed_tokens` tokens.

    Call it when a prefill chunk that ends at `num_computed_tokens` is scheduled (its
    KV is written in that step's forward, before any later request reads it).
    Idempotent; blocks cached already stay cached.
    """
    self._cache_full_blocks(self._resident(seq_id), num_computed_tokens)

  def _cache_full_blocks(self, seq: _SeqState, num_computed_tokens: int,
                         hashes: list[BlockHash] | None = None) -> None:
    if not self.enable_prefix_caching:
      return
    known = len(seq.token_ids) if seq.pending is None else seq.pending
    num_full = min(num_computed_tokens, known) // self.block_size
    start = len(seq.block_hashes)
    if num_full <= start:
      return
    if hashes is None:
      hashes = seq.block_hashes + hash_full_blocks(
          seq.token_ids[start * self.block_size:num_full * self.block_size], self.block_size,
          seq.extra_keys, seq.block_hashes[-1] if seq.block_hashes else None)
    for i in range(start, num_full):
      self.device_pool.cache_block(seq.block_ids[i], hashes[i])
    seq.block_hashes.extend(hashes[start:num_full])

  # --- Decoding ------------------------------------------------------------------

  def _needs_new_block(self, seq: _SeqState) -> bool:
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
    self._cache_full_blocks(seq, len(seq.token_ids))
    slot_id = seq.block_ids[-1] * self.block_size + position % self.block_size
    return AppendResult(slot_id=slot_id, copy=copy)

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
      self._cache_full_blocks(seq, len(seq.token_ids))

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
    self._seqs[child_id] = _SeqState(
        list(parent.token_ids), list(parent.block_ids), list(parent.block_hashes),
        parent.extra_keys, num_cached_tokens=parent.num_cached_tokens)

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

  # --- Moves between tiers -------------------------------------------------------

  def _pin_host_blocks(self, host_ids: Sequence[int], touch: bool) -> None:
    """Holds host blocks until `finish_step`; `host_ids` in eviction order."""
    if touch:
      self.host_pool.touch(host_ids)
    if host_ids:
      self._pinned_host_groups.append(list(host_ids))

  def finish_step(self) -> None:
    """Releases the host blocks pinned by this step's plans (call after the forward)."""
    for group in self._pinned_host_groups:
      self.host_pool.free(group)
    self._pinned_host_groups.clear()

  def _hits_in(self, pool: BlockPool, seq: _SeqState) -> list[int | None]:
    """Per block of `seq`: the block of `pool` holding its hash, or None."""
    hashes = seq.block_hashes
    return [pool.peek_cached_block(hashes[i]) if i < len(hashes) else None
            for i in range(len(seq.block_ids))]

  def _num_needed_in(self, pool: BlockPool, seq: _SeqState) -> int:
    return sum(h is None or pool.ref_cnt(h) == 0 for h in self._hits_in(pool, seq))

  def _move(self, seq: _SeqState, dst_pool: BlockPool) -> tuple[list[int], list[int], list[int]]:
    """New table of `seq` in `dst_pool`, and the (src, dst) ids of the blocks to copy.

    Full blocks whose hash `dst_pool` holds are shared there, not copied; the others get
    new blocks that take over their hashes.
    """
    hits = self._hits_in(dst_pool, seq)
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
  def _tail(seq: _SeqState, start: int) -> _SeqState:
    """A view of `seq` from block `start` on, for `_move` (which reads ids and hashes)."""
    return _SeqState([], seq.block_ids[start:], seq.block_hashes[start:], seq.extra_keys)

  def can_swap_out(self, seq_id: Hashable) -> bool:
    """Whether the host tier can take every block of the sequence now (blocks with a
    written-through host copy need none)."""
    seq = self._resident(seq_id)
    tail = self._tail(seq, len(seq.host_ids))
    return self._num_needed_in(self.host_pool, tail) <= self.host_pool.num_free_blocks

  def swap_out(self, seq_id: Hashable) -> SwapOutPlan:
    """Preempts a sequence by moving its blocks to the host; frees its device blocks.

    Full blocks whose hash the host tier already holds are shared, not copied, and
    written-through blocks keep their host copy. The freed device blocks keep their
    hashes (CACHED), so a quick return finds them.
    """
    seq = self._resident(seq_id)
    if not self.can_swap_out(seq_id):
      raise ValueError(
          f"cannot swap out {seq_id!r}: {len(seq.block_ids)} blocks, "
          f"{self.host_pool.num_free_blocks} host blocks free")
    num_copied = len(seq.host_ids)
    host_tail, device_src, host_dst = self._move(self._tail(seq, num_copied), self.host_pool)
    # Pinned too: if the sequence is freed in this step, its host blocks must not be
    # written by a second transfer of the same batch.
    self._pin_host_blocks(host_dst[::-1], touch=True)
    self.device_pool.free(reversed(seq.hot_slots))
    self.device_pool.free(b for b in reversed(seq.block_ids) if b != NULL_BLOCK_ID)
    seq.block_ids = seq.host_ids + host_tail
    seq.replaced_blocks()
    seq.host_ids, seq.hot_slots = [], []
    seq.swapped = True
    return SwapOutPlan(as_block_ids(device_src), as_block_ids(host_dst))

  def _num_kept_on_host(self, seq: _SeqState, hot_buffer_blocks: int,
                        num_computed_tokens: int | None) -> int:
    if hot_buffer_blocks <= 0:
      return 0
    if num_computed_tokens is None:
      raise ValueError("a swap-in with a hot buffer needs num_computed_tokens")
    # Leading full, computed blocks stay on the host (all of them when every block is
    # full: the next token opens a new block).
    return min(num_computed_tokens // self.block_size, len(seq.block_ids))

  def can_swap_in(self, seq_id: Hashable, hot_buffer_blocks: int = 0,
                  num_computed_tokens: int | None = None) -> bool:
    """Whether the device tier has the blocks to bring the sequence back now (with
    `hot_buffer_blocks`, only its blocks past the computed full ones, plus the slots)."""
    seq = self._seq(seq_id)
    if not seq.swapped:
      raise ValueError(f"sequence {seq_id!r} is not swapped out")
    keep = self._num_kept_on_host(seq, hot_buffer_blocks, num_computed_tokens)
    needed = self._num_needed_in(self.device_pool, self._tail(seq, keep))
    return needed + (hot_buffer_blocks if keep else 0) <= self.device_pool.num_free_blocks

  def swap_in(self, seq_id: Hashable, hot_buffer_blocks: int = 0,
              num_computed_tokens: int | None = None) -> SwapInPlan:
    """Brings a swapped-out sequence back to device blocks before it runs again.

    Full blocks still cached on the device are reused without a copy. The host blocks
    stay pinned until `finish_step`, then become CACHED host blocks (full ones).
    With `hot_buffer_blocks` > 0 (a HiSparse sequence that decodes), the leading full
    blocks of its first `num_computed_tokens` tokens stay on the host as its host
    copies and it comes back offloaded, with that many hot-buffer slots.
    """
    if not self.can_swap_in(seq_id, hot_buffer_blocks, num_computed_tokens):
      raise ValueError(
          f"cannot swap in {seq_id!r}: {self.device_pool.num_free_blocks} device blocks free")
    seq = self._seqs[seq_id]
    keep = self._num_kept_on_host(seq, hot_buffer_blocks, num_computed_tokens)
    device_tail, host_src, device_dst = self._move(self._tail(seq, keep), self.device_pool)
    self._pin_host_blocks(seq.block_ids[keep:][::-1], touch=False)  # Its refs become pins.
    seq.host_ids = seq.block_ids[:keep]
    seq.hot_slots = self.device_pool.allocate(hot_buffer_blocks) if keep else []
    seq.block_ids = [NULL_BLOCK_ID] * keep + device_tail
    seq.replaced_blocks()
    seq.swapped = False
    return SwapInPlan(as_block_ids(host_src), as_block_ids(device_dst))

  # --- HiSparse: write-through and offload ---------------------------------------

  def write_through(self, seq_id: Hashable, num_computed_tokens: int) -> SwapOutPlan:
    """Host copies of the full blocks within the first `num_computed_tokens` tokens
    that have none yet, in order (a d2h plan for this step's first batch).

    A block whose hash the host tier holds is shared, not copied. Stops early when the
    host pool is full (the sequence then cannot drop those blocks). The caller passes
    the tokens computed by EARLIER steps: the copy runs before this step's forward.
    The new host blocks stay pinned until `finish_step`."""
    seq = self._resident(seq_id)
    num_full = min(num_computed_tokens, len(seq.token_ids)) // self.block_size
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
    self._pin_host_blocks(host_dst[::-1], touch=True)
    return SwapOutPlan(as_block_ids(device_src), as_block_ids(host_dst))

  def _droppable(self, seq: _SeqState) -> list[int]:
    """Table indices of resident blocks with a host copy (full and computed, so never a
    block the next token is written into)."""
    return [i for i in range(len(seq.host_ids)) if seq.block_ids[i] != NULL_BLOCK_ID]

  def offload_gain(self, seq_id: Hashable, hot_buffer_blocks: int) -> int:
    """Device blocks `offload` would free, net of the hot-buffer slots it allocates."""
    seq = self._resident(seq_id)
    freed = sum(self.device_pool.ref_cnt(seq.block_ids[i]) == 1 for i in self._droppable(seq))
    return freed - (0 if seq.offloaded else hot_buffer_blocks)

  def offload(self, seq_id: Hashable, hot_buffer_blocks: int) -> int:
    """Drops the device copies of the sequence's written-through blocks (no write: the
    host holds them; the last block too when it is full) and gives it
    `hot_buffer_blocks` hot-buffer slots if it has none. Returns the net device blocks
    freed. The dropped blocks keep their hashes (CACHED)."""
    seq = self._resident(seq_id)
    if hot_buffer_blocks < 1:
      raise ValueError(f"hot_buffer_blocks must be >= 1, got {hot_buffer_blocks}")
    gain = self.offload_gain(seq_id, hot_buffer_blocks)
    if self.device_pool.num_free_blocks + gain < 0:
      raise ValueError(f"cannot offload {seq_id!r}: no device blocks for its hot buffer")
    drop = self._droppable(seq)
    self.device_pool.free(seq.block_ids[i] for i in reversed(drop))
    for i in drop:
      seq.block_ids[i] = NULL_BLOCK_ID
    seq.replaced_blocks()
    if not seq.offloaded:
      seq.hot_slots = self.device_pool.allocate(hot_buffer_blocks)
    return gain

  # --- Checks --------------------------------------------------------------------

  def check_invariants(self) -> None:
    """Raises AssertionError when a class invariant does not hold."""
    self.device_pool.check_invariants()
    self.host_pool.check_invariants()
    refs = {"device": np.zeros(self.device_pool.num_blocks, np.int64),
            "pinned_host": np.zeros(self.host_pool.num_blocks, np.int64)}
    for group in self._pinned_host_groups:
      np.add.at(refs["pinned_host"], group, 1)
    for seq_id, seq in self._seqs.items():
      assert len(seq.block_ids) == self._num_blocks(len(seq.token_ids)), seq_id
      if seq.mirror is not None and seq.mirror_version == seq.table_version:
        # The numpy mirror of the table is stale only where `_table_row` re-syncs it.
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
        assert seq.block_ids[-1] != NULL_BLOCK_ID or (
            len(seq.token_ids) % self.block_size == 0), seq_id
        assert len(seq.host_ids) <= len(seq.token_ids) // self.block_size, seq_id
        resident = [b for b in seq.block_ids if b != NULL_BLOCK_ID]
        np.add.at(refs["device"], resident + seq.hot_slots, 1)
        np.add.at(refs["pinned_host"], seq.host_ids, 1)
      if self.enable_prefix_caching:
        assert seq.block_hashes == hash_full_blocks(
            seq.token_ids, self.block_size, seq.extra_keys)[:len(seq.block_hashes)], seq_id
        pool = self.host_pool if seq.swapped else self.device_pool
        for block_id, block_hash in zip(seq.block_ids, seq.block_hashes):
          if block_id != NULL_BLOCK_ID:
            assert pool.block_hash(block_id) == block_hash, (seq_id, block_id)
        for host_id, block_hash in zip(seq.host_ids, seq.block_hashes):
          assert self.host_pool.block_hash(host_id) == block_hash, (seq_id, host_id)
    for kind, pool in self.pools.items():
      actual = [pool.ref_cnt(i) for i in range(pool.num_blocks)]
      assert actual == refs[kind].tolist(), (kind, actual, refs[kind].tolist())

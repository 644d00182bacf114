"""Block ids of one KV memory tier: ref counts, the free queue, the prefix-cache map.

This module owns the host-side bookkeeping of ONE pool of KV blocks (one memory
kind: "device" or "pinned_host"). It decides which block ids are handed out and
which cached block a prefix maps to; it never touches the pool arrays themselves.

A block's life in one tier:

             allocate (ref_cnt=1)              free, ref_cnt -> 0, no hash
    FREE ----------------------------> OWNED ---------------------------> FREE
     ^                                 |  ^
     | reused by allocate:             |  | touch (prefix hit), ref_cnt += 1
     | hash evicted (lazy eviction)    v  |
     +------------------------------ CACHED   (ref_cnt == 0, keeps its hash,
                                               waits in the free queue)

  free queue (LRU, O(1) remove):  head -> [evicted first] ... [evicted last] <- tail
      allocate pops the head; free appends at the tail; a prefix hit on a CACHED
      block removes it from the middle. Callers free a sequence's blocks in reverse
      order, so the tail of a prefix chain is evicted before its head.

Two tiers of one engine, each with its own BlockPool:

    device pool   [0=null][ 1 ][ 2 ] ...      memory_kind="device"
                      ^ swap_in (host -> device)   | swap_out (device -> host)
    host pool     [0=null][ 1 ][ 2 ] ...      memory_kind="pinned_host"

Both tiers reserve block 0 as the null block by default. On the device it pads
block tables. On the host it is the harmless target of padded entries when a
batched transfer is padded to a fixed size (a scatter with a padding id pointing at
a real block would overwrite it). It costs one block per tier.
"""

from __future__ import annotations

from collections.abc import Iterable

from hisparse_jax.kv_cache.kv_hash import BlockHash
from hisparse_jax.kv_cache.kv_pool import MEMORY_KINDS, NULL_BLOCK_ID


class _Block:
  """One block's metadata; also a node of the free queue's doubly linked list."""

  __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

  def __init__(self, block_id: int):
    self.block_id = block_id
    self.ref_cnt = 0
    self.block_hash: BlockHash | None = None
    self.prev_free: _Block | None = None
    self.next_free: _Block | None = None


class _FreeBlockQueue:
  """Doubly linked list of free blocks in eviction order, O(1) popleft/append/remove.

  Invariant: a block is linked iff its ref_cnt is 0 (null block excluded).
  """

  def __init__(self, blocks: list[_Block]):
    self._head = _Block(-1)  # Sentinels: never handed out.
    self._tail = _Block(-1)
    self._head.next_free = self._tail
    self._tail.prev_free = self._head
    self.num_free_blocks = 0
    for block in blocks:
      self.append(block)

  def popleft(self) -> _Block:
    block = self._head.next_free
    if block is self._tail:
      raise ValueError("no free block to pop")
    self.remove(block)
    return block

  def remove(self, block: _Block) -> None:
    if block.prev_free is None or block.next_free is None:
      raise ValueError(f"block {block.block_id} is not in the free queue")
    block.prev_free.next_free = block.next_free
    block.next_free.prev_free = block.prev_free
    block.prev_free = block.next_free = None
    self.num_free_blocks -= 1

  def append(self, block: _Block) -> None:
    if block.prev_free is not None:
      raise ValueError(f"block {block.block_id} is already in the free queue")
    last = self._tail.prev_free
    last.next_free = block
    block.prev_free = last
    block.next_free = self._tail
    self._tail.prev_free = block
    self.num_free_blocks += 1

  def block_ids(self) -> list[int]:
    """Free block ids, the next to be handed out first."""
    ids = []
    block = self._head.next_free
    while block is not self._tail:
      ids.append(block.block_id)
      block = block.next_free
    return ids


class BlockPool:
  """Block ids of one memory tier, with ref counts and a lazily evicted prefix cache.

  Invariants (checked by `check_invariants`):
  - every block except the null block is exactly one of FREE (ref_cnt 0, no hash),
    CACHED (ref_cnt 0, keeps a hash) or OWNED (ref_cnt > 0); FREE and CACHED blocks
    are the free queue, so num_free + num_owned = num_usable_blocks;
  - the null block is never handed out, never freed, never cached;
  - ref counts never go below zero (freeing a block with ref_cnt 0 raises);
  - only full blocks carry a hash, and `hash -> block` lists exactly the blocks that
    carry a hash; a CACHED block's hash is dropped when the block is reused.
  Duplicates are allowed: two blocks may carry the same hash (block tables are
  append-only, so a block that becomes full is not swapped for an equal cached one);
  lookups return the first one cached.
  """

  def __init__(self, num_blocks: int, memory_kind: str, *, reserve_null_block: bool = True):
    if memory_kind not in MEMORY_KINDS:
      raise ValueError(f"memory_kind must be one of {MEMORY_KINDS}, got {memory_kind!r}")
    min_blocks = 2 if reserve_null_block else 1
    if num_blocks < min_blocks:
      raise ValueError(
          f"a {memory_kind} pool needs at least {min_blocks} blocks, got {num_blocks}")
    self.num_blocks = num_blocks
    self.memory_kind = memory_kind
    self._blocks = [_Block(i) for i in range(num_blocks)]
    self.null_block_id: int | None = NULL_BLOCK_ID if reserve_null_block else None
    first = NULL_BLOCK_ID + 1 if reserve_null_block else 0
    self._free_queue = _FreeBlockQueue(self._blocks[first:])
    self._hash_to_blocks: dict[BlockHash, dict[int, _Block]] = {}
    self._num_owned_blocks = 0
    self._num_cached_blocks = 0  # ref_cnt 0 with a hash; kept O(1) for per-step metrics.
    # Prefix-cache lookups in this tier, counted in blocks (plain ints; the engine
    # exports them as metrics).
    self.prefix_cache_queries = 0
    self.prefix_cache_hits = 0
    # Called as on_evict(block_id, hash) when `allocate` reuses a CACHED block, before its
    # hash is dropped (a write-back third tier stores the block then; its content is
    # intact until a transfer dispatched after this call overwrites it).
    self.on_evict = None

  # --- Usage figures -------------------------------------------------------------

  @property
  def num_usable_blocks(self) -> int:
    return self.num_blocks - (self.null_block_id is not None)

  @property
  def num_free_blocks(self) -> int:
    """Blocks that `allocate` can hand out now: FREE plus CACHED."""
    return self._free_queue.num_free_blocks

  @property
  def num_used_blocks(self) -> int:
    """OWNED blocks (ref_cnt > 0)."""
    return self._num_owned_blocks

  @property
  def num_cached_blocks(self) -> int:
    """CACHED blocks: ref_cnt 0 but still holding a prefix hash (evictable)."""
    return self._num_cached_blocks

  @property
  def usage(self) -> float:
    """Fraction of usable blocks that are OWNED, in [0, 1]."""
    return self._num_owned_blocks / self.num_usable_blocks

  def ref_cnt(self, block_id: int) -> int:
    return self._blocks[block_id].ref_cnt

  def block_hash(self, block_id: int) -> BlockHash | None:
    return self._blocks[block_id].block_hash

  def free_block_ids(self) -> list[int]:
    """Free queue in eviction order (the next block `allocate` hands out first)."""
    return self._free_queue.block_ids()

  # --- Prefix cache --------------------------------------------------------------

  def get_cached_block(self, block_hash: BlockHash) -> int | None:
    """The block holding `block_hash` (OWNED or CACHED), or None; counts a query."""
    self.prefix_cache_queries += 1
    block_id = self.peek_cached_block(block_hash)
    if block_id is not None:
      self.prefix_cache_hits += 1
    return block_id

  def peek_cached_block(self, block_hash: BlockHash) -> int | None:
    """Like `get_cached_block` but not counted as a prefix-cache query."""
    blocks = self._hash_to_blocks.get(block_hash)
    return next(iter(blocks)) if blocks else None

  def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
    """Registers a full OWNED block under `block_hash` for later prefix hits."""
    block = self._blocks[block_id]
    if block.ref_cnt <= 0:
      raise ValueError(f"{self.memory_kind} block {block_id} is not owned; cannot cache it")
    if block.block_hash is not None:
      if block.block_hash != block_hash:
        raise ValueError(f"{self.memory_kind} block {block_id} already has another hash")
      return
    block.block_hash = block_hash
    self._hash_to_blocks.setdefault(block_hash, {})[block_id] = block

  def _evict_hash(self, block: _Block) -> None:
    if block.block_hash is None:
      return
    if block.ref_cnt == 0:
      self._num_cached_blocks -= 1
    blocks = self._hash_to_blocks[block.block_hash]
    del blocks[block.block_id]
    if not blocks:
      del self._hash_to_blocks[block.block_hash]
    block.block_hash = None

  # --- Allocation ----------------------------------------------------------------

  def allocate(self, num_blocks: int) -> list[int]:
    """Hands out `num_blocks` blocks from the head of the free queue, ref_cnt 1 each.

    A CACHED block that is handed out loses its hash (lazy eviction).
    """
    if num_blocks > self.num_free_blocks:
      raise ValueError(
          f"cannot allocate {num_blocks} {self.memory_kind} blocks: "
          f"{self.num_free_blocks} free")
    block_ids = []
    for _ in range(num_blocks):
      block = self._free_queue.popleft()
      if block.block_hash is not None and self.on_evict is not None:
        self.on_evict(block.block_id, block.block_hash)  # (before its content is reused)
      self._evict_hash(block)  # Lazy eviction: only now does a CACHED block lose its hash.
      block.ref_cnt = 1
      block_ids.append(block.block_id)
    self._num_owned_blocks += num_blocks
    return block_ids

  def touch(self, block_ids: Iterable[int]) -> None:
    """Adds one reference to each block; a CACHED block leaves the free queue."""
    for block_id in block_ids:
      if block_id == self.null_block_id:
        raise ValueError("the null block cannot be referenced")
      block = self._blocks[block_id]
      if block.ref_cnt == 0:
        self._free_queue.remove(block)
        self._num_owned_blocks += 1
        self._num_cached_blocks -= block.block_hash is not None
      block.ref_cnt += 1

  def free(self, block_ids: Iterable[int]) -> None:
    """Drops one reference from each block, in the given eviction order.

    Blocks reaching ref_cnt 0 join the tail of the free queue in that order; those
    with a hash stay CACHED until reused. Pass a sequence's blocks reversed so the
    tail of its prefix chain is evicted first.
    """
    for block_id in block_ids:
      if block_id == self.null_block_id:
        raise ValueError("the null block cannot be freed")
      block = self._blocks[block_id]
      if block.ref_cnt <= 0:
        raise ValueError(f"{self.memory_kind} block {block_id} freed with ref_cnt 0")
      block.ref_cnt -= 1
      if block.ref_cnt == 0:
        self._free_queue.append(block)
        self._num_owned_blocks -= 1
        self._num_cached_blocks += block.block_hash is not None

  def evict(self, block_id: int) -> bool:
    """Drops the hash of a CACHED block (it stays free); True if it had one."""
    block = self._blocks[block_id]
    if block.ref_cnt != 0:
      raise ValueError(f"{self.memory_kind} block {block_id} is owned; cannot evict it")
    had_hash = block.block_hash is not None
    self._evict_hash(block)
    return had_hash

  def cached_block_ids_lru(self) -> list[int]:
    """CACHED blocks in eviction order (coldest first)."""
    return [i for i in self.free_block_ids() if self._blocks[i].block_hash is not None]

  # --- Checks --------------------------------------------------------------------

  def check_invariants(self) -> None:
    """Raises AssertionError when a class invariant does not hold."""
    kind = self.memory_kind
    free_ids = self.free_block_ids()
    assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks, kind
    free_set = set(free_ids)
    num_owned = 0
    for block in self._blocks:
      assert block.ref_cnt >= 0, (kind, block.block_id, block.ref_cnt)
      if block.block_id == self.null_block_id:
        assert block.ref_cnt == 0 and block.block_hash is None, (kind, "null block used")
        assert block.block_id not in free_set, (kind, "null block in free queue")
        continue
      if block.ref_cnt > 0:
        num_owned += 1
        assert block.block_id not in free_set, (kind, block.block_id, "owned but free")
      else:
        assert block.block_id in free_set, (kind, block.block_id, "lost: not owned, not free")
      if block.block_hash is not None:
        assert self._hash_to_blocks[block.block_hash][block.block_id] is block, kind
    assert num_owned == self._num_owned_blocks, (kind, num_owned, self._num_owned_blocks)
    num_cached = sum(b.ref_cnt == 0 and b.block_hash is not None for b in self._blocks)
    assert num_cached == self._num_cached_blocks, (kind, num_cached, self._num_cached_blocks)
    assert num_owned + len(free_ids) == self.num_usable_blocks, kind
    num_hashed = sum(len(blocks) for blocks in self._hash_to_blocks.values())
    assert num_hashed == sum(b.block_hash is not None for b in self._blocks), kind

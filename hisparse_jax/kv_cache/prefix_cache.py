"""Prefix caching over both tiers: chained block hashes, lookups, caching full blocks.

Idioms (vLLM v1's): only full blocks whose KV is computed carry a hash, chained from the
first block, so a hit never changes what attention reads; a block holding a pending
token is hashed once its token is known. Lookups use the device tier first, then the
host tier (so a host query is counted only for a device miss); hits stop at the first
miss (hashes are chained) and never cover the last prompt token, which must be computed
to produce logits.
"""

from __future__ import annotations

from collections.abc import Sequence

from hisparse_jax.kv_cache.block_pool import BlockPool
from hisparse_jax.kv_cache.kv_hash import BlockHash, hash_full_blocks
from hisparse_jax.kv_cache.seq_state import SeqState


class PrefixCache:
  """Prefix-cache lookups and caching over a device and a host `BlockPool`.

  It owns no state of its own: a block's hash lives in its tier's `BlockPool` (hash ->
  block id, LRU eviction there) and a sequence's hashes in its `SeqState.block_hashes`.
  Disabled (`enabled=False`): no hashes, no hits, nothing cached.
  """

  def __init__(self, device_pool: BlockPool, host_pool: BlockPool, block_size: int,
               enabled: bool = True):
    self.device_pool = device_pool
    self.host_pool = host_pool
    self.block_size = block_size
    self.enabled = enabled

  def hashes(self, token_ids: Sequence[int], extra_keys: tuple | None,
             cache_salt: str | None = None) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` ([] when disabled); `cache_salt`
    enters the first block's (kv_hash.salted_root)."""
    if not self.enabled:
      return []
    return hash_full_blocks(token_ids, self.block_size, extra_keys, cache_salt=cache_salt)

  def hits(self, hashes: list[BlockHash], num_tokens: int,
           count: bool) -> list[tuple[str, int]]:
    """(memory_kind, block_id) of the longest cached prefix, device tier first (`count`:
    the lookups count as queries and hits in the pools' statistics)."""
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

  def num_device_blocks_needed(self, num_blocks: int, device_hit_ids: list[int]) -> int:
    """Free device blocks a sequence of `num_blocks` blocks takes, given its device hits.
    A hit on an OWNED block costs nothing; a hit on a CACHED block leaves the free queue
    just as a new block would."""
    return num_blocks - sum(self.device_pool.ref_cnt(i) > 0 for i in device_hit_ids)

  def cache_full_blocks(self, seq: SeqState, num_computed_tokens: int,
                        hashes: list[BlockHash] | None = None) -> None:
    """Caches the sequence's full blocks within its first `num_computed_tokens` tokens
    (those whose tokens are known) in the device tier; idempotent."""
    if not self.enabled:
      return
    known = len(seq.token_ids) if seq.pending is None else seq.pending
    num_full = min(num_computed_tokens, known) // self.block_size
    start = len(seq.block_hashes)
    if num_full <= start:
      return
    if hashes is None:
      hashes = seq.block_hashes + hash_full_blocks(
          seq.token_ids[start * self.block_size:num_full * self.block_size], self.block_size,
          seq.extra_keys, seq.block_hashes[-1] if seq.block_hashes else None,
          cache_salt=seq.cache_salt)
    for i in range(start, num_full):
      self.device_pool.cache_block(seq.block_ids[i], hashes[i])
    seq.block_hashes.extend(hashes[start:num_full])

  @staticmethod
  def hits_in(pool: BlockPool, seq: SeqState) -> list[int | None]:
    """Per block of `seq`: the block of `pool` holding its hash, or None."""
    hashes = seq.block_hashes
    return [pool.peek_cached_block(hashes[i]) if i < len(hashes) else None
            for i in range(len(seq.block_ids))]

  def num_needed_in(self, pool: BlockPool, seq: SeqState) -> int:
    """Free blocks of `pool` that moving `seq` there takes (hits on owned blocks are
    shared)."""
    return sum(h is None or pool.ref_cnt(h) == 0 for h in self.hits_in(pool, seq))

"""The host blocks the third KV tier holds outside any sequence (engine/tier_connector.py):
blocks a load from disk or a remote server writes into, and the host copies a store
reads from, each held by one reference until the load or store is done. A part of the
BlockManager (`BlockManager.tier_holds`), as prefix_cache.py, tier_mover.py and
hisparse_placement.py are; the BlockManager's take_host_blocks / release_host_blocks /
host_copies call it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hisparse_jax.kv_cache.block_pool import BlockPool
from hisparse_jax.kv_cache.kv_hash import BlockHash


class TierHolds:
  """Host blocks held for the third tier, over the BlockManager's two `BlockPool`s.

  State: `held` (first host id -> the host ids of one load in flight), one reference on
  each block, so neither eviction nor a sequence takes a block a transfer still uses.
  Invariant (check_block_manager counts them): a held host block's ref_cnt includes its
  hold. A store's host copies (`copies`) hold their reference until `release` too.
  Released blocks of a verified load become CACHED host blocks under their hashes (host
  prefix hits), unless the host tier holds the hash already.
  """

  def __init__(self, device_pool: BlockPool, host_pool: BlockPool,
               enable_prefix_caching: bool = True):
    self.device_pool = device_pool
    self.host_pool = host_pool
    self.enable_prefix_caching = enable_prefix_caching
    self.held: dict[int, list[int]] = {}

  def take(self, num_blocks: int) -> list[int]:
    """Up to `num_blocks` host blocks (fewer when fewer are free) for a third-tier load to
    write into, held (`held`) until `release`."""
    host_ids = self.host_pool.allocate(min(num_blocks, self.host_pool.num_free_blocks))
    if host_ids:
      self.held[host_ids[0]] = host_ids
    return host_ids

  def release(self, host_ids: Sequence[int], hashes: Sequence[BlockHash] | None) -> None:
    """Drops the hold on `host_ids` (from `take` or `copies`); the first
    len(hashes) of them hold those blocks' verified KV and stay CACHED under their
    hashes (as host prefix hits), unless the host tier holds the hash already."""
    if not host_ids:
      return
    self.held.pop(host_ids[0], None)
    if hashes and self.enable_prefix_caching:
      for block_id, block_hash in zip(host_ids, hashes):
        if (self.host_pool.block_hash(block_id) is None
            and self.host_pool.peek_cached_block(block_hash) is None):
          self.host_pool.cache_block(block_id, block_hash)
    self.host_pool.free(reversed(list(host_ids)))  # the chain's tail evicted first

  def copies(self, hashes: Sequence[BlockHash]
             ) -> tuple[list[int], np.ndarray, np.ndarray, list[int]]:
    """Host blocks holding the blocks of `hashes` (a chain), for a third-tier store:
    (host ids, each held until `release(host_ids, None)`; device ids and new
    host ids of the d2h copies the caller must dispatch first; the indices into `hashes`
    found). A block the host tier holds is shared; one only the device holds gets a new
    host block, CACHED under its hash once released. Stops at the first block in neither
    tier or when the host pool has no free block."""
    host_ids, device_ids, copy_ids, found = [], [], [], []
    for j, block_hash in enumerate(hashes):
      host_id = self.host_pool.peek_cached_block(block_hash)
      if host_id is not None:
        self.host_pool.touch([host_id])
      else:
        device_id = self.device_pool.peek_cached_block(block_hash)
        if device_id is None or self.host_pool.num_free_blocks == 0:
          break
        (host_id,) = self.host_pool.allocate(1)
        self.host_pool.cache_block(host_id, block_hash)
        device_ids.append(device_id)
        copy_ids.append(host_id)
      host_ids.append(host_id)
      found.append(j)
    return (host_ids, np.asarray(device_ids, np.int32), np.asarray(copy_ids, np.int32),
            found)

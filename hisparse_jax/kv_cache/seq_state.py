"""One sequence's blocks as the block manager keeps them (host bookkeeping only).

`SeqState` is the record every part of the BlockManager reads and writes: its tokens,
its block table in the tier it lives in, the hashes of its cached blocks, its HiSparse
host copies and hot-buffer slots, and the numpy mirror of its table that step arrays
are copied from.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hisparse_jax.kv_cache.kv_hash import BlockHash

# The token id of a slot appended before its token is known (the engine's steps overlap:
# a decode is planned while the token it computes is still being sampled); `set_token`
# fills it in. A block holding a pending token is not hashed (cached) until then.
PENDING_TOKEN = -1


@dataclasses.dataclass
class SeqState:
  """A sequence's blocks (see BlockManager for the invariants)."""

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
  # The numpy mirror of `block_ids` that step arrays are copied from (see `table_row`):
  # `table_version` changes whenever an entry of `block_ids` is replaced (appends do not
  # change it); the mirror is valid for `mirror_version` and its first `mirror_len`
  # entries.
  pending: int | None = None  # position of the PENDING_TOKEN in token_ids, if any
  # The request's cache_salt: the parent of its first block's hash (kv_hash.salted_root).
  cache_salt: str | None = None
  table_version: int = 0
  mirror: np.ndarray | None = None
  mirror_len: int = 0
  mirror_version: int = -1
  # HiSparse: (table_version, n) with block_ids[:n] all dropped (NULL_BLOCK_ID) as of that
  # version: where HiSparsePlacement.droppable's scan starts.
  dropped_prefix: tuple[int, int] = (-1, 0)

  @property
  def offloaded(self) -> bool:
    return bool(self.hot_slots)

  def replaced_blocks(self) -> None:
    """Records that entries of `block_ids` were replaced (not just appended)."""
    self.table_version += 1

  def table_row(self) -> np.ndarray:
    """`block_ids` as int32 numpy (a view of the mirror): entries appended since the last
    call are copied into it; a replaced entry (`table_version`) rewrites it. A step's
    tables cost O(batch) this way, whatever the contexts' lengths."""
    n = len(self.block_ids)
    mirror = self.mirror
    if mirror is None or len(mirror) < n:
      grown = np.zeros(max(16, 2 * n), np.int32)
      if mirror is not None and self.mirror_version == self.table_version:
        grown[:self.mirror_len] = mirror[:self.mirror_len]
      self.mirror = mirror = grown
    if self.mirror_version != self.table_version or self.mirror_len > n:
      self.mirror_len, self.mirror_version = 0, self.table_version
    if self.mirror_len < n:
      mirror[self.mirror_len:n] = self.block_ids[self.mirror_len:n]
      self.mirror_len = n
    return mirror[:n]

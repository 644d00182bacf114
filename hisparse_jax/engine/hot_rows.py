"""Which row of the runner's hot-buffer state each offloaded HiSparse sequence holds."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from hisparse_jax.kv_cache.block_manager import BlockManager


class HotRows:
  """Rows of the runner's hot-buffer state (`ModelRunner.hot_state`, one row per
  offloaded sequence, `num_rows` = max_num_seqs) handed to sequences.

  State: `rows` (sequence id -> row) and the free rows. Invariant: a row belongs to at
  most one sequence, and only while that sequence is resident and offloaded; a sequence
  that gets a row starts it empty (`assign` says so: `reset`).
  """

  def __init__(self, num_rows: int):
    self.rows: dict[Hashable, int] = {}
    self._free = list(range(num_rows))

  def assign(self, block_manager: BlockManager,
             seq_ids: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray]:
    """(row of each of the step's sequences, -1 for none; bool: the row starts empty).
    Rows of sequences no longer offloaded (finished, swapped out) come free first."""
    bm = block_manager
    for seq_id in list(self.rows):
      if seq_id not in bm or bm.is_swapped(seq_id) or not bm.is_offloaded(seq_id):
        self._free.append(self.rows.pop(seq_id))
    rows = np.full(len(seq_ids), -1, np.int32)
    reset = np.zeros(len(seq_ids), bool)
    for i, seq_id in enumerate(seq_ids):
      if bm.is_offloaded(seq_id):
        if seq_id not in self.rows:  # newly offloaded: a fresh row
          self.rows[seq_id] = self._free.pop()
          reset[i] = True
        rows[i] = self.rows[seq_id]
    return rows, reset

"""What the block manager decides, as plans for the engine to execute.

A plan names block ids only; the engine moves the data (TransferEngine for swaps,
the runner for copy-on-write copies) in the order `hisparse_jax.kv_cache.block_manager`
documents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


def as_block_ids(values: Sequence[int]) -> np.ndarray:
  """Block ids as a 1-D int32 array."""
  return np.asarray(values, dtype=np.int32).reshape(-1)


@dataclasses.dataclass(frozen=True)
class SwapOutPlan:
  """One batched device -> host copy: device block i goes to host block i."""

  device_ids: np.ndarray  # [num_blocks] int32
  host_ids: np.ndarray  # [num_blocks] int32

  @property
  def num_blocks(self) -> int:
    return int(self.device_ids.shape[0])


@dataclasses.dataclass(frozen=True)
class SwapInPlan:
  """One batched host -> device copy: host block i goes to device block i."""

  host_ids: np.ndarray  # [num_blocks] int32
  device_ids: np.ndarray  # [num_blocks] int32

  @property
  def num_blocks(self) -> int:
    return int(self.host_ids.shape[0])


@dataclasses.dataclass(frozen=True)
class AllocateResult:
  """Blocks of a new sequence: its table, what the prefix cache covered, what to compute."""

  block_ids: np.ndarray  # [num_blocks] int32, device block table in attention order
  num_cached_tokens: int  # prompt tokens whose KV exists (device hit) or is swapped in
  slot_ids: np.ndarray  # [num_tokens - num_cached_tokens] int32, slots of tokens to compute
  swap_in: SwapInPlan  # host-tier prefix hits to bring into the device blocks


@dataclasses.dataclass(frozen=True)
class AppendResult:
  """Where a sequence's new token goes, and the copy-on-write copy to do first."""

  slot_id: int  # block_id * block_size + offset
  copy: tuple[int, int] | None  # (src_device_id, dst_device_id) when the last block was shared

"""HiSparse's share of the device budget and what it admits (the capacity lines' HiSparse
parts): the key bounds of every block and the hot-buffer state rows it reserves
(hisparse_capacity), the blocks a streamed prompt needs (streamed_device_blocks), the
hot-state rows (num_hot_rows), and the words of "HiSparse runs N at once" (limited_by;
the count itself is capacity.CapacityReport.hisparse_concurrency)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, KVCacheSpec, num_usable_blocks


@dataclasses.dataclass(frozen=True)
class HiSparseCapacity:
  """What HiSparse takes from the device and what it admits.

  A sparse request (longer than `sparse_threshold_tokens`) keeps its full KV in the
  pinned-host pool (written through) and, once offloaded, only `hot_buffer_blocks`
  hot-buffer slots plus its newest block on the device; the indexer's key bounds of
  every device and host block stay on the device (`indexer_bytes`).
  """

  indexer_bytes: int  # key bounds by device block and by host block, all layers
  hot_state_bytes: int  # the hot-buffer bookkeeping rows (runner)
  hot_buffer_blocks: int  # device slots per offloaded request
  top_k_blocks: int
  sparse_threshold_tokens: int
  bounds_dtype: str = "float32"  # of the key bounds (HiSparseConfig.bounds_dtype)
  # Device blocks a prompt longer than the device pool streams through (chunked
  # prefill); None: prompts must fit the device pool.
  streamed_device_blocks: int | None = None
  # A DSA model's learned indexer (HiSparseConfig.indexer "lightning"): indexer_bytes are
  # the indexer keys of host blocks, the top-k and hot buffer are in tokens.
  lightning: bool = False
  top_k_tokens: int = 0
  # The scheduler's limits on sparse requests running at once (hisparse_concurrency):
  # its seats, and how it admits when the device is short (HiSparseConfig.admission).
  max_num_seqs: int | None = None
  admission: str = "offload"

  @property
  def reserved_bytes(self) -> int:
    return self.indexer_bytes + self.hot_state_bytes

  def device_detail(self, block_size: int) -> str:
    if self.lightning:
      return (f"HiSparse (learned indexer, top-k {self.top_k_tokens:,} tokens): indexer keys "
              f"of host blocks {self.indexer_bytes:,} bytes + hot-buffer state "
              f"{self.hot_state_bytes:,} bytes; hot buffer {self.hot_buffer_blocks:,} blocks "
              f"= {self.hot_buffer_blocks * block_size:,} token slots per offloaded request, "
              "from the pool")
    return (f"HiSparse: indexer key bounds ({self.bounds_dtype}) {self.indexer_bytes:,} "
            f"bytes + hot-buffer state "
            f"{self.hot_state_bytes:,} bytes; hot buffer {self.hot_buffer_blocks:,} blocks "
            f"= {self.hot_buffer_blocks * block_size:,} tokens per offloaded request, from "
            f"the pool; top-k {self.top_k_blocks:,} blocks")


def limited_by(report, running: int, tokens_per_request: int) -> str:
  """What bounds `hisparse_concurrency` (its arguments), in the capacity line's words."""
  hs, host = report.hisparse, report[PINNED_HOST]
  if hs.max_num_seqs is not None and running == hs.max_num_seqs:
    return "limited by --max_num_seqs"
  if running == host.num_blocks // math.ceil(tokens_per_request / host.block_size):
    return f"limited by the {PINNED_HOST} pool"
  streams = (hs.streamed_device_blocks is not None and hs.streamed_device_blocks - 2
             < math.ceil(tokens_per_request / host.block_size))
  first = "its first prefill chunk and hot buffer" if streams else "its whole prompt"
  return (f"limited by {DEVICE}: each also keeps a spare block, and the last admitted "
          f"needs {first}")


def bounds_bytes_per_block(spec: KVCacheSpec, bounds_dtype: str = "float32") -> int:
  """Device bytes of the key bounds of one block id over all layers (min and max, each
  [num_kv_heads, head_dim] of `bounds_dtype`; int8 adds a float32 scale per side and KV
  head: kernels_pallas.block_key_bounds.QuantizedBounds)."""
  scale_bytes = 4 if bounds_dtype == "int8" else 0
  return spec.num_layers * 2 * spec.num_kv_heads * (
      spec.head_dim * jnp.dtype(bounds_dtype).itemsize + scale_bytes)


def num_hot_rows(max_num_seqs: int, num_device_blocks: int, hot_buffer_blocks: int) -> int:
  """Rows of HiSparse's hot-buffer state (runner): one per sequence offloaded at once,
  and each offloaded sequence holds `hot_buffer_blocks` of the device pool's usable
  blocks, so at most that many fit; at most one per seat (max_num_seqs); at least one."""
  return max(1, min(max_num_seqs, num_usable_blocks(num_device_blocks) // hot_buffer_blocks))


def streamed_device_blocks(hisparse, block_size: int, max_num_batched_tokens: int) -> int:
  """Device blocks one request needs with HiSparse when its prompt streams through the
  device (Scheduler: a prompt longer than the device pool): its hot buffer, one prefill
  chunk of `max_num_batched_tokens`, the partly filled block before the chunk and one
  for the token after it. `hisparse`: a HiSparseConfig."""
  return (hisparse.blocks(block_size).hot_buffer_blocks
          + math.ceil(max_num_batched_tokens / block_size) + 2)


def hisparse_capacity(spec: KVCacheSpec, hisparse, *, num_device_blocks: int,
                      num_host_blocks: int, max_num_seqs: int,
                      max_model_len: int, num_devices: int = 1,
                      max_num_batched_tokens: int | None = None) -> HiSparseCapacity:
  """The device bytes HiSparse needs besides the pool, for pools of these block counts
  (null blocks included): key bounds of every device and host block, and hot-buffer
  state rows of [slots] x 2 + [max blocks] int32 per layer and hot row (num_hot_rows; what
  hisparse_jax.engine.runner.ModelRunner allocates). `hisparse`: a HiSparseConfig.
  num_devices: tensor parallel; the key bounds are split by KV head, the state is
  replicated (one copy per device, all counted). max_num_batched_tokens: the prefill
  chunk a prompt longer than the device pool streams through (None: no streaming)."""
  blocks = hisparse.blocks(spec.block_size)
  max_blocks = math.ceil(max_model_len / spec.block_size)
  if spec.is_mla:  # token-granular hot buffer; the indexer keys of every host block
    bs = spec.block_size
    rows = num_hot_rows(max_num_seqs, num_device_blocks, blocks.hot_buffer_blocks)
    state = spec.num_layers * rows * (2 * blocks.hot_buffer_blocks + max_blocks) * bs
    return HiSparseCapacity(
        indexer_bytes=num_host_blocks * bs * spec.index_bytes_per_token,
        hot_state_bytes=state * 4 * num_devices, hot_buffer_blocks=blocks.hot_buffer_blocks,
        top_k_blocks=blocks.top_k_blocks,
        sparse_threshold_tokens=hisparse.sparse_threshold_tokens,
        bounds_dtype=spec.dtype, lightning=True, top_k_tokens=hisparse.top_k_tokens,
        max_num_seqs=max_num_seqs, admission=hisparse.admission)
  rows = num_hot_rows(max_num_seqs, num_device_blocks, blocks.hot_buffer_blocks)
  state = spec.num_layers * rows * (2 * blocks.hot_buffer_blocks + max_blocks) * 4
  return HiSparseCapacity(
      indexer_bytes=(num_device_blocks + num_host_blocks)
      * bounds_bytes_per_block(spec, hisparse.bounds_dtype),
      hot_state_bytes=state * num_devices, hot_buffer_blocks=blocks.hot_buffer_blocks,
      top_k_blocks=blocks.top_k_blocks,
      sparse_threshold_tokens=hisparse.sparse_threshold_tokens,
      bounds_dtype=hisparse.bounds_dtype, max_num_seqs=max_num_seqs,
      admission=hisparse.admission,
      streamed_device_blocks=None if max_num_batched_tokens is None else
      streamed_device_blocks(hisparse, spec.block_size, max_num_batched_tokens))

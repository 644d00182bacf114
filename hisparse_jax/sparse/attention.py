"""Attention inside the step program, and the HiSparse sparse path.

Attention is `attend`: the one place where the HiSparse path swaps the dense block
table for a table of selected blocks. With a HiSparseConfig the runner also keeps, per
layer, the key bounds of every device block AND every host block in one array
(`bounds`, [num_device_blocks + num_host_blocks, 2, num_kv_heads, head_dim] of
HiSparseConfig.bounds_dtype (bfloat16 by default, uint16 bits on CPU; or float32):
device block i at row i, host block j at row num_device_blocks + j; donated like the
pages), and each layer of the step runs:

    write_kv -> block_key_bounds(touched blocks)
      dense rows (prefill chunks, short sequences):  ragged_paged_attention(block tables)
      sparse rows (one query token, kv_len > sparse_threshold_tokens):
        select   indexer.select(q, key bounds of each logical block, kv_lens)
                 -> logical ids [B, k]; one gather of `bounds` reads a resident block's
                 row (by device id) or a dropped block's (by host id)
        resolve  resolver.resolve: resident device block / hot-buffer slot / host miss
                 (LRU slot of that sequence's hot buffer), hot-buffer state per layer
        load     resolver.load_blocks: the misses, host pool -> hot-buffer slots, inside
                 this program (GPU: one host gather under compute_on("device_host") sized
                 to the misses; CPU, one memory: a loop of exactly the misses' block
                 copies); no miss moves nothing
        attend   paged_attention(q, pages, resolved table, selection kv_lens); per-head
                 selections: paged_attention_per_head over a table per head

`sparse_rows` (a per-row flag in StepMetadata) decides; shapes stay static (the
selected table is [num_seqs, top_k_blocks]), so the step is still one program.

A sparse row of more than one query is a prefill chunk of a streamed prompt (one longer
than the device pool; engine/scheduler.py) whose earlier blocks are partly on the host
only. It is selected, resolved and loaded like a decode row, over its E earlier full
blocks, by CHUNK_QUERIES of its queries spread over it (its last included); then it stays
in the dense call over a rewritten table: the selected blocks, then its own blocks from
block E on (`chunk_tables`), so its queries attend over top-k earlier blocks + every key
of their own chunk, causally.

Tier inputs of a step (`SparseTiers`, from the block manager): each row's host copies
per logical block (`host_tables`), its hot-buffer device blocks (`hot_slots`), and its
row of the hot-buffer state (`hot_rows`; `hot_reset` starts it empty). The runner owns
that state on the device: per layer [rows, slots] slot contents and last use, and
[rows, max_blocks] eviction steps, donated through the step like the pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

import kernels_pallas
from hisparse_jax.kv_cache.kv_pool import from_storage, to_storage
from hisparse_jax.sparse import indexer, resolver
from hisparse_jax.sparse.config import HiSparseBlocks
from kernels_pallas.common import packed_ids
from kernels_pallas.quant import QuantizedPages, kind_of, quantize

# Queries a sparse prefill chunk's selection ranks the blocks by: each of its query heads at
# this many positions, evenly spaced over the chunk (its last query included), as that many
# more query heads of the union (a decode row's one query, repeated, selects as alone).
CHUNK_QUERIES = 8

# Per row and layer of a HiSparse step: [device, hot, host, evictions, thrash] blocks.
COUNT_FIELDS = ("device", "hot", "host", "evictions", "thrash")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """Per-step attention inputs (all int32): what `attend` reads besides q, k, v and the
  layer's cache. The engine builds it per step (engine/step_batch.py); an embedder's loop
  builds its own."""

  slot_ids: jax.Array  # [num_tokens]; -1 = padding, not written
  block_tables: jax.Array  # [num_seqs, max_blocks]; padded with the null block 0
  kv_lens: jax.Array  # [num_seqs]: tokens in the cache after this step
  cu_q_lens: jax.Array  # [num_seqs + 1]
  sparse_rows: jax.Array  # bool [num_seqs]: decode rows that attend over selected blocks
  # HiSparse tiers (None without HiSparse):
  host_tables: jax.Array | None = None  # [num_seqs, max_blocks] host copy ids, 0 = none
  hot_slots: jax.Array | None = None  # [num_seqs, num_slots] hot-buffer device blocks
  hot_rows: jax.Array | None = None  # [num_seqs] hot-state row; >= rows: none
  hot_reset: jax.Array | None = None  # bool [num_seqs]: start the row empty
  step: jax.Array | None = None  # int32 scalar: decode-step clock of the hot buffers
  # Static sizes of the dense attention call (KernelOps.ragged_hints of the rows' query
  # lengths), as sorted (name, value) pairs: part of the compiled program's key.
  ragged_hints: tuple[tuple[str, int], ...] = dataclasses.field(
      default=(), metadata={"static": True})
  # HiSparse: rows the sparse path computes (a multiple of 8 holding the sparse rows; 0:
  # no sparse path in the program).
  num_sparse_rows: int = dataclasses.field(default=0, metadata={"static": True})
  # HiSparse: the queries a sparse prefill chunk is selected by (CHUNK_QUERIES, evenly
  # spaced over the chunk, its last one included) in a step that has one; else 1.
  chunk_queries: int = dataclasses.field(default=1, metadata={"static": True})


@dataclasses.dataclass(frozen=True)
class SparseStatic:
  """The static settings of the sparse path of a step program."""

  blocks: HiSparseBlocks
  selection: str
  thrash_window_steps: int
  device_sharding: jax.sharding.Sharding
  host_sharding: jax.sharding.Sharding
  one_memory: bool | None = None  # resolver.load_blocks' (None: the devices say)
  # Tensor parallel (under shard_map): the mesh axis of the KV heads, over which the
  # indexer gathers the block scores (one small collective per layer), and how many
  # copies of each KV head the devices hold (indexer.select).
  axis_name: str | None = None
  kv_head_repeat: int = 1
  bounds_dtype: str = "float32"  # of the key bounds (stored as uint16 when bf16 on CPU)


def write_pages(ops: kernels_pallas.KernelOps, kv_dtype, storage_dtype, pages, k, v,
                slot_ids):
  """This step's K/V [tokens, kv heads, head_dim] into a layer's `pages`: (k, v) arrays,
  or (k, v, k scales, v scales) of a quantized cache (int8 or fp8_e4m3 values, one scale
  per token and KV head, written like pages of head_dim 1; kernels_pallas.quant)."""
  if len(pages) == 2:
    return ops.write_kv(pages[0], pages[1], to_storage(k, kv_dtype, storage_dtype),
                        to_storage(v, kv_dtype, storage_dtype), slot_ids)
  kind = kind_of(pages[0].dtype)  # int8, or fp8_e4m3 stored as uint8
  (k_values, k_scales), (v_values, v_scales) = quantize(k, kind), quantize(v, kind)
  return (*ops.write_kv(pages[0], pages[1], k_values, v_values, slot_ids),
          *ops.write_kv(pages[2], pages[3], k_scales, v_scales, slot_ids))


def page_views(pages, kv_dtype):
  """(K, V) as the attention kernels read them: the pages in the model's dtype, or
  `QuantizedPages` that dequantize the blocks a kernel gathers."""
  if len(pages) == 2:
    return from_storage(pages[0], kv_dtype), from_storage(pages[1], kv_dtype)
  return (QuantizedPages(pages[0], pages[2], kv_dtype),
          QuantizedPages(pages[1], pages[3], kv_dtype))


def attend(ops: kernels_pallas.KernelOps, kv_dtype, storage_dtype,
           sparse: SparseStatic | None, q, k, v, *, layer_idx, kv_cache,
           metadata: StepMetadata, config):
  """Writes this step's K/V into the pages (and their blocks' key bounds, with HiSparse),
  then attends: each sequence over its blocks, or sparse rows over their selected ones.
  A layer's pages: (k, v), or (k, v, k scales, v scales) of an int8 cache."""
  del layer_idx
  if sparse is None:
    pages = write_pages(ops, kv_dtype, storage_dtype, tuple(kv_cache), k[0], v[0],
                        metadata.slot_ids)
    k_view, v_view = page_views(pages, kv_dtype)
    out = ops.ragged_paged_attention(
        q[0], k_view, v_view, metadata.block_tables, metadata.kv_lens, metadata.cu_q_lens,
        sliding_window=config.sliding_window, **dict(metadata.ragged_hints))
    return out[None], pages
  cache = dict(kv_cache)
  pages = write_pages(ops, kv_dtype, storage_dtype, cache["pages"], k[0], v[0],
                      metadata.slot_ids)
  bounds = ops.block_key_bounds(from_storage(cache["bounds"], sparse.bounds_dtype),
                                page_views(pages, kv_dtype)[0], metadata.slot_ids)
  out, pages, state, (counts, loaded) = _hisparse_attention(
      ops, sparse, kv_dtype, q[0], pages, bounds, cache, metadata, config)
  bounds = to_storage(bounds, sparse.bounds_dtype, cache["bounds"].dtype)
  return out[None], dict(pages=pages, bounds=bounds, state=state, counts=counts,
                         loaded=loaded)


def _hisparse_attention(ops: kernels_pallas.KernelOps, sparse: SparseStatic, kv_dtype, q,
                        pages, bounds, cache, metadata: StepMetadata, config):
  """Dense rows through ragged attention over their own tables; sparse rows, gathered
  into `metadata.num_sparse_rows` rows, through select -> resolve -> load -> attend (no
  sparse row's full table is read; with no sparse row none of it runs). q [num_tokens,
  num_q_heads, head_dim]; returns (out like q, new pages (a tuple, as `attend`'s), new
  hot-buffer state of this layer, (counts [num_seqs, 5], blocks the host loads moved))."""
  is_sparse = metadata.sparse_rows  # bool [num_seqs]
  num_tokens, batch = q.shape[0], is_sparse.shape[0]
  tables = metadata.block_tables  # device ids; 0 = dropped (or padding)
  kv_lens = metadata.kv_lens
  # Sparse prefill chunks (of a streamed prompt, some of whose earlier blocks are only on
  # the host): selected like a decode row (by CHUNK_QUERIES of their queries), then
  # attended in the dense call over a rewritten table (below).
  is_chunk = is_sparse & (metadata.cu_q_lens[1:] - metadata.cu_q_lens[:-1] > 1)
  counts = jnp.zeros((batch, len(COUNT_FIELDS)), jnp.int32)
  loaded = jnp.int32(0)
  new_state = cache["state"]
  sparse_out = None
  num_sparse = min(metadata.num_sparse_rows, batch)
  if num_sparse:
    rows, live = packed_ids(is_sparse, num_sparse)
    out_rows = jnp.where(live, rows, batch)  # for scatters back to the batch (padding dropped)
    # Each row's last query token (a decode row's only one).
    token = jnp.clip(metadata.cu_q_lens[rows + 1] - 1, 0, num_tokens - 1)
    chunk = live & is_chunk[rows]
    q_select = q[token]
    if metadata.chunk_queries > 1:  # queries evenly spaced over each row, the last included
      s = metadata.chunk_queries
      first = metadata.cu_q_lens[rows]
      q_len = jnp.maximum(token + 1 - first, 1)
      picks = first[:, None] + (jnp.arange(1, s + 1)[None, :] * q_len[:, None]) // s - 1
      picked = q[jnp.clip(picks, 0, num_tokens - 1)]  # [n, s, heads, d]
      # [n, heads * s] with head h's queries together: query head h * s + i is still in
      # KV group h // group (indexer: heads map to KV heads in order).
      q_select = jnp.swapaxes(picked, 1, 2).reshape(
          picked.shape[0], -1, picked.shape[-1])
    pages, new_state, row_counts, loaded, sparse_out, (chunk_tables, chunk_lens) = (
        _sparse_rows(sparse, kv_dtype, ops, q[token], q_select, pages, bounds, cache,
                     metadata, rows, live, chunk))
    counts = counts.at[out_rows].set(row_counts, mode="drop")
    chunk_rows = jnp.where(chunk, rows, batch)
    tables = tables.at[chunk_rows].set(chunk_tables, mode="drop")
    kv_lens = kv_lens.at[chunk_rows].set(chunk_lens, mode="drop")
  k_view, v_view = page_views(pages, kv_dtype)
  # Dense rows (prefill chunks, short decodes) through the ragged kernel; sparse decode
  # rows get no key there (their output is replaced below). A step with no dense row (a
  # batch of long decodes) skips the call: the reference's and the Pallas kernel's cost
  # follows the block-table width, not the lengths (measured: 408 of 463 ms per layer at
  # 64k tokens for length-1 rows).
  dense_lens = jnp.where(is_sparse & ~is_chunk, 0, kv_lens)
  any_dense = jnp.any(dense_lens > 0)
  out = lax.cond(
      any_dense,
      lambda: ops.ragged_paged_attention(q, k_view, v_view, tables, dense_lens,
                                         metadata.cu_q_lens,
                                         sliding_window=config.sliding_window,
                                         **dict(metadata.ragged_hints)).astype(q.dtype),
      lambda: jnp.zeros_like(q))
  if sparse_out is not None:
    decode = live & ~chunk
    out = out.at[jnp.where(decode, token, num_tokens)].set(sparse_out.astype(out.dtype),
                                                           mode="drop")
  return out, pages, new_state, (counts, loaded)


def chunk_tables(selected, valid, tables, kv_lens, q_lens, block_size: int):
  """Block tables of sparse prefill chunks for the dense attention call.

  A chunk of q_len queries ending at kv_len attends over E = (kv_len - q_len) //
  block_size earlier full blocks (whichever of them the selection picked) and over its
  own blocks from block E on (block E may hold earlier tokens too: it is partly filled
  and still on the device). The table is the selected blocks' distinct device ids
  (`selected` [n, x] where `valid`; their order does not matter: every query sees them
  all) followed by the tables' blocks E, E + 1, ...; the length m * block_size +
  kv_len - E * block_size keeps the causal mask of the chunk's own keys, which the
  kernels take from the row's last q_len positions. RoPE was applied when the keys were
  written, so the compacted key positions change nothing else.
  Returns (tables [n, width] int32, kv_lens [n] int32)."""
  n, width = tables.shape
  big = jnp.iinfo(jnp.int32).max
  ids = jnp.sort(jnp.where(valid, selected, big).astype(jnp.int32), axis=1)
  first = (ids != big) & jnp.concatenate(
      [jnp.ones((n, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  m = first.sum(axis=1, dtype=jnp.int32)
  pos = jnp.where(first, jnp.cumsum(first, axis=1) - 1, width)
  compact = jnp.zeros((n, width), jnp.int32).at[
      jnp.arange(n)[:, None], pos].set(ids, mode="drop")
  earlier = (kv_lens - q_lens) // block_size
  src = earlier[:, None] + jnp.arange(width)[None, :] - m[:, None]
  own = jnp.where(src < width,
                  jnp.take_along_axis(tables, jnp.clip(src, 0, width - 1), axis=1), 0)
  out = jnp.where(jnp.arange(width)[None, :] < m[:, None], compact, own)
  return out, (m * block_size + kv_lens - earlier * block_size).astype(jnp.int32)


def _sparse_rows(sparse: SparseStatic, kv_dtype, ops: kernels_pallas.KernelOps, q_rows,
                 q_select, pages, bounds, cache, metadata: StepMetadata, rows, live, chunk):
  """select -> resolve -> load -> attend for the batch rows `rows` (`live` False:
  padding; `chunk`: a sparse prefill chunk, selected over its earlier full blocks and
  attended in the dense call). q_rows [n, num_q_heads, head_dim] (each row's last query);
  q_select [n, num_q_heads * s, head_dim]: the queries the selection ranks by (q_rows, or
  s per head spread over a chunk: StepMetadata.chunk_queries). Returns (new pages, new
  hot-buffer state, counts [n, 5], blocks loaded, attention output of the decode rows
  [n, num_q_heads, head_dim], (tables, kv_lens) of the chunk rows for the dense call:
  `chunk_tables`)."""
  tables = metadata.block_tables[rows]
  host_tables = metadata.host_tables[rows]
  block_size = pages[0].shape[1]
  q_lens = metadata.cu_q_lens[rows + 1] - metadata.cu_q_lens[rows]
  row_lens = metadata.kv_lens[rows]
  # A chunk selects among its earlier full blocks only (its own are attended densely).
  kv_lens = jnp.where(live, jnp.where(chunk, (row_lens - q_lens) // block_size * block_size,
                                      row_lens), 0)
  # select: key bounds of each logical block, from its device copy's row or, once it was
  # dropped, its host copy's row (read in place by the C++ kernel on CPU, else gathered).
  num_device_blocks = pages[0].shape[0]
  bounds_rows = jnp.where(tables != 0, tables, num_device_blocks + host_tables)
  # The C++ select / resolve: the xla kernels on a CPU target (TPU also takes the xla
  # backend, and the FFI targets are registered for CPU only).
  cpu_kernel = ops.backend == "xla" and kernels_pallas.backend.target_platform() == "cpu"
  sel = indexer.select_rows(q_select, bounds, bounds_rows, kv_lens, sparse.blocks,
                            sparse.selection, axis_name=sparse.axis_name,
                            kv_head_repeat=sparse.kv_head_repeat,
                            cpu_kernel=cpu_kernel)
  # resolve: resident / hot-buffer hit / host miss, against this layer's hot-buffer rows.
  slot_block, last_used, evicted_at = cache["state"]
  num_state_rows, width = slot_block.shape[0], tables.shape[1]
  hot_rows = metadata.hot_rows[rows]
  own_row = live & (hot_rows < num_state_rows)
  state_row = jnp.minimum(hot_rows, num_state_rows - 1)
  fresh = (~own_row | metadata.hot_reset[rows])[:, None]
  state = resolver.HotBufferState(
      slot_block=jnp.where(fresh, -1, slot_block[state_row]),
      slot_last_used=jnp.where(fresh, resolver.NEVER, last_used[state_row]),
      evicted_at=jnp.where(fresh, resolver.NEVER, evicted_at[state_row, :width]))
  # Per-head selections ([n, heads, k]) resolve as one row per sequence: a block several
  # heads chose resolves and loads once; their union fits the hot buffer (indexer.select).
  n = q_rows.shape[0]
  per_head = sel.logical_ids.ndim == 3
  valid = (sel.valid & live.reshape((n,) + (1,) * (sel.valid.ndim - 1))).reshape(n, -1)
  res = resolver.resolve(jnp.where(valid, sel.logical_ids.reshape(n, -1), 0), valid, state,
                         tables, metadata.hot_slots[rows], host_tables, metadata.step,
                         num_device_blocks=num_device_blocks,
                         thrash_window_steps=sparse.thrash_window_steps,
                         max_distinct=sparse.blocks.hot_buffer_blocks if per_head else None,
                         cpu_kernel=cpu_kernel)
  # load: this layer's misses, host pool -> their slots; the bytes follow the misses
  # (none: nothing moves).
  # (An int8 cache's scales move with its values: they are pages too.)
  pages, loaded = resolver.load_blocks(
      cache["host"], pages, res.load_host_ids, res.load_device_ids,
      device_sharding=sparse.device_sharding, host_sharding=sparse.host_sharding,
      one_memory=sparse.one_memory)
  # attend: the newest, partly filled block is last (indexer order).
  k_view, v_view = page_views(pages, kv_dtype)
  decode = live & ~chunk
  if per_head:
    out = kernels_pallas.paged_attention_per_head(
        q_rows, k_view, v_view, res.block_tables.reshape(sel.logical_ids.shape),
        jnp.where(decode[:, None], sel.kv_lens, 0))
  else:
    out = ops.paged_attention(q_rows, k_view, v_view, res.block_tables,
                              jnp.where(decode, sel.kv_lens, 0))
  chunks = chunk_tables(res.block_tables.reshape(n, -1), valid, tables, row_lens, q_lens,
                        block_size)
  # The rows' new state goes back to their state rows (rows without one are dropped).
  dst = jnp.where(own_row, hot_rows, num_state_rows)
  new_state = (slot_block.at[dst].set(res.state.slot_block, mode="drop"),
               last_used.at[dst].set(res.state.slot_last_used, mode="drop"),
               evicted_at.at[dst, :width].set(res.state.evicted_at, mode="drop"))
  c = res.counts
  counts = jnp.stack([c.resident_hits, c.hot_hits, c.misses, c.evictions, c.thrash], axis=-1)
  counts = jnp.where(live[:, None], counts, 0).astype(jnp.int32)
  return pages, new_state, counts, loaded, out, chunks

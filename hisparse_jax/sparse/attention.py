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
than the device pool; engine/scheduler.py) whose E earlier full blocks are partly on the
host only. With `streamed_prefill="exact"` (the default) it attends over all of them
(`_exact_chunks`): groups of up to EXACT_GROUP_TOKENS of them at a time, resident ones
read in place and the others loaded from the host into its hot buffer's slots, merged by
an online softmax with its own blocks' causal part; its hot-buffer state then starts
empty. With "sparse" it is selected, resolved and loaded like a decode row, over its E
earlier blocks, by CHUNK_QUERIES of its queries spread over it (its last included); then
it stays in the dense call over a rewritten table: the selected blocks, then its own
blocks from block E on (`chunk_tables`), so its queries attend over top-k earlier blocks
+ every key of their own chunk, causally.

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
from kernels_pallas.block_key_bounds import max_touched_blocks
from kernels_pallas.common import MASK_VALUE, packed_ids
from kernels_pallas.quant import QuantizedPages, kind_of, quantize

# Queries a sparse prefill chunk's selection ranks the blocks by: each of its query heads at
# this many positions, evenly spaced over the chunk (its last query included), as that many
# more query heads of the union (a decode row's one query, repeated, selects as alone).
CHUNK_QUERIES = 8

# Keys an exact streamed prefill chunk attends per group of earlier blocks loaded at once
# (in whole blocks, at most the hot buffer): bounds its scores at [queries, heads, this].
EXACT_GROUP_TOKENS = 512
# Queries of an exact streamed chunk whose running softmax is updated together.
EXACT_QUERY_TILE = 256

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
  # HiSparse: whether the step may hold a streamed prefill chunk (a sparse row of more
  # than one query); False leaves the chunk path out of the program (a decode step's).
  sparse_chunks: bool = dataclasses.field(default=True, metadata={"static": True})


@dataclasses.dataclass(frozen=True)
class SparseStatic:
  """The static settings of the sparse path of a step program."""

  blocks: HiSparseBlocks
  selection: str
  thrash_window_steps: int
  device_sharding: jax.sharding.Sharding
  host_sharding: jax.sharding.Sharding
  one_memory: bool | None = None  # resolver.load_blocks' (None: the devices say)
  host_copy: str = "xla"  # resolver.load_blocks' (transfer.host_copy_mode)
  # Tensor parallel (under shard_map): the mesh axis of the KV heads, over which the
  # indexer gathers the block scores (one small collective per layer), and how many
  # copies of each KV head the devices hold (indexer.select).
  axis_name: str | None = None
  kv_head_repeat: int = 1
  bounds_dtype: str = "float32"  # of the key bounds (stored as uint16 when bf16 on CPU)
  streamed_prefill: str = "exact"  # HiSparseConfig.streamed_prefill
  # Decode rows attend their blocks already on the device while the misses load, then the
  # loaded misses, merged by log-sum-exp (`_sparse_rows`; resolver.overlap_loads_mode).
  overlap_loads: bool = False


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
  k_view = page_views(pages, kv_dtype)[0]
  # The step's rows write consecutive positions each: the bounds' work follows the blocks
  # they touch (a prefill chunk's tokens / block_size), not the tokens.
  bounds = ops.block_key_bounds(
      indexer.bounds_view(cache["bounds"], sparse.bounds_dtype), k_view, metadata.slot_ids,
      max_touched=max_touched_blocks(metadata.slot_ids.shape[0], metadata.kv_lens.shape[0],
                                     k_view.shape[1]))
  # The selection reads the bounds in their storage dtype (bfloat16 as uint16 bits on CPU,
  # which the C++ kernel takes as they are: a bfloat16 operand would cost the program a
  # converted copy of the whole array per layer).
  bounds = indexer.bounds_storage(bounds, sparse.bounds_dtype, cache["bounds"])
  out, pages, state, (counts, loaded) = _hisparse_attention(
      ops, sparse, kv_dtype, q[0], pages, bounds, cache, metadata, config)
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
  if not metadata.sparse_chunks:  # (the builder says none can be: no chunk path)
    is_chunk = jnp.zeros_like(is_sparse)
  exact = sparse.streamed_prefill == "exact"
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
    # Exact chunks are not selected (not live there); sparse ones are, as chunks.
    pages, new_state, row_counts, loaded, sparse_out, (chunk_tables, chunk_lens) = (
        _sparse_rows(sparse, kv_dtype, ops, q[token], q_select, pages, bounds, cache,
                     metadata, rows, live & ~chunk if exact else live,
                     jnp.zeros_like(chunk) if exact else chunk))
    counts = counts.at[out_rows].set(row_counts, mode="drop")
    chunk_rows = jnp.where(chunk, rows, batch)
    if exact and metadata.sparse_chunks:
      exact_out, exact_tokens, pages, chunk_counts, chunk_loaded = _exact_chunks(
          sparse, kv_dtype, q, pages, cache, metadata, rows, chunk, config)
      counts = counts.at[chunk_rows].set(chunk_counts, mode="drop")
      loaded = loaded + chunk_loaded
      # Their hot-buffer slots held the groups: the rows' state starts empty again.
      state_rows = metadata.hot_rows[rows]
      dst = jnp.where(chunk & (state_rows < new_state[0].shape[0]), state_rows,
                      new_state[0].shape[0])
      new_state = (new_state[0].at[dst].set(-1, mode="drop"),
                   new_state[1].at[dst].set(resolver.NEVER, mode="drop"),
                   new_state[2].at[dst].set(resolver.NEVER, mode="drop"))
    elif not exact and metadata.sparse_chunks:
      tables = tables.at[chunk_rows].set(chunk_tables, mode="drop")
      kv_lens = kv_lens.at[chunk_rows].set(chunk_lens, mode="drop")
  k_view, v_view = page_views(pages, kv_dtype)
  # Dense rows (prefill chunks, short decodes) through the ragged kernel; sparse decode
  # rows get no key there (their output is replaced below). A step with no dense row (a
  # batch of long decodes) skips the call: the reference's and the Pallas kernel's cost
  # follows the block-table width, not the lengths (measured: 408 of 463 ms per layer at
  # 64k tokens for length-1 rows).
  dense_lens = jnp.where(is_sparse & (~is_chunk | exact), 0, kv_lens)
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
    if exact and metadata.sparse_chunks:
      out = jnp.where(exact_tokens[:, None, None], exact_out.astype(out.dtype), out)
  return out, pages, new_state, (counts, loaded)


def _gather_blocks(pages, ids, kv_dtype):
  """(K, V) of the blocks `ids` [m] of a layer's pages, [m * block_size, kv heads,
  head_dim] float32 (an 8-bit cache's blocks dequantized)."""
  if len(pages) == 2:
    k, v = (from_storage(p[ids], kv_dtype) for p in pages)
  else:
    k, v = (QuantizedPages(values, scales, kv_dtype)[ids]
            for values, scales in ((pages[0], pages[2]), (pages[1], pages[3])))
  return tuple(x.reshape(-1, *x.shape[2:]).astype(jnp.float32) for x in (k, v))


def _online_softmax(q, k, v, mask, m, l, acc):
  """One more set of keys into a running softmax, in the layout of the xla backend's
  prefill tiles (batched over KV heads): q [kv heads, rows, d] float32 (scaled), k and v
  [keys, kv heads, d], mask [rows or 1, keys]; (m, l) [kv heads, rows] the running max
  (MASK_VALUE: none yet) and sum, acc [kv heads, rows, d] the unnormalized output."""
  dims = (((2,), (2,)), ((0,), (0,)))
  s = lax.dot_general(q, k.transpose(1, 0, 2), dims, precision=lax.Precision.HIGHEST)
  s = jnp.where(mask[None], s, MASK_VALUE)
  m_new = jnp.maximum(m, s.max(axis=-1))
  p = jnp.where(mask[None], jnp.exp(s - m_new[..., None]), 0.0)
  alpha = jnp.exp(m - m_new)
  pv = lax.dot_general(p, v.transpose(1, 0, 2), (((2,), (1,)), ((0,), (0,))),
                       precision=lax.Precision.HIGHEST)
  return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv


def _exact_chunks(sparse: SparseStatic, kv_dtype, q, pages, cache, metadata: StepMetadata,
                  rows, chunk, config):
  """Streamed prefill chunks (rows[i] where chunk[i]) attended exactly, as dense prefill
  would: over every key before each query. A row's keys go by in groups of up to
  EXACT_GROUP_TOKENS (whole blocks, at most the hot buffer): its E earlier full blocks
  read in place where resident, else loaded from the host into the row's hot-buffer
  slots (resolver.load_blocks), then its own blocks (block E on, on the device); each
  group into an online softmax per tile of EXACT_QUERY_TILE queries (a tile skips the
  groups wholly after it; causal and sliding-window masks by position). One row after
  the other (while loops: the pages stay in place, a tile's scores stay small), float32.

  Returns (out [num_tokens, heads, d] float32 at the chunks' tokens, bool [num_tokens]
  which tokens those are, new pages, counts [n, 5] (device = earlier resident blocks,
  host = loaded ones), blocks loaded)."""
  num_tokens, num_q_heads, head_dim = q.shape
  num_device_blocks, block_size, num_kv_heads = pages[0].shape[:3]
  group = num_q_heads // num_kv_heads
  width = metadata.block_tables.shape[1]
  group_blocks = max(1, min(sparse.blocks.hot_buffer_blocks,
                            EXACT_GROUP_TOKENS // block_size,
                            metadata.hot_slots.shape[1]))
  tile = min(EXACT_QUERY_TILE, num_tokens)
  num_tiles = -(-num_tokens // tile)
  n = rows.shape[0]
  order, _ = packed_ids(chunk, n)
  scale = head_dim ** -0.5
  window = config.sliding_window
  i_tile = jnp.arange(tile)
  in_group = jnp.arange(group_blocks)
  key_in_group = jnp.arange(group_blocks * block_size)
  state_rows = group * tile  # per KV head: row g * tile + query i, as the prefill tiles

  def row_body(i, carry):
    pages, out, is_out, counts, loaded = carry
    row = rows[order[i]]
    first = metadata.cu_q_lens[row]
    q_len = metadata.cu_q_lens[row + 1] - first
    kv_len = metadata.kv_lens[row]
    first_pos = kv_len - q_len  # the chunk's first query's position
    earlier = first_pos // block_size
    tiles = (q_len + tile - 1) // tile
    table, host_table = metadata.block_tables[row], metadata.host_tables[row]
    slots = metadata.hot_slots[row, :group_blocks]

    def attend_tile(x, state, k, v, key_pos, key_ok):
      src = jnp.clip(first + x * tile + i_tile, 0, num_tokens - 1)
      qt = q[src].astype(jnp.float32) * scale
      qt = qt.reshape(tile, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3).reshape(
          num_kv_heads, state_rows, head_dim)
      pos = jnp.tile(first_pos + x * tile + i_tile, group)[:, None]
      mask = key_ok[None, :] & (key_pos[None, :] <= pos)
      if window is not None:
        mask &= key_pos[None, :] > pos - window
      m, l, acc = (lax.dynamic_index_in_dim(a, x, keepdims=False) for a in state)
      m, l, acc = _online_softmax(qt, k, v, mask, m, l, acc)
      return tuple(lax.dynamic_update_index_in_dim(a, b, x, 0)
                   for a, b in zip(state, (m, l, acc)))

    def group_body(j, c):
      pages, state, resident_n, host_n, moved_n = c
      b = j * group_blocks + in_group
      inside = b < width
      device_ids = jnp.where(inside, table[jnp.minimum(b, width - 1)], 0)
      before = b < earlier
      resident = (before | inside) & (device_ids != 0)
      load = before & (device_ids == 0) & (slots != 0)
      pages, moved = resolver.load_blocks(
          cache["host"], pages, host_table[jnp.minimum(b, width - 1)],
          jnp.where(load, slots, num_device_blocks),
          device_sharding=sparse.device_sharding, host_sharding=sparse.host_sharding,
          one_memory=sparse.one_memory, host_copy=sparse.host_copy)
      k, v = _gather_blocks(pages, jnp.where(resident, device_ids, slots), kv_dtype)
      key_pos = j * group_blocks * block_size + key_in_group
      key_ok = jnp.repeat(resident | load, block_size) & (key_pos < kv_len)
      # Tiles whose last query comes before the group's first key see none of it.
      lo = jnp.clip((j * group_blocks * block_size - first_pos) // tile, 0, tiles)
      state = lax.fori_loop(lo, tiles,
                            lambda x, st: attend_tile(x, st, k, v, key_pos, key_ok), state)
      return (pages, state, resident_n + (resident & before).sum(dtype=jnp.int32),
              host_n + load.sum(dtype=jnp.int32), moved_n + moved)

    state = (jnp.full((num_tiles, num_kv_heads, state_rows), MASK_VALUE, jnp.float32),
             jnp.zeros((num_tiles, num_kv_heads, state_rows), jnp.float32),
             jnp.zeros((num_tiles, num_kv_heads, state_rows, head_dim), jnp.float32))
    num_groups = (kv_len + group_blocks * block_size - 1) // (group_blocks * block_size)
    pages, (_, l, acc), resident_n, host_n, moved = lax.fori_loop(
        0, num_groups, group_body, (pages, state, jnp.int32(0), jnp.int32(0), jnp.int32(0)))
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [tiles, kv heads, group * tile, d]
    o = o.reshape(num_tiles, num_kv_heads, group, tile, head_dim).transpose(
        0, 3, 1, 2, 4).reshape(num_tiles * tile, num_q_heads, head_dim)[:num_tokens]
    t = jnp.arange(num_tokens)
    dst = jnp.where(t < q_len, first + t, num_tokens)
    out = out.at[dst].set(o, mode="drop")
    is_out = is_out.at[dst].set(True, mode="drop")
    counts = counts.at[order[i]].set(
        jnp.stack([resident_n, 0, host_n, 0, 0]).astype(jnp.int32))
    return pages, out, is_out, counts, loaded + moved

  init = (pages, jnp.zeros(q.shape, jnp.float32), jnp.zeros(num_tokens, bool),
          jnp.zeros((n, len(COUNT_FIELDS)), jnp.int32), jnp.int32(0))
  pages, out, is_out, counts, loaded = lax.fori_loop(
      0, chunk.sum(dtype=jnp.int32), row_body, init)
  return out, is_out, pages, counts, loaded


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
  # dropped, its host copy's row (read in place by the C++ kernel on CPU and by
  # kernels_pallas.block_scores on the GPU backends; the reference backend gathers them).
  num_device_blocks = pages[0].shape[0]
  bounds_rows = jnp.where(tables != 0, tables, num_device_blocks + host_tables)
  # The C++ select / resolve: the xla kernels on a CPU target (TPU also takes the xla
  # backend, and the FFI targets are registered for CPU only).
  cpu_kernel = ops.backend == "xla" and kernels_pallas.backend.target_platform() == "cpu"
  sel = indexer.select_rows(q_select, bounds, bounds_rows, kv_lens, sparse.blocks,
                            sparse.selection, axis_name=sparse.axis_name,
                            kv_head_repeat=sparse.kv_head_repeat,
                            cpu_kernel=cpu_kernel, scores_kernel=ops.block_scores)
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
  decode = live & ~chunk
  table = res.block_tables.reshape(sel.logical_ids.shape)  # [n, k] or [n, heads, k]
  lens = jnp.where(decode.reshape((n,) + (1,) * (sel.kv_lens.ndim - 1)), sel.kv_lens, 0)
  attention = kernels_pallas.paged_attention_per_head if per_head else ops.paged_attention
  if sparse.overlap_loads:
    # The blocks already on the device (resident, hot-buffer hits, the newest one) are
    # attended over the pages as they are before the load, so nothing ties that attention
    # to the host copy: the loaded misses are attended after it, and the two merged.
    loaded_block = jnp.zeros(num_device_blocks, bool).at[res.load_device_ids].set(
        True, mode="drop")
    (on_device, on_device_lens), (misses, miss_lens) = resolver.split_loaded(
        table, lens, loaded_block, block_size)
    k_view, v_view = page_views(pages, kv_dtype)
    out_device, lse_device = attention(q_rows, k_view, v_view, on_device, on_device_lens,
                                       return_lse=True)
  # load: this layer's misses, host pool -> their slots; the bytes follow the misses
  # (none: nothing moves).
  # (An int8 cache's scales move with its values: they are pages too.)
  pages, loaded = resolver.load_blocks(
      cache["host"], pages, res.load_host_ids, res.load_device_ids,
      device_sharding=sparse.device_sharding, host_sharding=sparse.host_sharding,
      one_memory=sparse.one_memory, host_copy=sparse.host_copy,
      staged=resolver.OVERLAP_STAGED_BLOCKS if sparse.overlap_loads else 0)
  # attend: the newest, partly filled block is last (indexer order).
  k_view, v_view = page_views(pages, kv_dtype)
  if sparse.overlap_loads:
    out_missed, lse_missed = attention(q_rows, k_view, v_view, misses, miss_lens,
                                       return_lse=True)
    out = kernels_pallas.merge_attention(out_device, lse_device, out_missed, lse_missed)
  else:
    out = attention(q_rows, k_view, v_view, table, lens)
  chunks = (None, None)
  if metadata.sparse_chunks and sparse.streamed_prefill == "sparse":
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

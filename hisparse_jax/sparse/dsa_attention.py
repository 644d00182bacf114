"""DeepSeek Sparse Attention inside the step: the engine's `MLAAttnFn`
(models/mla_attention.py) over paged latent and indexer-key caches, and its tiered
(HiSparse, `HiSparseConfig.indexer="lightning"`) path.

A DSA layer's caches (kv_cache.kv_pool.MLACacheSpec): `latent` [num_blocks, block_size, 1,
kv_lora_rank + rope] and, in a layer with an indexer, `index_k` [num_blocks, block_size,
1, index_dim], in both memory kinds with shared block ids. Each layer of a step, over the
flat token axis (rows cut by cu_q_lens; a token's position is kv_len - q_len + its index
in the row):

    write    each token's latent entry and indexer key into its slot (slot_ids)
    select   per query token, the indexer's score of every key of its row at a position
             <= its own, the top `index_topk` positions (all of them when fewer: no
             scoring then); a layer without an indexer takes the previous layer's
    address  position p of a row -> the device token table[p // bs] * bs + p % bs
             offloaded rows (HiSparse): resolve -> load, at token granularity (below)
    attend   kernels' sparse_mla_decode(q, latent pages, token addresses): every query
             over its selected entries, prefill and decode alike (DSA's sparse prefill)

A step whose rows are all shorter than index_topk (its table width x block size is not
above it) selects every earlier key of every query: it attends densely, in place, with the
dense rows' kernel (ragged_paged_attention over the latent pages, MQA with the latent as
the value), the same values without the gather (a dense MLA model is one whose index_topk
is at least max_model_len).

Tiered rows (`metadata.sparse_rows`: offloaded sequences, some blocks only in the
pinned_host pool). The indexer needs every key of the row, so the indexer keys of every
host block stay on the device (`host_index` [num_host_blocks, block_size, 1, index_dim],
written when a block is copied to the host: the role the key bounds play for llama
models); a dropped block's keys are read there. The indexer picks tokens, so the hot
buffer is token-granular: its device blocks (`hot_slots`, hot_buffer_blocks of them)
are hot_buffer_blocks x block_size token slots, and `resolver.resolve` runs with a token
as its unit (resident token / hot-buffer token / miss loaded from its host token into the
LRU slot), and `resolver.load_tokens` moves exactly the missed tokens' latent entries
(one batched call per layer). SGLang's
HiSparse keeps the same token-granular buffer for DSA.

8-bit indexer keys (`MLACacheSpec.index_cache_dtype` int8 / fp8_e4m3: the layer's caches
are (latent, index values, index scales), and a tiered layer's `host_index` the same
pair): as DeepSeek-V3.2's reference indexer (`rotate_activation`, then `fp8_index` over
an fp8 key cache with a scale per 128 values), each new key is rotated by the normalized
Hadamard matrix (`hadamard`; orthogonal, so q . k is unchanged, and outlier dims are
spread over all of them before the per-token scale is taken), then quantized with one
float32 scale per token (kernels_pallas.quant); the select rotates the indexer queries
the same way and scores the dequantized keys (the GPU kernel reads the 8-bit values and
scales in place). A dim that is not a power of 2 is not rotated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import kernels_pallas
from hisparse_jax.kv_cache.kv_pool import from_storage, to_storage
from hisparse_jax.sparse import resolver
from hisparse_jax.sparse.attention import COUNT_FIELDS, StepMetadata
from kernels_pallas import quant
from kernels_pallas.common import packed_ids
from models.mla_attention import MLAStep, index_scores

# The indexer scores a tile of query tokens at a time against their rows' keys: at most
# this many float32 key elements ([tile, keys, index_dim]) are gathered at once.
MAX_TILE_KEY_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class DsaStatic:
  """Static settings of the DSA attention of a step program."""

  index_topk: int
  kv_lora_rank: int
  softmax_scale: float
  # HiSparse (None: every block of every row is on the device):
  hot_buffer_blocks: int = 0
  thrash_window_steps: int = 0
  device_sharding: jax.sharding.Sharding | None = None
  host_sharding: jax.sharding.Sharding | None = None
  one_memory: bool | None = None
  host_copy: str = "xla"  # resolver.load_tokens' (transfer.host_copy_mode)
  tiered: bool = False
  record_topk: bool = False  # the new cache holds each token's selection ("topk")


@functools.cache
def hadamard(dim: int) -> np.ndarray | None:
  """float32 [dim, dim]: the Sylvester Hadamard matrix scaled by dim**-0.5 (symmetric and
  orthogonal: x @ H is DeepSeek's `hadamard_transform(x, scale=dim**-0.5)`); None when
  dim is not a power of 2."""
  if dim < 1 or dim & (dim - 1):
    return None
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < dim:
    h = np.block([[h, h], [h, -h]])
  return h * np.float32(dim ** -0.5)


def rotate(x: jax.Array) -> jax.Array:
  """x [..., dim] @ `hadamard(dim)` in float32 (x as is when dim is not a power of 2)."""
  h = hadamard(x.shape[-1])
  if h is None:
    return x.astype(jnp.float32)
  return jnp.matmul(x.astype(jnp.float32), jnp.asarray(h), precision=lax.Precision.HIGHEST)


def quantize_index_keys(index_k: jax.Array, values_dtype) -> tuple[jax.Array, jax.Array]:
  """New indexer keys [tokens, dim] -> (8-bit values [tokens, dim] of `values_dtype`:
  int8, or uint8 fp8_e4m3 bits; float32 scales [tokens, 1]) of the rotated keys."""
  return quant.quantize(rotate(index_k), quant.kind_of(values_dtype))


def index_keys(pages: tuple, kv_dtype):
  """A layer's indexer keys as `select` reads them: the storage array, or with 8-bit keys
  (a (values, scales) pair) `QuantizedPages` of logical dtype kv_dtype."""
  if len(pages) == 1:
    return pages[0]
  return quant.QuantizedPages(pages[0], pages[1], kv_dtype)


def _gathered_keys(keys, ids: jax.Array, kv_dtype) -> jax.Array:
  """keys[ids] in their logical dtype (8-bit: dequantized in float32; `index_scores`
  computes in float32 either way)."""
  if isinstance(keys, quant.QuantizedPages):
    return quant.dequantize(keys.values[ids], keys.scales[ids], jnp.float32)
  return from_storage(keys[ids], kv_dtype)


def write_entries(pages: jax.Array, new: jax.Array, slot_ids: jax.Array, kv_dtype
                  ) -> jax.Array:
  """new [tokens, width] (logical dtype) into pages [num_blocks, block_size, 1, width]
  (storage dtype) at slot_ids (block * block_size + offset; negative: not written)."""
  num_blocks, block_size = pages.shape[:2]
  # Indexed by (block, offset), not through a reshape of the pages: XLA:CPU updates the
  # donated pages in place only when the scatter is on them as they are (a reshaped view
  # made it copy the whole array every step).
  block = jnp.where(slot_ids >= 0, slot_ids // block_size, num_blocks)
  return pages.at[block, slot_ids % block_size, 0].set(
      to_storage(new, kv_dtype, pages.dtype), mode="drop")


def token_rows(metadata: StepMetadata, num_tokens: int) -> tuple[jax.Array, jax.Array]:
  """(row of each token, its position); padding tokens get row num_seqs - 1 clipped and
  position -1 (they see no key)."""
  cu = metadata.cu_q_lens
  batch = metadata.kv_lens.shape[0]
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  row = jnp.clip(jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32), 0, batch - 1)
  q_len = cu[row + 1] - cu[row]
  live = t < cu[batch]
  pos = metadata.kv_lens[row] - q_len + (t - cu[row])
  return row, jnp.where(live, pos, -1)


def _tile(num_tokens: int, num_keys: int, index_dim: int) -> int:
  """Query tokens scored at once: a power of 2 dividing num_tokens (a power-of-2 bucket)."""
  tile = 1
  while (tile * 2 <= num_tokens and num_tokens % (tile * 2) == 0
         and tile * 2 * num_keys * index_dim <= MAX_TILE_KEY_ELEMENTS):
    tile *= 2
  return tile


def select(step: MLAStep, index_pages, host_index, metadata: StepMetadata, row, pos,
           index_topk: int, kv_dtype, scores_kernel=None) -> jax.Array:
  """int32 [tokens, k] selected key positions of each token (negative: none), k =
  min(index_topk, table width x block_size). index_pages: the layer's indexer keys
  (storage dtype, or 8-bit `QuantizedPages` of rotated keys: `index_keys`); host_index:
  those of host blocks on the device (HiSparse, the same form) or None.
  scores_kernel: the GPU backends' `KernelOps.index_scores` (kernels_pallas.index_scores:
  the keys read in place, a tile of tokens a launch, its scores bounding the tile), else
  the keys are gathered and scored in jnp (`index_scores`)."""
  tables = metadata.block_tables
  width = tables.shape[1]
  block_size = index_pages.shape[1]
  num_keys = width * block_size
  keys_pos = jnp.arange(num_keys, dtype=jnp.int32)
  k = min(index_topk, num_keys)
  if k == num_keys:  # every allowed key is selected: no scoring needed (the same set)
    return jnp.where(keys_pos[None, :] <= pos[:, None], keys_pos[None, :], -1)
  index_q, index_w = step.index_q[0], step.index_w[0]
  if isinstance(index_pages, quant.QuantizedPages):  # the keys are stored rotated
    index_q = rotate(index_q).astype(index_q.dtype)
  num_tokens, _, index_dim = index_q.shape
  # (the kernel writes one float32 score a key, the jnp path gathers index_dim values)
  tile = _tile(num_tokens, num_keys, 1 if scores_kernel is not None else index_dim)
  if scores_kernel is not None:  # the kernel's operands, in their logical dtype
    logical = lambda x: x if isinstance(x, quant.QuantizedPages) else from_storage(  # noqa: E731
        x, kv_dtype)
    keys_in_place = (logical(index_pages),) + (
        () if host_index is None else (logical(host_index),))

  def tile_topk(i, out):
    toks = i * tile + jnp.arange(tile)
    blocks = tables[row[toks]]  # [tile, width]
    if scores_kernel is not None:  # dropped blocks' keys: their device copy by host id
      host = () if host_index is None else (metadata.host_tables[row[toks]],)
      scores = scores_kernel(index_q[toks], index_w[toks], keys_in_place[0], blocks,
                             *keys_in_place[1:], *host)
    else:
      keys = _gathered_keys(index_pages, blocks, kv_dtype)  # [tile, width, bs, 1, d]
      if host_index is not None:  # dropped blocks: their keys' device copy by host id
        host = _gathered_keys(host_index, metadata.host_tables[row[toks]], kv_dtype)
        keys = jnp.where((blocks != 0)[:, :, None, None, None], keys, host)
      keys = keys.reshape(tile, num_keys, index_dim)
      scores = index_scores(index_q[toks], keys, index_w[toks])  # [tile, keys]
    scores = jnp.where(keys_pos[None, :] <= pos[toks][:, None], scores, -jnp.inf)
    values, top = lax.top_k(scores, k)
    top = jnp.where(values > -jnp.inf, top, -1).astype(jnp.int32)
    return lax.dynamic_update_slice_in_dim(out, top, i * tile, 0)

  # Only the tiles holding the step's tokens (the padding after them selects nothing).
  num_live = metadata.cu_q_lens[-1]
  return lax.fori_loop(0, (num_live + tile - 1) // tile, tile_topk,
                       jnp.full((num_tokens, k), -1, jnp.int32))


def device_addresses(tables: jax.Array, row: jax.Array, sel: jax.Array, block_size: int
                     ) -> jax.Array:
  """Device token of each selected position of resident rows (negative: none)."""
  blocks = jnp.take_along_axis(tables[row], jnp.maximum(sel, 0) // block_size, axis=1)
  return jnp.where(sel >= 0, blocks * block_size + jnp.maximum(sel, 0) % block_size, -1)


def attend(ops: kernels_pallas.KernelOps, kv_dtype, static: DsaStatic, step: MLAStep, *,
           layer_idx, kv_cache, metadata: StepMetadata, config, prev_topk):
  """The `MLAAttnFn` of a step: (out [1, tokens, heads, kv_lora_rank], new cache, the
  tokens' selections [tokens, k]). kv_cache: (latent pages,) or (latent, index_k) pages;
  tiered: a dict of `pages`, `host_index` (indexer keys of host blocks, layers with an
  indexer), `host` (the host pool's latent pages) and `state` (hot-buffer state)."""
  del layer_idx, config
  cache = dict(kv_cache) if static.tiered else dict(pages=tuple(kv_cache))
  pages = cache["pages"]
  num_tokens = step.q.shape[1]
  slot_ids = metadata.slot_ids
  latent = write_entries(pages[0], step.kv[0], slot_ids, kv_dtype)
  index_pages = None
  if step.index_q is not None:
    if len(pages) == 3:  # 8-bit indexer keys: rotated, quantized, with their scales
      values, scales = quantize_index_keys(step.index_k[0], pages[1].dtype)
      index_pages = (write_entries(pages[1], values, slot_ids, kv_dtype),
                     write_entries(pages[2], scales, slot_ids, kv_dtype))
    else:
      index_pages = (write_entries(pages[1], step.index_k[0], slot_ids, kv_dtype),)
  block_size = latent.shape[1]
  row, pos = token_rows(metadata, num_tokens)
  if index_pages is not None:
    # (The indexer keys of dropped blocks: only offloaded rows have any.)
    host_index = cache.get("host_index") if metadata.num_sparse_rows else None
    if host_index is not None:
      host_index = index_keys(host_index if isinstance(host_index, tuple) else (host_index,),
                              kv_dtype)
    sel = select(step, index_keys(index_pages, kv_dtype), host_index, metadata, row, pos,
                 static.index_topk, kv_dtype, scores_kernel=ops.index_scores)
  elif prev_topk is None:
    raise ValueError("a DSA layer without an indexer needs the previous layer's top-k")
  else:
    sel = prev_topk
  num_keys = metadata.block_tables.shape[1] * block_size
  out_cache = {}
  if static.index_topk >= num_keys and not (static.tiered and metadata.num_sparse_rows):
    # Every query of the step selects every key it may see (its rows are shorter than
    # index_topk) and every block is on the device: dense MLA, read in place by the
    # dense rows' kernel (the value is each entry's latent part), no gather.
    pages = from_storage(latent, kv_dtype)
    out = ops.ragged_paged_attention(
        step.q[0], pages, pages, metadata.block_tables, metadata.kv_lens, metadata.cu_q_lens,
        sm_scale=static.softmax_scale, **dict(metadata.ragged_hints))
    out = out[..., :static.kv_lora_rank]
    if static.tiered:
      out_cache = dict(state=cache["state"], loaded=jnp.int32(0),
                       counts=jnp.zeros((metadata.kv_lens.shape[0], len(COUNT_FIELDS)),
                                        jnp.int32))
  else:
    addresses = device_addresses(metadata.block_tables, row, sel, block_size)
    if static.tiered:
      latent, addresses, out_cache = _tiered_rows(ops, static, latent, cache, metadata, sel,
                                                  addresses)
    out = ops.sparse_mla_decode(step.q[0], from_storage(latent, kv_dtype), addresses,
                                sm_scale=static.softmax_scale,
                                kv_lora_rank=static.kv_lora_rank)
  new_pages = (latent,) if index_pages is None else (latent, *index_pages)
  if static.record_topk:
    out_cache["topk"] = sel
  if static.tiered:
    new_cache = dict(pages=new_pages, **out_cache)
  else:
    new_cache = new_pages if not static.record_topk else dict(pages=new_pages, **out_cache)
  return out[None], new_cache, sel


def _tiered_rows(ops: kernels_pallas.KernelOps, static: DsaStatic, latent, cache,
                 metadata: StepMetadata, sel, addresses):
  """Resolve -> load for the offloaded rows (`metadata.sparse_rows`, decode rows, packed
  to `num_sparse_rows`), at token granularity; returns (latent pages with the loads, the
  tokens' device addresses with those rows' resolved, cache outputs: state, counts,
  loaded)."""
  batch = metadata.kv_lens.shape[0]
  counts = jnp.zeros((batch, len(COUNT_FIELDS)), jnp.int32)
  num_sparse = min(metadata.num_sparse_rows, batch)
  if not num_sparse:
    return latent, addresses, dict(state=cache["state"], counts=counts, loaded=jnp.int32(0))
  num_device_blocks, block_size = latent.shape[:2]
  width = metadata.block_tables.shape[1]
  num_keys = width * block_size
  rows, live = packed_ids(metadata.sparse_rows, num_sparse)
  token = metadata.cu_q_lens[rows]  # (a tiered row decodes one token)
  row_sel = sel[token]  # [n, k]
  valid = (row_sel >= 0) & live[:, None]
  # Token-granular tiers of each row: position p -> its device token (0: dropped), its
  # host token; hot-buffer token slot j -> device token.
  offset = jnp.arange(num_keys, dtype=jnp.int32) % block_size
  block_of = jnp.arange(num_keys, dtype=jnp.int32) // block_size
  tables = metadata.block_tables[rows][:, block_of]
  host_tables = metadata.host_tables[rows][:, block_of]
  resident = jnp.where(tables != 0, tables * block_size + offset, 0)
  host = jnp.where(host_tables != 0, host_tables * block_size + offset, 0)
  num_slots = static.hot_buffer_blocks * block_size
  j = jnp.arange(num_slots, dtype=jnp.int32)
  slot_tokens = metadata.hot_slots[rows][:, j // block_size] * block_size + j % block_size
  slot_block, last_used, evicted_at = cache["state"]
  num_state_rows = slot_block.shape[0]
  hot_rows = metadata.hot_rows[rows]
  own_row = live & (hot_rows < num_state_rows)
  state_row = jnp.minimum(hot_rows, num_state_rows - 1)
  fresh = (~own_row | metadata.hot_reset[rows])[:, None]
  state = resolver.HotBufferState(
      slot_block=jnp.where(fresh, -1, slot_block[state_row]),
      slot_last_used=jnp.where(fresh, resolver.NEVER, last_used[state_row]),
      evicted_at=jnp.where(fresh, resolver.NEVER, evicted_at[state_row, :num_keys]))
  res = resolver.resolve(jnp.where(valid, row_sel, 0), valid, state, resident, slot_tokens,
                         host, metadata.step, num_device_blocks=num_device_blocks * block_size,
                         thrash_window_steps=static.thrash_window_steps,
                         cpu_kernel=ops.backend == "xla" and _cpu_target())
  latent, loaded = resolver.load_tokens(
      cache["host"][0], latent, res.load_host_ids, res.load_device_ids,
      device_sharding=static.device_sharding, host_sharding=static.host_sharding,
      one_memory=static.one_memory, host_copy=static.host_copy)
  resolved = jnp.where(valid, res.block_tables, -1)
  addresses = addresses.at[jnp.where(live, token, addresses.shape[0])].set(resolved,
                                                                            mode="drop")
  dst = jnp.where(own_row, hot_rows, num_state_rows)
  new_state = (slot_block.at[dst].set(res.state.slot_block, mode="drop"),
               last_used.at[dst].set(res.state.slot_last_used, mode="drop"),
               evicted_at.at[dst, :num_keys].set(res.state.evicted_at, mode="drop"))
  c = res.counts
  row_counts = jnp.stack([c.resident_hits, c.hot_hits, c.misses, c.evictions, c.thrash],
                         axis=-1)
  row_counts = jnp.where(live[:, None], row_counts, 0).astype(jnp.int32)
  counts = counts.at[jnp.where(live, rows, batch)].set(row_counts, mode="drop")
  return latent, addresses, dict(state=new_state, counts=counts, loaded=loaded)


def _cpu_target() -> bool:
  return kernels_pallas.backend.target_platform() == "cpu"

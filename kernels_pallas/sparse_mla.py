"""Sparse MLA decode: each query over its own list of selected tokens of a latent cache.

DeepSeek Sparse Attention's attention in its absorbed (MQA) form (FlashMLA's sparse
decode is the anchor): every query row attends the tokens its indexer picked, listed as
flat token ids (block_id * block_size + offset) into the paged latent cache, the value of
an entry being its first kv_lora_rank dims:

  kv_pages [num_blocks, block_size, 1, kv_lora_rank + rope]   per token: latent | rope key
  indices  [num_queries, topk]    flat token ids, negative = padding
  out[i, h] = sum_j softmax_j(sm_scale * q[i, h] . kv[idx_j]) * kv[idx_j, :kv_lora_rank]

Every listed entry counts once per listing; a row with no valid entry gives zeros; pages
not listed never reach the output (NaN there cannot leak).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Query rows of the reference gathered at once: at most this many float32 elements of
# gathered entries ([rows, topk, width]) live at a time.
REFERENCE_TILE_ELEMENTS = 1 << 24


def _check(q, kv_pages, indices, kv_lora_rank):
  if q.ndim != 3 or kv_pages.ndim != 4 or kv_pages.shape[2] != 1:
    raise ValueError(f"q must be [num_queries, num_heads, width] and kv_pages [num_blocks, "
                     f"block_size, 1, width], got q {q.shape}, kv_pages {kv_pages.shape}")
  if q.shape[-1] != kv_pages.shape[-1] or not 0 < kv_lora_rank <= q.shape[-1]:
    raise ValueError(f"q {q.shape} and kv_pages {kv_pages.shape} must share the width "
                     f"kv_lora_rank ({kv_lora_rank}) + rope")
  if indices.ndim != 2 or indices.shape[0] != q.shape[0] or indices.dtype != jnp.int32:
    raise ValueError(f"indices must be int32 [num_queries={q.shape[0]}, topk], got "
                     f"{indices.dtype}{list(indices.shape)}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_lora_rank"))
def sparse_mla_decode_reference(
    q: jax.Array,  # [num_queries, num_heads, kv_lora_rank + rope]
    kv_pages: jax.Array,  # [num_blocks, block_size, 1, kv_lora_rank + rope]
    indices: jax.Array,  # int32 [num_queries, topk]; negative = padding
    *, sm_scale: float, kv_lora_rank: int) -> jax.Array:
  """[num_queries, num_heads, kv_lora_rank] in q's dtype (float32 math): the gather of the
  listed entries of a tile of query rows at a time (memory bounded by
  REFERENCE_TILE_ELEMENTS), a masked softmax, the weighted sum of their latents."""
  _check(q, kv_pages, indices, kv_lora_rank)
  num_queries, _, width = q.shape
  num_blocks, block_size = kv_pages.shape[:2]
  flat = kv_pages.reshape(num_blocks * block_size, width)
  topk = indices.shape[1]
  tile = 1
  while (tile * 2 <= num_queries and num_queries % (tile * 2) == 0
         and tile * 2 * topk * width <= REFERENCE_TILE_ELEMENTS):
    tile *= 2

  def rows(args):
    q_tile, idx = args  # [tile, heads, width], [tile, topk]
    valid = idx >= 0
    entries = flat[jnp.clip(idx, 0, flat.shape[0] - 1)].astype(jnp.float32)
    entries = jnp.where(valid[..., None], entries, 0.0)  # (no NaN of unlisted tokens)
    s = jnp.einsum("thd,tkd->thk", q_tile.astype(jnp.float32), entries,
                   precision=lax.Precision.HIGHEST) * sm_scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(valid[:, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    out = jnp.einsum("thk,tkd->thd", p, entries[..., :kv_lora_rank],
                     precision=lax.Precision.HIGHEST)
    return (out / jnp.where(l > 0, l, 1.0)).astype(q.dtype)

  n = num_queries // tile
  out = lax.map(rows, (q.reshape(n, tile, *q.shape[1:]), indices.reshape(n, tile, topk)))
  return out.reshape(num_queries, q.shape[1], kv_lora_rank)

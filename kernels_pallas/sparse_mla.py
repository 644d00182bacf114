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

The Pallas kernel: grid (query row, head tile, split); a program holds `block_h` heads of
one query row (padded to a power of 2, at least Triton's 16 dot rows when compiled) and
walks its split of the row's list `tokens_per_step` entries at a time: the entries' rows
are gathered straight from the whole latent pool (one BlockSpec over every block: a
pointer gather through the flat ids on a GPU), latent and rope parts loaded apart so each
dot is power-of-2 wide (DeepSeek: 512 + 64), scores q_lat . k_lat + q_rope . k_rope, an
online softmax, acc += p . latent. Splits are merged outside with a log-sum-exp combine
(paged_attention's). The pure-jnp reference at the bottom is the CPU engine's path.

  indices[i] = [ 907, 12, -1, 4410, ... ]    flat token ids, -1 = padding
                 |split 0 ...| |split 1 ...|  each split: online softmax over its tiles
                 -> (acc, m, l) per split -> combine -> out[i]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import backend, common

# Entries gathered per inner step (Triton needs at least 16 columns per dot).
DEFAULT_TOKENS_PER_STEP = 16
# Split-K: at most this many splits, each of at least this many entries.
MAX_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256
# Query heads per program at most (the tile [block_h, kv_lora_rank] stays in registers).
MAX_BLOCK_H = 64


def _sparse_mla_kernel(
    q_lat_ref,  # [block_h, kv_lora_rank]
    q_rope_ref,  # [block_h, rope]
    kv_ref,  # [num_blocks, block_size, kv_lora_rank + rope] (the whole latent pool)
    idx_ref,  # [tokens_per_split] int32 flat token ids; negative = padding
    o_ref,  # [block_h, kv_lora_rank] f32, unnormalised
    m_ref,  # [block_h] f32 running max
    l_ref,  # [block_h] f32 running sum
    *,
    sm_scale: float,
    tokens_per_step: int,
    kv_lora_rank: int,
    rope: int,
):
  # q_lat / q_rope / o are padded to powers of 2 (rank_p, rope_p: Triton tensors) when
  # kv_lora_rank or rope is not one; the pool is read with its columns past each masked.
  block_h, rank_p = q_lat_ref.shape
  rope_p = q_rope_ref.shape[1]
  padded = (rank_p, rope_p) != (kv_lora_rank, rope)
  block_size = kv_ref.shape[1]
  num_steps = idx_ref.shape[0] // tokens_per_step
  q_lat, q_rope = q_lat_ref[...], q_rope_ref[...]

  def body(step, carry):
    m_prev, l_prev, acc_prev = carry
    idx = idx_ref[pl.ds(step * tokens_per_step, tokens_per_step)]
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0)
    blk, off = safe // block_size, safe % block_size
    # Every axis an array index: [tokens, width] rows gathered through the flat ids.
    shape_lat, shape_rope = (tokens_per_step, rank_p), (tokens_per_step, rope_p)
    lat_cols = lax.broadcasted_iota(jnp.int32, shape_lat, 1)
    rope_cols = lax.broadcasted_iota(jnp.int32, shape_rope, 1)
    lat_idx = (jnp.broadcast_to(blk[:, None], shape_lat),
               jnp.broadcast_to(off[:, None], shape_lat), lat_cols)
    rope_idx = (jnp.broadcast_to(blk[:, None], shape_rope),
                jnp.broadcast_to(off[:, None], shape_rope), kv_lora_rank + rope_cols)
    if padded:  # (columns past kv_lora_rank / rope: not read, 0)
      from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415

      k_lat = plgpu.load(kv_ref.at[lat_idx], mask=lat_cols < kv_lora_rank, other=0)
      k_rope = plgpu.load(kv_ref.at[rope_idx], mask=rope_cols < rope, other=0)
    else:
      k_lat, k_rope = kv_ref[lat_idx], kv_ref[rope_idx]
    s = (jnp.dot(q_lat, k_lat.T, precision=lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32)
         + jnp.dot(q_rope, k_rope.T, precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)) * sm_scale  # [block_h, tokens]
    # Masks built in the shape they are used in (no transposes of masks inside Triton).
    valid_s = jnp.broadcast_to(valid[None, :], (block_h, tokens_per_step))
    valid_v = jnp.broadcast_to(valid[:, None], shape_lat)
    s = jnp.where(valid_s, s, common.MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(valid_s, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + p.sum(axis=-1)
    # Padding entries read token 0 of the null block: zero them, NaN cannot leak.
    v = jnp.where(valid_v, k_lat, jnp.zeros_like(k_lat))
    pv = jnp.dot(p.astype(v.dtype), v, precision=lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32)
    return m_next, l_next, alpha[:, None] * acc_prev + pv

  m0 = jnp.full((block_h,), common.MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((block_h,), jnp.float32)
  acc0 = jnp.zeros((block_h, rank_p), jnp.float32)
  m, l, acc = lax.fori_loop(0, num_steps, body, (m0, l0, acc0))
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def _sparse_mla_call(q, kv_pages, indices, *, sm_scale, kv_lora_rank, block_h,
                     tokens_per_step, num_splits, interpret):
  """Builds grid and BlockSpecs; returns [num_queries, num_heads, kv_lora_rank]."""
  num_queries, num_heads, width = q.shape
  num_blocks, block_size = kv_pages.shape[:2]
  rope = width - kv_lora_rank
  # Triton tensors have power-of-2 sizes: q's two parts and the output padded with zeros,
  # the pool read in place with the columns past each masked (a rank of 192: 256).
  rank_p, rope_p = common.next_power_of_2(kv_lora_rank), common.next_power_of_2(rope)
  topk = indices.shape[1]
  head_tiles = common.cdiv(num_heads, block_h)
  per_split = common.round_up(common.cdiv(topk, num_splits), tokens_per_step)
  idx = jnp.pad(indices, ((0, 0), (0, num_splits * per_split - topk)), constant_values=-1)
  idx = idx.reshape(num_queries, num_splits, per_split)
  q = jnp.pad(q, ((0, 0), (0, head_tiles * block_h - num_heads), (0, 0)))
  q = q.reshape(num_queries, head_tiles, block_h, width)
  kernel = functools.partial(_sparse_mla_kernel, sm_scale=sm_scale,
                             tokens_per_step=tokens_per_step, kv_lora_rank=kv_lora_rank,
                             rope=rope)
  q_lat = jnp.pad(q[..., :kv_lora_rank], ((0, 0),) * 3 + ((0, rank_p - kv_lora_rank),))
  q_rope = jnp.pad(q[..., kv_lora_rank:], ((0, 0),) * 3 + ((0, rope_p - rope),))
  width_p = max(width, kv_lora_rank + rope_p)  # (the rope part's masked columns past it)
  part_shape = (num_splits, num_queries, head_tiles, block_h)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(num_queries, head_tiles, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, block_h, rank_p), lambda i, h, s: (i, h, 0, 0)),
          pl.BlockSpec((None, None, block_h, rope_p), lambda i, h, s: (i, h, 0, 0)),
          pl.BlockSpec((num_blocks, block_size, None, width_p), lambda i, h, s: (0, 0, 0, 0)),
          pl.BlockSpec((None, None, per_split), lambda i, h, s: (i, s, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, block_h, rank_p),
                       lambda i, h, s: (s, i, h, 0, 0)),
          pl.BlockSpec((None, None, None, block_h), lambda i, h, s: (s, i, h, 0)),
          pl.BlockSpec((None, None, None, block_h), lambda i, h, s: (s, i, h, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((*part_shape, rank_p), jnp.float32),
          jax.ShapeDtypeStruct(part_shape, jnp.float32),
          jax.ShapeDtypeStruct(part_shape, jnp.float32),
      ],
      interpret=interpret,
      compiler_params=backend.compiler_params(interpret),
      name="sparse_mla_decode",
  )(q_lat, q_rope, kv_pages, idx)
  # Log-sum-exp combine of the splits. Empty splits carry m = MASK_VALUE, l = 0.
  m_all = m.max(axis=0)
  w = jnp.exp(m - m_all[None])
  l_all = (w * l).sum(axis=0)
  o_all = (w[..., None] * o).sum(axis=0)
  out = jnp.where(l_all[..., None] > 0, o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None],
                  0.0)
  out = out.reshape(num_queries, head_tiles * block_h, rank_p)[:, :num_heads, :kv_lora_rank]
  return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "interpret",
                                             "block_h", "tokens_per_step", "num_splits"))
def sparse_mla_decode(
    q: jax.Array,  # [num_queries, num_heads, kv_lora_rank + rope]
    kv_pages: jax.Array,  # [num_blocks, block_size, 1, kv_lora_rank + rope]
    indices: jax.Array,  # int32 [num_queries, topk]; negative = padding
    *,
    sm_scale: float,
    kv_lora_rank: int,
    interpret: bool | None = None,
    block_h: int | None = None,
    tokens_per_step: int | None = None,
    num_splits: int | None = None,
) -> jax.Array:
  """Each query row over its listed tokens (module docstring): [num_queries, num_heads,
  kv_lora_rank] in q's dtype. interpret: None = interpret mode on CPU, compiled on GPU;
  block_h, tokens_per_step, num_splits: tuning knobs (None: defaults). The compiled kernel
  needs power-of-2 block_h and tokens_per_step (Triton tensors); a kv_lora_rank or rope
  that is not one is padded (its columns past masked)."""
  _check(q, kv_pages, indices, kv_lora_rank)
  interpret = backend.resolve_interpret(interpret)
  num_heads, width = q.shape[1:]
  topk = indices.shape[1]
  if tokens_per_step is None:
    tokens_per_step = max(DEFAULT_TOKENS_PER_STEP, backend.min_dot_rows(interpret))
  if block_h is None:
    block_h = min(MAX_BLOCK_H, common.next_power_of_2(
        max(num_heads, backend.min_dot_rows(interpret))))
  if num_splits is None:
    steps = common.cdiv(topk, tokens_per_step)
    num_splits = max(1, min(MAX_SPLITS, topk // MIN_TOKENS_PER_SPLIT, steps))
  for name, value in (("block_h", block_h), ("tokens_per_step", tokens_per_step),
                      ("num_splits", num_splits)):
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  backend.check_triton_sizes(interpret, block_h=block_h, tokens_per_step=tokens_per_step)
  return _sparse_mla_call(q, kv_pages, indices, sm_scale=float(sm_scale),
                          kv_lora_rank=kv_lora_rank, block_h=block_h,
                          tokens_per_step=tokens_per_step, num_splits=num_splits,
                          interpret=interpret)


# Query rows of the reference gathered at once: at most this many float32 elements of
# gathered entries ([rows, topk, width]) live at a time.
REFERENCE_TILE_ELEMENTS = 1 << 24


def _check(q, kv_pages, indices, kv_lora_rank):
  if q.ndim != 3 or kv_pages.ndim != 4 or kv_pages.shape[2] != 1:
    raise ValueError(f"q must be [num_queries, num_heads, width] and kv_pages [num_blocks, "
                     f"block_size, 1, width], got q {q.shape}, kv_pages {kv_pages.shape}")
  if q.shape[-1] != kv_pages.shape[-1] or not 0 < kv_lora_rank < q.shape[-1]:
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

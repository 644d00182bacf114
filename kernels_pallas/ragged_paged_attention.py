"""Ragged paged attention: prefill, chunked prefill and decode rows in one call.

Sequence b owns query rows ``cu_q_lens[b]:cu_q_lens[b+1]`` of ``q``; they are its
last ``q_len`` tokens, so query i sits at KV position ``kv_len - q_len + i`` and
attends keys ``j <= kv_len - q_len + i`` (and, with ``sliding_window=w``, only
``j > kv_len - q_len + i - w``: the last w tokens, itself included).

The wrapper cuts every sequence's queries into tiles of ``block_q`` tokens, so a
grid program never straddles two sequences::

  q rows:   |-- seq 0 (5) --|seq 1 (1)|------ seq 2 (11) ------|
  tiles:    [ t0 (4) ][t1 1][ t2 1 ]  [ t3 (4) ][ t4 ][ t5 3 ]  [unused...]
  grid:     (num_tiles, num_kv_heads); a tile's rows are (token, q head of the group)

Tile metadata (query start inside its sequence, q_len, kv_len) and each tile's
block table are computed in jnp before the call; the kernel loops over exactly the
KV blocks its causal/windowed range touches.

A GQA group that is not a power of 2 is padded to ``block_h = next_power_of_2(group)``
rows per token (the padding rows attend nothing useful and are dropped); a head_dim
that is not a power of 2 is tiled at the next one, the pages' padding columns masked
(see common.padded_head_dim).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import backend, common

DEFAULT_BLOCKS_PER_STEP = 2
DEFAULT_BLOCK_Q_INTERPRET = 8
DEFAULT_BLOCK_Q_GPU = 16
# The default block_q shrinks so that a tile has at most this many rows (block_q * block_h):
# groups up to 16 keep the defaults above, groups of 20 or 32 get 8-token tiles.
MAX_DEFAULT_ROWS = 256
REFERENCE_BLOCK_Q = 16


def _ragged_kernel(
    meta_ref,  # [4] int32: q_start (inside the sequence), q_len, kv_len, unused
    q_ref,  # [block_q * block_h, width], row = token * block_h + head; width: see below
    k_pages_ref,  # [num_blocks, block_size, width] (one KV head; columns >= head_dim masked)
    v_pages_ref,  # [num_blocks, block_size, width] (one KV head)
    *refs,  # (k_scales_ref, v_scales_ref: [num_blocks, block_size] when `quantized`),
    # block_tables_ref [max_blocks_padded], o_ref [block_q * block_h, width]
    quantized: bool,
    block_h: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    blocks_per_step: int,
    head_dim: int,  # width = head_dim padded to a power of 2; q is 0 past head_dim
):
  k_scales_ref = v_scales_ref = None
  if quantized:
    k_scales_ref, v_scales_ref, *refs = refs
  block_tables_ref, o_ref = refs
  rows, width = q_ref.shape
  block_q = rows // block_h
  block_size = k_pages_ref.shape[1]
  tokens_per_step = blocks_per_step * block_size
  q_start, q_len, kv_len = meta_ref[0], meta_ref[1], meta_ref[2]
  offset = kv_len - q_len

  row_token = q_start + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // block_h
  row_pos = offset + row_token  # [rows, 1] KV position of each query row
  row_valid = row_token < q_len
  last_pos = jnp.minimum(offset + q_start + block_q - 1, kv_len - 1)
  end_block = pl.cdiv(jnp.maximum(last_pos + 1, 0), block_size)
  start_block = jnp.int32(0)
  if sliding_window is not None:
    start_block = jnp.maximum(offset + q_start - sliding_window + 1, 0) // block_size
  num_steps = pl.cdiv(jnp.maximum(end_block - start_block, 0), blocks_per_step)
  q = q_ref[...]

  def body(step, carry):
    m_prev, l_prev, acc_prev = carry
    local_block = start_block + step * blocks_per_step
    block_ids = block_tables_ref[pl.ds(local_block, blocks_per_step)]
    k = common.load_kv_blocks(k_pages_ref, k_scales_ref, block_ids, head_dim, q.dtype)
    v = common.load_kv_blocks(v_pages_ref, v_scales_ref, block_ids, head_dim, q.dtype)
    k, v = k.reshape(tokens_per_step, width), v.reshape(tokens_per_step, width)
    s = jnp.dot(q, k.T, precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32) * sm_scale  # [rows, tokens_per_step]
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = local_block * block_size + lax.broadcasted_iota(
        jnp.int32, (1, tokens_per_step), 1)
    valid = (key_pos <= row_pos) & (key_pos < kv_len) & row_valid
    if sliding_window is not None:
      valid &= key_pos > row_pos - sliding_window
    s = jnp.where(valid, s, common.MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + p.sum(axis=-1)
    key_valid = local_block * block_size + lax.broadcasted_iota(
        jnp.int32, (tokens_per_step, 1), 0) < kv_len
    v = jnp.where(key_valid, v, jnp.zeros_like(v))
    pv = jnp.dot(p.astype(v.dtype), v, precision=lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32)
    return m_next, l_next, alpha[:, None] * acc_prev + pv

  m0 = jnp.full((rows,), common.MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((rows,), jnp.float32)
  acc0 = jnp.zeros((rows, width), jnp.float32)
  _, l, acc = lax.fori_loop(0, num_steps, body, (m0, l0, acc0))
  safe_l = jnp.where(l > 0, l, 1.0)
  o_ref[...] = jnp.where(l[:, None] > 0, acc / safe_l[:, None], 0.0).astype(o_ref.dtype)


def _tile_plan(cu_q_lens, kv_lens, num_tokens: int, block_q: int, num_tiles: int):
  """Per tile: (seq id, meta [q_start, q_len, kv_len, 0]); per token: its flat tile row."""
  batch = kv_lens.shape[0]
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]  # [batch]
  cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                              jnp.cumsum((q_lens + block_q - 1) // block_q, dtype=jnp.int32)])
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  tile_seq = jnp.minimum(jnp.searchsorted(cu_tiles[1:], tile, side="right"), batch - 1)
  used = tile < cu_tiles[batch]
  q_start = (tile - cu_tiles[tile_seq]) * block_q
  meta = jnp.stack([q_start, jnp.where(used, q_lens[tile_seq], 0),
                    jnp.where(used, kv_lens[tile_seq], 0), jnp.zeros_like(tile)], axis=-1)
  token = jnp.arange(num_tokens, dtype=jnp.int32)
  token_seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], token, side="right"), batch - 1)
  r = token - cu_q_lens[token_seq]
  token_row = (cu_tiles[token_seq] + r // block_q) * block_q + r % block_q
  tile_first_token = cu_q_lens[tile_seq] + q_start
  return tile_seq, meta, token_row, tile_first_token


def _ragged_call(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, sm_scale,
                 soft_cap, sliding_window, block_q, blocks_per_step, block_h, width,
                 interpret):
  """Builds tiles, grid and BlockSpecs; returns [total_q_tokens, num_q_heads, head_dim]."""
  num_tokens, num_q_heads, head_dim = q.shape
  num_blocks, block_size, num_kv_heads, _ = k_pages.shape
  (k_pages, k_scales), (v_pages, v_scales) = map(common.page_arrays, (k_pages, v_pages))
  quantized = k_scales is not None
  batch = kv_lens.shape[0]
  group = num_q_heads // num_kv_heads
  num_tiles = common.cdiv(num_tokens, block_q) + batch
  rows = block_q * block_h

  tile_seq, meta, token_row, tile_first = _tile_plan(cu_q_lens, kv_lens, num_tokens,
                                                     block_q, num_tiles)
  tables = jnp.pad(block_tables, ((0, 0), (0, blocks_per_step)))[tile_seq]
  # Gather q into tiles: [num_tiles, num_kv_heads, block_q * block_h, head_dim].
  src = jnp.clip(tile_first[:, None] + jnp.arange(block_q)[None, :], 0, num_tokens - 1)
  qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, block_h - group), (0, width - head_dim)))
  q_tiles = qg[src].transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, width)

  kernel = functools.partial(_ragged_kernel, quantized=quantized, block_h=block_h,
                             sm_scale=sm_scale, soft_cap=soft_cap,
                             sliding_window=sliding_window, blocks_per_step=blocks_per_step,
                             head_dim=head_dim)
  pages_spec = pl.BlockSpec((num_blocks, block_size, None, width), lambda t, h: (0, 0, h, 0))
  scales_spec = pl.BlockSpec((num_blocks, block_size, None), lambda t, h: (0, 0, h))
  scales, scales_specs = ((k_scales, v_scales), [scales_spec] * 2) if quantized else ((), [])
  tile_spec = pl.BlockSpec((None, None, rows, width), lambda t, h: (t, h, 0, 0))
  o = pl.pallas_call(
      kernel,
      grid=(num_tiles, num_kv_heads),
      in_specs=[
          pl.BlockSpec((None, 4), lambda t, h: (t, 0)),
          tile_spec,
          pages_spec,
          pages_spec,
          *scales_specs,
          pl.BlockSpec((None, tables.shape[1]), lambda t, h: (t, 0)),
      ],
      out_specs=tile_spec,
      out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
      interpret=interpret,
      compiler_params=backend.compiler_params(interpret),
      name="ragged_paged_attention",
  )(meta, q_tiles, k_pages, v_pages, *scales, tables)

  o = o.reshape(num_tiles, num_kv_heads, block_q, block_h, width).transpose(0, 2, 1, 3, 4)
  o = o.reshape(num_tiles * block_q, num_kv_heads, block_h, width)[token_row, :, :group, :head_dim]
  o = o.reshape(num_tokens, num_q_heads, head_dim)
  # Padding tokens past cu_q_lens[-1] land on invalid rows; zero them explicitly anyway.
  return jnp.where((jnp.arange(num_tokens) < cu_q_lens[batch])[:, None, None], o, 0).astype(
      q.dtype)


def _check(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, sliding_window):
  _, _, num_kv_heads, head_dim = common.check_pages(k_pages, v_pages)
  common.check_query(q, num_kv_heads, head_dim, k_pages.dtype)
  batch = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
  if batch < 1:
    raise ValueError(f"kv_lens must be int32 [batch >= 1], got shape {kv_lens.shape}")
  common.check_int32("kv_lens", kv_lens, (batch,))
  common.check_int32("cu_q_lens", cu_q_lens, (batch + 1,))
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(
        f"block_tables must be int32 [batch={batch}, max_blocks_per_seq], got shape "
        f"{block_tables.shape}")
  common.check_int32("block_tables", block_tables, block_tables.shape)
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "interpret", "block_q", "blocks_per_step"))
def ragged_paged_attention(
    q: jax.Array,  # [total_q_tokens, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: jax.Array,  # int32 [batch, max_blocks_per_seq]
    kv_lens: jax.Array,  # int32 [batch]
    cu_q_lens: jax.Array,  # int32 [batch + 1]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool | None = None,
    block_q: int | None = None,
    blocks_per_step: int | None = None,
) -> jax.Array:
  """Causal attention of several sequences' newest tokens over their paged KV.

  Args:
    q: [total_q_tokens, num_q_heads, head_dim], sequences concatenated in order.
    k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim], already
      holding the new tokens (write_kv first); or both `QuantizedPages` (8-bit values and
      their scales, dequantized as the kernel loads each block).
    block_tables: int32 [batch, max_blocks_per_seq], padded with 0.
    kv_lens: int32 [batch], KV tokens of each sequence, new ones included
      (kv_lens[b] >= q_len[b]).
    cu_q_lens: int32 [batch + 1], cumulative query counts; cu_q_lens[-1] may be
      below total_q_tokens (trailing padding rows give zeros).
    sm_scale, soft_cap: as in paged_attention.
    sliding_window: if set, each query attends its last `sliding_window` tokens.
    interpret: None = interpret mode on CPU, compiled on GPU (see backend.py).
    block_q, blocks_per_step: tuning knobs; None picks defaults (block_q: 8 tokens per
      tile in interpret mode, 16 compiled, fewer where the GQA group would make a tile
      over MAX_DEFAULT_ROWS rows).

  Returns:
    [total_q_tokens, num_q_heads, head_dim] in q's dtype.
  """
  _check(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, sliding_window)
  interpret = backend.resolve_interpret(interpret)
  _, block_size, num_kv_heads, head_dim = k_pages.shape
  group = q.shape[1] // num_kv_heads
  block_h = common.next_power_of_2(group)
  if block_q is None:
    block_q = DEFAULT_BLOCK_Q_INTERPRET if interpret else DEFAULT_BLOCK_Q_GPU
    block_q = max(1, min(block_q, MAX_DEFAULT_ROWS // block_h))
  block_q = max(block_q, common.cdiv(backend.min_dot_rows(interpret), block_h))
  if blocks_per_step is None:
    blocks_per_step = max(DEFAULT_BLOCKS_PER_STEP, backend.min_dot_rows(interpret) // block_size)
  backend.check_triton_sizes(interpret, rows=block_q * block_h,
                             tokens_per_step=block_size * blocks_per_step)
  return _ragged_call(
      q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
      sm_scale=head_dim**-0.5 if sm_scale is None else float(sm_scale), soft_cap=soft_cap,
      sliding_window=sliding_window, block_q=block_q, blocks_per_step=blocks_per_step,
      block_h=block_h, width=common.padded_head_dim(head_dim, backend.min_dot_rows(interpret)),
      interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "interpret"))
def ragged_paged_attention_reference(
    q: jax.Array,  # [total_q_tokens, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: jax.Array,  # int32 [batch, max_blocks_per_seq]
    kv_lens: jax.Array,  # int32 [batch]
    cu_q_lens: jax.Array,  # int32 [batch + 1]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
  """Pure-jnp reference (the "xla" backend): masked softmax per query tile.

  Queries are grouped in tiles of REFERENCE_BLOCK_Q tokens of one sequence (as the
  kernel does), so each sequence's KV is gathered once per tile, not once per token.
  """
  del interpret
  _check(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, sliding_window)
  num_tokens, num_q_heads, head_dim = q.shape
  _, _, num_kv_heads, _ = k_pages.shape
  batch = kv_lens.shape[0]
  group = num_q_heads // num_kv_heads
  scale = head_dim**-0.5 if sm_scale is None else sm_scale
  block_q = REFERENCE_BLOCK_Q
  num_tiles = common.cdiv(num_tokens, block_q) + batch
  tile_seq, meta, token_row, tile_first = _tile_plan(cu_q_lens, kv_lens, num_tokens,
                                                     block_q, num_tiles)
  q_start, q_len, kv_len = meta[:, 0:1], meta[:, 1:2], meta[:, 2:3]  # [num_tiles, 1]
  row = q_start + jnp.arange(block_q)[None, :]  # [num_tiles, block_q] index in the sequence
  pos = kv_len - q_len + row  # KV position of each query
  src = jnp.clip(tile_first[:, None] + jnp.arange(block_q)[None, :], 0, num_tokens - 1)
  qt = q[src].reshape(num_tiles, block_q, num_kv_heads, group, head_dim).astype(jnp.float32)
  k = k_pages[block_tables[tile_seq]].astype(jnp.float32)  # [tiles, blocks, bs, h, d]
  v = v_pages[block_tables[tile_seq]].astype(jnp.float32)
  k = k.reshape(num_tiles, -1, num_kv_heads, head_dim)  # [num_tiles, kv_tokens, h, d]
  v = v.reshape(num_tiles, -1, num_kv_heads, head_dim)
  s = jnp.einsum("tqhgd,tkhd->thgqk", qt, k, precision=lax.Precision.HIGHEST) * scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  key = jnp.arange(k.shape[1])[None, None, :]
  valid = (key <= pos[:, :, None]) & (key < kv_len[:, :, None]) & (row < q_len)[:, :, None]
  if sliding_window is not None:
    valid &= key > pos[:, :, None] - sliding_window
  valid5 = valid[:, None, None]  # [num_tiles, 1, 1, block_q, kv_tokens]
  s = jnp.where(valid5, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(valid5, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  denom = p.sum(axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  # Masked V rows are zeroed: 0 * NaN is NaN, and an unused slot may hold anything.
  v = jnp.where((key < kv_len[:, :, None])[:, 0, :, None, None], v, 0.0)
  o = jnp.einsum("thgqk,tkhd->tqhgd", p, v, precision=lax.Precision.HIGHEST)
  o = o.reshape(num_tiles * block_q, num_q_heads, head_dim)[token_row]
  # Tokens past cu_q_lens[-1] (padding) map to a row of some tile; zero them explicitly.
  o = jnp.where((jnp.arange(num_tokens) < cu_q_lens[batch])[:, None, None], o, 0.0)
  return o.astype(q.dtype)

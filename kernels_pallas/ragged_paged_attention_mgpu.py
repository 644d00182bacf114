"""Ragged paged attention for Pallas **Mosaic GPU** (Hopper WGMMA + TMA): mixed steps.

Same contract as :func:`kernels_pallas.ragged_paged_attention.ragged_paged_attention`
(prefill chunks and decode rows in one call; query i of a sequence sits at KV position
``kv_len - q_len + i``; causal, optional sliding window and soft cap; rows past
``cu_q_lens[-1]`` give zeros), and the body of
:mod:`kernels_pallas.paged_attention_mgpu` generalized from one token per program to a
q tile of many tokens of one sequence:

  grid (num_tiles, num_kv_heads); one warpgroup per program; T = tokens_per_step
  q tile = the 64 WGMMA rows: block_q = 64 // group tokens of ONE sequence x the group's
           query heads, row = token * group + head (rows past block_q * group: padding)
           decode row: 1 token (group rows);  prefill chunk: ceil(q_len / block_q) tiles

  GMEM  k_pages[tables[t, i], :, h, :] ──TMA──> k_smem[slot, j*bs:(j+1)*bs] (2 slots)
  SMEM  qo_smem [64, head_dim]; pos_smem [64] int32 (KV position of each row, -1: padding)
        k_smem, v_smem [2, T, head_dim]; p_smem [64, T]
  regs  s = q @ k^T [64, T] -> causal/window mask by absolute position -> online softmax
        -> acc += p @ v

Why tokens x heads as rows: WGMMA multiplies 64-row tiles; a decode row has only `group`
query heads per KV head, so one token's group (as in the decode kernel) is all a decode
tile holds, while a prefill tile fills the 64 rows with 64 // group tokens, each tile
reading its keys once for all of them. The tile plan (each tile's sequence, start inside
it, q_len, kv_len; ``_tile_plan`` of the Triton kernel) and each row's KV position are
computed in XLA before the call; the kernel reads its tile's steps
``[start_step, end_step)``: keys past the tile's last causal position are skipped at step
granularity, and with a sliding window so are the steps wholly before the window of the
tile's first token. Within a step the mask is per row (causal, window).

SMEM per program: 2 * (64 + 4 * T) * head_dim + 128 * T + 256 bytes (head_dim 128, T 64:
88 KiB; within 227 KiB for head_dim <= 128 at T <= 128, head_dim 256 at T = 64).

Limits, refused with a ``ValueError`` naming the size (those of the decode kernel):
dtype bfloat16 or float16 (no float32, no 8-bit pages yet: use the Triton kernel); query
heads per KV head at most 64; ``block_size`` a multiple of 8 dividing ``tokens_per_step``;
``head_dim`` a multiple of 32; ``tokens_per_step`` a multiple of 64 up to 256.

Masked keys get weight 0 but their V rows enter the WGMMA as 0 * v: the pools must hold
finite values (the engine's do), as for the decode kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import common
from kernels_pallas.paged_attention_mgpu import (
  DEFAULT_TOKENS_PER_STEP,
  NUM_SLOTS,
  WGMMA_ROWS,
  _check_mgpu_sizes,
  _smem_transforms,
  refuse_generic_interpret,
  softmax_start,
)
from kernels_pallas.quant import QuantizedPages
from kernels_pallas.ragged_paged_attention import _check, _tile_plan


def _ragged_kernel(q_gmem, pos_gmem, k_gmem, v_gmem, tables_gmem, meta_gmem, o_gmem, *,
                   sm_scale: float, soft_cap: float | None, sliding_window: int | None,
                   blocks_per_step: int, block_q: int, **smem):
  """One program: the q tile t (64 rows) against KV head h over its tile's steps.

  q [num_tiles, num_kv_heads, 64, head_dim], pos int32 [num_tiles, 64] (each row's KV
  position, -1 for padding rows), k and v pages [num_blocks, block_size, num_kv_heads,
  head_dim], tables int32 [num_tiles, steps * blocks_per_step] (the tile's sequence's
  table), meta int32 [num_tiles, 4] (q_start, q_len, kv_len, seq); out as q."""
  qo_smem, pos_smem, k_smem, v_smem, p_smem = (smem[n] for n in ("qo", "pos", "k", "v", "p"))
  k_barriers, v_barriers = smem["k_barriers"], smem["v_barriers"]
  t = lax.axis_index("tile")
  h = lax.axis_index("kv_head")
  block_size = k_gmem.shape[1]
  tokens_per_step = k_smem.shape[1]
  head_dim = qo_smem.shape[1]
  dtype = qo_smem.dtype

  q_start, q_len, kv_len = meta_gmem[t, 0], meta_gmem[t, 1], meta_gmem[t, 2]
  offset = kv_len - q_len
  last_pos = lax.min(offset + q_start + (block_q - 1), kv_len - 1)
  end_step = lax.div(lax.max(last_pos + 1, 0) + (tokens_per_step - 1), tokens_per_step)
  start_step = jnp.int32(0)
  if sliding_window is not None:
    start_step = lax.div(lax.max(offset + q_start - (sliding_window - 1), 0), tokens_per_step)
  num_steps = lax.max(end_step - start_step, jnp.int32(0))

  def fetch(local_step, slot):
    step = start_step + local_step
    for j in range(blocks_per_step):
      block_id = tables_gmem[t, step * blocks_per_step + j]
      rows = pl.ds(j * block_size, block_size)
      plgpu.copy_gmem_to_smem(k_gmem.at[block_id, :, h, :], k_smem.at[slot, rows],
                              k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(v_gmem.at[block_id, :, h, :], v_smem.at[slot, rows],
                              v_barriers.at[slot])

  plgpu.copy_gmem_to_smem(q_gmem.at[t, h], qo_smem, smem["q_barrier"])
  plgpu.copy_gmem_to_smem(pos_gmem.at[t], pos_smem, smem["q_barrier"])
  for slot in range(NUM_SLOTS):
    pl.when(slot < num_steps)(functools.partial(fetch, slot, slot))
  plgpu.barrier_wait(smem["q_barrier"])
  row_pos = plgpu.load(pos_smem, layout=plgpu.Layout.WGMMA.reduce(1))
  row_pos = lax.broadcast_in_dim(row_pos, (WGMMA_ROWS, tokens_per_step), [0])

  def body(local_step, carry):
    m_prev, l_prev, acc_prev = carry
    slot = lax.rem(local_step, NUM_SLOTS)
    step = start_step + local_step
    plgpu.barrier_wait(k_barriers.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
      return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((WGMMA_ROWS, tokens_per_step), jnp.float32))
    s = s * sm_scale  # [64, tokens_per_step]
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    key_pos = step * tokens_per_step + plgpu.broadcasted_iota(
        jnp.int32, (WGMMA_ROWS, tokens_per_step), 1, layout=plgpu.Layout.WGMMA)
    valid = key_pos <= row_pos  # row_pos <= kv_len - 1 (-1 on padding rows)
    if sliding_window is not None:
      valid = valid & (key_pos > row_pos - sliding_window)
    s = jnp.where(valid, s, common.MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    # A row may have no valid key in this step (or none yet): m_next is MASK_VALUE there,
    # so its masked keys' exp(s - m_next) is 1, not 0: zero them by the mask.
    p = jnp.where(valid, jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0])), 0.0)
    l_next = alpha * l_prev + p.sum(axis=1)
    p_smem[...] = p.astype(dtype)
    plgpu.barrier_wait(v_barriers.at[slot])
    plgpu.commit_smem()

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
      return acc_ref[...]

    pv_out = pl.run_scoped(pv, plgpu.ACC((WGMMA_ROWS, head_dim), jnp.float32))
    acc_next = lax.broadcast_in_dim(alpha, acc_prev.shape, [0]) * acc_prev + pv_out
    pl.when(local_step + NUM_SLOTS < num_steps)(
        functools.partial(fetch, local_step + NUM_SLOTS, slot))
    return m_next, l_next, acc_next

  m0, l0, (acc0,) = softmax_start(head_dim)
  _, l, acc = lax.fori_loop(0, num_steps, body, (m0, l0, acc0))
  l_safe = jnp.where(l > 0.0, l, 1.0)  # rows without keys (padding, empty tiles): zeros
  qo_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(qo_smem, o_gmem.at[t, h])
  plgpu.wait_smem_to_gmem(0)


def _scratch_types(dtype, head_dim: int, tokens_per_step: int, blocks_per_step: int) -> dict:
  transforms = _smem_transforms(head_dim, dtype)
  kv_slots = plgpu.SMEM((NUM_SLOTS, tokens_per_step, head_dim), dtype, transforms=transforms)
  arrivals = plgpu.Barrier(num_arrivals=blocks_per_step, num_barriers=NUM_SLOTS)
  return dict(
      qo=plgpu.SMEM((WGMMA_ROWS, head_dim), dtype, transforms=transforms),
      pos=plgpu.SMEM((WGMMA_ROWS,), jnp.int32),
      k=kv_slots, v=kv_slots,
      p=plgpu.SMEM((WGMMA_ROWS, tokens_per_step), dtype, transforms=transforms),
      q_barrier=plgpu.Barrier(num_arrivals=2), k_barriers=arrivals, v_barriers=arrivals)


def supports(q, k_pages, tokens_per_step: int = DEFAULT_TOKENS_PER_STEP) -> bool:
  """Whether the kernel takes these q and pages (the limits of the module docstring)."""
  if isinstance(k_pages, QuantizedPages) or k_pages.ndim != 4 or q.ndim != 3:
    return False
  try:
    _check_mgpu_sizes(q, k_pages, tokens_per_step)
  except ValueError:
    return False
  return True


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "interpret", "tokens_per_step"))
def ragged_paged_attention_mgpu(
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
    interpret: object = None,
    tokens_per_step: int = DEFAULT_TOKENS_PER_STEP,
) -> jax.Array:
  """Causal attention of several sequences' newest tokens over their paged KV.

  Arguments and result as :func:`kernels_pallas.ragged_paged_attention.
  ragged_paged_attention`, within the limits of the module docstring.

  Args:
    interpret: None, False: the compiled Mosaic GPU kernel (runs only on a Hopper-class
      GPU; lowers from any host); or ``InterpretGPUParams()`` to run it on CPU. ``True``
      is refused (the generic interpreter cannot run Mosaic GPU primitives).
    tokens_per_step: keys per pipeline step, a multiple of 64 up to 256.
  """
  _check(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, sliding_window)
  refuse_generic_interpret(interpret)
  if isinstance(k_pages, QuantizedPages):
    raise ValueError("the Mosaic GPU ragged attention takes bfloat16 or float16 pages, got "
                     f"8-bit pages ({k_pages.values.dtype}); use the Triton kernel")
  blocks_per_step = _check_mgpu_sizes(q, k_pages, tokens_per_step)
  num_tokens, num_q_heads, head_dim = q.shape
  _, block_size, num_kv_heads, _ = k_pages.shape
  batch = kv_lens.shape[0]
  group = num_q_heads // num_kv_heads
  block_q = WGMMA_ROWS // group
  num_tiles = common.cdiv(num_tokens, block_q) + batch

  tile_seq, meta, token_row, tile_first = _tile_plan(cu_q_lens, kv_lens, num_tokens,
                                                     block_q, num_tiles)
  max_blocks = block_tables.shape[1]
  width = max(common.cdiv(max_blocks, blocks_per_step), NUM_SLOTS) * blocks_per_step
  tables = jnp.pad(block_tables, ((0, 0), (0, width - max_blocks)))[tile_seq]
  meta = meta.at[:, 3].set(tile_seq)
  # Each row's KV position: row = token * group + head; -1 past the tile's tokens.
  row = jnp.arange(WGMMA_ROWS, dtype=jnp.int32)
  token = meta[:, 0:1] + row[None, :] // group  # [num_tiles, 64] index in the sequence
  row_ok = (row[None, :] < block_q * group) & (token < meta[:, 1:2])
  pos = jnp.where(row_ok, meta[:, 2:3] - meta[:, 1:2] + token, -1).astype(jnp.int32)
  # q tiles [num_tiles, num_kv_heads, 64, head_dim].
  src = jnp.clip(tile_first[:, None] + jnp.arange(block_q)[None, :], 0, num_tokens - 1)
  qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)[src]  # [tiles, bq, h, g, d]
  qg = qg.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, block_q * group, head_dim)
  q_tiles = jnp.pad(qg, ((0, 0), (0, 0), (0, WGMMA_ROWS - block_q * group), (0, 0)))

  kernel = functools.partial(
      _ragged_kernel, sm_scale=head_dim**-0.5 if sm_scale is None else float(sm_scale),
      soft_cap=soft_cap, sliding_window=sliding_window, blocks_per_step=blocks_per_step,
      block_q=block_q)
  (o,) = plgpu.kernel(
      kernel,
      out_type=[jax.ShapeDtypeStruct(q_tiles.shape, q.dtype)],
      scratch_types=_scratch_types(q.dtype, head_dim, tokens_per_step, blocks_per_step),
      grid=(num_tiles, num_kv_heads),
      grid_names=("tile", "kv_head"),
      compiler_params=plgpu.CompilerParams(),
      interpret=None if interpret is False else interpret,
      kernel_name="ragged_paged_attention_mgpu",
  )(q_tiles, pos, k_pages, v_pages, tables, meta)

  o = o[:, :, :block_q * group].reshape(num_tiles, num_kv_heads, block_q, group, head_dim)
  o = o.transpose(0, 2, 1, 3, 4).reshape(num_tiles * block_q, num_kv_heads, group, head_dim)
  o = o[token_row].reshape(num_tokens, num_q_heads, head_dim)
  return jnp.where((jnp.arange(num_tokens) < cu_q_lens[batch])[:, None, None], o, 0).astype(
      q.dtype)

"""Decode paged attention: one query token per sequence over its block table.

Dense and top-k sparse attention are the same call: a sparse table simply lists
the selected blocks. The grid is ``(batch, num_kv_heads * head_splits, num_splits)``;
each program attends ``block_h`` query heads of one KV head (GQA/MQA rows packed
together, the group padded to ``head_splits * block_h`` rows; ``head_splits`` is 1
unless ``block_h`` is set below the group) over one contiguous slice of the block table
(split-K), and the slices are merged with a log-sum-exp combine. A sequence of length
0 yields zeros. A head_dim that is not a power of 2 is tiled at the next one, the
pages' padding columns masked (see common.padded_head_dim).

  block_tables[b] = [ 7, 3, 9, 4, 0, 0 ]   (0 = null block, padding)
                      |split 0| |split 1|  ... each split: online softmax
                      -> (acc, m, l) per split -> combine -> out[b]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import backend, common

# Blocks gathered per inner-loop step: block_size * BLOCKS_PER_STEP keys per dot
# (Triton needs at least 16 columns per dot).
DEFAULT_BLOCKS_PER_STEP = 2
# Split-K: at most this many splits, each of at least this many blocks.
MAX_SPLITS = 16
MIN_BLOCKS_PER_SPLIT = 16


def _paged_attention_kernel(
    q_ref,  # [block_h, width]; width = head_dim padded to a power of 2, zeros past head_dim
    k_pages_ref,  # [num_blocks, block_size, width] (one KV head; columns >= head_dim masked)
    v_pages_ref,  # [num_blocks, block_size, width] (one KV head)
    *refs,  # (k_scales_ref, v_scales_ref: [num_blocks, block_size] when `quantized`),
    # block_tables_ref [blocks_per_split], lengths_ref [1], then the outputs: o_ref
    # [block_h, width] f32 unnormalised, m_ref [block_h] f32 running max, l_ref [block_h]
    # f32 running sum
    quantized: bool,
    sm_scale: float,
    soft_cap: float | None,
    blocks_per_step: int,
    head_dim: int,
):
  k_scales_ref = v_scales_ref = None
  if quantized:
    k_scales_ref, v_scales_ref, *refs = refs
  block_tables_ref, lengths_ref, o_ref, m_ref, l_ref = refs
  split_id = pl.program_id(2)
  block_h, width = q_ref.shape
  block_size = k_pages_ref.shape[1]
  blocks_per_split = block_tables_ref.shape[0]
  tokens_per_step = blocks_per_step * block_size

  length = lengths_ref[0]
  first_block = split_id * blocks_per_split
  num_blocks_here = jnp.clip(pl.cdiv(length, block_size) - first_block, 0, blocks_per_split)
  num_steps = pl.cdiv(num_blocks_here, blocks_per_step)
  q = q_ref[...]

  def body(step, carry):
    m_prev, l_prev, acc_prev = carry
    local_block = step * blocks_per_step
    block_ids = block_tables_ref[pl.ds(local_block, blocks_per_step)]
    k = common.load_kv_blocks(k_pages_ref, k_scales_ref, block_ids, head_dim, q.dtype)
    v = common.load_kv_blocks(v_pages_ref, v_scales_ref, block_ids, head_dim, q.dtype)
    k, v = k.reshape(tokens_per_step, width), v.reshape(tokens_per_step, width)
    s = jnp.dot(q, k.T, precision=lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32) * sm_scale  # [block_h, tokens_per_step]
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    start = (first_block + local_block) * block_size
    # Masks built in the shape they are used in (no transposes of masks inside Triton).
    valid = start + lax.broadcasted_iota(jnp.int32, (1, tokens_per_step), 1) < length
    valid_kv = start + lax.broadcasted_iota(jnp.int32, (tokens_per_step, 1), 0) < length
    s = jnp.where(valid, s, common.MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l_prev + p.sum(axis=-1)
    # Masked keys may sit in stale or null blocks: zero them so NaN/inf cannot leak.
    v = jnp.where(valid_kv, v, jnp.zeros_like(v))
    pv = jnp.dot(p.astype(v.dtype), v, precision=lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32)
    return m_next, l_next, alpha[:, None] * acc_prev + pv

  m0 = jnp.full((block_h,), common.MASK_VALUE, jnp.float32)
  l0 = jnp.zeros((block_h,), jnp.float32)
  acc0 = jnp.zeros((block_h, width), jnp.float32)
  m, l, acc = lax.fori_loop(0, num_steps, body, (m0, l0, acc0))
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def _paged_attention_call(q, k_pages, v_pages, block_tables, kv_lens, *, sm_scale, soft_cap,
                          num_splits, blocks_per_step, block_h, width, interpret,
                          return_lse=False, num_warps=4, num_stages=2):
  """Builds grid and BlockSpecs; returns [batch, num_q_heads, head_dim] (and, with
  `return_lse`, the log-sum-exp [batch, num_q_heads] float32 of the combined splits)."""
  batch, num_q_heads, head_dim = q.shape
  num_blocks, block_size, num_kv_heads, _ = k_pages.shape
  (k_pages, k_scales), (v_pages, v_scales) = map(common.page_arrays, (k_pages, v_pages))
  quantized = k_scales is not None
  group = num_q_heads // num_kv_heads
  max_blocks = block_tables.shape[1]
  head_splits = common.cdiv(group, block_h)
  heads = num_kv_heads * head_splits  # grid axis 1: (KV head, block_h-row slice of its group)

  blocks_per_split = common.round_up(common.cdiv(max_blocks, num_splits), blocks_per_step)
  pad_blocks = num_splits * blocks_per_split - max_blocks
  tables = jnp.pad(block_tables, ((0, 0), (0, pad_blocks)))
  tables = tables.reshape(batch, num_splits, blocks_per_split)
  q4 = q.reshape(batch, num_kv_heads, group, head_dim)
  q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, head_splits * block_h - group), (0, width - head_dim)))
  q4 = q4.reshape(batch, heads, block_h, width)

  kernel = functools.partial(_paged_attention_kernel, quantized=quantized, sm_scale=sm_scale,
                             soft_cap=soft_cap, blocks_per_step=blocks_per_step,
                             head_dim=head_dim)
  if head_splits == 1:
    pages_spec = pl.BlockSpec((num_blocks, block_size, None, width),
                              lambda b, h, s: (0, 0, h, 0))
    scales_spec = pl.BlockSpec((num_blocks, block_size, None), lambda b, h, s: (0, 0, h))
  else:
    pages_spec = pl.BlockSpec((num_blocks, block_size, None, width),
                              lambda b, h, s: (0, 0, h // head_splits, 0))
    scales_spec = pl.BlockSpec((num_blocks, block_size, None),
                               lambda b, h, s: (0, 0, h // head_splits))
  scales, scales_specs = ((k_scales, v_scales), [scales_spec] * 2) if quantized else ((), [])
  part_shape = (num_splits, batch, heads, block_h)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(batch, heads, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, block_h, width), lambda b, h, s: (b, h, 0, 0)),
          pages_spec,
          pages_spec,
          *scales_specs,
          pl.BlockSpec((None, None, blocks_per_split), lambda b, h, s: (b, s, 0)),
          pl.BlockSpec((1,), lambda b, h, s: (b,)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, block_h, width), lambda b, h, s: (s, b, h, 0, 0)),
          pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (s, b, h, 0)),
          pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (s, b, h, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((*part_shape, width), jnp.float32),
          jax.ShapeDtypeStruct(part_shape, jnp.float32),
          jax.ShapeDtypeStruct(part_shape, jnp.float32),
      ],
      interpret=interpret,
      compiler_params=backend.compiler_params(interpret, num_warps=num_warps,
                                              num_stages=num_stages),
      name="paged_attention",
  )(q4, k_pages, v_pages, *scales, tables, kv_lens)

  # Log-sum-exp combine of the splits. Empty splits carry m = MASK_VALUE, l = 0.
  m_all = m.max(axis=0)  # [batch, heads, block_h]
  w = jnp.exp(m - m_all[None])
  l_all = (w * l).sum(axis=0)
  o_all = (w[..., None] * o).sum(axis=0)
  safe_l = jnp.where(l_all > 0, l_all, 1.0)
  out = jnp.where(l_all[..., None] > 0, o_all / safe_l[..., None], 0.0)
  out = out.reshape(batch, num_kv_heads, head_splits * block_h, width)[:, :, :group, :head_dim]
  out = out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
  if not return_lse:
    return out
  lse = jnp.where(l_all > 0, m_all + jnp.log(safe_l), common.MASK_VALUE)
  lse = lse.reshape(batch, num_kv_heads, head_splits * block_h)[:, :, :group]
  return out, lse.reshape(batch, num_q_heads)


def _default_num_splits(max_blocks: int, blocks_per_step: int) -> int:
  steps = common.cdiv(max_blocks, blocks_per_step)
  return max(1, min(MAX_SPLITS, steps * blocks_per_step // MIN_BLOCKS_PER_SPLIT, steps))


def _check(q, k_pages, v_pages, block_tables, kv_lens):
  _, _, num_kv_heads, head_dim = common.check_pages(k_pages, v_pages)
  batch = common.check_query(q, num_kv_heads, head_dim, k_pages.dtype)[0]
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(
        f"block_tables must be int32 [batch={batch}, max_blocks_per_seq], got shape "
        f"{block_tables.shape} (q shape {q.shape})")
  common.check_int32("block_tables", block_tables, block_tables.shape)
  common.check_int32("kv_lens", kv_lens, (batch,))


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret", "num_splits",
                                             "blocks_per_step", "block_h", "return_lse",
                                             "num_warps", "num_stages"))
def paged_attention(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: jax.Array,  # int32 [batch, max_blocks_per_seq]
    kv_lens: jax.Array,  # int32 [batch]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    interpret: bool | None = None,
    num_splits: int | None = None,
    blocks_per_step: int | None = None,
    block_h: int | None = None,
    return_lse: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Decode attention of one query token per sequence over its listed blocks.

  Args:
    q: [batch, num_q_heads, head_dim]; num_q_heads a multiple of num_kv_heads.
    k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim], or both
      `QuantizedPages` (8-bit values + a float32 scale per token and KV head; the kernel
      dequantizes the blocks it loads to q's dtype).
    block_tables: int32 [batch, max_blocks_per_seq], blocks in attention order,
      padded with 0; all listed blocks but the last counted one are full.
    kv_lens: int32 [batch], tokens attended (0 gives a zero output).
    sm_scale: logit scale, default 1/sqrt(head_dim).
    soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap).
    interpret: None = interpret mode on CPU, compiled on GPU (see backend.py).
    num_splits, blocks_per_step, block_h: tuning knobs; None picks defaults. block_h
      (query-head rows per program) may be below the GQA group: the group is then
      split over cdiv(group, block_h) programs (each reads the KV head's blocks).
    num_warps, num_stages: Triton's (the compiled kernel's warps per program and its
      software pipeline's depth); ignored in interpret mode. make gpu-bench times a few
      settings beside the defaults (its paged case's tuning rows).
    return_lse: also return each query head's log-sum-exp over its keys (see
      `merge_attention`: attention over two disjoint key sets merged exactly).

  Returns:
    [batch, num_q_heads, head_dim] in q's dtype; with `return_lse`, (that, lse
    [batch, num_q_heads] float32: log sum_t exp(score_t), MASK_VALUE for a row of no key).
  """
  _check(q, k_pages, v_pages, block_tables, kv_lens)
  interpret = backend.resolve_interpret(interpret)
  _, block_size, num_kv_heads, head_dim = k_pages.shape
  group = q.shape[1] // num_kv_heads
  if blocks_per_step is None:
    blocks_per_step = max(DEFAULT_BLOCKS_PER_STEP,
                          backend.min_dot_rows(interpret) // block_size)
  if block_h is None:
    block_h = common.next_power_of_2(max(group, backend.min_dot_rows(interpret)))
  if block_h < 1:
    raise ValueError(f"block_h must be >= 1, got {block_h}")
  if num_splits is None:
    num_splits = _default_num_splits(block_tables.shape[1], blocks_per_step)
  backend.check_triton_sizes(interpret, block_h=block_h,
                             tokens_per_step=block_size * blocks_per_step)
  return _paged_attention_call(
      q, k_pages, v_pages, block_tables, kv_lens,
      sm_scale=head_dim**-0.5 if sm_scale is None else float(sm_scale), soft_cap=soft_cap,
      num_splits=num_splits, blocks_per_step=blocks_per_step, block_h=block_h,
      width=common.padded_head_dim(head_dim, backend.min_dot_rows(interpret)),
      interpret=interpret, return_lse=return_lse, num_warps=num_warps, num_stages=num_stages)


def _softmax_lse(s: jax.Array, valid: jax.Array, soft_cap: float | None):
  """softmax over the last axis of the scores `s` (soft-capped) where `valid`, 0 elsewhere
  and a row with no valid key all 0 (not NaN); and the log-sum-exp of the valid scores
  over that axis (MASK_VALUE where none is valid), that axis dropped. The references'
  shared body."""
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  s = jnp.where(valid, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(valid, jnp.exp(s - m), 0.0)
  denom = e.sum(axis=-1, keepdims=True)
  lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)),
                  common.MASK_VALUE)
  return e / jnp.where(denom > 0, denom, 1.0), lse[..., 0]


def merge_attention(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array,
                    lse_b: jax.Array, dtype=None) -> jax.Array:
  """Attention over two disjoint key sets -> attention over their union, exactly (the
  online-softmax / split-K merge): each part's output (normalized over its own keys)
  [..., head_dim] weighted by exp(its lse - the larger lse) [...]. A part without keys
  (lse MASK_VALUE, output 0) weighs 0 beside one with keys; a row with none at all gets
  0. In float32, returned in `dtype` (default out_a's)."""
  m = jnp.maximum(lse_a, lse_b)
  wa, wb = jnp.exp(lse_a - m)[..., None], jnp.exp(lse_b - m)[..., None]
  out = (wa * out_a.astype(jnp.float32) + wb * out_b.astype(jnp.float32)) / (wa + wb)
  return out.astype(out_a.dtype if dtype is None else dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret", "return_lse"))
def paged_attention_reference(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: jax.Array,  # int32 [batch, max_blocks_per_seq]
    kv_lens: jax.Array,  # int32 [batch]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    interpret: bool | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Pure-jnp reference (the "xla" backend): gather the listed blocks, masked softmax.
  `return_lse`: also the log-sum-exp [batch, num_q_heads] (`paged_attention`'s)."""
  del interpret  # Same signature as the kernel; nothing to interpret.
  _check(q, k_pages, v_pages, block_tables, kv_lens)
  batch, num_q_heads, head_dim = q.shape
  _, block_size, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  scale = head_dim**-0.5 if sm_scale is None else sm_scale
  k = k_pages[block_tables].reshape(batch, -1, num_kv_heads, head_dim).astype(jnp.float32)
  v = v_pages[block_tables].reshape(batch, -1, num_kv_heads, head_dim).astype(jnp.float32)
  qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
  s = jnp.einsum("bhgd,bthd->bhgt", qg, k, precision=lax.Precision.HIGHEST) * scale
  valid = (jnp.arange(k.shape[1])[None, :] < kv_lens[:, None])[:, None, None, :]
  p, lse = _softmax_lse(s, valid, soft_cap)
  v = jnp.where(valid[:, 0, 0, :, None, None], v, 0.0)
  o = jnp.einsum("bhgt,bthd->bhgd", p, v, precision=lax.Precision.HIGHEST)
  out = o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
  return (out, lse.reshape(batch, num_q_heads)) if return_lse else out


def paged_attention_per_head(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages,  # [num_blocks, block_size, num_kv_heads, head_dim] or QuantizedPages
    v_pages,
    block_tables: jax.Array,  # int32 [batch, num_heads, max_blocks_per_seq]
    kv_lens: jax.Array,  # int32 [batch, num_heads]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Decode attention where each head has its own block table (HiSparse's per-head
  selections): `num_heads` is num_q_heads (each query head over its own blocks) or
  num_kv_heads (a KV group's query heads share their KV head's blocks). Tables and
  kv_lens per head follow `paged_attention`'s contract (attention order, padded with 0,
  kv_lens counts the head's attended tokens).

  XLA gather of each head's blocks of its own KV head only (no other head's bytes), then
  a masked softmax in float32; no Pallas kernel yet. Returns [batch, num_q_heads,
  head_dim] in q's dtype (`return_lse`: and the log-sum-exp [batch, num_q_heads], as
  `paged_attention`'s)."""
  from kernels_pallas.quant import QuantizedPages, dequantize  # noqa: PLC0415

  batch, num_q_heads, head_dim = q.shape
  _, block_size, num_kv_heads, _ = k_pages.shape
  _, num_heads, width = block_tables.shape
  if num_heads not in (num_q_heads, num_kv_heads) or num_q_heads % num_kv_heads:
    raise ValueError(f"block_tables must have num_q_heads ({num_q_heads}) or num_kv_heads "
                     f"({num_kv_heads}) heads, got {block_tables.shape}")
  if kv_lens.shape != (batch, num_heads):
    raise ValueError(f"kv_lens must be [{batch}, {num_heads}], got {kv_lens.shape}")
  group = num_q_heads // num_heads  # query heads per table
  kv_head = jnp.arange(num_heads) * num_kv_heads // num_heads  # each table's KV head
  index = (block_tables, slice(None), kv_head[None, :, None])

  def gather(pages):  # -> [batch, num_heads, width * block_size, head_dim] float32
    if isinstance(pages, QuantizedPages):
      x = dequantize(pages.values[index], pages.scales[index], jnp.float32)
    else:
      x = pages[index].astype(jnp.float32)
    return x.reshape(batch, num_heads, width * block_size, head_dim)

  k, v = gather(k_pages), gather(v_pages)
  scale = head_dim**-0.5 if sm_scale is None else sm_scale
  qg = q.reshape(batch, num_heads, group, head_dim).astype(jnp.float32)
  s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision=lax.Precision.HIGHEST) * scale
  valid = (jnp.arange(width * block_size) < kv_lens[..., None])[:, :, None, :]
  p, lse = _softmax_lse(s, valid, soft_cap)
  v = jnp.where(valid[:, :, 0, :, None], v, 0.0)
  o = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=lax.Precision.HIGHEST)
  out = o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
  return (out, lse.reshape(batch, num_q_heads)) if return_lse else out

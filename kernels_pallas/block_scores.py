"""HiSparse's block scores, read in place: each query head's upper bound of q . k over the
keys of every block a row lists, from the per-block key bounds (block_key_bounds.py).

  score[b, i, m] = sum_d max(q[b, i, d] * lo[r, h, d], q[b, i, d] * hi[r, h, d])
                 = q+[b, i] . hi[r, h] + q-[b, i] . lo[r, h]
  (r = rows[b, m], h = query head i's KV head, q+ = max(q, 0), q- = min(q, 0))

  grid (batch, num_kv_heads, cdiv(max_blocks, block_m)): program (b, h, t) gathers the
  bounds of rows[b, t * block_m:(t + 1) * block_m] for KV head h through the row table
  ([block_m, width] of minima and of maxima, no gathered copy in HBM) and writes the
  [group, block_m] scores of h's query heads with two dots (float32 accumulation).

Why a kernel (#54: "the HiSparse select so that at 64k context the select is a small part
of the step"). The engine's jnp path (`hisparse_jax.sparse.indexer.block_scores` over
`bounds[rows]`) gathers the bounds into a [batch, max_blocks, 2, kv_heads, head_dim] copy,
then scores it with ONE float32 matmul whose rows hold each query head's q- / q+ at its own
KV head's place and zeros elsewhere (fast on XLA:CPU, which has no better batched form).
On a GPU, at Llama-3.1-8B's shape (GQA 32:8, head_dim 128, block 16) and 64k tokens
(4,096 blocks a row), batch 32, bfloat16 bounds, one layer:

  bounds read in place         16 MiB a row, 512 MiB       0.11 ms at 4.8 TB/s (H200 HBM)
  jnp path: the gathered copy  written + read back again    >= 3x those bytes
  jnp path: the matmul         2 * 32 * 32 * 2,048 * 4,096 = 17.2 GFLOP, 8x the useful
                               2.1 (the zeros of the other KV heads), float32 at HIGHEST
                               precision (no tensor cores): ~0.26 ms at ~67 TFLOP/s
  this kernel                  the 512 MiB once, 16 MiB of scores written; bfloat16
                               dots on tensor cores (group 4 padded to Triton's 16 dot
                               rows, the padding not stored: 8.6 GFLOP, ~0.01 ms)

against 8 MiB a row (0.06 ms at batch 32) for the sparse attention itself at top-k 2,048
tokens. With bfloat16 q and bounds the dot's products are exact and sum in float32, as
the jnp path's float32 products do: the same bound, up to the order of the float32 sums;
float32 q or bounds take float32 dots at IEEE precision (Triton's, not tf32).

int8 bounds (`QuantizedBounds`, block_key_bounds.py: int8 values and a float32 scale per
row, side and KV head; bound = values * scale): the kernel gathers each row's int8 values
of one KV head through the row table as it gathers 16-bit rows, and the row's two scales;
the values convert exactly to the dots' dtype (-127..127 are bfloat16 and float16 numbers:
with 16-bit q the products stay exact on tensor cores; float32 q takes float32 dots), and

  score = scale_max[r, h] * (q+ . values_max[r, h]) + scale_min[r, h] * (q- . values_min[r, h])

in float32, each row's scales broadcast over the group's query heads. At head_dim 128 a row
of one KV head is 2 x 128 B of values + 8 B of scales against bfloat16's 512 B: at the
shape above 264 MiB read instead of 512 (~0.06 ms at 4.8 TB/s). The score is that of the
dequantized bounds (block_scores_reference), up to the order of the float32 sums.

What is left of the select after this is XLA's: the top-k ranking over [batch, heads,
max_blocks] scores (indexer.union_priority), 1/32 of the bounds' bytes at this shape.

Limits: q [batch, num_q_heads, head_dim] with num_q_heads a multiple of the bounds' KV
heads (query heads KV-head-major, as the model's GQA layout and the indexer's chunk
queries); bounds float32, bfloat16, float16, uint16 (bfloat16 bits: the engine's CPU
storage) or int8 (QuantizedBounds); rows int32 [batch, max_blocks], read as
`bounds[rows]` reads them (negative ones from the end, the rest clamped into range; the
engine's are in range). A head_dim that is not a power of 2 is tiled at the next one, its
padding columns masked (common.padded_head_dim).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import backend, common
from kernels_pallas.block_key_bounds import QuantizedBounds

DEFAULT_BLOCK_M = 128  # blocks a program scores: 128 x 256 B of bounds per side (bf16, D 128)


def _gather_rows(ref, ids: jax.Array, head_dim: int) -> jax.Array:
  """`ref[ids]` of a [rows, width] ref: [len(ids), width], columns past head_dim 0."""
  if ref.shape[-1] == head_dim:
    return ref[ids]
  from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415

  shape = (ids.shape[0], ref.shape[-1])
  idx = (jnp.broadcast_to(ids[:, None], shape), lax.broadcasted_iota(jnp.int32, shape, 1))
  return plgpu.load(ref.at[idx], mask=common.columns_below(shape, head_dim), other=0)


def _block_scores_kernel(q_neg_ref, q_pos_ref, lo_ref, hi_ref, *refs, head_dim: int,
                         group: int, dot_dtype, quantized: bool = False):
  """q_neg / q_pos [group_rows, width] (q- / q+ of one KV head's query heads, zero rows
  past the group), lo / hi [num_rows, width] (the bounds of that KV head; int8 values
  when `quantized`, then lo_scale / hi_scale [num_rows] first in `refs`), rows [block_m];
  out [group_rows, block_m] float32, of which the first `group` rows exist."""
  if quantized:
    lo_scale_ref, hi_scale_ref, rows_ref, out_ref = refs
  else:
    rows_ref, out_ref = refs
  ids = rows_ref[...]
  # (int8 values convert exactly: -127..127 are 16-bit floats, so the products stay exact)
  lo = _gather_rows(lo_ref, ids, head_dim).astype(dot_dtype)
  hi = _gather_rows(hi_ref, ids, head_dim).astype(dot_dtype)
  dot = functools.partial(jnp.dot, precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
  pos, neg = dot(q_pos_ref[...], hi.T), dot(q_neg_ref[...], lo.T)
  if quantized:  # each row's scales, broadcast over the group's rows
    pos = pos * hi_scale_ref[ids][None, :]
    neg = neg * lo_scale_ref[ids][None, :]
  scores = pos + neg
  if group == scores.shape[0]:
    out_ref[...] = scores
    return
  from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415

  # Rows past the group (Triton's dot needs 16) are not written: the output holds `group`.
  plgpu.store(out_ref, scores,
              mask=lax.broadcasted_iota(jnp.int32, scores.shape, 0) < group)


def _dot_dtype(q_dtype, bounds_dtype):
  """The dots' operand dtype: 16-bit when q and the bounds are the same 16-bit type, or q
  16-bit over int8 values (exact products on tensor cores), else float32 (both convert to
  it exactly)."""
  exact = q_dtype == bounds_dtype or bounds_dtype == jnp.int8
  if exact and jnp.dtype(q_dtype).itemsize == 2:
    return q_dtype
  return jnp.float32


def _check(q, bounds, rows):
  if isinstance(bounds, QuantizedBounds) and (
      bounds.values.dtype != jnp.int8 or bounds.scales.dtype != jnp.float32
      or bounds.scales.shape != (*bounds.shape[:3], 1)):
    raise ValueError(f"QuantizedBounds must be int8 values {bounds.shape} and float32 "
                     f"scales {(*bounds.shape[:3], 1)}, got {bounds.values.dtype} and "
                     f"{bounds.scales.dtype} {bounds.scales.shape}")
  if (q.ndim != 3 or len(bounds.shape) != 4 or bounds.shape[1] != 2
      or bounds.shape[3] != q.shape[2]):
    raise ValueError(f"block_scores takes q [batch, num_q_heads, head_dim] and bounds "
                     f"[num_rows, 2, num_kv_heads, head_dim] of one head_dim, got q "
                     f"{q.shape} and bounds {bounds.shape}")
  if q.shape[1] % bounds.shape[2]:
    raise ValueError(f"num_q_heads {q.shape[1]} is not a multiple of the bounds' "
                     f"num_kv_heads {bounds.shape[2]}")
  if rows.ndim != 2 or rows.shape[0] != q.shape[0]:
    raise ValueError(f"rows must be [batch={q.shape[0]}, max_blocks], got {rows.shape}")


def _per_kv_head(scores: jax.Array, num_kv_heads: int) -> jax.Array:
  batch, num_q_heads, max_blocks = scores.shape
  return scores.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads,
                        max_blocks).max(axis=2)


def block_scores(q: jax.Array, bounds: jax.Array | QuantizedBounds, rows: jax.Array, *,
                 per_query_head: bool = False, interpret: bool | None = None,
                 block_m: int = DEFAULT_BLOCK_M) -> jax.Array:
  """float32 [batch, num_q_heads, max_blocks] (`per_query_head`) or [batch, num_kv_heads,
  max_blocks] (each KV head's max over its query heads): the bound of each listed block
  (module docstring), what `block_scores_reference` computes, the bounds read where they
  lie. `interpret` None: compiled for a GPU where traced for one (this process's GPU, or
  an abstract GPU context: a deviceless build), interpret mode on CPU."""
  _check(q, bounds, rows)
  if interpret is None:  # (resolved outside the jit: its cache does not see the context)
    interpret = backend.context_platform() == "cpu"
  return _block_scores(q, bounds, rows, per_query_head=per_query_head,
                       interpret=bool(interpret), block_m=block_m)


@functools.partial(jax.jit, static_argnames=("per_query_head", "interpret", "block_m"))
def _block_scores(q, bounds, rows, *, per_query_head: bool, interpret: bool, block_m: int):
  batch, num_q_heads, head_dim = q.shape
  num_rows, _, num_kv_heads, _ = bounds.shape
  max_blocks = rows.shape[1]
  group = num_q_heads // num_kv_heads
  quantized = isinstance(bounds, QuantizedBounds)
  if quantized:  # int8 values through the sides' specs; the scales as [num_rows, 2, heads]
    bounds, scales = bounds.values, bounds.scales.reshape(bounds.scales.shape[:3])
  if bounds.dtype == jnp.uint16:  # bfloat16 bits
    bounds = lax.bitcast_convert_type(bounds, jnp.bfloat16)
  dot_dtype = _dot_dtype(q.dtype, bounds.dtype)
  width = common.padded_head_dim(head_dim, backend.min_dot_rows(interpret))
  group_rows = common.next_power_of_2(max(group, backend.min_dot_rows(interpret)))
  block_m = min(block_m, common.next_power_of_2(max(max_blocks,
                                                     backend.min_dot_rows(interpret))))
  backend.check_triton_sizes(interpret, block_m=block_m)
  tiles = common.cdiv(max_blocks, block_m)

  qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(dot_dtype)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_rows - group), (0, width - head_dim)))
  q_neg, q_pos = jnp.minimum(qg, 0), jnp.maximum(qg, 0)
  rows = rows.astype(jnp.int32)  # read as `bounds[rows]`: negative from the end, clamped
  ids = jnp.clip(jnp.where(rows < 0, rows + num_rows, rows), 0, num_rows - 1)
  ids = jnp.pad(ids, ((0, 0), (0, tiles * block_m - max_blocks)))
  q_spec = pl.BlockSpec((None, None, group_rows, width), lambda b, h, t: (b, h, 0, 0))
  side = lambda which: pl.BlockSpec((num_rows, None, None, width),  # noqa: E731
                                    lambda b, h, t: (0, which, h, 0))
  scale_specs, scale_args = [], ()
  if quantized:  # each side's scales of KV head h: [num_rows]
    scale_side = lambda which: pl.BlockSpec((num_rows, None, None),  # noqa: E731
                                            lambda b, h, t: (0, which, h))
    scale_specs, scale_args = [scale_side(0), scale_side(1)], (scales, scales)
  out = pl.pallas_call(
      functools.partial(_block_scores_kernel, head_dim=head_dim, group=group,
                        dot_dtype=dot_dtype, quantized=quantized),
      grid=(batch, num_kv_heads, tiles),
      in_specs=[q_spec, q_spec, side(0), side(1), *scale_specs,
                pl.BlockSpec((None, block_m), lambda b, h, t: (b, t))],
      out_specs=pl.BlockSpec((None, None, group_rows, block_m), lambda b, h, t: (b, h, 0, t)),
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, group, tiles * block_m),
                                     jnp.float32),
      interpret=interpret,
      compiler_params=backend.compiler_params(interpret),
      name="block_scores",
  )(q_neg, q_pos, bounds, bounds, *scale_args, ids)
  scores = out[..., :max_blocks].reshape(batch, num_q_heads, max_blocks)
  return scores if per_query_head else _per_kv_head(scores, num_kv_heads)


def block_scores_reference(q: jax.Array, bounds: jax.Array | QuantizedBounds,
                           rows: jax.Array, *, per_query_head: bool = False) -> jax.Array:
  """What `block_scores` computes, elementwise in float32 over the gathered bounds (int8:
  the gathered rows dequantized)."""
  _check(q, bounds, rows)
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads = bounds.shape[2]
  kv_head = jnp.arange(num_q_heads) // (num_q_heads // num_kv_heads)
  if isinstance(bounds, QuantizedBounds):
    gathered = bounds.rows(rows).dequantize()
  else:
    if bounds.dtype == jnp.uint16:
      bounds = lax.bitcast_convert_type(bounds, jnp.bfloat16)
    gathered = bounds[rows].astype(jnp.float32)
  lo = gathered[:, :, 0][:, :, kv_head]  # [batch, max_blocks, num_q_heads, head_dim]
  hi = gathered[:, :, 1][:, :, kv_head]
  qf = q.astype(jnp.float32)[:, None]
  scores = jnp.maximum(qf * lo, qf * hi).sum(-1).transpose(0, 2, 1)
  return scores if per_query_head else _per_kv_head(scores, num_kv_heads)

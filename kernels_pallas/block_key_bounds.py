"""Per-block key summaries: elementwise min and max of the keys of valid tokens.

The input of the training-free block indexer. Layout (decided here)::

  bounds: [num_blocks, 2, num_kv_heads, head_dim]
                       ^ 0 = min, 1 = max over the block's valid tokens
  (or more rows than the pages' blocks: the rows past them are never touched, so a
  caller may keep other blocks' bounds in the same array, as the engine keeps its host
  blocks' beside the device blocks')

Block-major like the KV pages, so ``bounds[block_tables]`` gathers the summaries
of a block table in one gather and a block's summary moves with the block.

Update rule: after ``write_kv(..., slot_ids)``, call
``block_key_bounds(bounds, k_pages, slot_ids)``. Every block a non-negative slot
touched is recomputed from its tokens ``0 .. max written offset`` (blocks fill in
order, so those are exactly its valid tokens); other blocks are left unchanged.
The recompute (not an incremental min/max) makes a reused block forget its
previous owner's keys.

8-bit keys (`QuantizedPages`): the bounds are those of the dequantized keys (the kernel
loads a block's values and scales and dequantizes them as the attention does).

Bounds dtype: float32, bfloat16 (half the bytes: the engine keeps the bounds of every
host block on the device), int8 (`QuantizedBounds`: a quarter of float32's bytes plus a
float32 scale per block, side and KV head), or the keys' own dtype. Narrowing rounds
outward (min toward -inf, max toward +inf, `round_bounds`, `quantize_bounds`), so
``min <= k <= max`` still holds for every valid key and the indexer's score stays an
upper bound of q . k.

int8 bounds: ``QuantizedBounds(values int8 [num_blocks, 2, num_kv_heads, head_dim],
scales float32 [num_blocks, 2, num_kv_heads, 1])``; bound = values * scales, the scale of
a (block, side, KV head) its largest magnitude / 127 (a hair more, so no value passes
127), the minima floored and the maxima ceiled. At head_dim 128 a block's bounds are 264
bytes a KV head against bfloat16's 512 (1.94x fewer: the bytes the select reads at long
contexts and the device bytes of every host block's bounds); the score factors as
``scale_max * (q+ . values_max) + scale_min * (q- . values_min)`` (block_scores.py), and
the quantization's rounding can only raise it (a looser bound, never a missed key).

On CPU the reference scatters a bfloat16 ``bounds`` through its uint16 view (XLA:CPU
converts a whole bf16 array to scatter into it, DESIGN.md). ``bounds`` is donated and
updated in place. A head_dim that is not a power of 2 is tiled at the next one, the
padding columns of the pages and of ``bounds`` masked (see common.padded_head_dim);
neither array is copied.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import backend, common

MIN, MAX = 0, 1
BOUNDS_DTYPES = ("float32", "bfloat16", "int8")  # besides the keys' own dtype
INT8_MAX = 127
# The scale of a (block, side, KV head): its largest magnitude / 127 times this hair, so
# the division by it stays below 127 after float32 rounding (no value clips).
_SCALE_MARGIN = 1.0 + 2.0 ** -12
_MIN_SCALE = 1e-30  # all-zero bounds: values 0 (any positive scale)


class QuantizedBounds(NamedTuple):
  """int8 key bounds (module docstring): bound = values * scales, rounded outward."""

  values: jax.Array  # int8 [num_blocks, 2, num_kv_heads, head_dim]
  scales: jax.Array  # float32 [num_blocks, 2, num_kv_heads, 1]

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def nbytes(self) -> int:
    return int(self.values.nbytes) + int(self.scales.nbytes)

  def dequantize(self) -> jax.Array:
    """float32 bounds (gathered rows of this are what the jnp paths score)."""
    return self.values.astype(jnp.float32) * self.scales

  def rows(self, index) -> QuantizedBounds:
    """`bounds[index]` of both arrays (a gather of block rows)."""
    return QuantizedBounds(self.values[index], self.scales[index])


def _quantize_side(x: jax.Array, up: bool) -> tuple[jax.Array, jax.Array]:
  """One side of `quantize_bounds` over the last axis: (int8 values, float32 scale [..., 1]).
  The kernel runs this same code on a block's padded row (its padding columns are 0, so
  they change neither the amax nor anything stored): the same values and scale."""
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  scale = jnp.maximum(amax, _MIN_SCALE) * (_SCALE_MARGIN / INT8_MAX)
  step = 1.0 if up else -1.0
  v = jnp.ceil(x / scale) if up else jnp.floor(x / scale)
  # The division is only near the quotient (float32 rounding; a GPU's may be approximate):
  # v is then the tightest outward integer (up: the least with v * scale >= x), one step
  # each way, so every division that lands within one of it gives the same v.
  short = (v * scale < x) if up else (v * scale > x)
  v = jnp.where(short, v + step, v)
  back = v - step
  loose = (back * scale >= x) if up else (back * scale <= x)
  v = jnp.where(loose, back, v)
  return jnp.clip(v, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def quantize_bounds(k_min: jax.Array, k_max: jax.Array) -> QuantizedBounds:
  """float [..., num_kv_heads, head_dim] minima and maxima -> int8 bounds ([..., 2,
  num_kv_heads, head_dim] values, [..., 2, num_kv_heads, 1] scales) rounded outward:
  values_min * scale_min <= k_min and values_max * scale_max >= k_max in float32, every
  element, each value the tightest such integer."""
  lo, lo_scale = _quantize_side(k_min, up=False)
  hi, hi_scale = _quantize_side(k_max, up=True)
  axis = k_min.ndim - 2  # the side axis goes before the KV heads
  return QuantizedBounds(jnp.stack([lo, hi], axis=axis),
                         jnp.stack([lo_scale, hi_scale], axis=axis))


def bounds_arrays(shape: tuple[int, ...], dtype, make: Callable[[tuple[int, ...], Any], Any]):
  """Bounds of [rows, 2, num_kv_heads, head_dim] in `dtype` built by `make(shape, dtype)`
  (an array, or an abstract one): int8 gives QuantizedBounds of its two arrays."""
  if jnp.dtype(dtype) == jnp.int8:
    return QuantizedBounds(make(tuple(shape), jnp.dtype(jnp.int8)),
                           make((*shape[:-1], 1), jnp.dtype(jnp.float32)))
  return make(tuple(shape), jnp.dtype(dtype))


def empty_bounds(shape: tuple[int, ...], dtype) -> jax.Array | QuantizedBounds:
  """Zero bounds of [rows, 2, num_kv_heads, head_dim] in `dtype` (int8: QuantizedBounds)."""
  return bounds_arrays(shape, dtype, jnp.zeros)


def _bfloat16_outward(x: jax.Array, up: bool) -> jax.Array:
  """float32 -> bfloat16 rounded toward +inf (`up`) or -inf: bfloat16 is the top 16 bits
  of a float32, so truncating the low bits rounds toward zero, and a value with low bits
  set that must move away from zero gets one more unit in the top bits. Integer ops on
  the bits only: no float compare or convert, which XLA:CPU flushes to zero on
  subnormals."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  inexact = (bits & 0xFFFF) != 0
  negative = (bits >> 31) == 1
  away = inexact & (~negative if up else negative)
  top = (bits >> 16) + jnp.where(away, 1, 0).astype(jnp.uint32)
  return lax.bitcast_convert_type(top.astype(jnp.uint16), jnp.bfloat16)


def round_bounds(k_min: jax.Array, k_max: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """(k_min, k_max) in `dtype`, rounded outward when `dtype` is narrower than the keys:
  the stored min is <= every key's min and the stored max >= every key's max."""
  dtype = jnp.dtype(dtype)
  if dtype == k_min.dtype or dtype == jnp.float32:  # exact
    return k_min.astype(dtype), k_max.astype(dtype)
  if dtype != jnp.bfloat16:
    raise ValueError(f"bounds narrower than the keys must be bfloat16, got {dtype}")
  return (_bfloat16_outward(k_min.astype(jnp.float32), up=False),
          _bfloat16_outward(k_max.astype(jnp.float32), up=True))


def _block_key_bounds_kernel(
    slot_ids_ref,  # [1] int32, -1 unless this token is its block's last write
    k_pages_ref,  # [num_blocks, block_size, width] (one KV head; columns >= head_dim masked)
    *refs,  # (k_scales_ref [num_blocks, block_size] when `dtype` is set: 8-bit keys), the
    # bounds' inputs (aliased to the outputs, the same buffers), then the outputs:
    # bounds_ref [num_blocks, 2, width] (one KV head; columns >= head_dim masked), or with
    # `quantized` values_ref int8 [num_blocks, 2, width] and scales_ref [num_blocks, 2, 1]
    head_dim: int,  # width = head_dim padded to a power of 2
    dtype=None,  # the keys' dtype when the pages are 8-bit (dequantized as loaded)
    quantized: bool = False,  # int8 bounds (QuantizedBounds)
):
  k_scales_ref = None
  if dtype is not None:
    k_scales_ref, *refs = refs
  outs = refs[len(refs) // 2:]  # the first half are the outputs' inputs
  num_blocks, block_size, width = k_pages_ref.shape
  slot = slot_ids_ref[0]

  @pl.when((slot >= 0) & (slot < num_blocks * block_size))
  def _update():
    block_id = slot // block_size
    num_valid = slot % block_size + 1
    k = common.load_columns(k_pages_ref, (block_id,), head_dim)  # [block_size, width]
    if k_scales_ref is not None:
      k = common.dequantize_tile(k, k_scales_ref[block_id], dtype)
    valid = lax.broadcasted_iota(jnp.int32, (block_size, width), 0) < num_valid
    k_min = jnp.where(valid, k, jnp.array(jnp.inf, k.dtype)).min(axis=0)
    k_max = jnp.where(valid, k, jnp.array(-jnp.inf, k.dtype)).max(axis=0)
    if quantized:  # (the padding columns loaded as 0: 0 in k_min and k_max, not stored)
      values_ref, scales_ref = outs
      for side, x in ((MIN, k_min), (MAX, k_max)):
        values, scale = _quantize_side(x, up=side == MAX)
        common.store_columns(values_ref, (block_id, side), values, head_dim)
        scales_ref[block_id, side] = scale
      return
    (bounds_ref,) = outs
    k_min, k_max = round_bounds(k_min, k_max, bounds_ref.dtype)
    common.store_columns(bounds_ref, (block_id, MIN), k_min, head_dim)
    common.store_columns(bounds_ref, (block_id, MAX), k_max, head_dim)


def _last_write_slots(slot_ids, num_blocks: int, block_size: int):
  """Keeps, per touched block, only the slot with the largest offset (others -> -1)."""
  ok = (slot_ids >= 0) & (slot_ids < num_blocks * block_size)
  block_id = jnp.where(ok, slot_ids // block_size, num_blocks)
  fill = jnp.zeros((num_blocks,), jnp.int32).at[block_id].max(slot_ids % block_size + 1,
                                                             mode="drop")
  last = ok & (slot_ids % block_size + 1 == fill[jnp.minimum(block_id, num_blocks - 1)])
  return jnp.where(last, slot_ids, -1)


def max_touched_blocks(num_tokens: int, num_seqs: int, block_size: int) -> int:
  """The most distinct blocks the slots of a ragged step can touch: a sequence's q
  tokens are consecutive positions, so they fill at most floor(q / block_size) + 2
  blocks (and at most q), which sum to at most floor(tokens / block_size) + 2 * seqs."""
  return max(1, min(num_tokens, num_tokens // block_size + 2 * num_seqs))


def _touched_slots(slot_ids, num_blocks: int, block_size: int, max_touched: int | None):
  """Each touched block's last written slot: `_last_write_slots`, then (with
  `max_touched`) only its non-negative entries, packed into max_touched entries (-1
  after them). The caller vouches that no more blocks than that are touched (see
  `max_touched_blocks`); the work of the bounds then follows the blocks, not the tokens
  (a 2,048-token prefill chunk touches 128 blocks of 16)."""
  last = _last_write_slots(slot_ids, num_blocks, block_size)
  if max_touched is None or max_touched >= last.shape[0]:
    return last
  (idx,) = jnp.nonzero(last >= 0, size=max_touched, fill_value=last.shape[0])
  return jnp.concatenate([last, jnp.full((1,), -1, last.dtype)])[idx]


def _block_key_bounds_call(bounds, k_pages, slot_ids, *, interpret, max_touched=None):
  num_blocks, block_size, num_kv_heads, head_dim = k_pages.shape
  dtype = k_pages.dtype
  k_pages, k_scales = common.page_arrays(k_pages)
  scales, scales_specs = (), []
  if k_scales is not None:
    scales = (k_scales,)
    scales_specs = [pl.BlockSpec((num_blocks, block_size, None), lambda t, h: (0, 0, h))]
  last_slots = _touched_slots(slot_ids, num_blocks, block_size, max_touched)
  width = common.padded_head_dim(head_dim)
  quantized = isinstance(bounds, QuantizedBounds)
  arrays = tuple(bounds) if quantized else (bounds,)  # int8: (values, scales)
  specs = [pl.BlockSpec((num_blocks, 2, None, width), lambda t, h: (0, 0, h, 0))]
  if quantized:
    specs.append(pl.BlockSpec((num_blocks, 2, None, 1), lambda t, h: (0, 0, h, 0)))
  first = 2 + len(scales)  # the bounds' inputs, each aliased to its output
  out = pl.pallas_call(
      functools.partial(_block_key_bounds_kernel, head_dim=head_dim,
                        dtype=dtype if scales else None, quantized=quantized),
      grid=(last_slots.shape[0], num_kv_heads),
      in_specs=[
          pl.BlockSpec((1,), lambda t, h: (t,)),
          pl.BlockSpec((num_blocks, block_size, None, width), lambda t, h: (0, 0, h, 0)),
          *scales_specs,
          *specs,
      ],
      out_specs=specs,
      out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
      input_output_aliases={first + i: i for i in range(len(arrays))},
      interpret=interpret,
      compiler_params=backend.compiler_params(interpret, num_warps=1, num_stages=1),
      name="block_key_bounds",
  )(last_slots, k_pages, *scales, *arrays)
  return QuantizedBounds(*out) if quantized else out[0]


def _check(bounds, k_pages, slot_ids):
  num_blocks, _, num_kv_heads, head_dim = common.check_pages(k_pages, k_pages)
  want = (num_blocks, 2, num_kv_heads, head_dim)
  if (len(bounds.shape) != 4 or bounds.shape[1:] != want[1:] or bounds.shape[0] < num_blocks):
    raise ValueError(
        f"bounds must be [num_blocks (or more rows), 2, num_kv_heads, head_dim] = {want} "
        f"for k_pages shape {k_pages.shape}, got {bounds.shape}")
  if isinstance(bounds, QuantizedBounds):
    if (bounds.values.dtype != jnp.int8 or bounds.scales.dtype != jnp.float32
        or bounds.scales.shape != (*bounds.shape[:3], 1)):
      raise ValueError(f"QuantizedBounds must be int8 values {bounds.shape} and float32 "
                       f"scales {(*bounds.shape[:3], 1)}, got {bounds.values.dtype} "
                       f"{bounds.values.shape} and {bounds.scales.dtype} "
                       f"{bounds.scales.shape}")
  elif bounds.dtype not in (k_pages.dtype, *map(jnp.dtype, BOUNDS_DTYPES[:2])):
    raise ValueError(f"bounds dtype must be float32, bfloat16 or the keys' {k_pages.dtype} "
                     f"(int8: QuantizedBounds), got {bounds.dtype}")
  if slot_ids.ndim != 1:
    raise ValueError(f"slot_ids must be int32 [num_tokens], got shape {slot_ids.shape}")
  common.check_int32("slot_ids", slot_ids, slot_ids.shape)


@functools.partial(jax.jit, static_argnames=("interpret", "max_touched"), donate_argnums=(0,))
def block_key_bounds(
    bounds: jax.Array | QuantizedBounds,  # [num_blocks, 2, num_kv_heads, head_dim], donated
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ids: jax.Array,  # int32 [num_tokens], the slots write_kv just wrote; < 0 skipped
    *,
    interpret: bool | None = None,
    max_touched: int | None = None,
) -> jax.Array | QuantizedBounds:
  """Returns `bounds` with every block touched by `slot_ids` recomputed (in place; int8
  `QuantizedBounds`: both arrays, quantized in the kernel as `quantize_bounds` does).
  `max_touched`: at most this many distinct blocks are touched (`max_touched_blocks` of
  the step's shape); the work then scales with it instead of the slots' count."""
  _check(bounds, k_pages, slot_ids)
  interpret = backend.resolve_interpret(interpret)
  backend.check_triton_sizes(interpret, block_size=k_pages.shape[1])
  return _block_key_bounds_call(bounds, k_pages, slot_ids, interpret=interpret,
                                max_touched=max_touched)


@functools.partial(jax.jit, static_argnames=("interpret", "max_touched"), donate_argnums=(0,))
def block_key_bounds_reference(
    bounds: jax.Array | QuantizedBounds,  # [num_blocks, 2, num_kv_heads, head_dim], donated
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ids: jax.Array,  # int32 [num_tokens]; < 0 skipped
    *,
    interpret: bool | None = None,
    max_touched: int | None = None,
) -> jax.Array | QuantizedBounds:
  """Pure-jnp reference (the "xla" backend): masked min/max of the touched blocks (see
  `block_key_bounds` for `max_touched`); int8 `QuantizedBounds` quantized outward."""
  del interpret
  _check(bounds, k_pages, slot_ids)
  num_blocks, block_size = k_pages.shape[:2]
  last_slots = _touched_slots(slot_ids, num_blocks, block_size, max_touched)
  touched = last_slots >= 0
  block_id = jnp.where(touched, last_slots // block_size, 0)
  k = k_pages[block_id]  # [touched entries, block_size, num_kv_heads, head_dim]
  valid = (jnp.arange(block_size)[None, :] <= (last_slots % block_size)[:, None])
  valid = valid[:, :, None, None]
  k_min = jnp.where(valid, k, jnp.inf).min(axis=1)
  k_max = jnp.where(valid, k, -jnp.inf).max(axis=1)
  dst = jnp.where(touched, block_id, bounds.shape[0])
  if isinstance(bounds, QuantizedBounds):  # [entries, 2, h, d] values, [entries, 2, h, 1]
    new = quantize_bounds(k_min, k_max)
    return QuantizedBounds(bounds.values.at[dst].set(new.values, mode="drop"),
                           bounds.scales.at[dst].set(new.scales, mode="drop"))
  new = jnp.stack(round_bounds(k_min, k_max, bounds.dtype), axis=1)  # [entries, 2, h, d]
  if bounds.dtype == jnp.bfloat16:  # scatter the bits: XLA:CPU converts a bf16 array whole
    bits = lax.bitcast_convert_type(bounds, jnp.uint16).at[dst].set(
        lax.bitcast_convert_type(new, jnp.uint16), mode="drop")
    return lax.bitcast_convert_type(bits, jnp.bfloat16)
  return bounds.at[dst].set(new, mode="drop")

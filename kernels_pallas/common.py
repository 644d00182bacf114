"""Constants and shape checks shared by the kernel files.

Owns the mask value, the small integer helpers used to size grids and the
`ValueError`-raising checks for the paged KV layout, so that every public kernel
entry rejects bad shapes with the same wording.

KV layout (per layer), block-major so one block is one contiguous chunk::

  k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim]
                     ^ block 0 is the null block (padding in block tables)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas.quant import QuantizedPages

# A large finite negative logit: exp(MASK_VALUE - m) is exactly 0 for any real m,
# and, unlike -inf, MASK_VALUE - MASK_VALUE is 0 rather than NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def packed_ids(mask: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """The indices of `mask`'s True entries, packed to the front of a static `size`
  (traced): (ids [size], live [size]); past the True entries `live` is False and the id
  is clamped to the last index (a harmless read; scatter those to an out-of-range row)."""
  n = mask.shape[0]
  (ids,) = jnp.nonzero(mask, size=size, fill_value=n)
  return jnp.minimum(ids, n - 1), ids < n


def next_power_of_2(x: int) -> int:
  return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


# Head dims that are not powers of 2 (80, 96, 112, ...; Triton tensors must have power-of-2
# sizes): each kernel's BlockSpecs over the pages give the last dim as the padded width
# `padded_head_dim(head_dim)`, a view that reaches past the head's row, and every page
# access in the kernel body is masked to the first `head_dim` columns (masked-out columns
# are neither read nor written; loads give 0 there). The pool itself is never padded or
# copied. Small per-call operands (q, new K/V) are padded in the wrappers and outputs sliced.
# Interpret mode runs the same body; its interpreter pads the pages with NaN to the
# block shape (a per-call copy, CPU tests only), so a missing mask shows up as NaN.


def padded_head_dim(head_dim: int, minimum: int = 1) -> int:
  """The power-of-2 width a kernel tiles `head_dim` with (at least `minimum`)."""
  return next_power_of_2(max(head_dim, minimum))


def columns_below(shape: tuple[int, ...], head_dim: int) -> jax.Array:
  """bool `shape`: the last axis's index < head_dim (the real columns of a padded tile)."""
  return lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1) < head_dim


def _traced(idx: tuple) -> tuple:
  # Python ints as int32 scalars: interpret mode's masked load/store (jax 0.10.2) reads
  # `.shape` of every scalar index, which a Python int lacks.
  return tuple(jnp.int32(i) if isinstance(i, int) else i for i in idx)


def load_columns(ref, idx: tuple, head_dim: int) -> jax.Array:
  """`ref[idx]` (scalar indices of the leading axes) where the last axis may be padded
  past `head_dim`: the padding is not read and comes back as 0. The plain load when
  nothing is padded."""
  if ref.shape[-1] == head_dim:
    return ref[idx]
  from jax.experimental.pallas import triton as plgpu

  view = ref.at[_traced(idx)]
  return plgpu.load(view, mask=columns_below(view.shape, head_dim), other=0)


def store_columns(ref, idx: tuple, value: jax.Array, head_dim: int) -> None:
  """`ref[idx] = value`, writing only the first `head_dim` columns of the last axis."""
  if ref.shape[-1] == head_dim:
    ref[idx] = value
    return
  from jax.experimental.pallas import triton as plgpu

  view = ref.at[_traced(idx)]
  plgpu.store(view, value, mask=columns_below(view.shape, head_dim))


def load_blocks(pages_ref, block_ids: jax.Array, head_dim: int,
                block_mask: jax.Array | None = None) -> jax.Array:
  """`pages_ref[block_ids]`: [len(block_ids), block_size, width] gathered through the
  block table, columns past `head_dim` (width padding) not read and returned as 0, and
  with `block_mask` (bool [len(block_ids)]) the blocks where it is False not read (0).

  The masked gather spells every axis as an array index: interpret mode's masked load
  (jax 0.10.2) refuses an array index mixed with slices, and the Triton lowering takes
  both; the unmasked, unpadded case keeps the plain gather.
  """
  _, block_size, width = pages_ref.shape
  if width == head_dim and block_mask is None:
    return pages_ref[block_ids]
  from jax.experimental.pallas import triton as plgpu

  shape = (block_ids.shape[0], block_size, width)
  idx = (jnp.broadcast_to(block_ids[:, None, None], shape),
         lax.broadcasted_iota(jnp.int32, shape, 1), lax.broadcasted_iota(jnp.int32, shape, 2))
  mask = columns_below(shape, head_dim)
  if block_mask is not None:
    mask = mask & jnp.broadcast_to(block_mask[:, None, None], shape)
  return plgpu.load(pages_ref.at[idx], mask=mask, other=0)


# 8-bit pages (kernels_pallas.quant.QuantizedPages: int8, or fp8_e4m3 bits as uint8, with a
# float32 scale per token and KV head). The Pallas kernels take the two arrays as separate
# inputs: the values through the same BlockSpecs as float pages, the scales as
# [num_blocks, block_size, num_kv_heads] (a free reshape of [..., 1]) through a BlockSpec of
# one KV head, and dequantize the blocks they load (`load_kv_blocks`), as the xla attention
# and the references do after their gather: (values in float32 * scale) in the pages'
# dtype, so every path reads the same numbers.


def page_arrays(pages) -> tuple[jax.Array, jax.Array | None]:
  """(values, scales [num_blocks, block_size, num_kv_heads] or None) of a page array or
  of `QuantizedPages` (fp8_e4m3 values stay uint8 bits: a masked load of a padded head_dim
  fills its padding with integer 0, which Triton cannot cast to fp8)."""
  if not isinstance(pages, QuantizedPages):
    return pages, None
  return pages.values, pages.scales.reshape(pages.scales.shape[:3])


def dequantize_tile(values: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
  """A loaded tile of pages in `dtype`: `values` as is when `scales` is None, else
  values [..., width] (int8, or fp8_e4m3 bits as uint8) * scales [...] computed in
  float32 (fp8 bits are bitcast to float8_e4m3fn and converted: sm_89+ on a GPU)."""
  if scales is None:
    return values
  if values.dtype == jnp.uint8:
    values = lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
  return (values.astype(jnp.float32) * scales[..., None].astype(jnp.float32)).astype(dtype)


def load_kv_blocks(pages_ref, scales_ref, block_ids: jax.Array, head_dim: int,
                   dtype) -> jax.Array:
  """`load_blocks` of float pages, or of 8-bit pages (`scales_ref` [num_blocks,
  block_size] of one KV head) dequantized to `dtype`: [len(block_ids), block_size,
  width]."""
  values = load_blocks(pages_ref, block_ids, head_dim)
  return dequantize_tile(values, None if scales_ref is None else scales_ref[block_ids], dtype)


def check_quantized_pair(k_pages, v_pages) -> None:
  """Both pages 8-bit (QuantizedPages) or neither, with scales of the values' shape."""
  quantized = isinstance(k_pages, QuantizedPages), isinstance(v_pages, QuantizedPages)
  if quantized[0] != quantized[1]:
    raise ValueError("k_pages and v_pages must both be 8-bit (QuantizedPages) or both "
                     f"float pages, got {type(k_pages).__name__} and "
                     f"{type(v_pages).__name__}")
  for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
    if quantized[0] and pages.scales.shape != (*pages.values.shape[:3], 1):
      raise ValueError(f"{name} scales must be [num_blocks, block_size, num_kv_heads, 1] = "
                       f"{(*pages.values.shape[:3], 1)}, got {pages.scales.shape}")


def check_pages(k_pages: jax.Array, v_pages: jax.Array, *,
                float_only: bool = True) -> tuple[int, int, int, int]:
  """Checks the paged KV pair; returns (num_blocks, block_size, num_kv_heads, head_dim).

  `float_only=False` (pure data moves) also admits storage dtypes such as uint16, the
  bitcast form of bfloat16 that CPU pools use to avoid XLA:CPU's bf16 scatter.
  """
  check_quantized_pair(k_pages, v_pages)
  if k_pages.ndim != 4:
    raise ValueError(
        "k_pages must be [num_blocks, block_size, num_kv_heads, head_dim], got shape "
        f"{k_pages.shape}")
  if k_pages.shape != v_pages.shape:
    raise ValueError(
        f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(
        f"k_pages and v_pages must have the same dtype, got {k_pages.dtype} and {v_pages.dtype}")
  if float_only and k_pages.dtype not in SUPPORTED_DTYPES:
    raise ValueError(f"KV dtype must be float32, bfloat16 or float16, got {k_pages.dtype}")
  return k_pages.shape


def check_int32(name: str, x: jax.Array, shape: tuple[int, ...]) -> None:
  if x.shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
  if x.dtype != jnp.int32:
    raise ValueError(f"{name} must be int32, got {x.dtype} (shape {x.shape})")


def check_query(q: jax.Array, num_kv_heads: int, head_dim: int, kv_dtype) -> tuple[int, ...]:
  """Checks q [..., num_q_heads, head_dim] against the KV pages; returns q.shape."""
  if q.ndim != 3:
    raise ValueError(f"q must be rank 3 [tokens, num_q_heads, head_dim], got shape {q.shape}")
  if q.shape[-1] != head_dim:
    raise ValueError(
        f"q head_dim {q.shape[-1]} (q shape {q.shape}) != KV head_dim {head_dim}")
  if q.shape[-2] % num_kv_heads:
    raise ValueError(
        f"num_q_heads {q.shape[-2]} (q shape {q.shape}) must be a multiple of "
        f"num_kv_heads {num_kv_heads}")
  if q.dtype != kv_dtype:
    raise ValueError(f"q dtype {q.dtype} must equal the KV dtype {kv_dtype}")
  return q.shape

"""Writes new K/V tokens into their slots of the paged KV arrays, in place.

``slot = block_id * block_size + offset``; a negative slot (padding) or one past
the pool is skipped. The pages are donated and aliased to the outputs
(``input_output_aliases``), so the caller must use the returned arrays.

  k_new[t] ---slot_ids[t]=13, block_size=8---> k_pages[1, 5]   (block 1, offset 5)
  k_new[u] ---slot_ids[u]=-1-----------------> (dropped)

Slots must be distinct among the non-negative ones (a duplicate writes either). Any
element dtype is moved as is (e.g. uint16 pages holding bitcast bfloat16 on CPU). A
head_dim that is not a power of 2 is moved as its power-of-2 padding with the padding
columns masked off the store (see common.padded_head_dim); the pages are not copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend, common


def _write_kv_kernel(
    slot_ids_ref,  # [1] int32
    k_new_ref,  # [width] (one token, one KV head; width = head_dim padded to a power of 2)
    v_new_ref,  # [width]
    k_pages_in_ref,  # aliased to k_pages_ref
    v_pages_in_ref,  # aliased to v_pages_ref
    k_pages_ref,  # [num_blocks, block_size, width] (one KV head; columns >= head_dim masked)
    v_pages_ref,  # [num_blocks, block_size, width]
    *,
    head_dim: int,
):
  del k_pages_in_ref, v_pages_in_ref  # Same buffers as the outputs.
  num_blocks, block_size, _ = k_pages_ref.shape
  slot = slot_ids_ref[0]

  @pl.when((slot >= 0) & (slot < num_blocks * block_size))
  def _write():
    block_id, offset = slot // block_size, slot % block_size
    common.store_columns(k_pages_ref, (block_id, offset), k_new_ref[...], head_dim)
    common.store_columns(v_pages_ref, (block_id, offset), v_new_ref[...], head_dim)


def _write_kv_call(k_pages, v_pages, k_new, v_new, slot_ids, *, interpret):
  num_blocks, block_size, num_kv_heads, head_dim = k_pages.shape
  num_tokens = k_new.shape[0]
  width = common.padded_head_dim(head_dim)
  if width != head_dim:  # The new tokens (not the pages) are padded: [num_tokens, heads, width].
    k_new, v_new = (jnp.pad(x, ((0, 0), (0, 0), (0, width - head_dim))) for x in (k_new, v_new))
  pages_spec = pl.BlockSpec((num_blocks, block_size, None, width), lambda t, h: (0, 0, h, 0))
  new_spec = pl.BlockSpec((None, None, width), lambda t, h: (t, h, 0))
  return pl.pallas_call(
      functools.partial(_write_kv_kernel, head_dim=head_dim),
      grid=(num_tokens, num_kv_heads),
      in_specs=[pl.BlockSpec((1,), lambda t, h: (t,)), new_spec, new_spec, pages_spec,
                pages_spec],
      out_specs=[pages_spec, pages_spec],
      out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                 jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
      input_output_aliases={3: 0, 4: 1},
      interpret=interpret,
      compiler_params=backend.compiler_params(interpret, num_warps=1, num_stages=1),
      name="write_kv",
  )(slot_ids, k_new, v_new, k_pages, v_pages)


def _check(k_pages, v_pages, k_new, v_new, slot_ids):
  _, _, num_kv_heads, head_dim = common.check_pages(k_pages, v_pages, float_only=False)
  if k_new.ndim != 3 or k_new.shape[1:] != (num_kv_heads, head_dim):
    raise ValueError(
        f"k_new must be [num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}], got "
        f"shape {k_new.shape} (k_pages shape {k_pages.shape})")
  if v_new.shape != k_new.shape:
    raise ValueError(f"v_new shape {v_new.shape} != k_new shape {k_new.shape}")
  if k_new.dtype != k_pages.dtype or v_new.dtype != k_pages.dtype:
    raise ValueError(
        f"k_new/v_new dtypes {k_new.dtype}/{v_new.dtype} must equal the pages' {k_pages.dtype}")
  common.check_int32("slot_ids", slot_ids, (k_new.shape[0],))


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0, 1))
def write_kv(
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim], donated
    v_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim], donated
    k_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_ids: jax.Array,  # int32 [num_tokens]; < 0 means skip
    *,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Returns (k_pages, v_pages) with token t written at slot_ids[t] (in place)."""
  _check(k_pages, v_pages, k_new, v_new, slot_ids)
  interpret = backend.resolve_interpret(interpret)
  return _write_kv_call(k_pages, v_pages, k_new, v_new, slot_ids, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0, 1))
def write_kv_reference(
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim], donated
    v_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim], donated
    k_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    v_new: jax.Array,  # [num_tokens, num_kv_heads, head_dim]
    slot_ids: jax.Array,  # int32 [num_tokens]; < 0 means skip
    *,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Pure-jnp reference (the "xla" backend): a dropping scatter into the donated pages."""
  del interpret
  _check(k_pages, v_pages, k_new, v_new, slot_ids)
  num_blocks, block_size = k_pages.shape[:2]
  # Negative slots would wrap around; send them out of range, where mode="drop" skips.
  slot = jnp.where(slot_ids < 0, num_blocks * block_size, slot_ids)
  block_id, offset = slot // block_size, slot % block_size
  k_pages = k_pages.at[block_id, offset].set(k_new, mode="drop")
  v_pages = v_pages.at[block_id, offset].set(v_new, mode="drop")
  return k_pages, v_pages

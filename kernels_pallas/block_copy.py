"""Copies listed KV blocks between two block arrays, in place, in one kernel launch:
the zero-copy path for moves between the pinned_host pool and the device pool.

    dst[dst_ids[i]] := src[src_ids[i]]    for every i with 0 <= dst_ids[i] < len(dst)

    grid (num_ids, chunks_per_block): program (i, c) copies elements [c * chunk,
    (c + 1) * chunk) of block src_ids[i] to the same elements of block dst_ids[i]
    (blocks viewed flat: [num_blocks, elements_per_block]); a destination out of range
    (the padding of a bucketed id list) copies nothing.

Why a kernel (#55): on a GPU, XLA moves blocks between memory kinds as a host-side gather
(`compute_on("device_host")`, single-threaded on the CPU), one crossing, and a scatter on
the device; on an H200 (jax 0.11.2) that reached 1.6-9.7 GB/s host -> device for 16-256
scattered blocks, 2.5-15% of PCIe Gen5. SGLang's HiCache and LMCache instead let the GPU
read (or write) pinned host memory directly, page by page, from many thread blocks at
once: with unified addressing a pinned allocation's host address is valid on the device,
and PCIe carries only the blocks' bytes. XLA's GPU compiler keeps a Triton custom call's
operand in the host memory space (S(5)) and hands the kernel the host buffer's address,
with no copy inserted (seen compiling for an H200 deviceless, jax 0.11.2), so this
Pallas kernel over a `pinned_host` pool and a `device` pool is that zero-copy move,
either direction, with the host pool still a jax array of kind pinned_host.

Unverified on a GPU: whether XLA's pinned_host allocation is device-mapped at the same
address (CUDA's cuMemHostAlloc under unified addressing is), and its bandwidth against
the host-gather path: `make gpu-bench`'s transfer part times both and checks the blocks
bit for bit.

The destination is aliased to the output (`input_output_aliases`): callers donate it and
use the returned array. Destination ids of one call must be distinct (a repeat writes
either source). Elements move as they are (any dtype: bf16, int8 / fp8 bits, float32
scales). `chunk` is the largest power of two <= `max_chunk` dividing a block's element
count, so no store is masked; in interpret mode (CPU) the same body runs on numpy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import backend

MAX_CHUNK = 4096  # elements one program copies: 8 KiB of bf16 (enough loads in flight)


def chunk_elements(elements_per_block: int, max_chunk: int = MAX_CHUNK) -> int:
  """The largest power of two <= max_chunk that divides elements_per_block."""
  if elements_per_block < 1:
    raise ValueError(f"a block must hold at least one element, got {elements_per_block}")
  return min(elements_per_block & -elements_per_block, max_chunk & -max_chunk)


def _copy_kernel(src_ids_ref, dst_ids_ref, src_ref, dst_in_ref, dst_ref, *, chunk: int):
  del dst_in_ref  # the same buffer as dst_ref
  i, c = pl.program_id(0), pl.program_id(1)
  d = dst_ids_ref[i]

  @pl.when((d >= 0) & (d < dst_ref.shape[0]))
  def _copy():
    cols = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    dst_ref[d, cols] = src_ref[src_ids_ref[i], cols]


def _copy_call(src, dst, src_ids, dst_ids, *, chunk: int, interpret: bool):
  n = src_ids.shape[0]
  elements = src.shape[1]
  whole = lambda shape: pl.BlockSpec(shape, lambda i, c: (0,) * len(shape))  # noqa: E731
  return pl.pallas_call(
      functools.partial(_copy_kernel, chunk=chunk),
      grid=(n, elements // chunk),
      in_specs=[whole((n,)), whole((n,)), whole(src.shape), whole(dst.shape)],
      out_specs=whole(dst.shape),
      out_shape=jax.ShapeDtypeStruct(dst.shape, dst.dtype),
      input_output_aliases={3: 0},
      interpret=interpret,
      compiler_params=backend.compiler_params(interpret, num_warps=4, num_stages=1),
      name="block_copy",
  )(src_ids, dst_ids, src, dst)


def copy_blocks(src_arrays, dst_arrays, src_ids, dst_ids, *, interpret: bool | None = None,
                max_chunk: int = MAX_CHUNK):
  """dst_arrays[j][dst_ids[i]] := src_arrays[j][src_ids[i]] for each in-range dst id, one
  kernel launch per array pair (traced inside a jit; donate the destinations). Arrays
  are [num_blocks, ...] of one dtype per pair, the same trailing shape on both sides;
  src_ids must be in range wherever dst_ids are. Returns the new destination arrays.
  `interpret` None: compiled for a GPU where traced for one (this process's GPU, or an
  abstract GPU context: backend.context_platform), interpret mode on CPU."""
  if len(src_arrays) != len(dst_arrays):
    raise ValueError(f"source and destination arrays must pair up, got {len(src_arrays)} "
                     f"and {len(dst_arrays)}")
  src_ids = jnp.asarray(src_ids, jnp.int32)
  dst_ids = jnp.asarray(dst_ids, jnp.int32)
  if src_ids.shape != dst_ids.shape or src_ids.ndim != 1:
    raise ValueError(f"src_ids and dst_ids must be 1-D of one length, got "
                     f"{src_ids.shape} and {dst_ids.shape}")
  if interpret is None:  # (compiled inside an abstract GPU context: a deviceless build)
    interpret = backend.context_platform() == "cpu"
  out = []
  for src, dst in zip(src_arrays, dst_arrays):
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
      raise ValueError(f"a block must be the same on both sides, got {src.dtype}"
                       f"{list(src.shape[1:])} and {dst.dtype}{list(dst.shape[1:])}")
    if src_ids.shape[0] == 0:
      out.append(dst)
      continue
    shape = dst.shape
    elements = int(src.size // src.shape[0])
    flat = _copy_call(src.reshape(src.shape[0], elements), dst.reshape(shape[0], elements),
                      src_ids, dst_ids, chunk=chunk_elements(elements, max_chunk),
                      interpret=interpret)
    out.append(flat.reshape(shape))
  return tuple(out)


def copy_blocks_reference(src_arrays, dst_arrays, src_ids, dst_ids):
  """What copy_blocks computes, in jnp (an XLA gather and a dropping scatter)."""
  src_ids = jnp.asarray(src_ids, jnp.int32)
  dst_ids = jnp.asarray(dst_ids, jnp.int32)
  out = []
  for src, dst in zip(src_arrays, dst_arrays):
    ok = (dst_ids >= 0) & (dst_ids < dst.shape[0])
    rows = src[jnp.where(ok, src_ids, 0)]
    out.append(dst.at[jnp.where(ok, dst_ids, dst.shape[0])].set(rows, mode="drop"))
  return tuple(out)

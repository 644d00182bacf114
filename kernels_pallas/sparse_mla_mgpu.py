"""Sparse MLA decode for Pallas **Mosaic GPU** (Hopper WGMMA + TMA), beside the Triton one.

Same contract and reference as :func:`kernels_pallas.sparse_mla.sparse_mla_decode`: every
query row over its own list of flat token ids into the latent pool, the value of an entry
its first kv_lora_rank dims, negative ids padding (weight 0; a row with no valid id gives
zeros; unlisted pages never reach the output).

  XLA   rows[i, j] = kv_pages.flat[indices[i, j]]   (0 where the id is negative)
        bias[i, j] = 0 | MASK_VALUE                 (valid | padding)
  grid (query row i, head tile h of 64 heads, split s); one warpgroup per program

  GMEM  rows[i, step*T:(step+1)*T, :rank] ──TMA──> k_lat[slot]  [2, T, rank]
        rows[i, step*T:(step+1)*T, rank:] ──TMA──> k_rope[slot] [2, T, rope]
        bias[i, step*T:(step+1)*T]        ──TMA──> bias[slot]   [2, T] f32
  SMEM  q_lat [64, rank] (the output tile too), q_rope [64, rope]
  regs  s = q_lat @ k_lat^T + q_rope @ k_rope^T (two WGMMAs into one accumulator)
        -> + bias, online softmax -> p [64, T] stored over k_rope[slot] (read by now)
        -> acc += p @ k_lat (WGMMAs of 256 columns; the value is the latent)

Why an XLA gather first rather than one TMA copy per selected token: the ids are arbitrary
tokens, not blocks, and a WGMMA operand lives in 8-row swizzled SMEM tiles, which a TMA
copy fills whole (paged_attention_mgpu's blocks are multiples of 8 rows for that reason);
a one-row copy into such a tile is not what Mosaic GPU's copy_gmem_to_smem takes in jax
0.11, and a per-token copy of 1152 bytes would also be 64 copies per step to issue. The
gather costs HBM traffic: each listed row is read from the pool, written to `rows`, read
again by the kernel (3 x 1152 bytes per listed token and query row, against the 1 x of
FlashMLA's in-kernel gather); the kernel itself reads each gathered row once for all 64
heads of a tile (128 heads: twice, the second time from L2 when the two head tiles run
together). Getting to FlashMLA's ~90% of HBM needs the in-kernel gather (cp.async rows
into the swizzled tile, or TMA gather4 on Blackwell) and FlashMLA's split of the
[64, 512] float32 accumulator over two warpgroups: here one warpgroup holds it (256
registers per thread for the accumulator alone, past a thread's 255: expect spills; the
module's PTX compile happens only where a GPU loads it, so that is not seen from a CPU
host), so this kernel is the correct Mosaic GPU baseline, not yet the fast one.

SMEM per program (bytes, T = tokens_per_step, 2-byte dtype; ``smem_bytes``):
  2*64*(rank + rope) + 2*2*T*(rank + rope) + 2*4*T + 256 (split-K's lse)
  DeepSeek (rank 512, rope 64, T 64): 73728 + 147456 + 512 + 256 = 221952 of the 232448
  (227 KiB) Hopper gives one block; Mosaic GPU's lowering adds ~3.3 KiB (alignment,
  barriers), which is why p has no tile of its own: with one (8 KiB) the lowering refused
  233496 bytes. T = 64 is the only step that fits.

Limits, refused with a ``ValueError`` naming the size: dtype bfloat16 or float16 (q and
the pool the same; WGMMA would round float32 to tf32); kv_lora_rank and rope multiples of
64 (whole 128-byte swizzled columns of the SMEM tiles); tokens_per_step 64 (the WGMMA row
tile; 128 overflows SMEM); the SMEM budget above within 227 KiB. Heads are padded to a
multiple of 64 (rows of WGMMA); splits past the list read padding only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import common
from kernels_pallas.paged_attention_mgpu import (
  _smem_transforms,
  combine_splits,
  refuse_generic_interpret,
  softmax_start,
)
from kernels_pallas.sparse_mla import _check

WGMMA_ROWS = 64  # query heads per program (WGMMA's row tile)
DEFAULT_TOKENS_PER_STEP = 64
NUM_SLOTS = 2  # double buffering of one step's gathered rows
ROPE = 64  # the rope width taken (DeepSeek's, GLM-5's): p reuses a step's rope tile
PV_COLUMNS = 256  # p @ latent in WGMMAs of N = 256 columns (WGMMA's largest N)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block
# Split-K: one program per SM of an H100/H200 at least, splits of at least
# MIN_STEPS_PER_SPLIT steps, at most MAX_SPLITS.
NUM_SMS = 132
MIN_STEPS_PER_SPLIT = 4
MAX_SPLITS = 16


def _sparse_mla_kernel(q_gmem, rows_gmem, bias_gmem, *out_gmem, sm_scale: float,
                       kv_lora_rank: int, num_splits: int, steps_per_split: int, **smem):
  """One program: 64 heads (head tile h) of query row i over split s of its list.

  q_gmem [num_queries, head_tiles, 64, width]; rows_gmem [num_queries, padded_topk, width]
  (the listed entries, gathered); bias_gmem float32 [num_queries, padded_topk] (0 valid,
  MASK_VALUE padding); out: [num_queries, head_tiles, 64, rank] normalized, or with
  num_splits > 1 each split's [num_splits, ...] normalized over its own entries and its
  log-sum-exp [num_splits, num_queries, head_tiles, 64] float32.
  """
  q_lat, q_rope = smem["q_lat"], smem["q_rope"]
  k_lat, k_rope, bias = smem["k_lat"], smem["k_rope"], smem["bias"]
  barriers = smem["barriers"]
  i = lax.axis_index("query")
  h = lax.axis_index("head_tile")
  split = lax.axis_index("split") if num_splits > 1 else 0
  tokens_per_step = k_lat.shape[1]
  rope = k_rope.shape[2]
  dtype = q_lat.dtype
  lat_cols, rope_cols = pl.ds(0, kv_lora_rank), pl.ds(kv_lora_rank, rope)
  first_step = split * steps_per_split
  cols = math.gcd(kv_lora_rank, PV_COLUMNS)  # output columns per PV WGMMA

  def fetch(local_step, slot):
    """Starts the copies of this split's `local_step` (its T gathered rows, their bias)."""
    keys = pl.ds((first_step + local_step) * tokens_per_step, tokens_per_step)
    plgpu.copy_gmem_to_smem(rows_gmem.at[i, keys, lat_cols], k_lat.at[slot],
                            barriers.at[slot])
    plgpu.copy_gmem_to_smem(rows_gmem.at[i, keys, rope_cols], k_rope.at[slot],
                            barriers.at[slot])
    plgpu.copy_gmem_to_smem(bias_gmem.at[i, keys], bias.at[slot], barriers.at[slot])

  plgpu.copy_gmem_to_smem(q_gmem.at[i, h, :, lat_cols], q_lat, smem["q_barrier"])
  plgpu.copy_gmem_to_smem(q_gmem.at[i, h, :, rope_cols], q_rope, smem["q_barrier"])
  for slot in range(min(NUM_SLOTS, steps_per_split)):
    fetch(slot, slot)
  plgpu.barrier_wait(smem["q_barrier"])

  def body(local_step, carry):
    m_prev, l_prev, acc_prev = carry
    slot = lax.rem(local_step, NUM_SLOTS)
    plgpu.barrier_wait(barriers.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_lat, k_lat.at[slot].transpose((1, 0)))
      plgpu.wgmma(acc_ref, q_rope, k_rope.at[slot].transpose((1, 0)))
      return acc_ref[...]

    s = pl.run_scoped(qk, plgpu.ACC((WGMMA_ROWS, tokens_per_step), jnp.float32))
    b = plgpu.load(bias.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    # Padding: MASK_VALUE (finite). While a row has seen only padding, m = MASK_VALUE and
    # padding weighs 1, but its gathered rows are zeros (acc stays 0) and the first valid
    # entry's alpha = exp(MASK_VALUE - m) = 0 wipes its l: no valid entry -> zeros.
    s = s * sm_scale + lax.broadcast_in_dim(b, s.shape, [1])
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
    l_next = alpha * l_prev + p.sum(axis=1)
    # p goes to the slot's rope tile ([T, rope] = [64, 64], the swizzle of the latent's):
    # the QK WGMMAs above have read it, and the next fetch into the slot waits for PV.
    k_rope[slot] = p.astype(dtype)
    plgpu.commit_smem()  # the register store of p, visible to WGMMA

    def pv(c, acc_ref):
      plgpu.wgmma(acc_ref, k_rope.at[slot], k_lat.at[slot, :, pl.ds(c, cols)])
      return acc_ref[...]  # waits for the WGMMA: the slot is free after the last chunk

    acc_next = tuple(
        lax.broadcast_in_dim(alpha, a.shape, [0]) * a
        + pl.run_scoped(functools.partial(pv, c),
                        plgpu.ACC((WGMMA_ROWS, cols), jnp.float32))
        for c, a in zip(range(0, kv_lora_rank, cols), acc_prev, strict=True))
    next_step = local_step + NUM_SLOTS
    pl.when(next_step < steps_per_split)(functools.partial(fetch, next_step, slot))
    return m_next, l_next, acc_next

  m0, l0, acc0 = softmax_start(*[cols] * (kv_lora_rank // cols))
  m, l, acc = lax.fori_loop(0, steps_per_split, body, (m0, l0, acc0))
  l_safe = jnp.where(l > 0.0, l, 1.0)  # (l >= 1 after any step)
  for c, a in zip(range(0, kv_lora_rank, cols), acc, strict=True):
    q_lat[:, pl.ds(c, cols)] = (
        a / lax.broadcast_in_dim(l_safe, a.shape, [0])).astype(dtype)
  if num_splits > 1:
    smem["lse"][...] = m + jnp.log(l_safe)
  plgpu.commit_smem()
  if num_splits > 1:
    o_gmem, lse_gmem = out_gmem
    plgpu.copy_smem_to_gmem(q_lat, o_gmem.at[split, i, h])
    plgpu.copy_smem_to_gmem(smem["lse"], lse_gmem.at[split, i, h])
  else:
    plgpu.copy_smem_to_gmem(q_lat, out_gmem[0].at[i, h])
  plgpu.wait_smem_to_gmem(0)


def smem_bytes(dtype, kv_lora_rank: int, rope: int, tokens_per_step: int,
               num_splits: int) -> int:
  """SMEM the kernel's buffers take (the module docstring's sum)."""
  size = jnp.dtype(dtype).itemsize
  width = kv_lora_rank + rope
  return (size * WGMMA_ROWS * width + size * NUM_SLOTS * tokens_per_step * width
          + 4 * NUM_SLOTS * tokens_per_step
          + (4 * WGMMA_ROWS if num_splits > 1 else 0))


def _scratch_types(dtype, kv_lora_rank: int, rope: int, tokens_per_step: int,
                   num_splits: int) -> dict:
  """The kernel's SMEM buffers and barriers, by name."""
  lat, rop = _smem_transforms(kv_lora_rank, dtype), _smem_transforms(rope, dtype)
  scratch = dict(
      q_lat=plgpu.SMEM((WGMMA_ROWS, kv_lora_rank), dtype, transforms=lat),
      q_rope=plgpu.SMEM((WGMMA_ROWS, rope), dtype, transforms=rop),
      k_lat=plgpu.SMEM((NUM_SLOTS, tokens_per_step, kv_lora_rank), dtype, transforms=lat),
      k_rope=plgpu.SMEM((NUM_SLOTS, tokens_per_step, rope), dtype, transforms=rop),
      bias=plgpu.SMEM((NUM_SLOTS, tokens_per_step), jnp.float32),
      q_barrier=plgpu.Barrier(num_arrivals=2),
      barriers=plgpu.Barrier(num_arrivals=3, num_barriers=NUM_SLOTS))
  if num_splits > 1:
    scratch.update(lse=plgpu.SMEM((WGMMA_ROWS,), jnp.float32))
  return scratch


def _check_mgpu_sizes(q, kv_pages, kv_lora_rank: int, tokens_per_step: int):
  """Refuses what WGMMA/TMA and the SMEM budget cannot take, naming the size."""
  rope = q.shape[-1] - kv_lora_rank
  if q.dtype not in SUPPORTED_DTYPES or kv_pages.dtype != q.dtype:
    raise ValueError(
        f"the Mosaic GPU sparse MLA decode takes bfloat16 or float16 q and kv_pages of one "
        f"dtype, got q {q.dtype}, kv_pages {kv_pages.dtype} (WGMMA would round float32 to "
        "tf32); use the Triton kernel for float32")
  if kv_lora_rank % 64 or rope != ROPE:
    raise ValueError(f"the Mosaic GPU sparse MLA decode needs kv_lora_rank a multiple of "
                     f"64 and rope {ROPE}, got {kv_lora_rank} + {rope}")
  if tokens_per_step != DEFAULT_TOKENS_PER_STEP:
    raise ValueError(f"tokens_per_step must be {DEFAULT_TOKENS_PER_STEP} (the WGMMA row "
                     f"tile; 128 overflows SMEM), got {tokens_per_step}")
  need = smem_bytes(q.dtype, kv_lora_rank, rope, tokens_per_step, num_splits=2)
  if need > SMEM_BYTES:
    raise ValueError(f"kv_lora_rank {kv_lora_rank} + rope {rope} at tokens_per_step "
                     f"{tokens_per_step} needs {need} bytes of SMEM, over {SMEM_BYTES}")


def default_num_splits(num_queries: int, head_tiles: int, num_steps: int,
                       num_sms: int = NUM_SMS) -> int:
  """Splits of each row's list for num_queries * head_tiles programs over `num_steps`
  steps: enough for one program per SM, each at least MIN_STEPS_PER_SPLIT steps, at most
  MAX_SPLITS; then as few as cover the steps at that size. DSA at batch 32, 128 heads,
  top-k 2048: 64 programs, 32 steps -> 3 splits of 11 steps (192 programs)."""
  splits = max(1, min(common.cdiv(num_sms, num_queries * head_tiles),
                      num_steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS))
  return common.cdiv(num_steps, common.cdiv(num_steps, splits)) if num_steps else 1


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "interpret",
                                             "tokens_per_step", "num_splits"))
def sparse_mla_decode_mgpu(
    q: jax.Array,  # [num_queries, num_heads, kv_lora_rank + rope]
    kv_pages: jax.Array,  # [num_blocks, block_size, 1, kv_lora_rank + rope]
    indices: jax.Array,  # int32 [num_queries, topk]; negative = padding
    *,
    sm_scale: float,
    kv_lora_rank: int,
    interpret: object = None,
    tokens_per_step: int = DEFAULT_TOKENS_PER_STEP,
    num_splits: int | None = None,
) -> jax.Array:
  """Each query row over its listed tokens: [num_queries, num_heads, kv_lora_rank] in q's
  dtype, as :func:`kernels_pallas.sparse_mla.sparse_mla_decode`, within the limits of the
  module docstring.

  Args:
    interpret: None, False: the compiled Mosaic GPU kernel (runs only on a Hopper-class
      GPU; lowers from any host). Or ``InterpretGPUParams`` (jax's GPU interpreter, on
      CPU). ``True`` is refused: the generic interpreter cannot run Mosaic GPU primitives.
    num_splits: programs per (query row, head tile), each over one contiguous run of the
      list's steps, merged by ``combine_splits``; None: `default_num_splits`.
  """
  _check(q, kv_pages, indices, kv_lora_rank)
  refuse_generic_interpret(interpret)
  _check_mgpu_sizes(q, kv_pages, kv_lora_rank, tokens_per_step)
  num_queries, num_heads, width = q.shape
  rope = width - kv_lora_rank
  topk = indices.shape[1]
  head_tiles = common.cdiv(num_heads, WGMMA_ROWS)
  num_steps = common.cdiv(topk, tokens_per_step)
  if num_splits is None:
    num_splits = default_num_splits(num_queries, head_tiles, num_steps)
  if num_splits < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")
  steps_per_split = common.cdiv(num_steps, num_splits)
  padded = num_splits * steps_per_split * tokens_per_step
  idx = jnp.pad(indices, ((0, 0), (0, padded - topk)), constant_values=-1)
  valid = idx >= 0
  flat = kv_pages.reshape(-1, width)
  rows = jnp.where(valid[..., None], flat[jnp.clip(idx, 0, flat.shape[0] - 1)], 0)
  bias = jnp.where(valid, 0.0, common.MASK_VALUE).astype(jnp.float32)
  q4 = jnp.pad(q, ((0, 0), (0, head_tiles * WGMMA_ROWS - num_heads), (0, 0)))
  q4 = q4.reshape(num_queries, head_tiles, WGMMA_ROWS, width)

  kernel = functools.partial(_sparse_mla_kernel, sm_scale=float(sm_scale),
                             kv_lora_rank=kv_lora_rank, num_splits=num_splits,
                             steps_per_split=steps_per_split)
  out_shape = (num_queries, head_tiles, WGMMA_ROWS)
  if num_splits > 1:
    out_type = [jax.ShapeDtypeStruct((num_splits, *out_shape, kv_lora_rank), q.dtype),
                jax.ShapeDtypeStruct((num_splits, *out_shape), jnp.float32)]
    grid, names = (num_queries, head_tiles, num_splits), ("query", "head_tile", "split")
  else:
    out_type = [jax.ShapeDtypeStruct((*out_shape, kv_lora_rank), q.dtype)]
    grid, names = (num_queries, head_tiles), ("query", "head_tile")
  out = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=_scratch_types(q.dtype, kv_lora_rank, rope, tokens_per_step,
                                   num_splits),
      grid=grid,
      grid_names=names,
      compiler_params=plgpu.CompilerParams(),
      interpret=None if interpret is False else interpret,
      kernel_name="sparse_mla_decode_mgpu",
  )(q4, rows, bias)
  out = combine_splits(*out).astype(q.dtype) if num_splits > 1 else out[0]
  out = out.reshape(num_queries, head_tiles * WGMMA_ROWS, kv_lora_rank)
  return out[:, :num_heads]

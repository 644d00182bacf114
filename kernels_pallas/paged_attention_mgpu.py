"""Decode paged attention for Pallas **Mosaic GPU** (Hopper WGMMA + TMA).

Same contract as :func:`kernels_pallas.paged_attention.paged_attention` (one query
token per sequence over its block table; a sequence of length 0 yields zeros), a
different body: the pools stay in GMEM, and each program copies the blocks its row's
table lists into shared memory with asynchronous (TMA) copies, double-buffered, while
the warpgroup runs the online softmax on the previous step's blocks.

  grid (batch, num_kv_heads); one warpgroup per program; T = tokens_per_step

  GMEM  k_pages[block_tables[b, i], :, h, :] ──TMA──> k_smem[slot, j*bs:(j+1)*bs]
        (blocks_per_step copies per step into slot = step % 2, one barrier per slot)
  SMEM  q_smem [64, head_dim]      query heads of KV head h, zero-padded to 64 rows
        k_smem, v_smem [2, T, head_dim]
        p_smem [64, T]             softmax weights, bf16/f16 (WGMMA's A operand)
  regs  s = q @ k^T [64, T] (WGMMA) -> mask, online softmax -> acc += p @ v (WGMMA)

Limits, refused with a ``ValueError`` naming the size (what WGMMA and the 128-byte
swizzled SMEM tiles need): dtype bfloat16 or float16 (no float32: WGMMA would round it
to tf32; no 8-bit pages, which the Triton kernel reads); query heads per KV head at most
64 (the WGMMA row tile; rows past the group are padding); ``block_size`` a multiple of 8
(one TMA copy per block lands on whole 8-row SMEM tiles) that divides
``tokens_per_step``; ``head_dim`` a multiple of 32; ``tokens_per_step`` a multiple of 64
up to 256; the step's buffers within the 227 KiB of SMEM (2 * (64 + 4 * tokens_per_step)
* head_dim + 128 * tokens_per_step bytes, checked by Mosaic GPU's lowering: head_dim 256
fits 64 keys per step, not 128). So the HiSparse default block size 4 and float32 pools
are refused here: use the Triton kernel for those.

Masked keys (past ``kv_len`` in the last step) get weight 0, but their V rows still
enter the WGMMA as 0 * v: the pools must hold finite values there (the engine's do: its pools
start as zeros and hold only written K/V), unlike the Triton kernel, which
zeroes masked V rows explicitly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import common
from kernels_pallas.paged_attention import _check
from kernels_pallas.quant import QuantizedPages

# WGMMA's row tile: one warpgroup multiplies 64 rows at a time.
WGMMA_ROWS = 64
DEFAULT_TOKENS_PER_STEP = 64
NUM_SLOTS = 2  # double buffering of the K/V blocks of one step
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


def _smem_transforms(minor_dim: int, dtype) -> tuple:
  """Tiling + swizzle of a 2-D SMEM operand of WGMMA with `minor_dim` columns."""
  bits = jnp.finfo(dtype).bits
  swizzle = plgpu.find_swizzle(minor_dim * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _paged_attention_kernel(
    q_gmem,  # [batch, num_kv_heads, 64, head_dim]
    k_gmem,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_gmem,  # [num_blocks, block_size, num_kv_heads, head_dim]
    tables_gmem,  # int32 [batch, num_steps * blocks_per_step]
    lens_gmem,  # int32 [batch]
    o_gmem,  # [batch, num_kv_heads, 64, head_dim]
    qo_smem,  # [64, head_dim]: the query, then the output
    k_smem,  # [NUM_SLOTS, tokens_per_step, head_dim]
    v_smem,  # [NUM_SLOTS, tokens_per_step, head_dim]
    p_smem,  # [64, tokens_per_step]
    q_barrier,
    k_barriers,  # [NUM_SLOTS], blocks_per_step arrivals each
    v_barriers,  # [NUM_SLOTS], blocks_per_step arrivals each
    *,
    sm_scale: float,
    soft_cap: float | None,
    blocks_per_step: int,
):
  b = lax.axis_index("batch")
  h = lax.axis_index("kv_head")
  block_size = k_gmem.shape[1]
  tokens_per_step = k_smem.shape[1]
  head_dim = qo_smem.shape[1]
  dtype = qo_smem.dtype

  length = lens_gmem[b]
  num_steps = lax.div(length + (tokens_per_step - 1), jnp.int32(tokens_per_step))

  def fetch(step, slot):
    """Starts the copies of the blocks of `step` into `slot` (blocks_per_step each)."""
    for j in range(blocks_per_step):
      block_id = tables_gmem[b, step * blocks_per_step + j]
      rows = pl.ds(j * block_size, block_size)
      plgpu.copy_gmem_to_smem(k_gmem.at[block_id, :, h, :], k_smem.at[slot, rows],
                              k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(v_gmem.at[block_id, :, h, :], v_smem.at[slot, rows],
                              v_barriers.at[slot])

  plgpu.copy_gmem_to_smem(q_gmem.at[b, h], qo_smem, q_barrier)
  for slot in range(NUM_SLOTS):
    pl.when(slot < num_steps)(functools.partial(fetch, slot, slot))
  plgpu.barrier_wait(q_barrier)

  def body(step, carry):
    m_prev, l_prev, acc_prev = carry
    slot = lax.rem(step, NUM_SLOTS)

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
    valid = key_pos < length
    s = jnp.where(valid, s, common.MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    # Every step holds at least one valid key, so m_next is a real logit and the
    # masked keys' exp(MASK_VALUE - m_next) is exactly 0.
    p = jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
    l_next = alpha * l_prev + p.sum(axis=1)
    p_smem[...] = p.astype(dtype)
    plgpu.commit_smem()  # make the register stores visible to WGMMA

    plgpu.barrier_wait(v_barriers.at[slot])

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
      return acc_ref[...]  # waits for the WGMMA: the slot and p_smem are free after this

    pv_out = pl.run_scoped(pv, plgpu.ACC((WGMMA_ROWS, head_dim), jnp.float32))
    acc_next = lax.broadcast_in_dim(alpha, acc_prev.shape, [0]) * acc_prev + pv_out
    pl.when(step + NUM_SLOTS < num_steps)(
        functools.partial(fetch, step + NUM_SLOTS, slot))
    return m_next, l_next, acc_next

  m0 = plgpu.layout_cast(jnp.full((WGMMA_ROWS,), common.MASK_VALUE, jnp.float32),
                         plgpu.Layout.WGMMA.reduce(1))
  l0 = plgpu.layout_cast(jnp.full((WGMMA_ROWS,), 0.0, jnp.float32),
                         plgpu.Layout.WGMMA.reduce(1))
  acc0 = plgpu.layout_cast(jnp.full((WGMMA_ROWS, head_dim), 0.0, jnp.float32),
                           plgpu.Layout.WGMMA)
  _, l, acc = lax.fori_loop(0, num_steps, body, (m0, l0, acc0))
  # Length 0: no step ran, acc = 0 and l = 0 -> zeros (l >= 1 once any key is valid).
  l_safe = jnp.where(l > 0.0, l, 1.0)
  qo_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(qo_smem, o_gmem.at[b, h])
  plgpu.wait_smem_to_gmem(0)


def _check_mgpu_sizes(q, k_pages, tokens_per_step: int) -> int:
  """Refuses what WGMMA/TMA cannot take, naming the size; returns blocks_per_step."""
  _, block_size, num_kv_heads, head_dim = k_pages.shape
  group = q.shape[1] // num_kv_heads
  if isinstance(k_pages, QuantizedPages):
    raise ValueError(
        "the Mosaic GPU paged attention takes no 8-bit KV pages (kv_cache_dtype int8 or "
        "fp8_e4m3: WGMMA would need them dequantized into shared memory first); use the "
        "Triton kernel (backend 'pallas'), which dequantizes the blocks it loads")
  if k_pages.dtype not in SUPPORTED_DTYPES:
    raise ValueError(
        f"the Mosaic GPU paged attention takes bfloat16 or float16 KV, got {k_pages.dtype} "
        "(WGMMA would round float32 to tf32); use the Triton kernel for float32")
  if group > WGMMA_ROWS:
    raise ValueError(
        f"query heads per KV head {group} (q shape {q.shape}) exceed the WGMMA row tile "
        f"{WGMMA_ROWS}")
  if head_dim % 32:
    raise ValueError(f"the Mosaic GPU paged attention needs head_dim a multiple of 32, "
                     f"got {head_dim}")
  if tokens_per_step % WGMMA_ROWS or not WGMMA_ROWS <= tokens_per_step <= 256:
    raise ValueError(f"tokens_per_step must be a multiple of {WGMMA_ROWS} up to 256, "
                     f"got {tokens_per_step}")
  if block_size % 8 or tokens_per_step % block_size:
    raise ValueError(
        f"the Mosaic GPU paged attention needs block_size a multiple of 8 that divides "
        f"tokens_per_step={tokens_per_step}, got block_size {block_size} (k_pages shape "
        f"{k_pages.shape}); use the Triton kernel for smaller blocks")
  return tokens_per_step // block_size


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret",
                                             "tokens_per_step"))
def paged_attention_mgpu(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    k_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: jax.Array,  # int32 [batch, max_blocks_per_seq]
    kv_lens: jax.Array,  # int32 [batch]
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    interpret: object = None,
    tokens_per_step: int = DEFAULT_TOKENS_PER_STEP,
) -> jax.Array:
  """Decode attention of one query token per sequence over its listed blocks.

  Arguments and result as :func:`kernels_pallas.paged_attention.paged_attention`, within
  the limits of the module docstring (bf16/f16, block_size a multiple of 8, ...).

  Args:
    interpret: None, False: the compiled Mosaic GPU kernel (runs only on a Hopper-class
      GPU; lowers from any host). Or the GPU interpreter's parameters
      (``jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams``), which run the
      kernel on CPU simulating SMEM, barriers and TMA copies. ``True`` is refused: the
      generic Pallas interpreter cannot run Mosaic GPU primitives.
    tokens_per_step: keys per pipeline step (per WGMMA), a multiple of 64 up to 256.
  """
  _check(q, k_pages, v_pages, block_tables, kv_lens)
  if interpret is True:
    raise ValueError("interpret=True cannot run Mosaic GPU primitives; pass "
                     "InterpretGPUParams() to run this kernel on CPU")
  blocks_per_step = _check_mgpu_sizes(q, k_pages, tokens_per_step)
  batch, num_q_heads, head_dim = q.shape
  _, _, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  dtype = q.dtype

  max_blocks = block_tables.shape[1]
  tables = jnp.pad(block_tables,
                   ((0, 0), (0, common.round_up(max_blocks, blocks_per_step) - max_blocks)))
  q4 = q.reshape(batch, num_kv_heads, group, head_dim)
  q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, WGMMA_ROWS - group), (0, 0)))
  # A length past the table would read past it: clamp (the reference clamps the same way).
  kv_lens = jnp.minimum(kv_lens, max_blocks * k_pages.shape[1])

  kv_transforms = _smem_transforms(head_dim, dtype)
  kernel = functools.partial(
      _paged_attention_kernel,
      sm_scale=head_dim**-0.5 if sm_scale is None else float(sm_scale),
      soft_cap=soft_cap, blocks_per_step=blocks_per_step)
  out = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((batch, num_kv_heads, WGMMA_ROWS, head_dim), dtype),
      scratch_types=[
          plgpu.SMEM((WGMMA_ROWS, head_dim), dtype, transforms=kv_transforms),
          plgpu.SMEM((NUM_SLOTS, tokens_per_step, head_dim), dtype, transforms=kv_transforms),
          plgpu.SMEM((NUM_SLOTS, tokens_per_step, head_dim), dtype, transforms=kv_transforms),
          # WGMMA needs its two operands' swizzles equal: p's is v's.
          plgpu.SMEM((WGMMA_ROWS, tokens_per_step), dtype, transforms=kv_transforms),
          plgpu.Barrier(),
          plgpu.Barrier(num_arrivals=blocks_per_step, num_barriers=NUM_SLOTS),
          plgpu.Barrier(num_arrivals=blocks_per_step, num_barriers=NUM_SLOTS),
      ],
      grid=(batch, num_kv_heads),
      grid_names=("batch", "kv_head"),
      compiler_params=plgpu.CompilerParams(),
      interpret=None if interpret is False else interpret,
      kernel_name="paged_attention_mgpu",
  )(q4, k_pages, v_pages, tables, kv_lens)
  return out[:, :, :group].reshape(batch, num_q_heads, head_dim)

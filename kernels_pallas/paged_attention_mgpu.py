"""Decode paged attention for Pallas **Mosaic GPU** (Hopper WGMMA + TMA).

Same contract as :func:`kernels_pallas.paged_attention.paged_attention` (one query
token per sequence over its block table; a sequence of length 0 yields zeros), a
different body: the pools stay in GMEM, and each program copies the blocks its row's
table lists into shared memory with asynchronous (TMA) copies, double-buffered (or
`num_slots` deep), while the warpgroup runs the online softmax on an earlier step's blocks.

  grid (batch, num_kv_heads[, num_splits]); one warpgroup per program; T = tokens_per_step

  GMEM  k_pages[block_tables[b, i], :, h, :] ──TMA──> k_smem[slot, j*bs:(j+1)*bs]
        (blocks_per_step copies per step into slot = step % num_slots, one barrier a slot)
  SMEM  q_smem [64, head_dim]      query heads of KV head h, zero-padded to 64 rows
        k_smem, v_smem [2, T, head_dim]
        p_smem [64, T]             softmax weights, bf16/f16 (WGMMA's A operand)
  regs  s = q @ k^T [64, T] (WGMMA) -> mask, online softmax -> acc += p @ v (WGMMA)

Split-K: with num_splits > 1 each program reads one contiguous run of steps_per_split
steps of its row's table (a split past the row's length reads nothing) and writes its
output normalized over its own keys (in q's dtype, through the same SMEM tile as the
unsplit output) and its log-sum-exp (float32); ``combine_splits`` (XLA) merges them. So a
decode of few rows over a long context fills the SMs (``default_num_splits``: a pure
function of batch, KV heads and table steps); the partial outputs cost 64 * head_dim * 2 +
256 bytes per program, beside at least MIN_STEPS_PER_SPLIT * T keys of K and V read.

8-bit pages (``QuantizedPages``: int8, or fp8_e4m3 stored as its uint8 bits, with a
float32 scale per token and KV head; what ``kv_cache_dtype`` int8 / fp8_e4m3 stores). The
TMA copies move the 8-bit values into the slots (one byte per value from HBM: half the
bytes of bf16, which is the point of a memory-bound decode) and each step's scales beside
them, from a [batch, num_kv_heads, keys] copy XLA gathers first (``scales_by_row``: the
pool interleaves the heads' scales 4 bytes apart, a stride TMA cannot copy). Before each
WGMMA the warpgroup dequantizes the step's K (then V) tile into one bf16/f16 SMEM tile:

  SMEM  k_smem, v_smem [2, T, head_dim] int8/uint8;  k_scales, v_scales [2, T] float32
        k_tile, v_tile [T, head_dim] bf16/f16 = values (float32) * scale (per row), rounded
        once: the references' QuantizedPages read, bit for bit in the inputs of each dot

Why dequantize the tiles rather than fold the scales into the scores (s * k_scale per
column after q @ k^T, p * v_scale before p @ v): Hopper's WGMMA multiplies 8-bit operands
only by 8-bit operands of the same kind (s8 x s8, e4m3/e5m2 x e4m3/e5m2), never bf16 q by
int8 K, and it reads K and V (its B operands) from SMEM only, so each 8-bit tile has to be
converted and stored back to SMEM whichever way the scales go; the per-token scale rides
on that conversion (one multiply per value, no extra SMEM traffic), and the products match
the references' rounding. fp8_e4m3 converts with sm_89+ instructions (via f16), which
every target of this kernel (sm_90a) has. SMEM per step is that of 16-bit pages: the
8-bit slots and the two 16-bit tiles take the bytes of the 16-bit slots, plus 16 * T bytes
of scales.

Limits, refused with a ``ValueError`` naming the size (what WGMMA and the 128-byte
swizzled SMEM tiles need): dtype bfloat16 or float16, that of 8-bit pages' reads too (no
float32: WGMMA would round it to tf32); query heads per KV head at most
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
# Split-K (default_num_splits): one program per SM of an H100/H200, splits of at least
# MIN_STEPS_PER_SPLIT steps, at most MAX_SPLITS of them.
NUM_SMS = 132
MIN_STEPS_PER_SPLIT = 4
MAX_SPLITS = 32


def _smem_transforms(minor_dim: int, dtype) -> tuple:
  """Tiling + swizzle of a 2-D SMEM operand of WGMMA with `minor_dim` columns (and of an
  8-bit tile, loaded into registers with the same WGMMA layout)."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(minor_dim * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def softmax_start(*acc_cols: int):
  """The online softmax's carry before any key, for one warpgroup's 64 WGMMA rows: m =
  MASK_VALUE and l = 0 per row (the rows' reduced WGMMA layout), and one float32 zero
  accumulator [64, c] (WGMMA layout) per width c in `acc_cols`. Shared by this module's,
  ragged_paged_attention_mgpu's and sparse_mla_mgpu's kernels."""
  row = plgpu.Layout.WGMMA.reduce(1)
  m0 = plgpu.layout_cast(jnp.full((WGMMA_ROWS,), common.MASK_VALUE, jnp.float32), row)
  l0 = plgpu.layout_cast(jnp.full((WGMMA_ROWS,), 0.0, jnp.float32), row)
  return m0, l0, tuple(plgpu.layout_cast(jnp.full((WGMMA_ROWS, c), 0.0, jnp.float32),
                                         plgpu.Layout.WGMMA) for c in acc_cols)


def refuse_generic_interpret(interpret: object) -> None:
  """The Mosaic GPU kernels' `interpret`: None / False (compiled) or the GPU interpreter's
  InterpretGPUParams; `True` (the generic Pallas interpreter) cannot run their primitives."""
  if interpret is True:
    raise ValueError("interpret=True cannot run Mosaic GPU primitives; pass "
                     "InterpretGPUParams() to run this kernel on CPU")


def _dequantize_into(dst_ref, src_ref, scales_ref):
  """dst [T, head_dim] (bf16/f16, WGMMA's B operand) = src [T, head_dim] (int8 or fp8_e4m3
  bits) * scales [T] (float32, one per token), computed in float32 and rounded to dst's
  dtype once (the references' rounding), 64 rows (one WGMMA row tile) at a time."""
  for r in range(0, dst_ref.shape[0], WGMMA_ROWS):
    rows = pl.ds(r, WGMMA_ROWS)
    x = plgpu.load(src_ref.at[rows], layout=plgpu.Layout.WGMMA)
    if x.dtype == jnp.uint8:  # fp8_e4m3 stored as its bits
      x = lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
    scale = plgpu.load(scales_ref.at[rows], layout=plgpu.Layout.WGMMA.reduce(1))
    x = x.astype(jnp.float32) * lax.broadcast_in_dim(scale, x.shape, [0])
    dst_ref[rows] = x.astype(dst_ref.dtype)


def _paged_attention_kernel(*refs, sm_scale: float, soft_cap: float | None,
                            blocks_per_step: int, quantized: bool, num_splits: int,
                            steps_per_split: int, with_lse: bool, **smem):
  """One program: the query heads of KV head h of row b over the row's listed blocks (of
  split `split`: its steps_per_split steps of the table).

  refs: q [batch, num_kv_heads, 64, head_dim], k and v pages [num_blocks, block_size,
  num_kv_heads, head_dim] (8-bit values when `quantized`), tables int32 [batch, num_splits *
  steps_per_split * blocks_per_step], lens int32 [batch], (when `quantized`: k and v scales
  float32 [batch, num_kv_heads, tables.shape[1] * block_size], each row's keys in attention
  order), then the output: [batch, num_kv_heads, 64, head_dim] normalized, or with
  `with_lse` (num_splits > 1, or the caller's return_lse) each split's [num_splits, batch,
  num_kv_heads, 64, head_dim] normalized over its own keys and its log-sum-exp
  [num_splits, batch, num_kv_heads, 64] float32 (MASK_VALUE for a split without keys).
  smem: the scratch of `_scratch_types`.
  """
  if quantized:
    q_gmem, k_gmem, v_gmem, tables_gmem, lens_gmem, ks_gmem, vs_gmem, *out_gmem = refs
  else:
    q_gmem, k_gmem, v_gmem, tables_gmem, lens_gmem, *out_gmem = refs
  qo_smem, k_smem, v_smem, p_smem = smem["qo"], smem["k"], smem["v"], smem["p"]
  k_barriers, v_barriers = smem["k_barriers"], smem["v_barriers"]
  b = lax.axis_index("batch")
  h = lax.axis_index("kv_head")
  split = lax.axis_index("split") if num_splits > 1 else 0
  block_size = k_gmem.shape[1]
  num_slots, tokens_per_step = k_smem.shape[:2]
  head_dim = qo_smem.shape[1]
  dtype = qo_smem.dtype

  length = lens_gmem[b]
  first_step = split * steps_per_split  # this split's steps: first_step + [0, num_steps)
  row_steps = lax.div(length + (tokens_per_step - 1), jnp.int32(tokens_per_step))
  num_steps = lax.min(lax.max(row_steps - first_step, jnp.int32(0)),
                      jnp.int32(steps_per_split))

  def fetch(local_step, slot):
    """Starts the copies of the blocks of this split's `local_step` into `slot`
    (blocks_per_step each, and the step's scales when quantized)."""
    step = first_step + local_step
    for j in range(blocks_per_step):
      block_id = tables_gmem[b, step * blocks_per_step + j]
      rows = pl.ds(j * block_size, block_size)
      plgpu.copy_gmem_to_smem(k_gmem.at[block_id, :, h, :], k_smem.at[slot, rows],
                              k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(v_gmem.at[block_id, :, h, :], v_smem.at[slot, rows],
                              v_barriers.at[slot])
    if quantized:
      keys = pl.ds(step * tokens_per_step, tokens_per_step)
      plgpu.copy_gmem_to_smem(ks_gmem.at[b, h, keys], smem["k_scales"].at[slot],
                              k_barriers.at[slot])
      plgpu.copy_gmem_to_smem(vs_gmem.at[b, h, keys], smem["v_scales"].at[slot],
                              v_barriers.at[slot])

  plgpu.copy_gmem_to_smem(q_gmem.at[b, h], qo_smem, smem["q_barrier"])
  for slot in range(num_slots):
    pl.when(slot < num_steps)(functools.partial(fetch, slot, slot))
  plgpu.barrier_wait(smem["q_barrier"])

  def body(local_step, carry):
    m_prev, l_prev, acc_prev = carry
    slot = lax.rem(local_step, num_slots)
    step = first_step + local_step

    plgpu.barrier_wait(k_barriers.at[slot])
    if quantized:  # WGMMA reads its B operand from SMEM: stage the dequantized tile there
      k_operand = smem["k_tile"]
      _dequantize_into(k_operand, k_smem.at[slot], smem["k_scales"].at[slot])
      plgpu.commit_smem()
    else:
      k_operand = k_smem.at[slot]

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, qo_smem, k_operand.transpose((1, 0)))
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

    plgpu.barrier_wait(v_barriers.at[slot])
    if quantized:
      v_operand = smem["v_tile"]
      _dequantize_into(v_operand, v_smem.at[slot], smem["v_scales"].at[slot])
    else:
      v_operand = v_smem.at[slot]
    plgpu.commit_smem()  # make the register stores (p, the V tile) visible to WGMMA

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem, v_operand)
      return acc_ref[...]  # waits for the WGMMA: the slot and p_smem are free after this

    pv_out = pl.run_scoped(pv, plgpu.ACC((WGMMA_ROWS, head_dim), jnp.float32))
    acc_next = lax.broadcast_in_dim(alpha, acc_prev.shape, [0]) * acc_prev + pv_out
    pl.when(local_step + num_slots < num_steps)(
        functools.partial(fetch, local_step + num_slots, slot))
    return m_next, l_next, acc_next

  m0, l0, (acc0,) = softmax_start(head_dim)
  m, l, acc = lax.fori_loop(0, num_steps, body, (m0, l0, acc0))
  # No keys (length 0, or a split past the length): no step ran, acc = 0 and l = 0 ->
  # zeros (l >= 1 once any key is valid).
  l_safe = jnp.where(l > 0.0, l, 1.0)
  qo_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
  if with_lse:
    smem["lse"][...] = jnp.where(l > 0.0, m + jnp.log(l_safe), common.MASK_VALUE)
  plgpu.commit_smem()
  if with_lse:
    o_gmem, lse_gmem = out_gmem
    plgpu.copy_smem_to_gmem(qo_smem, o_gmem.at[split, b, h])
    plgpu.copy_smem_to_gmem(smem["lse"], lse_gmem.at[split, b, h])
  else:
    plgpu.copy_smem_to_gmem(qo_smem, out_gmem[0].at[b, h])
  plgpu.wait_smem_to_gmem(0)


def _scratch_types(dtype, values_dtype, head_dim: int, tokens_per_step: int,
                   blocks_per_step: int, quantized: bool, with_lse: bool,
                   num_slots: int = NUM_SLOTS) -> dict:
  """The kernel's SMEM buffers and barriers, by name."""
  transforms = _smem_transforms(head_dim, dtype)
  slots = (num_slots, tokens_per_step, head_dim)
  kv_slots = plgpu.SMEM(slots, values_dtype,
                        transforms=_smem_transforms(head_dim, values_dtype))
  # One TMA arrival per block copy, and one for the step's scales when quantized.
  arrivals = plgpu.Barrier(num_arrivals=blocks_per_step + quantized, num_barriers=num_slots)
  scratch = dict(
      qo=plgpu.SMEM((WGMMA_ROWS, head_dim), dtype, transforms=transforms),
      k=kv_slots, v=kv_slots,
      # WGMMA needs its two operands' swizzles equal: p's is v's.
      p=plgpu.SMEM((WGMMA_ROWS, tokens_per_step), dtype, transforms=transforms),
      q_barrier=plgpu.Barrier(), k_barriers=arrivals, v_barriers=arrivals)
  if quantized:
    tile = plgpu.SMEM((tokens_per_step, head_dim), dtype, transforms=transforms)
    scales = plgpu.SMEM((num_slots, tokens_per_step), jnp.float32)
    scratch.update(k_tile=tile, v_tile=tile, k_scales=scales, v_scales=scales)
  if with_lse:
    scratch.update(lse=plgpu.SMEM((WGMMA_ROWS,), jnp.float32))
  return scratch


def scales_by_row(scales: jax.Array, tables: jax.Array) -> jax.Array:
  """Per-token scales [num_blocks, block_size, num_kv_heads] -> [batch, num_kv_heads,
  tables.shape[1] * block_size]: each row's listed blocks' scales in attention order, one
  contiguous run per KV head (one TMA copy per step). The pool interleaves the heads' scales
  4 bytes apart, a stride TMA cannot copy, so XLA gathers them first: 4 bytes per listed
  token and KV head, against head_dim bytes of 8-bit values for each of K and V."""
  batch, width = tables.shape
  _, block_size, num_kv_heads = scales.shape
  gathered = scales[tables].reshape(batch, width * block_size, num_kv_heads)
  return gathered.transpose(0, 2, 1)


def _check_mgpu_sizes(q, k_pages, tokens_per_step: int) -> int:
  """Refuses what WGMMA/TMA cannot take, naming the size; returns blocks_per_step."""
  _, block_size, num_kv_heads, head_dim = k_pages.shape
  group = q.shape[1] // num_kv_heads
  if k_pages.dtype not in SUPPORTED_DTYPES:
    read_as = " (8-bit pages read as)" if isinstance(k_pages, QuantizedPages) else ""
    raise ValueError(
        f"the Mosaic GPU paged attention takes bfloat16 or float16 KV{read_as}, got "
        f"{k_pages.dtype} (WGMMA would round float32 to tf32); use the Triton kernel for "
        "float32")
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


def supports(q, k_pages, tokens_per_step: int = DEFAULT_TOKENS_PER_STEP) -> bool:
  """Whether the kernel takes these q and pages (float or 8-bit `QuantizedPages`; the
  limits of the module docstring): the "pallas_mgpu" backend's decode runs the Triton
  kernel where not (kernels_pallas.backend)."""
  if k_pages.ndim != 4 or q.ndim != 3:
    return False
  try:
    _check_mgpu_sizes(q, k_pages, tokens_per_step)
  except ValueError:
    return False
  return True


def default_num_splits(batch: int, num_kv_heads: int, num_steps: int,
                       num_sms: int = NUM_SMS) -> int:
  """Splits of each row's table (split-K) for a grid of batch * num_kv_heads programs over
  tables of `num_steps` steps: enough for one program per SM (`num_sms`: 132 on an
  H100/H200), each split at least MIN_STEPS_PER_SPLIT steps (its TMA pipeline gets going,
  and its partial output stays small beside the keys it reads), at most MAX_SPLITS; 1 when
  the batch alone fills the SMs. Then as few splits as cover the steps at that size.
  A batch-1 32k-token decode with 8 KV heads at 64 keys per step: 512 steps -> 17 splits of
  31 steps, 136 programs."""
  programs = batch * num_kv_heads
  splits = max(1, min(common.cdiv(num_sms, programs), num_steps // MIN_STEPS_PER_SPLIT,
                      MAX_SPLITS))
  return common.cdiv(num_steps, common.cdiv(num_steps, splits)) if num_steps else 1


def combine_splits(o: jax.Array, lse: jax.Array, return_lse: bool = False):
  """Each split's output o [num_splits, ..., head_dim] (normalized over its own keys) and
  its log-sum-exp lse [num_splits, ...] -> the output over all keys, float32: weights
  exp(lse - max lse). A split without keys has lse = MASK_VALUE (weight 0 beside any split
  with keys) and o = 0, so a row without keys at all gets 0. `return_lse`: and the
  log-sum-exp over all keys [...] (MASK_VALUE where no split has a key)."""
  top = lse.max(axis=0)
  w = jnp.exp(lse - top)
  out = (w[..., None] * o.astype(jnp.float32)).sum(axis=0) / w.sum(axis=0)[..., None]
  if not return_lse:
    return out
  return out, jnp.where(top > common.MASK_VALUE, top + jnp.log(w.sum(axis=0)),
                        common.MASK_VALUE)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret",
                                             "tokens_per_step", "num_splits", "return_lse",
                                             "num_slots"))
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
    num_splits: int | None = None,
    return_lse: bool = False,
    num_slots: int = NUM_SLOTS,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Decode attention of one query token per sequence over its listed blocks.

  Arguments and result as :func:`kernels_pallas.paged_attention.paged_attention`, within
  the limits of the module docstring (bf16/f16 or 8-bit pages read as either, block_size a
  multiple of 8, ...).

  Args:
    interpret: None, False: the compiled Mosaic GPU kernel (runs only on a Hopper-class
      GPU; lowers from any host). Or the GPU interpreter's parameters
      (``jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams``), which run the
      kernel on CPU simulating SMEM, barriers and TMA copies. ``True`` is refused: the
      generic Pallas interpreter cannot run Mosaic GPU primitives.
    tokens_per_step: keys per pipeline step (per WGMMA), a multiple of 64 up to 256.
    num_splits: programs per (row, KV head), each over one contiguous run of the table's
      steps (split-K), merged by `combine_splits`; None: `default_num_splits`.
    num_slots: SMEM slots of the K/V pipeline (2: double buffering; more keep more steps'
      copies in flight while one is computed, at 4 * tokens_per_step * head_dim bytes of
      SMEM a slot for 16-bit pages); make gpu-bench times 3 beside the default.
    return_lse: also the log-sum-exp [batch, num_q_heads] float32 over each row's keys
      (`paged_attention`'s; the kernel then writes each split's, even of one split).
  """
  _check(q, k_pages, v_pages, block_tables, kv_lens)
  refuse_generic_interpret(interpret)
  blocks_per_step = _check_mgpu_sizes(q, k_pages, tokens_per_step)
  batch, num_q_heads, head_dim = q.shape
  _, _, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  dtype = q.dtype

  max_blocks = block_tables.shape[1]
  max_steps = common.cdiv(max_blocks, blocks_per_step)
  if num_splits is None:
    num_splits = default_num_splits(batch, num_kv_heads, max_steps)
  if num_splits < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")
  if num_slots < 1:
    raise ValueError(f"num_slots must be >= 1, got {num_slots}")
  steps_per_split = common.cdiv(max_steps, num_splits)
  # (at least num_slots steps: the prologue's fetches index them statically, under pl.when)
  width = max(num_splits * steps_per_split, num_slots) * blocks_per_step
  tables = jnp.pad(block_tables, ((0, 0), (0, width - max_blocks)))
  q4 = q.reshape(batch, num_kv_heads, group, head_dim)
  q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, WGMMA_ROWS - group), (0, 0)))
  # A length past the table would read past it: clamp (the reference clamps the same way).
  kv_lens = jnp.minimum(kv_lens, max_blocks * k_pages.shape[1])

  with_lse = num_splits > 1 or return_lse
  (k_values, k_scales), (v_values, v_scales) = map(common.page_arrays, (k_pages, v_pages))
  quantized = k_scales is not None
  scales = (scales_by_row(k_scales, tables), scales_by_row(v_scales, tables)) if quantized else ()
  kernel = functools.partial(
      _paged_attention_kernel,
      sm_scale=head_dim**-0.5 if sm_scale is None else float(sm_scale),
      soft_cap=soft_cap, blocks_per_step=blocks_per_step, quantized=quantized,
      num_splits=num_splits, steps_per_split=steps_per_split, with_lse=with_lse)
  out_shape = (batch, num_kv_heads, WGMMA_ROWS)
  if with_lse:
    out_type = [jax.ShapeDtypeStruct((num_splits, *out_shape, head_dim), dtype),
                jax.ShapeDtypeStruct((num_splits, *out_shape), jnp.float32)]
  else:
    out_type = [jax.ShapeDtypeStruct((*out_shape, head_dim), dtype)]
  out = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=_scratch_types(dtype, k_values.dtype, head_dim, tokens_per_step,
                                   blocks_per_step, quantized, with_lse, num_slots),
      grid=(batch, num_kv_heads, num_splits) if num_splits > 1 else (batch, num_kv_heads),
      grid_names=("batch", "kv_head", "split") if num_splits > 1 else ("batch", "kv_head"),
      compiler_params=plgpu.CompilerParams(),
      interpret=None if interpret is False else interpret,
      kernel_name="paged_attention_mgpu",
  )(q4, k_values, v_values, tables, kv_lens, *scales)
  if with_lse:
    o, lse = out
    out, lse = combine_splits(o[:, :, :, :group], lse[:, :, :, :group], return_lse=True)
    out = out.astype(dtype).reshape(batch, num_q_heads, head_dim)
    return (out, lse.reshape(batch, num_q_heads)) if return_lse else out
  out = out[0][:, :, :group]
  return out.reshape(batch, num_q_heads, head_dim)

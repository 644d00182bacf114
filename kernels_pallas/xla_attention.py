"""The XLA backend's attention: what the engine runs where Pallas does not compile (CPU).

Same contracts as the Pallas kernels (`paged_attention`, `ragged_paged_attention`), in
jnp, shaped for XLA:CPU. Each sequence's KV is read once per call, straight from the
pages, in key chunks of `blocks_per_step` blocks with an online softmax (flash attention
in jnp); nothing is gathered per query tile or per query head:

  decode rows (one query each):  one loop over key chunks for every row at once; its trip
                                 count follows the longest row, not the table width
  prefill rows (q_len > 1):      query tiles of `prefill_tile` tokens (lax.map); a tile
                                 loops over exactly the key chunks its causal (and
                                 sliding-window) range touches
  GQA:  the query heads of one KV head are folded into the rows of one matmul
        ([num_kv_heads, group * rows, head_dim] x [num_kv_heads, keys, head_dim]), so
        K/V are never repeated in memory.

Masked keys contribute nothing whatever the unused slots of a block hold (NaN or inf
from an earlier owner included): their scores are masked, their probabilities are 0 and
their V rows are zeroed before the product.

On a CPU target where the C++ kernels are built (cpu_kernels: XLA FFI custom calls that
read the blocks in place), decode rows and prefill rows run them instead of these loops;
the loops stay for other targets, 8-bit or bf16 pages, and machines without a compiler.

Host-known sizes keep the compiled shapes small: `prefill_plan(q_lens)` gives the static
`(prefill_tile, num_prefill_tiles)` of a batch (0 tiles: no prefill work compiled);
`kernel_hints`, where the C++ kernel takes every prefill row, only whether there is any
(the engine's hints on CPU with float32 pages: `backend.ops(pages_dtype=)`).
The pure-jnp references of each kernel file stay the references; tests hold this
module to them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import common, cpu_kernels
from kernels_pallas.paged_attention import _check as _check_paged
from kernels_pallas.paged_attention import paged_attention_reference
from kernels_pallas.ragged_paged_attention import _check as _check_ragged

# Keys per inner-loop step: a chunk of DECODE_KEYS / PREFILL_KEYS tokens (whole blocks).
# Measured on a 2-core x86 CPU (tokens/s of the engine on the default model): decode
# chunks of 128 keys keep a batch's gathered chunk in L2; prefill tiles of 256 queries
# against 512 keys make matmuls big enough for both cores. The masked part of a prefill
# tile (the causal diagonal) runs in chunks of PREFILL_DIAGONAL_KEYS, so a tile computes
# few scores its mask drops. 2 x 1,024-token prompts, one layer of the default model:
# 128-key diagonal chunks take 0.88-0.95x the time of 512-key ones (64: 0.92-1.11x,
# 256: 1.04-1.07x, in noisy side-by-side runs).
DECODE_KEYS = 128
DECODE_GROUP_BYTES = 512 * 1024
PREFILL_KEYS = 512
PREFILL_TILE = 128
PREFILL_DIAGONAL_KEYS = 128  # key chunk of the masked (causal diagonal) part of a tile
MIN_PREFILL_TILE = 16
# `prefill_tile` of `kernel_hints`: the C++ kernel tiles the prefill rows itself.
KERNEL_TILE = 0


def prefill_plan(q_lens: Sequence[int], max_tile: int = PREFILL_TILE) -> tuple[int, int]:
  """(prefill_tile, num_prefill_tiles) for rows of these query lengths (host side).

  Rows with one query are decode rows (no tile). The tile is the longest prefill row
  rounded up to a power of two (at least MIN_PREFILL_TILE, at most `max_tile`); the tile
  count is rounded up to a power of two, so a run compiles few shapes.
  """
  multi = [int(n) for n in q_lens if n > 1]
  if not multi:
    return MIN_PREFILL_TILE, 0
  tile = min(max(common.next_power_of_2(max(multi)), MIN_PREFILL_TILE), max_tile)
  return tile, common.next_power_of_2(sum(common.cdiv(n, tile) for n in multi))


def decode_rows_bucket(num_decode_rows: int) -> int:
  """Static count of decode rows a call computes: a multiple of 8 up to 64, of 32 past
  it (a batch's padding rows and prefill rows are not computed as decode rows)."""
  step = 8 if num_decode_rows <= 64 else 32
  return common.round_up(num_decode_rows, step)


def ragged_hints(q_lens: Sequence[int]) -> dict[str, int]:
  """`ragged_paged_attention_xla`'s static sizes for rows of these query lengths."""
  tile, num_tiles = prefill_plan(q_lens)
  return {"prefill_tile": tile, "num_prefill_tiles": num_tiles,
          "num_decode_rows": decode_rows_bucket(sum(int(n) == 1 for n in q_lens))}


def kernel_hints(q_lens: Sequence[int]) -> dict[str, int]:
  """`ragged_hints` where the C++ kernel computes every prefill row (a CPU target, the
  kernels built, float32 pages): it tiles them itself, so the prefill's static size is
  only whether there is one (`prefill_tile` KERNEL_TILE, 1 or 0 tiles), and batches of any
  prompt lengths share one program."""
  return {"prefill_tile": KERNEL_TILE, "num_prefill_tiles": int(any(n > 1 for n in q_lens)),
          "num_decode_rows": decode_rows_bucket(sum(int(n) == 1 for n in q_lens))}


def hints_cover(hints: dict[str, int], q_lens: Sequence[int]) -> bool:
  """Whether a call with the static sizes `hints` (of `ragged_hints` or `kernel_hints`,
  perhaps of other rows) computes rows of these query lengths: enough prefill tiles of its
  tile size (the kernel's: any prefill at all) and enough decode rows."""
  multi = [int(n) for n in q_lens if n > 1]
  tile = hints["prefill_tile"]
  needed = (int(bool(multi)) if tile == KERNEL_TILE
            else sum(common.cdiv(n, tile) for n in multi))
  return (needed <= hints["num_prefill_tiles"]
          and sum(int(n) == 1 for n in q_lens) <= hints["num_decode_rows"])


def _blocks_per_step(keys: int, block_size: int) -> int:
  return max(1, keys // block_size)


def _online_softmax_step(carry, s, valid, v, dot_pv):
  """One key chunk of an online softmax. s [..., keys] scores; valid like s, or None when
  every key of the chunk counts for every row (no mask: the selects cost as much as the
  exp); v the chunk's V (masked rows already zeroed); dot_pv(p, v) -> the [..., head_dim]
  update."""
  m_prev, l_prev, acc_prev = carry
  if valid is not None:
    s = jnp.where(valid, s, common.MASK_VALUE)
  m_next = jnp.maximum(m_prev, s.max(axis=-1))
  alpha = jnp.exp(m_prev - m_next)
  p = jnp.exp(s - m_next[..., None])
  if valid is not None:
    p = jnp.where(valid, p, 0.0)
  l_next = alpha * l_prev + p.sum(axis=-1)
  return m_next, l_next, alpha[..., None] * acc_prev + dot_pv(p, v)


def _split_loop(lo, mid, hi, body, carry):
  """fori_loop over chunks [lo, hi): body(j, carry, masked) with masked=False on the
  chunks [lo, mid) where no key needs a mask (in order, so the result is the masked
  loop's)."""
  mid = jnp.clip(mid, lo, hi)
  carry = lax.fori_loop(lo, mid, functools.partial(body, masked=False), carry)
  return lax.fori_loop(mid, hi, functools.partial(body, masked=True), carry)


def _finish(l, acc):
  return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _cap(s, soft_cap):
  return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _decode_rows(q, k_pages, v_pages, block_tables, kv_lens, starts, *, sm_scale, soft_cap,
                 blocks_per_step):
  """One query per row over keys [starts, kv_lens) of its table (starts None: from 0).
  q [B, Hq, D] -> f32. On a CPU target with the C++ kernel built (cpu_kernels), the
  kernel reads the blocks in place; elsewhere `_decode_rows_jnp`."""
  jnp_path = functools.partial(_decode_rows_jnp, sm_scale=sm_scale, soft_cap=soft_cap,
                               blocks_per_step=blocks_per_step)
  if not cpu_kernels.supports(q, k_pages):
    return jnp_path(q, k_pages, v_pages, block_tables, kv_lens, starts)
  kernel = functools.partial(cpu_kernels.paged_decode, sm_scale=sm_scale, soft_cap=soft_cap)
  return lax.platform_dependent(q, k_pages, v_pages, block_tables, kv_lens, starts,
                                cpu=kernel, default=jnp_path)


def _decode_rows_jnp(q, k_pages, v_pages, block_tables, kv_lens, starts, *, sm_scale,
                     soft_cap, blocks_per_step):
  """`_decode_rows` in jnp.

  Rows go in groups (lax.map) whose key chunk, K and V, is about DECODE_GROUP_BYTES: the
  gathered chunk stays in the core's L2 between its gather and its two products
  (measured, 32 rows x 1,088 tokens: 1.42 ms in one group, 1.10 ms in groups of 8)."""
  batch, num_q_heads, head_dim = q.shape
  _, block_size, num_kv_heads, _ = k_pages.shape
  row_bytes = 2 * blocks_per_step * block_size * num_kv_heads * head_dim * 4
  rows = max(1, min(batch, DECODE_GROUP_BYTES // row_bytes))
  rows = 1 << (rows.bit_length() - 1)  # a power of two
  if rows >= batch:
    return _decode_group(q, block_tables, kv_lens, k_pages=k_pages, v_pages=v_pages,
                         starts=starts, sm_scale=sm_scale, soft_cap=soft_cap,
                         blocks_per_step=blocks_per_step)
  num_groups = common.cdiv(batch, rows)
  pad = num_groups * rows - batch

  def grouped(x):  # [B, ...] -> [num_groups, rows, ...] (padding rows: length 0)
    return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(
        num_groups, rows, *x.shape[1:])

  args = [grouped(q), grouped(block_tables), grouped(kv_lens)]
  if starts is not None:
    args.append(grouped(starts))

  def one_group(xs):
    return _decode_group(*xs[:3], k_pages=k_pages, v_pages=v_pages,
                         starts=xs[3] if starts is not None else None, sm_scale=sm_scale,
                         soft_cap=soft_cap, blocks_per_step=blocks_per_step)

  out = lax.map(one_group, args)
  return out.reshape(num_groups * rows, num_q_heads, head_dim)[:batch]


def _decode_group(q, block_tables, kv_lens, *, k_pages, v_pages, starts, sm_scale, soft_cap,
                  blocks_per_step):
  """_decode_rows over one group of rows: one loop over key chunks for all of them."""
  batch, num_q_heads, head_dim = q.shape
  _, block_size, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  nb = blocks_per_step
  keys = nb * block_size
  tables = block_tables
  if block_tables.shape[1] % nb:
    tables = jnp.pad(block_tables, ((0, 0), (0, (-block_tables.shape[1]) % nb)))
  qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale
  if starts is None:  # (no sliding window)
    live, first = kv_lens > 0, 0
  else:
    live = kv_lens > starts
    first = jnp.min(jnp.where(live, starts // keys, tables.shape[1]))
  last = jnp.max(jnp.where(live, (kv_lens + keys - 1) // keys, 0))

  def body(j, carry):
    # (One mask for every chunk: a decode row's mask is [B, keys], cheap beside the
    # chunk's gather; splitting the loop into masked and unmasked chunks measured slower.)
    if nb == 1:
      ids = lax.dynamic_index_in_dim(tables, j, axis=1, keepdims=False)  # [B]
    else:
      ids = lax.dynamic_slice_in_dim(tables, j * nb, nb, axis=1)  # [B, nb]
    k = k_pages[ids].reshape(batch, keys, num_kv_heads, head_dim).astype(jnp.float32)
    v = v_pages[ids].reshape(batch, keys, num_kv_heads, head_dim).astype(jnp.float32)
    pos = j * keys + lax.broadcasted_iota(jnp.int32, (1, keys), 1)
    valid = pos < kv_lens[:, None]  # [B, keys]
    if starts is not None:
      valid &= pos >= starts[:, None]
    v = jnp.where(valid[:, :, None, None], v, 0.0)
    s = _cap(jnp.einsum("bhgd,bthd->bhgt", qg, k, precision=lax.Precision.HIGHEST),
             soft_cap)
    return _online_softmax_step(
        carry, s, valid[:, None, None, :], v,
        lambda p, v: jnp.einsum("bhgt,bthd->bhgd", p, v, precision=lax.Precision.HIGHEST))

  init = (jnp.full((batch, num_kv_heads, group), common.MASK_VALUE, jnp.float32),
          jnp.zeros((batch, num_kv_heads, group), jnp.float32),
          jnp.zeros((batch, num_kv_heads, group, head_dim), jnp.float32))
  _, l, acc = lax.fori_loop(first, last, body, init)
  return _finish(l, acc).reshape(batch, num_q_heads, head_dim)


def _prefill_tiles(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, sm_scale,
                   soft_cap, sliding_window, tile, num_tiles, blocks_per_step):
  """Rows with q_len > 1 in query tiles; returns (out [num_tiles, tile, Hq, D] f32,
  dst [num_tiles, tile]: the flat token row of each output, num_tokens = none)."""
  num_tokens, num_q_heads, head_dim = q.shape
  _, block_size, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  batch = kv_lens.shape[0]
  nb = blocks_per_step
  keys = nb * block_size
  small_nb = max(1, min(nb, PREFILL_DIAGONAL_KEYS // block_size))
  while nb % small_nb:
    small_nb -= 1
  small_keys = small_nb * block_size
  tables = jnp.pad(block_tables, ((0, 0), (0, (-block_tables.shape[1]) % nb)))
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  tiles_per_row = jnp.where(q_lens > 1, (q_lens + tile - 1) // tile, 0)
  cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                              jnp.cumsum(tiles_per_row, dtype=jnp.int32)])
  t = jnp.arange(num_tiles, dtype=jnp.int32)
  row = jnp.minimum(jnp.searchsorted(cu_tiles[1:], t, side="right"), batch - 1)
  used = t < cu_tiles[batch]
  q_start = (t - cu_tiles[row]) * tile  # first query of the tile, inside its row's chunk
  n_q = jnp.where(used, jnp.clip(q_lens[row] - q_start, 0, tile), 0)
  first_token = cu_q_lens[row] + q_start
  first_pos = kv_lens[row] - q_lens[row] + q_start  # KV position of the tile's first query
  i = jnp.arange(tile, dtype=jnp.int32)

  def one_tile(x):
    row, first_token, first_pos, n_q = x
    kv_len = kv_lens[row]
    src = jnp.clip(first_token + i, 0, num_tokens - 1)
    qt = q[src].astype(jnp.float32) * sm_scale  # [tile, Hq, D]
    # [num_kv_heads, group * tile, D]: row r = g * tile + query i.
    qt = qt.reshape(tile, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3).reshape(
        num_kv_heads, group * tile, head_dim)
    q_pos = jnp.tile(first_pos + i, group)[:, None]  # [rows, 1]
    q_valid = jnp.tile(i < n_q, group)[:, None]
    end = jnp.minimum(first_pos + n_q, kv_len)  # keys < end
    start = jnp.int32(0)
    if sliding_window is not None:
      start = jnp.maximum(first_pos - sliding_window + 1, 0)
    table = tables[row]

    def body(j, carry, masked, nb=nb):
      keys = nb * block_size
      ids = lax.dynamic_slice_in_dim(table, j * nb, nb)
      k = k_pages[ids].reshape(keys, num_kv_heads, head_dim).astype(jnp.float32)
      v = v_pages[ids].reshape(keys, num_kv_heads, head_dim).astype(jnp.float32)
      valid = None
      if masked:
        k_pos = j * keys + lax.broadcasted_iota(jnp.int32, (1, keys), 1)
        v = jnp.where((k_pos < kv_len).reshape(keys, 1, 1), v, 0.0)
        valid = (k_pos <= q_pos) & (k_pos < kv_len) & q_valid
        if sliding_window is not None:
          valid &= k_pos > q_pos - sliding_window
        valid = valid[None]
      s = lax.dot_general(qt, k.transpose(1, 0, 2), (((2,), (2,)), ((0,), (0,))),
                          precision=lax.Precision.HIGHEST)  # [H, rows, keys]
      return _online_softmax_step(
          carry, _cap(s, soft_cap), valid, v.transpose(1, 0, 2),
          lambda p, v: lax.dot_general(p, v, (((2,), (1,)), ((0,), (0,))),
                                       precision=lax.Precision.HIGHEST))

    rows = group * tile
    init = (jnp.full((num_kv_heads, rows), common.MASK_VALUE, jnp.float32),
            jnp.zeros((num_kv_heads, rows), jnp.float32),
            jnp.zeros((num_kv_heads, rows, head_dim), jnp.float32))
    num_steps = jnp.where(n_q > 0, (end + keys - 1) // keys, 0)
    # Chunks at or before the tile's first query and inside the context need no mask
    # (rows past n_q are dropped); with a sliding window every chunk is masked.
    full_hi = jnp.minimum(first_pos + 1, kv_len) // keys
    if sliding_window is not None:
      full_hi = jnp.int32(0)
    lo = jnp.minimum(start // keys, num_steps)
    if sliding_window is None and small_nb < nb:
      # The masked chunks (the causal diagonal) in smaller chunks: a tile's queries need
      # keys only up to their own positions, so big chunks there mostly compute scores
      # the mask drops.
      mid = jnp.clip(full_hi, lo, num_steps)
      carry = lax.fori_loop(lo, mid, functools.partial(body, masked=False), init)
      ratio = nb // small_nb
      small_end = jnp.where(n_q > 0, (end + small_keys - 1) // small_keys, 0)
      _, l, acc = lax.fori_loop(mid * ratio, jnp.maximum(small_end, mid * ratio),
                                functools.partial(body, masked=True, nb=small_nb), carry)
    else:
      _, l, acc = _split_loop(lo, full_hi, num_steps, body, init)
    out = _finish(l, acc).reshape(num_kv_heads, group, tile, head_dim)
    return out.transpose(2, 0, 1, 3).reshape(tile, num_q_heads, head_dim)

  out = lax.map(one_tile, (row, first_token, first_pos, n_q))
  dst = jnp.where(i[None, :] < n_q[:, None], first_token[:, None] + i[None, :], num_tokens)
  return out, dst


def _prefill_rows_jnp(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, sm_scale,
                      soft_cap, sliding_window, tile, num_tiles, blocks_per_step):
  """`cpu_kernels.ragged_prefill`'s contract from `_prefill_tiles`: [T, Hq, D] f32, the
  rows with more than one query, zeros elsewhere."""
  tiles, dst = _prefill_tiles(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                              sm_scale=sm_scale, soft_cap=soft_cap,
                              sliding_window=sliding_window, tile=tile, num_tiles=num_tiles,
                              blocks_per_step=blocks_per_step)
  out = jnp.zeros((q.shape[0], *q.shape[1:]), jnp.float32)
  return out.at[dst.reshape(-1)].set(tiles.reshape(-1, *q.shape[1:]), mode="drop")


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window",
                                             "interpret", "prefill_tile",
                                             "num_prefill_tiles", "num_decode_rows"))
def ragged_paged_attention_xla(
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
    interpret: bool | None = None,
    prefill_tile: int = PREFILL_TILE,
    num_prefill_tiles: int | None = None,
    num_decode_rows: int | None = None,
) -> jax.Array:
  """`ragged_paged_attention`'s contract, computed as decode rows plus prefill tiles.

  prefill_tile, num_prefill_tiles, num_decode_rows: static sizes from `ragged_hints`
  over the rows' query lengths (host-known); None = enough for any lengths (slower: for
  tests). num_decode_rows must be at least the number of rows with one query.
  """
  del interpret
  _check_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, sliding_window)
  num_tokens, num_q_heads, head_dim = q.shape
  block_size = k_pages.shape[1]
  batch = kv_lens.shape[0]
  scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
  if num_prefill_tiles is None:
    num_prefill_tiles = common.cdiv(num_tokens, prefill_tile) + batch
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
  # Decode rows (one query, at KV position kv_len - 1), gathered into num_decode_rows.
  num_decode_rows = batch if num_decode_rows is None else min(num_decode_rows, batch)
  if num_decode_rows:
    rows, is_decode = common.packed_ids(q_lens == 1, num_decode_rows)
    decode_kv_lens = jnp.where(is_decode, kv_lens[rows], 0)
    starts = None
    if sliding_window is not None:
      starts = jnp.maximum(decode_kv_lens - sliding_window, 0)
    tokens = jnp.minimum(cu_q_lens[rows], num_tokens - 1)
    dec = _decode_rows(q[tokens], k_pages, v_pages, block_tables[rows], decode_kv_lens, starts,
                       sm_scale=scale, soft_cap=soft_cap,
                       blocks_per_step=_blocks_per_step(DECODE_KEYS, block_size))
    out = out.at[jnp.where(is_decode, tokens, num_tokens)].set(dec, mode="drop")
  if num_prefill_tiles and prefill_tile == KERNEL_TILE:
    # kernel_hints: the C++ kernel alone (a CPU target); its own tiles.
    if not cpu_kernels.supports(q, k_pages):
      raise ValueError("prefill_tile=KERNEL_TILE (kernel_hints) needs the C++ kernels and "
                       "float32 pages")
    out = out + cpu_kernels.ragged_prefill(q, k_pages, v_pages, block_tables, kv_lens,
                                           cu_q_lens, sm_scale=scale, soft_cap=soft_cap,
                                           sliding_window=sliding_window)
  elif num_prefill_tiles and cpu_kernels.supports(q, k_pages):
    # Rows with more than one query through the C++ kernel on a CPU target (zeros for the
    # other rows); the jnp tiles elsewhere.
    prefill = functools.partial(_prefill_rows_jnp, sm_scale=scale, soft_cap=soft_cap,
                                sliding_window=sliding_window, tile=prefill_tile,
                                num_tiles=num_prefill_tiles,
                                blocks_per_step=_blocks_per_step(PREFILL_KEYS, block_size))
    kernel = functools.partial(cpu_kernels.ragged_prefill, sm_scale=scale, soft_cap=soft_cap,
                               sliding_window=sliding_window)
    rows = lax.platform_dependent(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                                  cpu=kernel, default=prefill)
    out = out + rows  # each token's output is in one of them, the other holds 0
  elif num_prefill_tiles:
    tiles, dst = _prefill_tiles(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, sm_scale=scale,
        soft_cap=soft_cap, sliding_window=sliding_window, tile=prefill_tile,
        num_tiles=num_prefill_tiles,
        blocks_per_step=_blocks_per_step(PREFILL_KEYS, block_size))
    out = out.at[dst.reshape(-1)].set(tiles.reshape(-1, num_q_heads, head_dim), mode="drop")
  return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret",
                                             "return_lse"))
def paged_attention_xla(
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
  """`paged_attention`'s contract: one query per row over its first `kv_lens` keys.
  `return_lse` (the log-sum-exp too): the jnp reference computes it (the C++ kernel and
  the key-chunk loop return the output only)."""
  del interpret
  if return_lse:
    return paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lens,
                                     sm_scale=sm_scale, soft_cap=soft_cap, return_lse=True)
  _check_paged(q, k_pages, v_pages, block_tables, kv_lens)
  head_dim = q.shape[-1]
  scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
  out = _decode_rows(q, k_pages, v_pages, block_tables, kv_lens, None, sm_scale=scale,
                     soft_cap=soft_cap,
                     blocks_per_step=_blocks_per_step(DECODE_KEYS, k_pages.shape[1]))
  return out.astype(q.dtype)

"""The training-free "block_bounds" indexer: block scores from key bounds, top-k selection.

Owns step 3's "score blocks from summaries -> top-k blocks plus sink and local blocks"
(DESIGN.md). Pure jnp with static shapes, so it lives inside the jitted step.

Score of a block for one query head (`bounds` from kernels_pallas.block_key_bounds)::

  score(q, block) = sum_d max(q_d * min_d, q_d * max_d)
                  = q . (max + min) / 2  +  |q| . (max - min) / 2      (one matmul a head)

an upper bound of q . k for every key k of the block (each term bounds q_d * k_d).
A KV group's score is the max over its query heads (the bound of the group's best
head). Four selections:

- "union" (default): one selection for all heads, the union of every QUERY head's
  best blocks: each query head ranks the blocks by its own score, and blocks are taken
  by their best rank in any head (every head's 1st choice, then every head's 2nd, ...)
  until the budget is full. Ranks, not scores, are compared across heads: raw bounds of
  different heads live on different scales (key norms differ by head), so a raw max lets
  one large-norm head decide alone, and a per-head [0, 1] normalisation still lets a few
  flat-scored heads crowd out the one head that reads the needle. Measured on the real
  model's passkey prompts (4k tokens, block 16, top-k 512): "shared" 2/5, "union" 5/5
  (WORKSPACE.md). Same cost as "shared": one table per sequence, one attention kernel.
- "shared": one selection for all KV heads; scores normalised per (sequence, KV head)
  to [0, 1] over the sequence's valid blocks, then the max over KV heads (wave 2's rule).
- "per_kv_head" / "per_query_head": each KV head (or each query head) picks its own
  blocks from its own scores and attends over them only; the union of one sequence's
  heads is bounded by the hot buffer (`select_blocks`' max_union_blocks), since a block
  holds every head and must be resident for any head to read it.

`select_blocks` returns the blocks in attention order (ascending logical index, the
newest, partly filled block last), as kernels_pallas.paged_attention requires.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from hisparse_jax.kv_cache.kv_pool import from_storage, to_storage
from hisparse_jax.sparse.config import SELECTIONS, HiSparseBlocks
from kernels_pallas import cpu_kernels
from kernels_pallas.block_key_bounds import QuantizedBounds

PAD = -1  # logical id of padding in a selection


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
  """Selected logical blocks of each sequence (and KV head, for "per_kv_head").

  Invariants: `logical_ids[..., :num_selected]` are distinct, ascending, within the
  sequence's valid blocks, and end with its newest block; the rest is `PAD`;
  `kv_lens = (num_selected - 1) * block_size + tokens of the newest block` (0 when
  nothing is selected), the `kv_lens` argument of paged attention.
  """

  logical_ids: jax.Array  # int32 [batch, (num_kv_heads,) k]
  num_selected: jax.Array  # int32 [batch, (num_kv_heads,)]
  kv_lens: jax.Array  # int32 [batch, (num_kv_heads,)]

  @property
  def valid(self) -> jax.Array:  # bool [batch, (num_kv_heads,) k]
    k = self.logical_ids.shape[-1]
    return jnp.arange(k) < self.num_selected[..., None]


def num_valid_blocks(kv_lens: jax.Array, block_size: int) -> jax.Array:
  """int32 [batch]: blocks holding at least one token of each sequence."""
  return (kv_lens + block_size - 1) // block_size


def block_scores(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    bounds: jax.Array,  # [batch, max_blocks, 2, num_kv_heads, head_dim], 0 = min, 1 = max
    per_query_head: bool = False,
) -> jax.Array:
  """float32 [batch, num_kv_heads, max_blocks]: per KV head, max over its query heads of
  the upper bound of q . k over each block's keys (`per_query_head`: [batch,
  num_q_heads, max_blocks], each query head's own bound, no max). Padding blocks get
  whatever their bounds say; `select_blocks` masks them."""
  batch, num_q_heads, head_dim = q.shape
  _, max_blocks, two, num_kv_heads, bounds_dim = bounds.shape
  if two != 2 or bounds_dim != head_dim or bounds.shape[0] != batch:
    raise ValueError(f"bounds must be [batch={batch}, max_blocks, 2, num_kv_heads, "
                     f"head_dim={head_dim}], got {bounds.shape} (q shape {q.shape})")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads "
                     f"{num_kv_heads}")
  group = num_q_heads // num_kv_heads
  # q . k <= q+ . max + q- . min for every k in a block (q+ = max(q, 0), q- = min(q, 0)).
  # As ONE batched matmul over the bounds as they are laid out ([2, kv heads, d] per
  # block, contraction 2 x kv x d, no transposed or concatenated copy of the gathered
  # bounds): each query head's row holds its q- and q+ at its own KV head's place and
  # zeros elsewhere. Measured at 8 x 4,096 blocks, 2 KV heads of 64, 4 query heads each:
  # 1.3 ms against 18 ms for a matmul per head over a concatenated [center, radius] copy.
  qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
  split = jnp.stack([jnp.minimum(qg, 0.0), jnp.maximum(qg, 0.0)], axis=3)  # [b, h, g, 2, d]
  eye = jnp.eye(num_kv_heads, dtype=jnp.float32)  # [h, h']: the block's head h' = h
  rows = jnp.einsum("bhgtd,hk->bhgtkd", split, eye).reshape(
      batch, num_kv_heads * group, 2 * num_kv_heads * head_dim)
  flat = bounds.astype(jnp.float32).reshape(batch, max_blocks, 2 * num_kv_heads * head_dim)
  s = jnp.einsum("bxk,bmk->bxm", rows, flat, precision=lax.Precision.HIGHEST)
  if per_query_head:
    return s  # [batch, num_q_heads, max_blocks]: row h * group + g is query head h * group + g
  return s.reshape(batch, num_kv_heads, group, max_blocks).max(axis=2)


def shared_scores(
    scores: jax.Array,  # [batch, num_kv_heads, max_blocks]
    kv_lens: jax.Array,  # int32 [batch]
    block_size: int,
) -> jax.Array:
  """float32 [batch, max_blocks]: per-head scores normalised to [0, 1] over the valid
  blocks, then the max over KV heads (see the module docstring for why)."""
  max_blocks = scores.shape[-1]
  valid = (jnp.arange(max_blocks) < num_valid_blocks(kv_lens, block_size)[:, None])
  valid = valid[:, None, :]  # [batch, 1, max_blocks]
  hi = jnp.where(valid, scores, -jnp.inf).max(axis=-1, keepdims=True)
  lo = jnp.where(valid, scores, jnp.inf).min(axis=-1, keepdims=True)
  span = jnp.where(hi > lo, hi - lo, 1.0)
  norm = jnp.where(valid, (scores - jnp.where(valid, lo, 0.0)) / span, 0.0)
  return norm.max(axis=1)


def union_priority(
    scores: jax.Array,  # [batch, num_heads, max_blocks]
    kv_lens: jax.Array,  # int32 [batch]
    blocks: HiSparseBlocks,
) -> jax.Array:
  """float32 [batch, max_blocks]: scores for `select_blocks` that make it pick the
  "union" selection (module docstring). The order it encodes over a sequence's valid
  blocks: a block's best rank in any head (each head ranks all valid blocks by its own
  score, ties to the lower block), then its highest score in any head, then the lower
  block; the sink and local blocks are forced first by `select_blocks`, the free
  budget (top-k minus those) goes down this order.

  Cost: one top-k of `top_k_blocks` per head and two more over [batch, max_blocks], no
  sort of all blocks (a double argsort of every head's scores was 10x "shared"'s select
  at 4,096 blocks). Blocks past the budget's boundary rank get -inf; those before it
  +inf (fewer than the free budget, so with the forced ones fewer than top-k); those at
  the boundary rank their highest score."""
  batch, num_heads, max_blocks = scores.shape
  k = min(blocks.top_k_blocks, max_blocks)
  n = num_valid_blocks(kv_lens.astype(jnp.int32), blocks.block_size)[:, None]  # [batch, 1]
  idx = jnp.arange(max_blocks, dtype=jnp.int32)
  valid = idx < n
  forced = valid & ((idx < blocks.sink_blocks) | (idx >= n - blocks.local_blocks))
  s = jnp.where(valid[:, None, :], scores.astype(jnp.float32), -jnp.inf)
  top_s, top = lax.top_k(s, k)  # [batch, heads, k], best first, ties to the lower block
  rank = jnp.where(top_s > -jnp.inf, jnp.arange(k, dtype=jnp.int32), k)
  best = jnp.full((batch, max_blocks), k, jnp.int32).at[
      jnp.arange(batch)[:, None, None], top].min(rank)
  # level: k - best rank (higher first; 0: in no head's top-k). A head's top-k holds at
  # most `forced` forced blocks, so at least the free budget of free blocks is listed.
  level = jnp.where(valid & ~forced & (best < k), k - best, 0)
  budget = k - forced.sum(axis=1)  # free slots of each row
  levels, _ = lax.top_k(level, k)  # [batch, k] descending
  boundary = jnp.take_along_axis(levels, jnp.clip(budget - 1, 0, k - 1)[:, None], axis=1)
  highest = s.max(axis=1)  # [batch, max_blocks]: finite for every valid block
  return jnp.where(level > boundary, jnp.inf,
                   jnp.where((level == boundary) & (level > 0), highest, -jnp.inf))


def select_blocks(
    scores: jax.Array,  # float [batch, (num_heads,) max_blocks]
    kv_lens: jax.Array,  # int32 [batch]: tokens in the cache, the query's own included
    blocks: HiSparseBlocks,
    max_union_blocks: int | None = None,
) -> Selection:
  """Sink blocks, local blocks (the newest included) and the best-scored others, at
  most `blocks.top_k_blocks` per row, in attention order, padded with `PAD`.

  Works on shared scores [batch, max_blocks] or per-head scores
  [batch, num_heads, max_blocks] (a row per KV head or per query head). A sequence with
  at most `top_k_blocks` valid blocks selects all of them.

  max_union_blocks (per-head scores only): the distinct blocks the heads of one sequence
  select together are at most this many (what one step may need resident: the hot
  buffer's slots). When the heads' own top-k sets would exceed it, the union keeps the
  blocks by their best rank in any head (every head's 1st choice, then every head's 2nd,
  ...; ties: more heads, then the lower block), and each head selects its best-scored
  blocks within that union. Sink and local blocks rank first in every head, so they are
  always kept (`top_k_blocks <= max_union_blocks` is required).
  """
  if scores.ndim not in (2, 3) or scores.shape[0] != kv_lens.shape[0]:
    raise ValueError(f"scores must be [batch, (num_kv_heads,) max_blocks] with batch = "
                     f"len(kv_lens) = {kv_lens.shape[0]}, got {scores.shape}")
  block_size = blocks.block_size
  max_blocks = scores.shape[-1]
  k = min(blocks.top_k_blocks, max_blocks)
  lens = kv_lens.astype(jnp.int32).reshape((-1,) + (1,) * (scores.ndim - 1))
  n = num_valid_blocks(lens, block_size)  # [batch, (1,) 1]
  idx = jnp.arange(max_blocks, dtype=jnp.int32)
  valid = idx < n
  forced = (idx < blocks.sink_blocks) | (idx >= n - blocks.local_blocks)
  # Forced blocks outrank every score; invalid ones (NaN/inf bounds of padding) rank last.
  priority = jnp.where(valid, jnp.where(forced, jnp.inf, scores.astype(jnp.float32)),
                       -jnp.inf)
  if max_union_blocks is not None and scores.ndim == 3:
    if max_union_blocks < k:
      raise ValueError(f"max_union_blocks ({max_union_blocks}) must be >= top_k_blocks ({k})")
    if scores.shape[1] * k > max_union_blocks and max_union_blocks < max_blocks:
      priority = _within_union(priority, k, max_union_blocks)
  _, top = lax.top_k(priority, k)  # [batch, (num_heads,) k]
  top_valid = top < n
  ordered = jnp.sort(jnp.where(top_valid, top, max_blocks), axis=-1)  # padding sorts last
  num_selected = top_valid.sum(axis=-1).astype(jnp.int32)
  logical_ids = jnp.where(ordered < max_blocks, ordered, PAD).astype(jnp.int32)
  lens = lens[..., 0]
  last_tokens = lens - (n[..., 0] - 1) * block_size
  selected_lens = jnp.where(num_selected > 0, (num_selected - 1) * block_size + last_tokens,
                            0)
  return Selection(logical_ids=logical_ids, num_selected=num_selected,
                   kv_lens=selected_lens.astype(jnp.int32))


def _within_union(priority: jax.Array, k: int, max_union_blocks: int) -> jax.Array:
  """priority [batch, num_heads, max_blocks] with the blocks outside the bounded union of
  the heads' top-k sets set to -inf (`select_blocks`' max_union_blocks)."""
  batch, num_heads, max_blocks = priority.shape
  top_priority, top = lax.top_k(priority, k)  # [batch, heads, k], best first
  listed = top_priority > -jnp.inf  # a valid block (padding ranks last, -inf)
  rank = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), top.shape)
  rows = jnp.arange(batch)[:, None, None]
  best = jnp.full((batch, max_blocks), k, jnp.int32).at[rows, top].min(
      jnp.where(listed, rank, k))
  votes = jnp.zeros((batch, max_blocks), jnp.int32).at[rows, top].add(listed.astype(jnp.int32))
  # Higher key = kept first: best rank, then the number of heads that listed the block;
  # blocks no head listed get -1 and are never kept. (top_k keeps the lower index on ties.)
  key = jnp.where(best < k, (k - best) * (num_heads + 1) + votes, -1)
  key_kept, kept = lax.top_k(key, max_union_blocks)  # [batch, max_union_blocks]
  allowed = jnp.zeros((batch, max_blocks), bool).at[jnp.arange(batch)[:, None], kept].set(
      key_kept >= 0)
  return jnp.where(allowed[:, None, :], priority, -jnp.inf)


def select(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    bounds: jax.Array | None,  # [batch, max_blocks, 2, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # int32 [batch]
    blocks: HiSparseBlocks,
    selection: str = "shared",
    axis_name: str | None = None,
    kv_head_repeat: int = 1,
    cpu_kernel: bool = False,
    scores: jax.Array | None = None,
) -> Selection:
  """Scores and selection in one call: [batch, k] ("shared"), [batch, num_kv_heads, k]
  ("per_kv_head") or [batch, num_q_heads, k] ("per_query_head"). The per-head selections
  keep the union of one sequence's heads within `blocks.hot_buffer_blocks` blocks
  (`select_blocks`' max_union_blocks): what a step loads fits the sequence's hot buffer.

  axis_name: the KV heads are split over this mesh axis (tensor parallel, inside
  shard_map): each device scores its own heads, then ONE all-gather of the scores
  ([batch, heads, max_blocks] float32, small) gives every device all heads, so each
  selects the blocks the unsplit model selects. kv_head_repeat: each of the model's KV
  heads is held `kv_head_repeat` times (fewer KV heads than devices); the copies' scores
  (each over its own query heads) are maxed back into the head's score first.

  cpu_kernel: the program runs on XLA:CPU (the engine's "xla" kernels): "union" selects
  with the C++ kernel (`cpu_kernels.union_select`, the same blocks) when it is built.

  scores: this device's block scores when computed elsewhere (float32 [batch, heads,
  max_blocks]: per query head for "union" / "per_query_head", per KV head otherwise, as
  `block_scores`; `select_rows`' scores kernel); `bounds` is then not read (None)."""
  if selection not in SELECTIONS:
    raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
  if selection not in ("shared", "union") and axis_name is not None:
    raise ValueError(f"selection={selection!r} is not supported with tensor parallelism")
  if scores is None:
    scores = block_scores(q, bounds, per_query_head=_per_query_head(selection))
  if axis_name is not None:
    scores = lax.all_gather(scores, axis_name, axis=1, tiled=True)
    if kv_head_repeat > 1 and selection == "shared":
      batch, heads, max_blocks = scores.shape
      scores = scores.reshape(batch, heads // kv_head_repeat, kv_head_repeat,
                              max_blocks).max(axis=2)
  if selection == "union":
    k = min(blocks.top_k_blocks, scores.shape[-1])
    if cpu_kernel and cpu_kernels.available():
      ids, num, lens = cpu_kernels.union_select(
          scores, kv_lens, k=k, block_size=blocks.block_size, sink_blocks=blocks.sink_blocks,
          local_blocks=blocks.local_blocks)
      return Selection(logical_ids=ids, num_selected=num, kv_lens=lens)
    return select_blocks(union_priority(scores, kv_lens, blocks), kv_lens, blocks)
  if selection == "shared":
    return select_blocks(shared_scores(scores, kv_lens, blocks.block_size), kv_lens, blocks)
  return select_blocks(scores, kv_lens, blocks, max_union_blocks=blocks.hot_buffer_blocks)


def _per_query_head(selection: str) -> bool:
  """Whether `selection` ranks by each query head's scores (else each KV head's)."""
  return selection in ("union", "per_query_head")


def select_rows(
    q: jax.Array,  # [batch, num_q_heads, head_dim]
    bounds: jax.Array | QuantizedBounds,  # [rows, 2, num_kv_heads, head_dim]: every
    # block's key bounds (float32, bfloat16, uint16: bfloat16 bits, which the C++ kernel
    # reads in place, or int8 QuantizedBounds)
    bounds_rows: jax.Array,  # int32 [batch, max_blocks]: each logical block's row
    kv_lens: jax.Array,  # int32 [batch]
    blocks: HiSparseBlocks,
    selection: str = "shared",
    axis_name: str | None = None,
    kv_head_repeat: int = 1,
    cpu_kernel: bool = False,
    scores_kernel: Callable[..., jax.Array] | None = None,
) -> Selection:
  """`select(q, bounds[bounds_rows], ...)`: the selection from the bounds array the step
  holds and each logical block's row of it. With `cpu_kernel` (XLA:CPU), "union" without
  tensor parallelism and float32 / bfloat16 / int8 bounds, the C++ kernel scores the
  bounds in place (`cpu_kernels.union_select_bounds`: no [batch, max_blocks, 2, heads, head_dim]
  gathered copy; scores equal up to float32 rounding). Else with `scores_kernel` (the GPU
  backends' `KernelOps.block_scores`: kernels_pallas.block_scores' signature) the scores
  come from it, the bounds read in place; otherwise from the gathered bounds; then
  `select`."""
  if (cpu_kernel and selection == "union" and axis_name is None
      and cpu_kernels.union_select_bounds_target(bounds) is not None
      and cpu_kernels.available()):
    ids, num, lens = cpu_kernels.union_select_bounds(
        q, bounds, bounds_rows, kv_lens, k=min(blocks.top_k_blocks, bounds_rows.shape[1]),
        block_size=blocks.block_size, sink_blocks=blocks.sink_blocks,
        local_blocks=blocks.local_blocks)
    return Selection(logical_ids=ids, num_selected=num, kv_lens=lens)
  scores = gathered = None
  if scores_kernel is not None:
    scores = scores_kernel(q, bounds, bounds_rows, per_query_head=_per_query_head(selection))
  elif isinstance(bounds, QuantizedBounds):  # int8: the gathered rows dequantized
    gathered = bounds.rows(bounds_rows).dequantize()
  else:
    if bounds.dtype == jnp.uint16:  # bfloat16 bits (the engine's storage on CPU)
      bounds = lax.bitcast_convert_type(bounds, jnp.bfloat16)
    gathered = bounds[bounds_rows]
  return select(q, gathered, kv_lens, blocks, selection, axis_name=axis_name,
                kv_head_repeat=kv_head_repeat, cpu_kernel=cpu_kernel, scores=scores)


def bounds_view(stored, bounds_dtype: str):
  """A layer's key bounds as block_key_bounds takes them: the logical dtype of a stored
  array (bfloat16 from its uint16 bits on CPU), or int8 QuantizedBounds as they are."""
  if isinstance(stored, QuantizedBounds):
    return stored
  return from_storage(stored, bounds_dtype)


def bounds_storage(bounds, bounds_dtype: str, stored):
  """The inverse of `bounds_view`: `bounds` in the storage dtype of `stored`."""
  if isinstance(bounds, QuantizedBounds):
    return bounds
  return to_storage(bounds, bounds_dtype, stored.dtype)

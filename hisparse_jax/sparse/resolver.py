"""The HiSparse resolver: selected logical blocks -> device block ids, hot-buffer LRU, loads.

Owns step 3's "resolve each selected block to a device block id" and the host loads it
implies (DESIGN.md). Pure jnp over static-shape state, so select -> resolve -> load ->
attend is one jitted program with no host sync.

  device pool (block ids)                       host pool (pinned_host)
  +---+---------------------+-----------------+   +---------------------------------+
  | 0 | resident blocks     | hot-buffer slots|   | full KV of every sparse sequence|
  |nul| (a sequence's own   | seq 0: s0..sS-1 |   | (written through as blocks fill)|
  |   |  device copies,     | seq 1: s0..sS-1 |   +---------------------------------+
  |   |  newest block incl.)| ...             |        |  host miss: one batched gather
  +---+---------------------+-----------------+        |  per layer per step, into the
            ^ (a) resident: no copy  ^ (b) hot hit      v  LRU slot of that sequence (c)

  per layer, per step:
    select   indexer.select(q, bounds[block_tables], kv_lens)  -> logical ids [B, k]
    resolve  resolve(...)   -> device block table [B, k], load list, new HotBufferState
    load     load_blocks(host k/v, device k/v, load list)       -> device k/v with misses
    attend   paged_attention(q, k, v, table, selection.kv_lens)

Each selected block resolves, in this order, to (a) its resident device block
(`resident_ids[b, i] != 0`), (b) the hot-buffer slot already holding it, or (c) a miss:
it is loaded from `host_ids[b, i]` into the least recently used slot of the sequence
not used by this step (empty slots first, ties by slot index), evicting what was there.
`num_slots >= k` (hot_buffer_tokens >= top_k_tokens) guarantees room, so a selected
block never evicts another block selected in the same step. A block selected twice in
one row (per-KV-head selections flattened into one row) resolves once.

How the engine plugs this in:
- Per sparse sequence it keeps: its hot-buffer slots (`hot_buffer_blocks` device blocks
  allocated when the sequence turns sparse, released with it), its row of
  `HotBufferState` (slot contents, last use, eviction steps; one state per layer, since
  selections differ by layer), the host block of every logical block (`host_ids`), and
  which logical blocks still have a resident device copy (`resident_ids`, 0 once the
  device copy is dropped under pressure). A sequence's row moves with it when the batch
  is reordered; a new sparse sequence starts from `HotBufferState.create` rows.
- The runner passes, per step: the gathered `bounds[block_tables]` and `kv_lens` to the
  indexer; `resident_ids`, `slot_device_ids`, `host_ids` (int32 [B, max_blocks] and
  [B, num_slots]), the step counter, the state, and the host pool arrays (pinned_host,
  read-only) beside the device pool arrays (donated) to the jitted step; `sparse.attention.attend`
  calls select -> resolve -> load_blocks -> paged_attention instead of the dense table,
  and the step returns the new state and the counts for the metrics.
- selection="per_kv_head" / "per_query_head": the [B, num_heads, k] selection is
  flattened to one row per sequence for `resolve` (a block chosen by several heads
  resolves and loads once; the indexer keeps the union within the hot buffer's slots),
  the table reshaped back, and each head attends over its own table
  (kernels_pallas.paged_attention_per_head).
- Write-through: the newest (partly filled) block is always resident (it receives this
  step's K/V). When a block of a sparse sequence fills, the engine swaps it out to its
  host block after the step (TransferEngine.swap_out, batched with the others), so the
  device copy can later be dropped (resident id -> 0) without a write.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from hisparse_jax.kv_cache import transfer
from hisparse_jax.kv_cache.host_compute import on_host
from kernels_pallas import block_copy, cpu_kernels
from kernels_pallas.common import packed_ids

NEVER = -(2**30)  # step of "never used / never evicted"; far enough to never thrash
_LAST = 2**31 - 1  # LRU key of slots used by this step: never a victim


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HotBufferState:
  """Hot-buffer bookkeeping of a batch of sparse sequences (one layer).

  Invariants: a logical block sits in at most one slot of its row; `slot_block == -1`
  marks an empty slot; `slot_last_used` is the last step the slot was hit or loaded
  (`NEVER` if never); `evicted_at[b, i]` the last step logical block i left row b's
  hot buffer (`NEVER` if never).
  """

  slot_block: jax.Array  # int32 [batch, num_slots]: logical block held, -1 = empty
  slot_last_used: jax.Array  # int32 [batch, num_slots]
  evicted_at: jax.Array  # int32 [batch, max_blocks]

  @classmethod
  def create(cls, batch: int, num_slots: int, max_blocks: int) -> HotBufferState:
    return cls(slot_block=jnp.full((batch, num_slots), -1, jnp.int32),
               slot_last_used=jnp.full((batch, num_slots), NEVER, jnp.int32),
               evicted_at=jnp.full((batch, max_blocks), NEVER, jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResolveCounts:
  """Per-sequence counts of one step (int32 [batch] each); a block selected twice in a
  row counts once. `resident_hits + hot_hits + misses` = distinct selected blocks."""

  resident_hits: jax.Array
  hot_hits: jax.Array
  misses: jax.Array  # = loads from the host pool
  evictions: jax.Array  # misses that replaced a block (not an empty slot)
  thrash: jax.Array  # misses of a block evicted within `thrash_window_steps` steps


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Resolution:
  """Output of `resolve`. Load lists are padded: host id 0, device id
  `num_device_blocks` (out of range, dropped by `load_blocks`)."""

  block_tables: jax.Array  # int32 [batch, k]: device block ids, 0 for padding
  load_host_ids: jax.Array  # int32 [batch * k]
  load_device_ids: jax.Array  # int32 [batch * k]
  state: HotBufferState
  counts: ResolveCounts


def _resolve_row(sel, valid, slot_block, slot_last_used, evicted_at, resident_ids,
                 slot_device_ids, host_ids, step, num_device_blocks, thrash_window_steps):
  """One sequence: sel, valid [k]; slots [num_slots]; per-logical-block arrays
  [max_blocks]."""
  num_slots = slot_block.shape[0]
  safe = jnp.where(valid, sel, 0)
  same = (sel[:, None] == sel[None, :]) & valid[:, None] & valid[None, :]  # [k, k]
  first = valid & ~jnp.tril(same, -1).any(axis=1)  # first occurrence of each block
  first_of = jnp.argmax(same, axis=1)  # [k] index of the first occurrence

  resident = resident_ids[safe]
  is_resident = first & (resident != 0)
  match = (slot_block[None, :] == sel[:, None]) & (first & ~is_resident)[:, None]
  is_hot = match.any(axis=1)
  is_miss = first & ~is_resident & ~is_hot

  # LRU victims among the slots this step does not hit: empty slots, then oldest use.
  used = match.any(axis=0)  # [num_slots]
  key = jnp.where(used, _LAST, jnp.where(slot_block < 0, NEVER, slot_last_used))
  order = jnp.argsort(key, stable=True)
  rank = jnp.cumsum(is_miss) - 1
  victim = order[jnp.clip(rank, 0, num_slots - 1)]
  slot = jnp.where(is_hot, jnp.argmax(match, axis=1), jnp.where(is_miss, victim, num_slots))
  slot_device = slot_device_ids[jnp.minimum(slot, num_slots - 1)]

  device_ids = jnp.where(is_resident, resident, jnp.where(is_hot | is_miss, slot_device, 0))
  table = jnp.where(valid, device_ids[first_of], 0)

  old = slot_block[jnp.minimum(slot, num_slots - 1)]
  evicted = is_miss & (old >= 0)
  thrash = is_miss & (step - evicted_at[safe] <= thrash_window_steps)
  max_blocks = evicted_at.shape[0]
  new_evicted_at = evicted_at.at[jnp.where(evicted, old, max_blocks)].set(step, mode="drop")
  load_slot = jnp.where(is_miss, slot, num_slots)
  new_slot_block = slot_block.at[load_slot].set(sel, mode="drop")
  new_last_used = slot_last_used.at[slot].set(step, mode="drop")

  load_host = jnp.where(is_miss, host_ids[safe], 0)
  load_device = jnp.where(is_miss, slot_device, num_device_blocks)
  counts = [x.sum(dtype=jnp.int32) for x in (is_resident, is_hot, is_miss, evicted, thrash)]
  return (table, load_host, load_device, new_slot_block, new_last_used, new_evicted_at,
          *counts)


def resolve(
    logical_ids: jax.Array,  # int32 [batch, k]: selected logical blocks
    valid: jax.Array,  # bool [batch, k]
    state: HotBufferState,
    resident_ids: jax.Array,  # int32 [batch, max_blocks]: device copy, 0 = not resident
    slot_device_ids: jax.Array,  # int32 [batch, num_slots]: device blocks of the slots
    host_ids: jax.Array,  # int32 [batch, max_blocks]: host block of each logical block
    step: jax.Array | int,  # int32 scalar, increases by one per decode step
    *,
    num_device_blocks: int,
    thrash_window_steps: int,
    max_distinct: int | None = None,
    cpu_kernel: bool = False,
) -> Resolution:
  """Resolves every selected block to a device block id (module docstring); updates
  the hot-buffer state; lists the host -> device loads of the misses.

  max_distinct: the most distinct blocks a row lists (default k; per-head selections
  flattened into one row list up to num_heads x top-k entries, but the indexer bounds
  their union, indexer.select_blocks' max_union_blocks); the hot buffer must hold it.

  cpu_kernel: the program runs on XLA:CPU (the engine's "xla" kernels): the C++ kernel
  resolves (`cpu_kernels.resolve`, the same values as `_resolve_row`) when it is built."""
  batch, k = logical_ids.shape
  num_slots = slot_device_ids.shape[1]
  max_blocks = resident_ids.shape[1]
  distinct = k if max_distinct is None else min(k, max_distinct)
  if num_slots < distinct:
    raise ValueError(f"the hot buffer has {num_slots} slots per sequence, fewer than the "
                     f"{distinct} blocks a step may select: raise hot_buffer_tokens")
  want = {"valid": (valid, (batch, k)),
          "slot_block": (state.slot_block, (batch, num_slots)),
          "slot_last_used": (state.slot_last_used, (batch, num_slots)),
          "evicted_at": (state.evicted_at, (batch, max_blocks)),
          "host_ids": (host_ids, (batch, max_blocks))}
  for name, (x, shape) in want.items():
    if x.shape != shape:
      raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
  step = jnp.asarray(step, jnp.int32)
  if cpu_kernel and cpu_kernels.available():
    (table, load_host, load_device, slot_block, last_used, evicted_at,
     counts) = cpu_kernels.resolve(
         logical_ids, valid, state.slot_block, state.slot_last_used, state.evicted_at,
         resident_ids, slot_device_ids, host_ids, step, num_device_blocks=num_device_blocks,
         thrash_window_steps=thrash_window_steps)
    return Resolution(
        block_tables=table, load_host_ids=load_host.reshape(batch * k),
        load_device_ids=load_device.reshape(batch * k),
        state=HotBufferState(slot_block, last_used, evicted_at),
        counts=ResolveCounts(*(counts[:, i] for i in range(5))))
  row = jax.vmap(_resolve_row, in_axes=(0, 0, 0, 0, 0, 0, 0, 0, None, None, None))
  (table, load_host, load_device, slot_block, last_used, evicted_at, *counts) = row(
      logical_ids.astype(jnp.int32), valid, state.slot_block, state.slot_last_used,
      state.evicted_at, resident_ids, slot_device_ids, host_ids, step, num_device_blocks,
      thrash_window_steps)
  return Resolution(
      block_tables=table.astype(jnp.int32),
      load_host_ids=load_host.reshape(batch * k).astype(jnp.int32),
      load_device_ids=load_device.reshape(batch * k).astype(jnp.int32),
      state=HotBufferState(slot_block, last_used, evicted_at),
      counts=ResolveCounts(*counts))


HOST_LOADS_ENV = "HISPARSE_JAX_HOST_LOADS"


def host_loads_mode() -> str:
  """How a step's host loads cross where host and device are different memories:
  "loop" (default): a while loop over chunks of `load_chunk` blocks, as many trips as
  the misses need (none without a miss), so the bytes follow the misses; "fixed": one
  gather of the whole load list every step (no control flow around the host
  computation). The env var HISPARSE_JAX_HOST_LOADS picks it (a fallback for an XLA
  whose host offloader rejects host computations inside a loop)."""
  mode = os.environ.get(HOST_LOADS_ENV, "loop")
  if mode not in ("loop", "fixed"):
    raise ValueError(f"{HOST_LOADS_ENV} must be 'loop' or 'fixed', got {mode!r}")
  return mode


OVERLAP_LOADS_ENV = "HISPARSE_JAX_OVERLAP_LOADS"


def overlap_loads_mode() -> bool:
  """Whether a HiSparse decode row attends the blocks already on the device while its
  misses load (then the loaded misses; the two merged exactly by log-sum-exp:
  sparse.attention._sparse_rows) instead of one attention after the load. Off by
  default; the env var HISPARSE_JAX_OVERLAP_LOADS=1 turns it on (0 / unset: off)."""
  mode = os.environ.get(OVERLAP_LOADS_ENV, "0")
  if mode not in ("0", "1"):
    raise ValueError(f"{OVERLAP_LOADS_ENV} must be '0' or '1', got {mode!r}")
  return mode == "1"


def load_chunk(max_loads: int, min_bucket: int = 8) -> int:
  """Blocks (or tokens) one trip of the host-load loop moves: `min_bucket`, or all of a
  smaller load list. A step moves ceil(misses / chunk) chunks: its misses rounded up.

  (Not a `lax.switch` over sizes: XLA's host offloader, jax 0.11.2 on an H200, rejects
  a host computation inside a conditional's branch, "Expected computation ... to be
  called only by one caller and that caller to be a While"; a while loop is the control
  flow it follows.)"""
  return max(1, min(min_bucket, max_loads))


# HISPARSE_JAX_OVERLAP_LOADS=1, loads crossing by XLA (host_copy "xla"): the first this many
# entries of a step's packed load list cross as one staged copy per array, outside any
# loop (`staged_gather`), which XLA's scheduler overlaps with the attention over the
# blocks already on the device; the rest in the while loop's trips after it.
OVERLAP_STAGED_BLOCKS = 8


def staged_gather(host_arrays, host_ids, device_sharding):
  """Blocks `host_ids` [m] (static m) of each host array, on the device: m dynamic slices
  of the pinned pool concatenated (XLA's host offloader runs that fusion on the host, into
  a pinned staging buffer) and ONE host -> device copy per array, which compiles to an
  asynchronous copy-start / copy-done pair (no host computation call, no control flow:
  the latency-hiding scheduler may put independent kernels between the two; a
  compute_on gather compiles to a HostExecute call the schedule waits on at once,
  seen compiling for the H200 deviceless)."""
  # (the ids materialized first: else XLA fuses their computation, and with it device work
  # beside it, such as the attention's padded queries, into the host fusion)
  host_ids = lax.optimization_barrier(host_ids)
  out = []
  for a in host_arrays:
    rows = [lax.dynamic_slice_in_dim(a, host_ids[i], 1, axis=0)
            for i in range(host_ids.shape[0])]
    out.append(jax.device_put(jnp.concatenate(rows, axis=0), device_sharding))
  return tuple(out)


def _host_load_loop(gather, host_operand, host_packed, device_packed, count, carry,
                    scatter, *, total, chunk, mode, out_of_range, staged=None):
  """Runs `scatter(carry, gather(host_operand, ids), device ids)` over the packed load
  list: in `chunk`-sized trips, ceil(count / chunk) of them ("loop"), or once over the
  whole list ("fixed"); returns (new carry, entries that crossed). `staged` (m,
  staged_gather-like fn): the first m entries first cross by `staged(host_operand, ids)`,
  outside the loop, then the loop over the rest."""
  if staged is not None and mode == "loop":
    m, staged_fn = min(staged[0], total), staged[1]
    carry = scatter(carry, staged_fn(host_operand, host_packed[:m]), device_packed[:m])
    if m == total:
      return carry, jnp.int32(m)
    rest, moved = _host_load_loop(
        gather, host_operand, host_packed[m:], device_packed[m:],
        jnp.maximum(count - m, 0), carry, scatter, total=total - m,
        chunk=load_chunk(total - m), mode=mode, out_of_range=out_of_range)
    return rest, moved + m
  if mode == "fixed":
    return scatter(carry, gather(host_operand, host_packed), device_packed), jnp.int32(total)
  trips_max = -(-total // chunk)
  pad = trips_max * chunk - total
  host_padded = jnp.pad(host_packed, (0, pad))
  # (the padding repeats the list's out-of-range device id: the scatter drops it)
  device_padded = jnp.pad(device_packed, (0, pad), constant_values=out_of_range)
  trips = (count + chunk - 1) // chunk

  def body(i, carry):
    h = lax.dynamic_slice(host_padded, (i * chunk,), (chunk,))
    d = lax.dynamic_slice(device_padded, (i * chunk,), (chunk,))
    return scatter(carry, gather(host_operand, h), d)

  return lax.fori_loop(0, trips, body, carry), trips * chunk


def load_blocks(
    host_arrays: tuple[jax.Array, ...],  # pinned_host [num_host_blocks, block_size, h, d]
    device_arrays: tuple[jax.Array, ...],  # device, same layout and order (k..., v...)
    host_ids: jax.Array,  # int32 [n]
    device_ids: jax.Array,  # int32 [n]; out of range = no load (padding)
    *,
    device_sharding: jax.sharding.Sharding,
    host_sharding: jax.sharding.Sharding,
    one_memory: bool | None = None,  # None: transfer.hop_free(device_sharding)
    host_copy: str = "xla",  # transfer.host_copy_mode: how the loads cross (not one memory)
    staged: int = 0,  # leading loads crossing by `staged_gather`, outside the loop
) -> tuple[tuple[jax.Array, ...], jax.Array]:
  """device_arrays[j][device_ids[i]] := host_arrays[j][host_ids[i]] for every i with an
  in-range device id; returns (new device arrays, int32 blocks moved per array).

  Moves only what is loaded: the loads are packed to the front and cross from the host
  in a while loop of `load_chunk`-block trips, ceil(loads / chunk) of them, so the bytes
  follow the misses (rounded up to a chunk); no load moves nothing. Each trip's gather
  is transfer.gather_to_device, the swap-ins' mechanism; its scatter into the pages
  drops the padding. (`host_loads_mode` "fixed": one gather of the whole list.)
  `staged` > 0 (HISPARSE_JAX_OVERLAP_LOADS=1): the first `staged` packed loads (padding
  included: always that many blocks) cross by `staged_gather`, one asynchronous copy per
  array outside any loop, the rest in the loop's trips after.
  `host_copy` "kernel": one zero-copy kernel launch per array reads the loaded blocks
  from the pinned pool (kernels_pallas.block_copy; entries with an out-of-range device id
  copy nothing), no loop and no host computation. Where
  device and host are one memory (CPU, `transfer.hop_free`), the loads are a loop of
  exactly `loads` block copies (transfer.copy_block_loop, the swap-ins' mechanism
  there): the blocks moved equal the misses, with no bucket.
  """
  if len(host_arrays) != len(device_arrays) or not host_arrays:
    raise ValueError(f"host and device arrays must be the same number (k..., v...; a DSA "
                     f"layer's latent pages), got {len(host_arrays)} and {len(device_arrays)}")
  total = host_ids.shape[0]
  num_device_blocks = device_arrays[0].shape[0]
  device_ids = device_ids.astype(jnp.int32)
  loads = (device_ids >= 0) & (device_ids < num_device_blocks)
  order, packed = packed_ids(loads, total)
  host_packed = jnp.where(packed, host_ids.astype(jnp.int32)[order], 0)
  device_packed = jnp.where(packed, device_ids[order], num_device_blocks)
  count = loads.sum(dtype=jnp.int32)
  if transfer.hop_free(device_sharding) if one_memory is None else one_memory:
    # One memory (CPU): copy exactly the loads, host page -> device page, no bucket.
    # (device_sharding None: the caller already moved them to the device kind)
    host_view = (list(host_arrays) if device_sharding is None else
                 [jax.device_put(h, device_sharding) for h in host_arrays])
    new_arrays = transfer.copy_block_loop(host_view, device_arrays, host_packed,
                                          device_packed, count)
    return new_arrays, count
  if host_copy == "kernel":  # the GPU reads the misses from the pinned pool
    return block_copy.copy_blocks(host_arrays, device_arrays, host_ids, device_ids), count
  gather = transfer.gather_program(len(host_arrays), device_sharding, host_sharding)

  def scatter(arrays, blocks, ids):
    return tuple(d.at[ids].set(b, mode="drop") for d, b in zip(arrays, blocks))

  new_arrays, moved = _host_load_loop(
      gather, tuple(host_arrays), host_packed, device_packed, count, tuple(device_arrays),
      scatter, total=total, chunk=load_chunk(total), mode=host_loads_mode(),
      out_of_range=num_device_blocks,
      staged=(staged, functools.partial(staged_gather, device_sharding=device_sharding))
      if staged else None)
  return new_arrays, moved


@functools.cache
def _token_gather_program(device_sharding, host_sharding):
  """(host pages, host token ids) -> the tokens' rows [n, width] on the device: the
  gather runs on the host (compute_on("device_host")), only the rows cross."""

  def gather(host_pages, host_ids):
    host_ids = jax.device_put(host_ids, host_sharding)
    # (pinned to the host kind again, as transfer.gather_to_device's operand: inside the
    # load loop the pages came typed device memory beside host ids, which XLA's GPU
    # compiler for jax 0.11.2 refused: "memory_space of all inputs passed to `gather` must
    # be the same"; seen compiling for an H200 deviceless, hisparse-jax compile)
    host_pages = jax.device_put(host_pages, host_sharding)
    # (the host pages viewed as token rows, on the host)
    rows = on_host(lambda p, i: p.reshape(-1, p.shape[-1])[i])(host_pages, host_ids)
    return jax.device_put(rows, device_sharding)

  return jax.jit(gather, out_shardings=device_sharding)


def load_tokens(
    host_pages: jax.Array,  # pinned_host [num_host_blocks, block_size, 1, width]
    device_pages: jax.Array,  # device [num_device_blocks, block_size, 1, width]
    host_ids: jax.Array,  # int32 [n]: host tokens (block * block_size + offset)
    device_ids: jax.Array,  # int32 [n]: device tokens; out of range = no load (padding)
    *,
    device_sharding: jax.sharding.Sharding | None,
    host_sharding: jax.sharding.Sharding | None,
    one_memory: bool | None = None,
    host_copy: str = "xla",
) -> tuple[jax.Array, jax.Array]:
  """`load_blocks` at token granularity (a DSA layer's latent entries: its hot buffer
  holds tokens): device token t := host token h for each listed pair with an in-range
  device token; returns (new device pages, int32 tokens moved). The pages are indexed by
  (block, offset), never through a reshaped view of the donated device pages (XLA:CPU
  would copy them whole). One memory (CPU): a loop of exactly the loads' row copies; else
  host gathers of the packed tokens in `load_chunk`-token trips of a while loop (as many
  as the loads need), each crossing to the device and scattered into the pages;
  `host_copy` "kernel": the zero-copy block copy over token rows (a token is a block of
  one row of the pages viewed [blocks * block_size, width])."""
  num_blocks, block_size = device_pages.shape[:2]
  width = device_pages.shape[-1]
  total = host_ids.shape[0]
  num_tokens = num_blocks * block_size
  device_ids = device_ids.astype(jnp.int32)
  loads = (device_ids >= 0) & (device_ids < num_tokens)
  order, packed = packed_ids(loads, total)
  host_packed = jnp.where(packed, host_ids.astype(jnp.int32)[order], 0)
  device_packed = jnp.where(packed, device_ids[order], num_tokens)
  count = loads.sum(dtype=jnp.int32)
  if transfer.hop_free(device_sharding) if one_memory is None else one_memory:
    host = host_pages if device_sharding is None else jax.device_put(host_pages,
                                                                     device_sharding)

    def body(i, pages):
      h, d = host_packed[i], device_packed[i]
      row = lax.dynamic_slice(host, (h // block_size, h % block_size, 0, 0), (1, 1, 1, width))
      return lax.dynamic_update_slice(pages, row, (d // block_size, d % block_size, 0, 0))

    return lax.fori_loop(0, count, body, device_pages), count
  if host_copy == "kernel":
    (rows,) = block_copy.copy_blocks((host_pages.reshape(-1, width),),
                                     (device_pages.reshape(-1, width),), host_ids, device_ids)
    return rows.reshape(device_pages.shape), count
  gather = _token_gather_program(device_sharding, host_sharding)

  def scatter(pages, rows, ids):
    return pages.at[ids // block_size, ids % block_size, 0].set(rows, mode="drop")

  return _host_load_loop(gather, host_pages, host_packed, device_packed, count, device_pages,
                         scatter, total=total, chunk=load_chunk(total),
                         mode=host_loads_mode(), out_of_range=num_tokens)


def split_loaded(tables, kv_lens, loaded_block, block_size: int):
  """A resolved decode table split in two by whether each block is loaded this step:
  tables [..., k] of device ids in attention order (each full but the last counted one),
  kv_lens [...] (tokens attended), loaded_block bool [num_device_blocks] (True: a device
  block the step's load writes). Returns ((tables, kv_lens) of the blocks already on the
  device, (tables, kv_lens) of the loaded ones), each in the original order with 0 after
  its own blocks: a part's only partly filled block can be the table's last counted one
  (the newest block, which is resident), so each part keeps `paged_attention`'s contract.
  Attention over the two, merged by log-sum-exp (`kernels_pallas.merge_attention`),
  equals attention over the whole table: attention is invariant to the keys' order."""
  k = tables.shape[-1]
  tokens = jnp.clip(kv_lens[..., None] - jnp.arange(k) * block_size, 0, block_size)
  miss = loaded_block[tables] & (tokens > 0)

  def part(take):
    # Stable: the entries of `take` first, in their order; then 0.
    order = jnp.argsort(~take, axis=-1, stable=True)
    count = take.sum(axis=-1, keepdims=True)
    t = jnp.where(jnp.arange(k) < count, jnp.take_along_axis(tables, order, axis=-1), 0)
    return t.astype(jnp.int32), jnp.where(take, tokens, 0).sum(axis=-1).astype(jnp.int32)

  return part(~miss & (tokens > 0)), part(miss)

"""Batched block transfers between the device pool and the host pool.

Owns the data movement of the memory tiers. One `swap_out` (device -> host, "d2h") or
`swap_in` (host -> device, "h2d") is ONE jitted call that moves every listed block of
every layer, K and V, never a call per block:

    swap_out(device_ids=[3, 9], host_ids=[40, 7])      swap_in(host_ids=[40], device_ids=[5])
      device pool  k[l][3] -> host pool k[l][40]         host pool k[l][40] -> device k[l][5]
                   k[l][9] -> host pool k[l][7]          (every layer l, and the same for v)
                   (every layer l, and the same for v)

Mechanics (measured on jax 0.10.2 CPU, DESIGN.md): the destination pool is donated and
comes back in the same buffers, and `out_shardings` pins each result to its memory kind.
Where the two kinds are different memories (GPU: HBM and pinned host DRAM), host-side
indexing runs under `compute_on("device_host")` with the ids `device_put` to the
pinned_host kind, and only the gathered blocks cross (`device_put` inside the program).
On CPU both kinds are the same DRAM and that crossing is a copy of its own (and XLA:CPU's
gather and scatter run element by element): there the program views the source pool as
the destination's kind (`device_put` of the whole array, which XLA:CPU compiles to no
copy at all) and copies each listed block straight into its destination in a loop whose
trip count is the number of real ids (`copy_block_loop`): one pass over the moved bytes
where numpy's `dst[ids] = src[ids]` makes two (`hop_free`). Id lists are padded to a bucket
(a power of two, at least `min_bucket`) so a run compiles a handful of programs: padded
sources read block 0 (the null block), padded destinations are out of range and dropped
(`mode="drop"`), so padding never writes.

Calls are dispatched asynchronously: they return as soon as the program is enqueued,
and JAX orders every later use of the pools after them. `wait()` blocks (only needed
before reading pool contents on the host or to time a transfer); `poll()` collects
finished transfers without blocking. Latency is observed from dispatch to the first
`poll`/`wait` that sees the transfer done, so it is an upper bound when polled late.

`TransferEngine` is the whole interface other modules use for tier moves (copy-on-write
copies inside the device pool are the runner's `copy_blocks`: they move the key bounds
too, and are not tier transfers). On GPU, XLA's host
offloading has known bugs (openxla/xla#34565: scatter into pinned_host with computed
indices); a fallback (per-block host arrays plus `jax.device_put`) can replace
`_dispatch` without changing callers.

`host_copy_mode` "kernel" (env HISPARSE_JAX_HOST_COPY=kernel) replaces the host gather,
crossing and scatter with one zero-copy kernel launch per array in which the GPU reads
(swap-in) or writes (swap-out, the pool donated and aliased in place) the pinned pool
directly (kernels_pallas.block_copy): SGLang's HiCache I/O kernels' way. It compiles for
an H200 deviceless with no copy and no host computation in the program; its speed on a
GPU is unmeasured (make gpu-bench's transfer part times both), so "xla" stays the default.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import make_single_device_sharding

from hisparse_jax.kv_cache.host_compute import on_host
from hisparse_jax.kv_cache.kv_pool import DEVICE, NULL_BLOCK_ID, PINNED_HOST, KVPool
from hisparse_jax.observability import metrics as m
from kernels_pallas import block_copy
from kernels_pallas.common import next_power_of_2


def bucket_size(n: int, min_bucket: int, max_bucket: int | None = None) -> int:
  """The padded length for `n` items (ids, tokens, rows): the next power of two, at least
  `min_bucket`, and at most `max_bucket` when `n` fits (never less than `n`)."""
  b = max(min_bucket, next_power_of_2(n))
  return max(n, min(b, max_bucket)) if max_bucket is not None else b


def warm_buckets(max_items: int, min_bucket: int, max_bucket: int | None = None) -> list[int]:
  """The padded lengths `bucket_size` gives to lists of 1 to `max_items` items, ascending
  (the programs a run over such lists compiles: what a warm-up compiles first)."""
  return sorted({bucket_size(n, min_bucket, max_bucket) for n in range(1, max_items + 1)})


def hop_free(sharding) -> bool:
  """Whether the device and pinned_host kinds of `sharding`'s device are one memory (CPU),
  so that moving an array between them inside a program needs no copy."""
  return next(iter(sharding.device_set)).platform == "cpu"


def ids_sharding(host_sharding):
  """The host-kind sharding of an id list beside pool arrays of `host_sharding`: the same
  device, or replicated over a tensor-parallel mesh (the pools' own sharding splits dim 2
  of rank-4 arrays; ids are rank 1)."""
  if isinstance(host_sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(host_sharding.mesh, jax.sharding.PartitionSpec(),
                                      memory_kind=host_sharding.memory_kind)
  return host_sharding


HOST_COPY_ENV = "HISPARSE_JAX_HOST_COPY"
HOST_COPIES = ("xla", "kernel")


def host_copy_mode(mode: str | None = None) -> str:
  """How blocks cross between the pinned_host and device pools where they are different
  memories (a GPU): "xla" (default): XLA's host offloading, a gather on the host
  (compute_on("device_host")), one crossing and a scatter; "kernel": the zero-copy block
  copy (kernels_pallas.block_copy: the GPU reads / writes the pinned pool directly, one
  launch, no host computation). `mode` None: the env var HISPARSE_JAX_HOST_COPY. Both
  the tier moves (TransferEngine) and HiSparse's in-step loads follow it; where the two
  kinds are one memory (CPU) neither applies (`copy_block_loop`)."""
  mode = os.environ.get(HOST_COPY_ENV, "xla") if mode is None else mode
  if mode not in HOST_COPIES:
    raise ValueError(f"{HOST_COPY_ENV} must be 'xla' or 'kernel', got {mode!r}")
  return mode


def copy_block_loop(src_arrays, dst_arrays, src_ids, dst_ids, count):
  """dst_arrays[j][dst_ids[i]] := src_arrays[j][src_ids[i]] for i < `count` (traced), one
  block of every array per iteration, in place in the (donated) destination: a loop of
  `count` block copies, so nothing past the real ids is read or written. Sources and
  destinations are distinct arrays (traced inside a jit; all of one memory kind)."""

  def body(i, arrays):
    return tuple(
        lax.dynamic_update_slice_in_dim(d, lax.dynamic_slice_in_dim(s, src_ids[i], 1),
                                        dst_ids[i], 0)
        for s, d in zip(src_arrays, arrays))

  return lax.fori_loop(0, count, body, tuple(dst_arrays))


def _gather(array, ids):
  return array[ids]


def _scatter_drop(array, ids, values):
  return array.at[ids].set(values, mode="drop")


def _num_real(dst_ids, num_dst_blocks: int):
  """Real ids of a padded list: padding destinations are out of range (>= the pool)."""
  return jnp.sum(dst_ids < num_dst_blocks, dtype=jnp.int32)


@functools.cache  # one program per pool shape set, shared by engines of a process
def _swap_out_program(num_arrays: int, device_sharding, host_sharding, one_memory: bool,
                      scalar_sharding=None, host_copy: str = "xla"):
  """(device arrays, host arrays [donated], device_ids, host_ids) -> new host arrays."""

  def swap_out(device_arrays, host_arrays, device_ids, host_ids):
    if host_copy == "kernel" and not one_memory:  # the GPU writes the pinned pool
      out = block_copy.copy_blocks(device_arrays, host_arrays, device_ids, host_ids)
      return out, device_ids[0]
    if one_memory:  # block copies, no hop (see the module doc)
      out = copy_block_loop(device_arrays,
                            [jax.device_put(h, device_sharding) for h in host_arrays],
                            device_ids, host_ids,
                            _num_real(host_ids, host_arrays[0].shape[0]))
      return tuple(jax.device_put(a, host_sharding) for a in out), device_ids[0]
    host_ids = jax.device_put(host_ids, ids_sharding(host_sharding))
    out = []
    for device_array, host_array in zip(device_arrays, host_arrays):
      blocks = jax.device_put(device_array[device_ids], host_sharding)
      out.append(on_host(_scatter_drop)(host_array, host_ids, blocks))
    return tuple(out), device_ids[0]  # a small output to wait on, never donated

  shardings = (tuple([host_sharding] * num_arrays), scalar_sharding or device_sharding)
  return jax.jit(swap_out, donate_argnums=(1,), out_shardings=shardings)


def gather_to_device(host_arrays, host_ids, *, device_sharding, host_sharding):
  """Blocks `host_ids` of each host array, as device arrays (traced inside a jit): the
  gather runs on the host (compute_on("device_host")) and only its result crosses to
  the device kind. The host -> device mechanism of swap-ins and HiSparse loads where the
  two kinds are different memories (else: `copy_block_loop`)."""
  host_ids = jax.device_put(host_ids, ids_sharding(host_sharding))
  out = []
  for host_array in host_arrays:
    # (pinned to the host kind again: jax 0.11.2 on a GPU rejected this gather inside the
    # HiSparse step's lax.switch, its pool operand typed device memory beside host ids;
    # a no-op where the operand is host-typed, as on jax 0.10.2)
    host_array = jax.device_put(host_array, host_sharding)
    blocks = on_host(_gather)(host_array, host_ids)
    out.append(jax.device_put(blocks, device_sharding))
  return tuple(out)


@functools.cache
def gather_program(num_arrays: int, device_sharding, host_sharding):
  """(host arrays, host_ids) -> gather_to_device's device arrays, as a jitted program
  (a nested call keeps the host computation out of an enclosing switch's closure)."""

  def gather(host_arrays, host_ids):
    return gather_to_device(host_arrays, host_ids, device_sharding=device_sharding,
                            host_sharding=host_sharding)

  return jax.jit(gather, out_shardings=tuple([device_sharding] * num_arrays))


@functools.cache
def _swap_in_program(num_arrays: int, device_sharding, host_sharding, one_memory: bool,
                     scalar_sharding=None, host_copy: str = "xla"):
  """(host arrays, device arrays [donated], host_ids, device_ids) -> new device arrays."""

  def swap_in(host_arrays, device_arrays, host_ids, device_ids):
    if host_copy == "kernel" and not one_memory:  # the GPU reads the pinned pool
      out = block_copy.copy_blocks(host_arrays, device_arrays, host_ids, device_ids)
      return out, device_ids[0]
    if one_memory:  # block copies, no hop (see the module doc)
      out = copy_block_loop([jax.device_put(h, device_sharding) for h in host_arrays],
                            device_arrays, host_ids, device_ids,
                            _num_real(device_ids, device_arrays[0].shape[0]))
      return out, device_ids[0]
    blocks = gather_to_device(host_arrays, host_ids, device_sharding=device_sharding,
                              host_sharding=host_sharding)
    out = tuple(d.at[device_ids].set(b, mode="drop") for d, b in zip(device_arrays, blocks))
    return out, device_ids[0]

  shardings = (tuple([device_sharding] * num_arrays), scalar_sharding or device_sharding)
  return jax.jit(swap_in, donate_argnums=(1,), out_shardings=shardings)


def register_transfer_metrics(registry: m.MetricsRegistry):
  """The transfer metrics, labelled by direction (h2d, d2h)."""
  labels = ("direction",)
  return (
      registry.counter(m.TRANSFERS_TOTAL, "Batched block transfer calls.", labels),
      registry.counter(m.TRANSFER_BLOCKS_TOTAL, "KV blocks moved between tiers.", labels),
      registry.counter(m.TRANSFER_BYTES_TOTAL, "KV bytes moved between tiers.", labels),
      registry.histogram(m.TRANSFER_SECONDS,
                         "Seconds from dispatch of a transfer to its observed completion.",
                         labels),
  )


class TransferEngine:
  """Moves whole blocks between a device pool and a host pool of the same spec.

  Invariants: the pools' arrays are only replaced by the arrays a transfer returns
  (donated, same buffers); destination ids of one call are distinct and in range and
  source ids are usable ids (never a null block); each call is one jitted
  program; `metrics` count real (unpadded) blocks, and bytes = blocks x
  `spec.bytes_per_block`.
  """

  def __init__(self, device_pool: KVPool, host_pool: KVPool,
               metrics: m.MetricsRegistry | None = None, min_bucket: int = 8,
               one_memory: bool | None = None, host_copy: str | None = None):
    """one_memory: None: as the devices are (`hop_free`); host_copy: how blocks cross
    where they are not one memory (`host_copy_mode`; None: the env var)."""
    if device_pool.memory_kind != DEVICE or host_pool.memory_kind != PINNED_HOST:
      raise ValueError("TransferEngine needs a device pool and a pinned_host pool, got "
                       f"{device_pool.memory_kind} and {host_pool.memory_kind}")
    if device_pool.spec != host_pool.spec or device_pool.device != host_pool.device:
      raise ValueError("device and host pools must share one KVCacheSpec and one device")
    if min_bucket <= 0 or min_bucket & (min_bucket - 1):
      raise ValueError(f"min_bucket must be a power of two, got {min_bucket}")
    self.device_pool = device_pool
    self.host_pool = host_pool
    self.min_bucket = min_bucket
    self.metrics = metrics if metrics is not None else m.MetricsRegistry()
    self._transfers, self._blocks, self._bytes, self._seconds = register_transfer_metrics(
        self.metrics)
    device_sharding = make_single_device_sharding(device_pool.device, memory_kind=DEVICE)
    scalar_sharding = None
    if device_pool.mesh is not None:  # tensor parallel: pools split by KV head
      device_sharding, scalar_sharding = device_pool.sharding, device_pool.replicated
    # Every array of a pool moves (K, V, and an int8 cache's scales: KVPool.arrays).
    num_arrays = len(device_pool.arrays())
    # One memory (CPU): block-copy loops without a hop; else host gather + crossing.
    self.one_memory = hop_free(device_sharding) if one_memory is None else one_memory
    self.host_copy = host_copy_mode(host_copy)
    self._swap_out = _swap_out_program(num_arrays, device_sharding, host_pool.sharding,
                                       self.one_memory, scalar_sharding, self.host_copy)
    self._swap_in = _swap_in_program(num_arrays, device_sharding, host_pool.sharding,
                                     self.one_memory, scalar_sharding, self.host_copy)
    self._pending: list[tuple[str, float, jax.Array]] = []
    self.buckets_used: set[tuple[str, int]] = set()  # (direction, padded length)

  def swap_out(self, device_ids, host_ids) -> None:
    """Copies device blocks `device_ids[i]` to host blocks `host_ids[i]` (all layers)."""
    device_ids, host_ids = self._check(device_ids, self.device_pool, host_ids,
                                       self.host_pool)
    if len(device_ids):
      self._dispatch(m.DIRECTION_D2H, device_ids, host_ids)

  def swap_in(self, host_ids, device_ids) -> None:
    """Copies host blocks `host_ids[i]` to device blocks `device_ids[i]` (all layers)."""
    host_ids, device_ids = self._check(host_ids, self.host_pool, device_ids,
                                       self.device_pool)
    if len(host_ids):
      self._dispatch(m.DIRECTION_H2D, host_ids, device_ids)

  def _check(self, src_ids, src_pool: KVPool, dst_ids, dst_pool: KVPool):
    src = np.asarray(src_ids)
    dst = np.asarray(dst_ids)
    for ids, pool in ((src, src_pool), (dst, dst_pool)):
      if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{pool.memory_kind} block ids must be a 1-D integer array, "
                         f"got {ids.dtype}{list(ids.shape)}")
      bad = ids[(ids <= NULL_BLOCK_ID) | (ids >= pool.num_blocks)]
      if bad.size:
        raise ValueError(f"{pool.memory_kind} block ids must be in "
                         f"[{NULL_BLOCK_ID + 1}, {pool.num_blocks}), got {bad.tolist()}")
    if src.shape != dst.shape:
      raise ValueError(f"source and destination id lists differ in length: "
                       f"{src.size} != {dst.size}")
    if np.unique(dst).size != dst.size:
      raise ValueError(f"destination {dst_pool.memory_kind} block ids repeat: {dst.tolist()}")
    return src.astype(np.int32), dst.astype(np.int32)

  def _dispatch(self, direction: str, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    num_blocks = len(src_ids)
    padded = bucket_size(num_blocks, self.min_bucket)
    self.buckets_used.add((direction, padded))
    src = np.zeros(padded, np.int32)  # padding reads block 0 ...
    src[:num_blocks] = src_ids
    if direction == m.DIRECTION_D2H:
      src_pool, dst_pool, program = self.device_pool, self.host_pool, self._swap_out
    else:
      src_pool, dst_pool, program = self.host_pool, self.device_pool, self._swap_in
    dst = np.full(padded, dst_pool.num_blocks, np.int32)  # ... and writes nowhere
    dst[:num_blocks] = dst_ids
    start = time.perf_counter()
    new_arrays, done = program(src_pool.arrays(), dst_pool.arrays(), src, dst)
    dst_pool.set_arrays(new_arrays)
    self._pending.append((direction, start, done))
    self._transfers.inc(direction=direction)
    self._blocks.inc(num_blocks, direction=direction)
    self._bytes.inc(num_blocks * src_pool.spec.bytes_per_block, direction=direction)

  def lowered_programs(self, max_blocks: int) -> list[jax.stages.Lowered]:
    """The swap-out and swap-in programs of every id bucket up to the one of `max_blocks`
    ids, lowered from the pools' types: what a server's warm-up compiles
    (engine/warmup.py). Nothing moves and no metric counts."""
    out = []
    for n in warm_buckets(max_blocks, self.min_bucket):
      ids = np.zeros(n, np.int32)
      out.append(self._swap_out.lower(self.device_pool.arrays(), self.host_pool.arrays(),
                                      ids, ids))
      out.append(self._swap_in.lower(self.host_pool.arrays(), self.device_pool.arrays(),
                                     ids, ids))
    return out

  @property
  def num_pending(self) -> int:
    """Transfers dispatched whose completion has not been observed yet."""
    return len(self._pending)

  def poll(self) -> int:
    """Records finished transfers without blocking; returns how many are still pending."""
    still = []
    for direction, start, done in self._pending:
      if done.is_ready():
        self._seconds.observe(time.perf_counter() - start, direction=direction)
      else:
        still.append((direction, start, done))
    self._pending = still
    return len(still)

  def wait(self) -> None:
    """Blocks until every dispatched transfer has finished, and records its latency."""
    for direction, start, done in self._pending:
      done.block_until_ready()
      self._seconds.observe(time.perf_counter() - start, direction=direction)
    self._pending = []

"""TierConnector: the engine's third KV tier (local disk, a Redis-protocol store).

The device and pinned_host pools are the engine's first two tiers; a `KVTier`
(kv_cache/tiers) per configured backend is the third. This module decides what crosses
between the host pool and those tiers; the tiers do the I/O on their worker threads.

    waiting request, prefix misses in device and host       (Scheduler._schedule_waiting)
      -> start_load: chain keys, exists() on each tier, the gate (load vs recompute),
         host blocks taken, submit_load; the request waits in `Scheduler.loading`
    engine.step() -> poll(): finished loads; their verified blocks become CACHED host
         blocks under the engine's prefix hashes; the request goes back to the waiting
         queue, where admission finds them as host prefix hits (swap-in to the device)
    first token of a request (its prompt's KV computed)       (Engine._append_token)
      -> on_prefilled: host copies of its full prompt blocks (d2h of those not on the host
         yet), then submit_store (write_through) or nothing until the host pool evicts
         them (write_back: `on_host_evict` keys, stored before the block is reused)

The gate: a load of n blocks is issued only when it is expected to beat recomputing
them: n x block_bytes / the tier's measured load bandwidth (EWMA over its loads) <
n x block_size x the engine's measured prefill seconds per token (EWMA over prefill
steps). Before either is measured a load is allowed (its own time is the measurement).

Faults never reach requests: a tier that cannot open at start is logged on one line,
counted (`failures{reason="open"}`) and left out; a failed or partial load serves its
good prefix (verified by checksum, namespace and key) and the rest is recomputed; a
failed store is counted. Nothing read from a tier reaches attention unverified.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Sequence

import numpy as np
from absl import logging

from hisparse_jax.kv_cache.tiers import payload
from hisparse_jax.kv_cache.tiers.base import TierError
from hisparse_jax.kv_cache.tiers.keys import Namespace, chain_keys
from hisparse_jax.kv_cache.tiers.pool_io import HostPoolIO
from hisparse_jax.kv_cache.tiers.tier import KVTier
from hisparse_jax.observability import metrics as m

WRITE_POLICIES = ("write_through", "write_back")
_EWMA_ALPHA = 0.3
# A prefill step counts towards the per-token prefill time only with at least this many
# prompt tokens, or half the step's token budget when that is smaller: a recompute runs
# in full chunks, and a short step's fixed costs would make its per-token time several
# times a full chunk's (measured: the 88-token tail of a loaded 600-token prompt on the
# embedded model let a load slower than recomputing through the gate).
_MIN_PREFILL_TOKENS = 256


@dataclasses.dataclass
class _Load:
  request: object  # engine.request.Request
  tier: int
  host_ids: list[int]
  hashes: list  # the engine's prefix hashes of the loaded blocks
  start: float


@dataclasses.dataclass(frozen=True)
class ThirdTierCapacity:
  """One third-tier capacity line: what the backend holds and may hold."""

  kind: str  # "disk" | "remote"
  where: str  # "path=/x" | "url=redis://host:port/0"
  block_size: int
  block_nbytes: int  # payload bytes of one block
  stored_nbytes: int  # bytes one block takes in the tier (payload + header + checksum)
  capacity_bytes: int | None  # None: bounded by the server
  used_bytes: int
  used_blocks: int

  @property
  def num_blocks(self) -> int | None:
    return None if self.capacity_bytes is None else self.capacity_bytes // self.stored_nbytes

  @property
  def num_tokens(self) -> int | None:
    n = self.num_blocks
    return None if n is None else n * self.block_size

  def log_line(self) -> str:
    if self.capacity_bytes is None:
      cap = "bounded by the server (no maxmemory)"
    else:
      cap = (f"{self.capacity_bytes / 2**30:.2f} GiB = {self.num_blocks:,} blocks x "
             f"{self.block_size} tokens = {self.num_tokens:,} tokens")
    return (f"KV cache capacity [tier={self.kind} {self.where}]: {cap}; "
            f"{self.stored_nbytes:,} bytes per stored block ({self.block_nbytes:,} payload); "
            f"used {self.used_bytes:,} bytes = {self.used_blocks:,} blocks = "
            f"{self.used_blocks * self.block_size:,} tokens")


@dataclasses.dataclass(frozen=True)
class FailedTier:
  """A configured tier that did not open: its capacity line says so."""

  kind: str
  where: str
  error: str
  num_tokens = None

  def log_line(self) -> str:
    return (f"KV cache capacity [tier={self.kind} {self.where}]: unavailable, the engine "
            f"recomputes instead ({self.error})")


def model_identity(name: str, model, samples_per_array: int = 4096) -> str:
  """The model part of a tier namespace: the checkpoint's name and a SHA-256 over a
  strided sample of every weight array (the same checkpoint gives the same identity in
  every process and on every host; another checkpoint, or the same one at another
  dtype, a different one)."""
  import hashlib
  import os

  import jax
  from flax import nnx

  h = hashlib.sha256()
  leaves = jax.tree.leaves(nnx.state(model)) if isinstance(model, nnx.Module) else \
      jax.tree.leaves(model)
  for leaf in leaves:
    a = np.asarray(leaf).reshape(-1)
    h.update(f"{a.dtype}{a.size};".encode())
    h.update(np.ascontiguousarray(a[::max(1, a.size // samples_per_array)]).tobytes())
  base = os.path.basename(os.path.normpath(name)) if name else "model"
  return f"{base}@{h.hexdigest()[:16]}"


def namespace_for(model_name: str, dtype: str, block_size: int, layout: str,
                  block_nbytes: int) -> Namespace:
  return Namespace(model=model_name, dtype=dtype, block_size=block_size, kv_layout=layout,
                   shard="tp0of1", block_nbytes=block_nbytes)


def open_engine_tiers(config, mesh, host_pool, model_config, model):
  """(tiers, failures at open, namespace, capacity lines) of an engine's configured third
  tiers (`config`: its EngineConfig); one that cannot open is logged on one line and left
  out (the engine serves without it, recomputing)."""
  if mesh is not None:
    raise ValueError(f"--disk_cache_dir / --remote_cache_url: the third KV tier does not "
                     f"support --tensor_parallel_size={config.tensor_parallel_size} yet; use 1")
  block_io = HostPoolIO(host_pool)
  name = (model_config.name_or_path if getattr(model_config, "name_or_path", None)
          else (config.model or "hisparse-tiny"))
  namespace = namespace_for(model_identity(name, model), config.dtype, config.block_size,
                            block_io.layout(), block_io.block_nbytes)
  tiers, failed = open_tiers(config, host_pool, namespace, block_io)
  lines = [*TierConnector.capacity_of(tiers, namespace), *failed]
  return tiers, failed, namespace, lines


def open_tiers(config, host_pool, namespace: Namespace, block_io) -> tuple[list[KVTier],
                                                                          list[tuple[str, str]]]:
  """The configured tiers (disk first), and those that failed to open (`FailedTier`, each
  logged on one line; the engine runs without them)."""
  from hisparse_jax.kv_cache.tiers import disk
  from hisparse_jax.kv_cache.tiers.remote import RemoteBackend, redact_url

  tiers, failed = [], []
  wanted = []
  if config.disk_cache_dir:
    wanted.append(("disk", f"path={os.path.abspath(config.disk_cache_dir)}",
                   lambda: disk.DiskBackend(config.disk_cache_dir,
                                            int(config.disk_cache_gib * 2**30), namespace,
                                            min_free_bytes=disk.DEFAULT_MIN_FREE_BYTES)))
  if config.remote_cache_url:
    wanted.append(("remote", f"url={redact_url(config.remote_cache_url)}",
                   lambda: RemoteBackend(config.remote_cache_url, namespace,
                                         ttl_s=config.remote_cache_ttl_s)))
  for kind, where, make in wanted:
    try:
      backend = make()
    except TierError as e:
      logging.warning("KV tier %s not used (the engine recomputes instead): %s", kind, e)
      failed.append(FailedTier(kind, where, str(e)))
      continue
    tiers.append(KVTier(backend, block_io))
  return tiers, failed


class TierConnector:
  """The third tier(s) of one engine: loads on prefix misses, stores of prompt blocks.

  Invariants: every host block it holds (a load in flight) is counted in
  `BlockManager.tier_holds` until the load finished; a request is in `Scheduler.loading`
  exactly while one of its loads is in flight; a host block gets a prefix hash from a
  load only for the verified prefix of that load's chain.
  """

  def __init__(self, tiers: Sequence[KVTier], block_manager, transfer, runner,
               namespace: Namespace, *, write_policy: str = "write_through",
               failed_at_open: Sequence[FailedTier] = (),
               registry: m.MetricsRegistry | None = None,
               max_num_batched_tokens: int = 2048):
    if write_policy not in WRITE_POLICIES:
      raise ValueError(f"kv_tier_write_policy must be one of {WRITE_POLICIES}, got "
                       f"{write_policy!r}")
    self.tiers = list(tiers)
    self.bm = block_manager
    self.transfer = transfer
    self.runner = runner
    self.namespace = namespace
    self.block_size = namespace.block_size
    self.block_nbytes = namespace.block_nbytes
    self.write_policy = write_policy
    self.failed_at_open = list(failed_at_open)
    self._loads: dict[tuple[int, int], _Load] = {}
    # The engine's prefix hash -> the tier key of the same block (write-back stores and
    # host evictions need it); bounded, oldest dropped first.
    self._keys: collections.OrderedDict = collections.OrderedDict()
    self._max_keys = 4 * (block_manager.device_pool.num_blocks
                          + block_manager.host_pool.num_blocks)
    self._evicted: list[tuple[int, bytes]] = []  # write_back: (host id, key) to store
    self.prefill_s_per_token: float | None = None
    self._min_prefill_tokens = max(1, min(_MIN_PREFILL_TOKENS, max_num_batched_tokens // 2))
    self.counts = collections.Counter()  # by "<tier>/<what>"
    if write_policy == "write_back":
      block_manager.host_pool.on_evict = self._on_host_evict
    self._registry = registry
    self._exported: dict = {}
    if registry is not None:
      self._register(registry)

  @property
  def kinds(self) -> list[str]:
    return [t.backend.kind for t in self.tiers]

  # --- keys ---------------------------------------------------------------------

  def _chain(self, request, tokens: Sequence[int], hashes: list, num_blocks: int) -> list[bytes]:
    """Tier keys of the request's first `num_blocks` full blocks (cached on it)."""
    keys = request.tier_keys
    if len(keys) < num_blocks:
      keys = request.tier_keys = chain_keys(tokens[:num_blocks * self.block_size],
                                            self.block_size, self.namespace,
                                            request.cache_salt)
    for h, k in zip(hashes[:num_blocks], keys):
      self._keys[h] = k
      self._keys.move_to_end(h)
    while len(self._keys) > self._max_keys:
      self._keys.popitem(last=False)
    return keys[:num_blocks]

  # --- loads --------------------------------------------------------------------

  def start_load(self, request, tokens: Sequence[int], hashes: list) -> bool:
    """Loads the blocks of `request`'s prompt that the device and host pools miss and a
    tier holds, if the gate allows; True when a load was submitted (the request waits)."""
    if not self.tiers:
      return False
    bs = self.block_size
    max_blocks = (len(tokens) - 1) // bs  # the last token is always computed
    hits = self.bm.prefix_cache.hits(hashes, len(tokens), count=False)
    first = len(hits)
    if first >= max_blocks:
      return False
    keys = self._chain(request, tokens, hashes, max_blocks)
    best, best_n = None, first
    for i, tier in enumerate(self.tiers):
      n = tier.exists(keys)
      kind = tier.backend.kind
      self.counts[f"{kind}/lookup_tokens"] += (max_blocks - first) * bs
      self.counts[f"{kind}/hit_tokens"] += max(0, n - first) * bs
      if n > best_n:
        best, best_n = i, n
    if best is None:
      return False
    tier = self.tiers[best]
    kind = tier.backend.kind
    num = best_n - first
    if not self._gate(tier, num):
      self.counts[f"{kind}/gate_refusals"] += 1
      return False
    host_ids = self.bm.take_host_blocks(num)
    if not host_ids:
      self.counts[f"{kind}/no_host_blocks"] += 1
      return False
    num = len(host_ids)
    job = tier.submit_load(keys[first:first + num], host_ids)
    self._loads[(best, job)] = _Load(request, best, host_ids, list(hashes[first:first + num]),
                                     time.perf_counter())
    request.num_tier_loads += 1
    return True

  def expected_seconds(self, tier: KVTier, num_blocks: int) -> tuple[float | None, float | None]:
    """(load, recompute) seconds expected for `num_blocks` blocks (None: not measured)."""
    rate = tier.stats()["load_bytes_per_s"]
    load = None if not rate else num_blocks * self.block_nbytes / rate
    per_token = self.prefill_s_per_token
    recompute = None if per_token is None else num_blocks * self.block_size * per_token
    return load, recompute

  def _gate(self, tier: KVTier, num_blocks: int) -> bool:
    load, recompute = self.expected_seconds(tier, num_blocks)
    if load is None or recompute is None:
      return True
    if load < recompute:
      return True
    logging.log_every_n_seconds(
        logging.INFO, "KV tier %s: load of %d blocks refused: expected %.3f s, recomputing "
        "them %.3f s", 30, tier.backend.kind, num_blocks, load, recompute)
    return False

  def observe_prefill(self, num_prefill_tokens: int, seconds: float) -> None:
    """A step's prefill tokens and its time: the per-token prefill time the gate uses."""
    if num_prefill_tokens < self._min_prefill_tokens or seconds <= 0:
      return
    x = seconds / num_prefill_tokens
    prev = self.prefill_s_per_token
    self.prefill_s_per_token = x if prev is None else (1 - _EWMA_ALPHA) * prev + _EWMA_ALPHA * x

  def poll(self) -> list:
    """Collects finished jobs; returns the requests whose loads finished (to requeue)."""
    self.store_evicted()
    ready = []
    for i, tier in enumerate(self.tiers):
      kind = tier.backend.kind
      for job in tier.finished():
        if job.kind == "store":
          continue
        load = self._loads.pop((i, job.job_id))
        num = job.num_succeeded
        self.bm.release_host_blocks(load.host_ids, load.hashes[:num])
        self.counts[f"{kind}/loaded_blocks"] += num
        if num < len(load.host_ids):
          self.counts[f"{kind}/partial_loads"] += 1
        request = load.request
        request.num_tier_loads -= 1
        request.num_tier_loaded_blocks += num
        if not request.is_finished and request.num_tier_loads == 0:
          ready.append(request)
    return ready

  @property
  def num_loading(self) -> int:
    return len(self._loads)

  def wait(self, timeout_s: float) -> None:
    """Blocks until a tier finished a job or `timeout_s` passed (nothing else to run)."""
    deadline = time.perf_counter() + timeout_s
    while self.tiers:
      left = deadline - time.perf_counter()
      if left <= 0:
        return
      if any(t.wait(0 if i else min(left, 0.01)) for i, t in enumerate(self.tiers)):
        return

  # --- stores -------------------------------------------------------------------

  def on_prefilled(self, request, hashes: list) -> None:
    """The request's prompt KV is computed: host copies of its full prompt blocks, then
    stores of those no tier holds (write_through; write_back: at host eviction)."""
    if not self.tiers:
      return
    tokens = request.prompt_token_ids
    num = min(len(tokens) // self.block_size, len(hashes))
    if num == 0:
      return
    keys = self._chain(request, tokens, hashes, num)
    todo = [j for j in range(num) if not all(t.has(keys[j]) for t in self.tiers)]
    if not todo:
      return
    host_ids, device_ids, copy_host_ids, found = self.bm.host_copies([hashes[j] for j in todo])
    self.store_evicted()  # (taking host blocks may have evicted some: read them first)
    if len(device_ids):
      self.transfer.swap_out(device_ids, copy_host_ids)
      self.runner.copy_bounds_to_host_index(device_ids, copy_host_ids)
    try:
      if self.write_policy == "write_through" and host_ids:
        sel = [keys[todo[j]] for j in found]
        for tier in self.tiers:
          tier.submit_store(sel, host_ids)
    finally:
      self.bm.release_host_blocks(host_ids, None)

  def _on_host_evict(self, block_id: int, block_hash) -> None:
    key = self._keys.get(block_hash)
    if key is not None:
      self._evicted.append((block_id, key))

  def store_evicted(self) -> None:
    """write_back: stores the host blocks evicted since the last call (before anything
    overwrites them: every host write is dispatched after this runs)."""
    if not self._evicted:
      return
    evicted, self._evicted = self._evicted, []
    ids = [b for b, _ in evicted]
    keys = [k for _, k in evicted]
    for tier in self.tiers:
      todo = [j for j, k in enumerate(keys) if not tier.has(k)]
      if todo:
        tier.submit_store([keys[j] for j in todo], [ids[j] for j in todo])

  def flush(self) -> None:
    """write_back: stores every cached host block a tier lacks (at close)."""
    if self.write_policy != "write_back":
      return
    pool = self.bm.host_pool
    for block_id in pool.cached_block_ids_lru():
      key = self._keys.get(pool.block_hash(block_id))
      if key is not None:
        self._evicted.append((block_id, key))
    self.store_evicted()

  def close(self) -> None:
    self.flush()
    for tier in self.tiers:
      tier.close()
    for tier in self.tiers:  # cancelled loads give their host blocks back
      for job in tier.finished():
        load = self._loads.pop((self.tiers.index(tier), job.job_id), None)
        if load is not None:
          self.bm.release_host_blocks(load.host_ids, None)

  # --- capacity and metrics -----------------------------------------------------

  def capacity(self) -> list[ThirdTierCapacity]:
    return self.capacity_of(self.tiers, self.namespace)

  @staticmethod
  def capacity_of(tiers: Sequence[KVTier], namespace: Namespace) -> list[ThirdTierCapacity]:
    """One capacity line per tier, from what each backend holds now (a remote store's
    used bytes: the blocks of this namespace on the server, counted at open)."""
    out = []
    for tier in tiers:
      b = tier.backend
      usage = b.usage()
      where = f"path={b.path}" if b.kind == "disk" else f"url={b.url}"
      out.append(ThirdTierCapacity(
          b.kind, where, namespace.block_size, namespace.block_nbytes,
          payload.stored_nbytes(namespace.block_nbytes), usage.capacity_bytes,
          usage.used_bytes, usage.used_blocks))
    return out

  def _register(self, r: m.MetricsRegistry) -> None:
    t = ("tier",)
    self._g_used_bytes = r.gauge(m.TIER_USED_BYTES, "Bytes stored in each third KV tier.", t)
    self._g_used_tokens = r.gauge(m.TIER_USED_TOKENS, "KV tokens stored in each third tier.", t)
    self._g_capacity = r.gauge(m.TIER_CAPACITY_BYTES,
                               "Configured bytes of each third tier (0: server-bounded).", t)
    self._g_pending = r.gauge(m.TIER_PENDING_STORES, "Blocks queued for a store.", t)
    self._g_loading = r.gauge(m.TIER_LOADING_REQUESTS, "Requests waiting on a tier load.")
    self._c = {
      "lookup_tokens": r.counter(m.TIER_LOOKUP_TOKENS, "Prompt tokens looked up in the tier "
                                 "after device and host prefix misses.", t),
      "hit_tokens": r.counter(m.TIER_HIT_TOKENS, "Of those, tokens the tier held.", t),
      "loaded_blocks": r.counter(m.TIER_LOADED_BLOCKS, "Blocks loaded into the host pool.", t),
      "gate_refusals": r.counter(m.TIER_GATE_REFUSALS, "Loads not issued: expected slower "
                                 "than recomputing.", t),
      "load_bytes": r.counter(m.TIER_LOAD_BYTES, "Payload bytes loaded.", t),
      "load_seconds": r.counter(m.TIER_LOAD_SECONDS, "Seconds of load jobs.", t),
      "store_bytes": r.counter(m.TIER_STORE_BYTES, "Payload bytes stored.", t),
      "store_seconds": r.counter(m.TIER_STORE_SECONDS, "Seconds of store jobs.", t),
      "evictions": r.counter(m.TIER_EVICTIONS, "Blocks evicted by the tier's cap.", t),
    }
    self._c_fail = r.counter(m.TIER_FAILURES, "Blocks (or opens) that failed, by reason.",
                             ("tier", "reason"))
    for failed in self.failed_at_open:
      self._c_fail.inc(1, tier=failed.kind, reason="open")
    for tier in self.tiers:
      kind = tier.backend.kind
      for c in self._c.values():
        c.inc(0, tier=kind)

  def export(self) -> None:
    """Brings the tier metrics up to date (counters by their increments)."""
    if self._registry is None:
      return
    self._g_loading.set(self.num_loading)
    for tier in self.tiers:
      kind = tier.backend.kind
      s = tier.stats()
      self._g_used_bytes.set(s["used_bytes"], tier=kind)
      self._g_used_tokens.set(s["used_blocks"] * self.block_size, tier=kind)
      self._g_capacity.set(s["capacity_bytes"] or 0, tier=kind)
      self._g_pending.set(s["pending_stores"], tier=kind)
      values = {name: s[name] for name in ("load_bytes", "load_seconds", "store_bytes",
                                           "store_seconds", "evictions")}
      for name in ("lookup_tokens", "hit_tokens", "loaded_blocks", "gate_refusals"):
        values[name] = self.counts[f"{kind}/{name}"]
      for name, value in values.items():
        self._inc_to(self._c[name], (kind, name), value, tier=kind)
      for reason, value in s["failures"].items():
        self._inc_to(self._c_fail, (kind, "fail", reason), value, tier=kind, reason=reason)

  def _inc_to(self, counter, key, value, **labels) -> None:
    delta = value - self._exported.get(key, 0)
    if delta > 0:
      counter.inc(delta, **labels)
      self._exported[key] = value

  def stats(self) -> dict:
    """Per tier: KVTier.stats() plus the engine's lookups, hits and gate refusals."""
    out = {}
    for tier in self.tiers:
      kind = tier.backend.kind
      s = tier.stats()
      for name in ("lookup_tokens", "hit_tokens", "loaded_blocks", "gate_refusals",
                   "partial_loads", "no_host_blocks"):
        s[name] = self.counts[f"{kind}/{name}"]
      out[kind] = s
    for failed in self.failed_at_open:
      out.setdefault(failed.kind, {"open_error": failed.error})
    return out


def hashes_of(tokens: Sequence[int], block_size: int, have: list,
              cache_salt: str | None = None) -> list:
  """Extends `have` (a request's prefix hashes, under its `cache_salt`) to every full
  block of `tokens`."""
  from hisparse_jax.kv_cache import kv_hash

  full = len(tokens) // block_size
  if len(have) < full:
    start = len(have)
    have.extend(kv_hash.hash_full_blocks(list(tokens[start * block_size:full * block_size]),
                                         block_size, None, have[-1] if have else None,
                                         cache_salt=cache_salt))
  return have[:full]


__all__ = ["WRITE_POLICIES", "FailedTier", "ThirdTierCapacity", "TierConnector", "hashes_of",
           "model_identity", "namespace_for", "open_tiers"]

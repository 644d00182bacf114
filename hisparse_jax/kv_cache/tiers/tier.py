"""KVTier: one backend behind a worker thread, the engine's whole view of the third tier.

    engine thread                         worker thread (one, FIFO)
    -------------                         -------------------------
    submit_store(keys, host_ids)
      BlockIO.read(host_ids)  (snapshot) -> encode, Backend.put_many
    submit_load(keys, host_ids)          -> Backend.get_many, decode + verify into staging
    finished()
      BlockIO.write(loaded rows)        <-  completed jobs (stores and loads)
    lookup(key), exists(keys), stats()     (memory; exists may make one round trip)

Invariants:
  * BlockIO is touched only on the engine's thread: a load's bytes reach the host pool
    only inside `finished()`, after their checksum verified, and only for the longest
    good prefix of the load's chain (the rows of a later key are never written, even if
    that key was fine: a prefix cache cannot use blocks past a hole).
  * One worker runs jobs in submission order, so a load submitted after a store of the
    same key runs after it: `exists()` counts keys with a pending store as stored.
  * No backend error escapes submit_*/finished/lookup/exists: each becomes a failure
    counted by reason, one rate-limited log line, and a miss (a failed store is simply
    not stored). Caller bugs (mismatched lengths, a bad BlockIO) still raise.
  * A key is in flight from submit until the worker finished it; a store skips keys
    already stored or in flight, and refuses (reason "backlog") a store whose snapshot
    would take pending bytes past `max_pending_bytes`, so a slow backend cannot grow
    the engine's memory without bound.

`close()` finishes the stores already submitted (up to `close_timeout_s`, then cancels the
rest) and cancels pending loads (their rows would land in a pool being torn down); the
cancelled jobs are reported by the next `finished()` as failed with reason "cancelled".
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time

import numpy as np
from absl import logging

from hisparse_jax.kv_cache.tiers import payload
from hisparse_jax.kv_cache.tiers.base import (
  Backend,
  BackendError,
  BlockIO,
  LookupResult,
  RateLimitedLog,
  TierError,
  TierJob,
)

_EWMA_ALPHA = 0.3  # weight of the newest job in the bandwidth estimates


@dataclasses.dataclass
class _Work:
  job: TierJob
  data: np.ndarray | None = None  # store: the snapshot [n, block_nbytes]; load: staging


def _reason(e: BaseException) -> str:
  if isinstance(e, BackendError):
    return e.reason
  return "io" if isinstance(e, OSError) else "error"


class KVTier:
  """The third tier over one `Backend`: non-blocking lookups, background stores/loads."""

  def __init__(self, backend: Backend, block_io: BlockIO, *,
               max_pending_bytes: int = 1 << 30, close_timeout_s: float = 5.0,
               log_interval_s: float = 30.0):
    if block_io.block_nbytes != backend.namespace.block_nbytes:
      raise TierError(f"KVTier: the host pool's block_nbytes {block_io.block_nbytes} differs "
                      f"from the namespace's {backend.namespace.block_nbytes}")
    self.backend = backend
    self._io = block_io
    self._block_nbytes = block_io.block_nbytes
    self._digest = bytes.fromhex(backend.namespace.digest())
    self._max_pending_bytes = max_pending_bytes
    self._close_timeout_s = close_timeout_s
    self._log = RateLimitedLog(f"kv tier ({backend.kind})", log_interval_s)

    self._lock = threading.Lock()  # guards everything below
    self._queue: queue.Queue[_Work | None] = queue.Queue()
    self._done: collections.deque[_Work] = collections.deque()
    self._done_event = threading.Event()  # set when the worker finished a job
    self._pending_store: set[bytes] = set()
    self._pending_load: collections.Counter[bytes] = collections.Counter()
    self._pending_store_bytes = 0
    self._next_job_id = 1
    self._closed = False
    self._cancel = False  # close() timed out: the worker cancels what is left
    self._counts = collections.Counter()  # lookups, hits, load_bytes, store_jobs, ...
    self._seconds = collections.Counter()  # load, store
    self._failures = collections.Counter()  # by reason, in keys
    self._bytes_per_s: dict[str, float | None] = {"load": None, "store": None}

    self._worker = threading.Thread(target=self._run, name=f"kv-tier-{backend.kind}",
                                    daemon=True)
    self._worker.start()

  # --- engine thread ---------------------------------------------------------------------

  def describe(self) -> str:
    return self.backend.describe()

  def lookup(self, key: bytes) -> LookupResult:
    """HIT / MISS / IN_FLIGHT from memory only (see the backend for what it knows)."""
    with self._lock:
      self._counts["lookups"] += 1
      if key in self._pending_store or key in self._pending_load:
        self._counts["in_flight"] += 1
        return LookupResult.IN_FLIGHT
    try:
      hit = self.backend.contains(key)
    except Exception as e:  # noqa: BLE001 (never out of lookup)
      self._fail("lookup", _reason(e), 1, str(e))
      return LookupResult.MISS
    if hit:
      with self._lock:
        self._counts["hits"] += 1
      return LookupResult.HIT
    return LookupResult.MISS

  def has(self, key: bytes) -> bool:
    """Whether `key` is stored or being stored, from memory only (not counted as a
    lookup: the engine asks before storing)."""
    with self._lock:
      if key in self._pending_store:
        return True
    try:
      return self.backend.contains(key)
    except Exception:  # noqa: BLE001 (memory only; a backend bug is a miss)
      return False

  def exists(self, keys: list[bytes]) -> int:
    """Length of the longest prefix of the chain `keys` that is stored or being stored."""
    if not keys:
      return 0
    with self._lock:
      self._counts["exists_calls"] += 1
    try:
      stored = self.backend.exists_many(list(keys))
    except Exception as e:  # noqa: BLE001 (never out of exists)
      self._fail("exists", _reason(e), 1, str(e))
      stored = [False] * len(keys)
    num = 0
    with self._lock:
      for key, s in zip(keys, stored):
        if not (s or key in self._pending_store):
          break
        num += 1
    return num

  def submit_store(self, keys: list[bytes], host_ids) -> int:
    """Snapshot rows `host_ids` now (BlockIO.read) and store them under `keys` in the
    background; keys already stored or in flight are skipped. Returns the job id."""
    host_ids = self._check(keys, host_ids)
    with self._lock:
      job_id = self._take_id()
      if self._closed:
        return self._refuse(job_id, "store", keys, host_ids, "closed", "tier is closed")
      seen = set()
      keep = []
      for i, key in enumerate(keys):
        if key in seen or key in self._pending_store or self.backend.contains(key):
          continue
        seen.add(key)
        keep.append(i)
      num_skipped = len(keys) - len(keep)
      nbytes = len(keep) * self._block_nbytes
      sel_keys = [keys[i] for i in keep]
      sel_ids = host_ids[keep]
      if keep and self._pending_store_bytes + nbytes > self._max_pending_bytes:
        return self._refuse(job_id, "store", sel_keys, sel_ids, "backlog",
                            f"{self._pending_store_bytes + nbytes} pending bytes would pass "
                            f"max_pending_bytes={self._max_pending_bytes}", num_skipped)
    data = self._io.read(sel_ids) if keep else np.empty((0, self._block_nbytes), np.uint8)
    if data.dtype != np.uint8 or data.shape != (len(keep), self._block_nbytes):
      raise ValueError(f"BlockIO.read returned {data.dtype}{list(data.shape)}, expected "
                       f"uint8{[len(keep), self._block_nbytes]}")
    job = TierJob(job_id, "store", sel_keys, sel_ids, [False] * len(keep),
                  num_skipped=num_skipped)
    with self._lock:
      self._pending_store.update(sel_keys)
      self._pending_store_bytes += nbytes
    self._queue.put(_Work(job, data))
    return job_id

  def submit_load(self, keys: list[bytes], host_ids) -> int:
    """Read the chain `keys` in the background; `finished()` writes the verified prefix
    into rows `host_ids`. Returns the job id."""
    host_ids = self._check(keys, host_ids)
    with self._lock:
      job_id = self._take_id()
      if self._closed:
        return self._refuse(job_id, "load", list(keys), host_ids, "closed", "tier is closed")
      self._pending_load.update(keys)
    job = TierJob(job_id, "load", list(keys), host_ids, [False] * len(keys))
    self._queue.put(_Work(job))
    return job_id

  def wait(self, timeout_s: float) -> bool:
    """Blocks until a job has finished since the last `finished()` (True) or `timeout_s`
    passed (False): an engine with nothing to run but loads in flight waits here instead
    of spinning (a spinning engine thread starves the worker of the GIL)."""
    if self._done:
      return True
    return self._done_event.wait(timeout_s)

  def finished(self) -> list[TierJob]:
    """Jobs completed since the last call; writes each load's verified rows into the pool."""
    out = []
    self._done_event.clear()
    while True:
      try:
        work = self._done.popleft()
      except IndexError:
        return out
      job = work.job
      num = job.num_succeeded  # a load's successes are a prefix of its chain
      if job.kind == "load" and num:
        self._io.write(job.host_ids[:num], work.data[:num])
      out.append(job)

  def stats(self) -> dict:
    """Counters since construction (bytes are payload bytes; used_* are stored bytes)."""
    usage = self.backend.usage()
    extra = self.backend.extra_stats()
    stored = payload.stored_nbytes(self._block_nbytes)
    with self._lock:
      c, s = self._counts, self._seconds
      return {
        "tier": self.backend.kind,
        "used_bytes": usage.used_bytes,
        "used_blocks": usage.used_blocks,
        "capacity_bytes": usage.capacity_bytes,  # None: unbounded (server)
        "capacity_blocks": (None if usage.capacity_bytes is None
                            else usage.capacity_bytes // stored),
        "lookups": c["lookups"], "hits": c["hits"], "in_flight": c["in_flight"],
        "exists_calls": c["exists_calls"],
        "load_jobs": c["load_jobs"], "load_blocks": c["load_blocks"],
        "load_bytes": c["load_bytes"], "load_seconds": s["load"],
        "store_jobs": c["store_jobs"], "store_blocks": c["store_blocks"],
        "store_bytes": c["store_bytes"], "store_seconds": s["store"],
        "store_skipped": c["store_skipped"],
        "load_bytes_per_s": self._bytes_per_s["load"],  # EWMA over loads; None: none yet
        "store_bytes_per_s": self._bytes_per_s["store"],
        "pending_stores": len(self._pending_store),
        "pending_store_bytes": self._pending_store_bytes,
        "pending_loads": sum(self._pending_load.values()),
        "failures": dict(self._failures),
        "corrupt": c["corrupt"],
        "evictions": usage.evictions,
        **extra,
      }

  def close(self) -> None:
    """Finish submitted stores (up to close_timeout_s), cancel pending loads, release the
    backend. Idempotent."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._queue.put(None)
    self._worker.join(self._close_timeout_s)
    if self._worker.is_alive():
      self._cancel = True
      logging.warning("kv tier (%s): close: worker still busy after %.1f s; cancelling the "
                      "rest", self.backend.kind, self._close_timeout_s)
      self._worker.join(1.0)
    if not self._worker.is_alive():
      self.backend.close()

  def __enter__(self) -> KVTier:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # --- helpers ---------------------------------------------------------------------------

  def _check(self, keys: list[bytes], host_ids) -> np.ndarray:
    host_ids = np.asarray(host_ids, dtype=np.int64).reshape(-1)
    if len(keys) != len(host_ids):
      raise ValueError(f"{len(keys)} keys but {len(host_ids)} host ids")
    return host_ids

  def _take_id(self) -> int:  # under the lock
    job_id = self._next_job_id
    self._next_job_id += 1
    return job_id

  def _refuse(self, job_id, kind, keys, host_ids, reason, message, num_skipped=0) -> int:
    """A job failed at submit (under the lock): reported by the next finished()."""
    job = TierJob(job_id, kind, list(keys), host_ids, [False] * len(keys),
                  error=f"{reason}: {message}", num_skipped=num_skipped)
    self._failures[reason] += len(keys)
    self._done.append(_Work(job))
    self._log.warn(reason, f"{kind} of {len(keys)} blocks refused: {message}")
    return job_id

  def _fail(self, what: str, reason: str, num_keys: int, message: str) -> None:
    with self._lock:
      self._failures[reason] += num_keys
    self._log.warn(reason, f"{what} of {num_keys} blocks failed: {message}")

  # --- worker thread ---------------------------------------------------------------------

  def _run(self) -> None:
    while True:
      work = self._queue.get()
      if work is None:  # close(): submits after it are refused, so nothing follows
        return
      try:
        if self._cancel or (self._closed and work.job.kind == "load"):
          self._cancelled(work)
        elif work.job.kind == "store":
          self._store(work)
        else:
          self._load(work)
      except Exception as e:  # noqa: BLE001 (a bug here must not kill the worker)
        logging.exception("kv tier (%s): job %d failed", self.backend.kind, work.job.job_id)
        work.job.error = work.job.error or f"error: {e}"
        self._release(work.job)
        self._done.append(work)
      self._done_event.set()

  def _release(self, job: TierJob) -> None:
    with self._lock:
      if job.kind == "store":
        self._pending_store.difference_update(job.keys)
        self._pending_store_bytes -= len(job.keys) * self._block_nbytes
      else:
        self._pending_load.subtract(job.keys)
        self._pending_load = +self._pending_load  # drop zero counts

  def _cancelled(self, work: _Work) -> None:
    work.job.error = "cancelled: tier closed"
    with self._lock:
      self._failures["cancelled"] += len(work.job.keys)
    self._release(work.job)
    work.data = None
    self._done.append(work)

  def _store(self, work: _Work) -> None:
    job = work.job
    start = time.perf_counter()
    if job.keys:
      items = [(key, payload.encode(self._digest, key, work.data[i]))
               for i, key in enumerate(job.keys)]
      try:
        reasons = self.backend.put_many(items)
      except Exception as e:  # noqa: BLE001
        reasons = [_reason(e)] * len(job.keys)
        job.error = f"{reasons[0]}: {e}"
      del items
    else:
      reasons = []
    job.seconds = time.perf_counter() - start
    job.success = [r is None for r in reasons]
    job.nbytes = job.num_succeeded * self._block_nbytes
    work.data = None
    failed = collections.Counter(r for r in reasons if r is not None)
    if failed and not job.error:
      job.error = f"{next(iter(failed))}: {sum(failed.values())} of {len(reasons)} blocks"
    self._release(job)
    with self._lock:
      self._counts["store_jobs"] += 1
      self._counts["store_blocks"] += job.num_succeeded
      self._counts["store_bytes"] += job.nbytes
      self._counts["store_skipped"] += job.num_skipped
      self._seconds["store"] += job.seconds
      self._failures.update(failed)
      self._update_rate("store", job)
    if failed:
      self._log.warn(next(iter(failed)), f"store of {sum(failed.values())} blocks failed: "
                     f"{job.error}")
    self._done.append(work)

  def _load(self, work: _Work) -> None:
    job = work.job
    start = time.perf_counter()
    n = len(job.keys)
    staging = np.empty((n, self._block_nbytes), np.uint8)
    failed = collections.Counter()
    num_corrupt = 0
    try:
      blobs = self.backend.get_many(job.keys) if n else []
      batch_failed = False
    except Exception as e:  # noqa: BLE001
      blobs = [None] * n
      failed[_reason(e)] = n
      job.error = f"{_reason(e)}: {e}"
      batch_failed = True
    prefix_ok = True
    for i, (key, blob) in enumerate(zip(job.keys, blobs)):
      good = False
      if blob is None:
        if not batch_failed:
          failed["missing"] += 1
          job.error = job.error or f"missing: key {key.hex()[:16]}"
      else:
        try:
          staging[i] = np.frombuffer(
            payload.decode(blob, self._digest, key, self._block_nbytes), np.uint8)
          good = True
        except payload.CorruptPayload as e:
          num_corrupt += 1
          failed["corrupt"] += 1
          job.error = job.error or f"corrupt: key {key.hex()[:16]}: {e.reason}"
          self._log.warn("corrupt", f"key {key.hex()[:16]} dropped: {e.reason}")
          try:
            self.backend.delete(key)
          except Exception as d:  # noqa: BLE001
            failed[_reason(d)] += 1
      prefix_ok = prefix_ok and good
      job.success[i] = prefix_ok
    job.seconds = time.perf_counter() - start
    job.nbytes = job.num_succeeded * self._block_nbytes
    work.data = staging
    self._release(job)
    with self._lock:
      self._counts["load_jobs"] += 1
      self._counts["load_blocks"] += job.num_succeeded
      self._counts["load_bytes"] += job.nbytes
      self._counts["corrupt"] += num_corrupt
      self._seconds["load"] += job.seconds
      self._failures.update(failed)
      self._update_rate("load", job)
    if failed and not job.error.startswith("corrupt"):  # corrupt keys logged above
      self._log.warn(job.error.split(":")[0], f"load of {n} blocks: {job.error}")
    self._done.append(work)

  def _update_rate(self, kind: str, job: TierJob) -> None:  # under the lock
    if job.nbytes and job.seconds > 0:
      rate = job.nbytes / job.seconds
      old = self._bytes_per_s[kind]
      self._bytes_per_s[kind] = rate if old is None else (
        _EWMA_ALPHA * rate + (1 - _EWMA_ALPHA) * old)

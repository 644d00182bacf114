"""The third tier's interfaces: what the engine supplies (BlockIO), what a backend
implements (Backend), and what a tier reports (LookupResult, TierJob, TierError).

Threads: `BlockIO` is called only on the engine's thread (inside `KVTier.submit_store`
and `KVTier.finished`). A `Backend` is called from the tier's worker thread (put, get,
delete, exists) and from the engine's thread (`contains`, `exists_many`, `usage`), so it
guards its own in-memory state with a lock. `contains` never does I/O.

Errors: a backend raises `BackendError` (or lets an OSError / client error escape) from
its I/O methods; `KVTier` turns every one of them into a counted failure, a rate-limited
log line and a miss. Only construction raises `TierError`, one line naming the flag
(`--disk_cache_dir=...: ...`), which the engine logs before running without the tier.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import threading
import time
from typing import Protocol

import numpy as np
from absl import logging

from hisparse_jax.kv_cache.tiers.keys import Namespace


class TierError(ValueError):
  """A tier cannot be built: one line naming the flag and what is wrong with it."""


class BackendError(Exception):
  """A backend operation failed; `reason` is the failure counter it goes under
  ("io", "disk_full", "connection", "too_large", ...)."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


class LookupResult(enum.Enum):
  HIT = "hit"              # stored: a load now will find it (unless evicted meanwhile)
  MISS = "miss"            # not stored, or not known to be (remote: see RemoteBackend)
  IN_FLIGHT = "in_flight"  # a store or load of this key is pending in the worker


class BlockIO(Protocol):
  """The engine's host pool, as the tier sees it: rows of `block_nbytes` bytes.

  Called only on the engine's thread. `read` returns a copy (the tier keeps it after the
  pool changes); `write` copies `data` into the rows `host_ids`.
  """
  block_nbytes: int

  def read(self, host_ids: np.ndarray) -> np.ndarray:  # -> uint8 [n, block_nbytes]
    ...

  def write(self, host_ids: np.ndarray, data: np.ndarray) -> None:  # data: [n, block_nbytes]
    ...


@dataclasses.dataclass(frozen=True)
class Usage:
  """A backend's occupancy. capacity_bytes None: bounded by the server, not by us."""
  used_bytes: int
  used_blocks: int
  capacity_bytes: int | None
  evictions: int


class Backend(abc.ABC):
  """Stored blocks by key: one instance per tier, values are payload.encode blobs."""

  kind: str  # "disk", "remote": the `tier=` of describe()
  namespace: Namespace

  @abc.abstractmethod
  def describe(self) -> str:
    """One log line: "tier=disk path=/x" (never a password)."""

  @abc.abstractmethod
  def contains(self, key: bytes) -> bool:
    """Whether `key` is known to be stored, from memory only (never I/O)."""

  @abc.abstractmethod
  def exists_many(self, keys: list[bytes]) -> list[bool]:
    """Whether each key is stored (may do one round trip)."""

  @abc.abstractmethod
  def put_many(self, items: list[tuple[bytes, bytes]]) -> list[str | None]:
    """Store (key, blob) pairs; per pair None (stored) or the failure reason. Raises
    BackendError when the whole batch failed."""

  @abc.abstractmethod
  def get_many(self, keys: list[bytes]) -> list[bytes | None]:
    """The stored blobs (None: not stored). Raises BackendError when the batch failed."""

  @abc.abstractmethod
  def delete(self, key: bytes) -> None:
    """Drop one stored value (a corrupt one); missing keys are fine."""

  @abc.abstractmethod
  def usage(self) -> Usage:
    """Occupancy from memory (never I/O)."""

  def extra_stats(self) -> dict:
    """Backend-specific counters merged into KVTier.stats() (never I/O)."""
    return {}

  def close(self) -> None:  # noqa: B027 (optional hook)
    """Release files, sockets and locks."""


@dataclasses.dataclass
class TierJob:
  """One finished store or load, as `KVTier.finished()` reports it.

  keys/host_ids: what was submitted (a store's keys exclude those skipped as already
  stored or in flight). success[i]: key i was stored / written into host row
  host_ids[i]. A load serves the longest good prefix of its chain: after the first
  missing or corrupt key every later key is False, and only the rows with success True
  were written. nbytes: payload bytes moved for the keys that succeeded. error: empty,
  or "reason: message" of the first failure.
  """
  job_id: int
  kind: str  # "store" | "load"
  keys: list[bytes]
  host_ids: np.ndarray
  success: list[bool]
  nbytes: int = 0
  seconds: float = 0.0
  error: str = ""
  num_skipped: int = 0  # store: keys already stored or in flight, not submitted

  @property
  def num_succeeded(self) -> int:
    return sum(self.success)

  @property
  def ok(self) -> bool:
    return all(self.success)


class RateLimitedLog:
  """Warnings at most once per `interval_s` per reason, with the count suppressed
  since the last line: a dead server makes one line per interval, not one per call."""

  def __init__(self, prefix: str, interval_s: float = 30.0):
    self._prefix = prefix
    self._interval_s = interval_s
    self._last: dict[str, float] = {}
    self._suppressed: dict[str, int] = {}
    self._lock = threading.Lock()
    self.num_lines = 0  # lines actually logged (tests)

  def warn(self, reason: str, message: str) -> None:
    now = time.monotonic()
    with self._lock:
      last = self._last.get(reason)
      if last is not None and now - last < self._interval_s:
        self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
        return
      self._last[reason] = now
      suppressed = self._suppressed.pop(reason, 0)
      self.num_lines += 1
    more = f" ({suppressed} more since the last line)" if suppressed else ""
    logging.warning("%s: %s: %s%s", self._prefix, reason, message, more)

"""DiskBackend: stored blocks as files in one directory, under a byte cap with LRU
eviction and a free-space floor.

  <path>/
    lock                  flock'ed while an engine uses the directory (one at a time)
    manifest.json         the Namespace JSON of the engine that created the directory
    blocks-<digest16>/    the namespace's blocks, fanned out by the key's first hex byte
      3f/3fa9...e1.kv     one file per block: payload.encode's bytes
      3f/.3fa9...e1.<pid>.tmp   a store in progress (renamed over the real name when whole)

Invariants:
  * A file under its real name is whole: a store writes a temp name in the same directory
    and `os.replace`s it, so a crash leaves at most a temp file, removed at the next start.
    (No fsync: this is a cache; a file the kernel lost or tore is caught by its checksum
    on read and deleted.)
  * The in-memory index (key -> stored bytes, LRU order in an OrderedDict) lists exactly
    the files this process knows: a scan at start rebuilds it (a size-only check; a file
    of the wrong size is deleted), recency from file mtime, which `get` refreshes with
    os.utime so recency survives restarts.
  * used_bytes <= capacity_bytes: a store evicts least recently used files first. It is
    then refused (reason "disk_full") when writing it would leave less than
    `min_free_bytes` free on the filesystem (shutil.disk_usage), so the cache never fills
    a disk the engine shares with other writers.
  * A directory holds one namespace: an engine whose namespace differs from the manifest
    is refused at start (TierError naming --disk_cache_dir and each differing field).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import shutil
import threading

from hisparse_jax.kv_cache.tiers import payload
from hisparse_jax.kv_cache.tiers.base import Backend, BackendError, TierError, Usage
from hisparse_jax.kv_cache.tiers.keys import KEY_NBYTES, Namespace

MANIFEST = "manifest.json"
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
DEFAULT_MIN_FREE_BYTES = 1 << 30


class DiskBackend(Backend):
  """One directory of block files; see the module docstring for its invariants."""

  kind = "disk"

  def __init__(self, path: str | os.PathLike, capacity_bytes: int, namespace: Namespace,
               *, min_free_bytes: int = DEFAULT_MIN_FREE_BYTES):
    self.path = os.path.abspath(os.fspath(path))
    self.namespace = namespace
    self.capacity_bytes = int(capacity_bytes)
    self.min_free_bytes = int(min_free_bytes)
    flag = f"--disk_cache_dir={os.fspath(path)}"
    if self.capacity_bytes <= 0:
      raise TierError(f"--disk_cache_gib={capacity_bytes / 2**30:g}: must be positive")
    self._stored_nbytes = payload.stored_nbytes(namespace.block_nbytes)
    if self.capacity_bytes < self._stored_nbytes:
      raise TierError(f"--disk_cache_gib={capacity_bytes / 2**30:g}: holds no block "
                      f"({self._stored_nbytes} bytes each)")
    try:
      os.makedirs(self.path, exist_ok=True)
      self._lock_file = open(os.path.join(self.path, "lock"), "a+")  # noqa: SIM115
    except OSError as e:
      raise TierError(f"{flag}: cannot create the cache directory: {e.strerror}") from None
    try:
      fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      self._lock_file.close()
      raise TierError(f"{flag}: in use by another engine process (its lock is held)") from None
    try:
      self._check_manifest(flag)
      self._root = os.path.join(self.path, f"blocks-{namespace.digest()[:16]}")
      os.makedirs(self._root, exist_ok=True)
      if not os.access(self._root, os.W_OK):
        raise TierError(f"{flag}: not writable")
    except BaseException:
      self.close()
      raise
    self._lock = threading.Lock()  # guards the index and counters
    self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self._used_bytes = 0
    self._evictions = 0
    self.num_stray_removed = 0  # temp files of an interrupted run, removed at start
    self.num_scan_dropped = 0  # files of the wrong size, deleted at start
    self._scan()

  def _check_manifest(self, flag: str) -> None:
    manifest = os.path.join(self.path, MANIFEST)
    try:
      with open(manifest) as f:
        text = f.read()
    except FileNotFoundError:
      tmp = f"{manifest}.{os.getpid()}{_TMP_SUFFIX}"
      try:
        with open(tmp, "w") as f:
          f.write(self.namespace.to_json() + "\n")
        os.replace(tmp, manifest)
      except OSError as e:
        raise TierError(f"{flag}: cannot write {MANIFEST}: {e.strerror}") from None
      return
    except OSError as e:
      raise TierError(f"{flag}: cannot read {MANIFEST}: {e.strerror}") from None
    try:
      theirs = Namespace.from_json(text)
    except ValueError as e:
      raise TierError(f"{flag}: {MANIFEST} unreadable ({e}); point the flag at another "
                      "directory or empty this one") from None
    diffs = self.namespace.differences(theirs)
    if diffs:
      raise TierError(f"{flag}: manifest written by a different engine (this engine vs the "
                      f"manifest: {', '.join(diffs)}); point the flag at another directory "
                      "or empty this one")

  def _scan(self) -> None:
    """Rebuild the index from the files (oldest mtime first); remove temp files and
    files of the wrong size; evict down to the cap if it shrank."""
    found = []
    for fan in os.scandir(self._root):
      if not fan.is_dir():
        continue
      for entry in os.scandir(fan.path):
        name = entry.name
        if name.endswith(_TMP_SUFFIX):
          _unlink(entry.path)
          self.num_stray_removed += 1
          continue
        if not name.endswith(_SUFFIX):
          continue
        try:
          key = bytes.fromhex(name[:-len(_SUFFIX)])
          st = entry.stat()
        except (ValueError, OSError):
          continue
        if len(key) != KEY_NBYTES:
          continue
        if st.st_size != self._stored_nbytes:
          _unlink(entry.path)
          self.num_scan_dropped += 1
          continue
        found.append((st.st_mtime_ns, key, st.st_size))
    for _, key, size in sorted(found):
      self._index[key] = size
      self._used_bytes += size
    for key in self._evict_to(self.capacity_bytes):
      _unlink(self._file(key))

  def _file(self, key: bytes) -> str:
    h = key.hex()
    return os.path.join(self._root, h[:2], h + _SUFFIX)

  def _evict_to(self, limit: int) -> list[bytes]:
    """Drop LRU entries from the index until used <= limit (under the lock, or at start);
    returns the evicted keys (their files are for the caller to unlink)."""
    victims = []
    while self._used_bytes > limit and self._index:
      key, size = self._index.popitem(last=False)
      self._used_bytes -= size
      self._evictions += 1
      victims.append(key)
    return victims

  # --- Backend ---------------------------------------------------------------------------

  def describe(self) -> str:
    return (f"tier=disk path={self.path} capacity={self.capacity_bytes / 2**30:.2f}GiB "
            f"min_free={self.min_free_bytes / 2**30:.2f}GiB")

  def contains(self, key: bytes) -> bool:
    with self._lock:
      return key in self._index

  def exists_many(self, keys: list[bytes]) -> list[bool]:
    with self._lock:
      return [key in self._index for key in keys]

  def put_many(self, items: list[tuple[bytes, bytes]]) -> list[str | None]:
    reasons = []
    for key, blob in items:
      try:
        reasons.append(self._put(key, blob))
      except OSError as e:
        reasons.append("disk_full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "io")
    return reasons

  def _put(self, key: bytes, blob: bytes) -> str | None:
    size = len(blob)
    with self._lock:
      if key in self._index:
        self._index.move_to_end(key)
        return None
      if size > self.capacity_bytes:
        return "too_large"
      victims = self._evict_to(self.capacity_bytes - size)
    for victim in victims:
      _unlink(self._file(victim))
    if shutil.disk_usage(self._root).free - size < self.min_free_bytes:
      return "disk_full"
    final = self._file(key)
    tmp = os.path.join(os.path.dirname(final),
                       f".{key.hex()}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}")
    os.makedirs(os.path.dirname(final), exist_ok=True)
    try:
      with open(tmp, "wb") as f:
        f.write(blob)
      os.replace(tmp, final)
    except BaseException:
      _unlink(tmp)
      raise
    with self._lock:
      self._index[key] = size
      self._used_bytes += size
    return None

  def get_many(self, keys: list[bytes]) -> list[bytes | None]:
    blobs = []
    for key in keys:
      with self._lock:
        if key not in self._index:
          blobs.append(None)
          continue
        self._index.move_to_end(key)
      path = self._file(key)
      try:
        with open(path, "rb") as f:
          blobs.append(f.read())
        os.utime(path)  # recency that survives a restart
      except FileNotFoundError:  # deleted behind our back
        self._forget(key)
        blobs.append(None)
      except OSError as e:
        raise BackendError("io", f"read {path}: {e.strerror}") from None
    return blobs

  def delete(self, key: bytes) -> None:
    self._forget(key)
    _unlink(self._file(key))

  def _forget(self, key: bytes) -> None:
    with self._lock:
      size = self._index.pop(key, None)
      if size is not None:
        self._used_bytes -= size

  def usage(self) -> Usage:
    with self._lock:
      return Usage(self._used_bytes, len(self._index), self.capacity_bytes, self._evictions)

  def extra_stats(self) -> dict:
    return {"path": self.path, "min_free_bytes": self.min_free_bytes,
            "stray_removed": self.num_stray_removed, "scan_dropped": self.num_scan_dropped}

  def keys(self) -> list[bytes]:
    """Stored keys, least recently used first (tests, tools)."""
    with self._lock:
      return list(self._index)

  def file_path(self, key: bytes) -> str:
    """Where `key`'s block lives (tests, tools)."""
    return self._file(key)

  def close(self) -> None:
    lock_file = getattr(self, "_lock_file", None)
    if lock_file is not None and not lock_file.closed:
      fcntl.flock(lock_file, fcntl.LOCK_UN)
      lock_file.close()


def _unlink(path: str) -> None:
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass

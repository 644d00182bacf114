"""RemoteBackend: stored blocks as values on a Redis-protocol server (Redis, Valkey),
shared by every engine process that points at it with the same namespace.

  hisparse:<digest16>:manifest     the Namespace JSON (set once, never expires)
  hisparse:<digest16>:<key hex>    one block: payload.encode's bytes, EX ttl_s

Round trips: a store is pipelined SETs with EX (batches of at most `max_batch_bytes`),
a load one pipeline of MGET plus an EXPIRE per key (a hit refreshes its TTL, so blocks in
use outlive the TTL and idle ones age out), `exists_many` one pipeline of EXISTS. The
`redis` client is imported here only, when a backend is built: an engine without a
remote URL never needs the package.

What the engine's non-blocking `lookup` knows: the server is not asked. `contains` answers
from a bounded set of keys this process knows to be stored (stored, loaded, or seen by
`exists_many`), so a block another engine stored is a MISS until an `exists` call (one
round trip, which the engine makes once per new request) has seen it, or the SCAN at
open (the blocks of this namespace stored before this process started) has. The set can be
stale (TTL expiry, the server's maxmemory eviction, a flush): a load of such a key then
reports "missing", the key is forgotten, and nothing is served.

Failure model: connect and socket timeouts are short (1.5 s / 2 s) and the client never
retries, so an unreachable URL fails construction fast (TierError naming
--remote_cache_url) and a server that dies mid-run turns each call into a
BackendError("connection" | "timeout") within a timeout, never a hang. The URL's password
is never logged (`redact_url`). capacity_bytes: the server's `maxmemory` when set, else
None ("unbounded (server)"); used_* count the keys this process knows (those on the server
at open, plus those stored or seen since), not other namespaces'.
"""

from __future__ import annotations

import collections
import threading
import urllib.parse

from hisparse_jax.kv_cache.tiers import payload
from hisparse_jax.kv_cache.tiers.base import Backend, BackendError, TierError, Usage
from hisparse_jax.kv_cache.tiers.keys import Namespace

DEFAULT_TTL_S = 24 * 3600


def redact_url(url: str) -> str:
  """`url` with any password replaced by ***, in the userinfo or a ?password= query."""
  try:
    parts = urllib.parse.urlsplit(url)
  except ValueError:
    return "<unparseable url>"
  netloc = parts.netloc
  if parts.password is not None:
    user = parts.username or ""
    netloc = f"{user}:***@{netloc.rpartition('@')[2]}"
  query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
  query = [(k, "***" if k.lower() == "password" else v) for k, v in query]
  return urllib.parse.urlunsplit(parts._replace(netloc=netloc,
                                                query=urllib.parse.urlencode(query)))


class RemoteBackend(Backend):
  """Blocks on a Redis-protocol server; see the module docstring for what it promises."""

  kind = "remote"

  def __init__(self, url: str, namespace: Namespace, *, ttl_s: int = DEFAULT_TTL_S,
               capacity_bytes: int | None = None, connect_timeout_s: float = 1.5,
               timeout_s: float = 2.0, max_batch_bytes: int = 64 << 20,
               max_known_keys: int = 1 << 20):
    self.url = redact_url(url)
    self.namespace = namespace
    self.ttl_s = int(ttl_s)
    self._max_batch_bytes = max_batch_bytes
    self._max_known_keys = max_known_keys
    self._stored_nbytes = payload.stored_nbytes(namespace.block_nbytes)
    flag = f"--remote_cache_url={self.url}"
    if self.ttl_s <= 0:
      raise TierError(f"--remote_cache_ttl_s={ttl_s}: must be positive")
    try:
      import redis
      from redis.backoff import NoBackoff
      from redis.retry import Retry
    except ImportError:
      raise TierError(f"{flag}: the `redis` package is not installed") from None
    self._redis = redis
    try:
      self._client = redis.Redis.from_url(
        url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0), health_check_interval=0)
    except ValueError as e:
      raise TierError(f"{flag}: {e}") from None
    self._prefix = f"hisparse:{namespace.digest()[:16]}:".encode()
    try:
      self._client.ping()
      self._check_manifest(flag)
      if capacity_bytes is None:
        capacity_bytes = int(self._client.info("memory").get("maxmemory", 0)) or None
    except redis.RedisError as e:
      self._client.close()
      raise TierError(f"{flag}: cannot connect ({type(e).__name__}: {e})") from None
    except TierError:
      self._client.close()
      raise
    self.capacity_bytes = capacity_bytes
    self._lock = threading.Lock()  # guards _known
    self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
    try:
      self._scan_known()
    except redis.RedisError as e:
      self._client.close()
      raise TierError(f"{flag}: cannot list the stored blocks ({type(e).__name__}: {e})"
                      ) from None

  def _scan_known(self) -> None:
    """Knows the blocks of this namespace already on the server (SCAN at open, up to
    max_known_keys): the capacity line's used bytes, and lookups that hit without a
    round trip."""
    manifest = self._prefix + b"manifest"
    keys = []
    for name in self._client.scan_iter(match=self._prefix + b"*", count=1000):
      if name == manifest:
        continue
      try:
        keys.append(bytes.fromhex(name[len(self._prefix):].decode()))
      except ValueError:
        continue
      if len(keys) >= self._max_known_keys:
        break
    self._remember(keys, [True] * len(keys))

  def _check_manifest(self, flag: str) -> None:
    manifest = self._prefix + b"manifest"
    self._client.set(manifest, self.namespace.to_json(), nx=True)
    text = self._client.get(manifest)
    try:
      theirs = Namespace.from_json((text or b"").decode(errors="replace"))
    except ValueError as e:
      raise TierError(f"{flag}: {manifest.decode()} unreadable ({e})") from None
    diffs = self.namespace.differences(theirs)
    if diffs:
      raise TierError(f"{flag}: manifest written by a different engine (this engine vs the "
                      f"manifest: {', '.join(diffs)})")

  def _name(self, key: bytes) -> bytes:
    return self._prefix + key.hex().encode()

  def _error(self, what: str, e: Exception) -> BackendError:
    reason = "timeout" if isinstance(e, self._redis.TimeoutError) else (
      "connection" if isinstance(e, self._redis.ConnectionError) else "remote_error")
    return BackendError(reason, f"{what}: {type(e).__name__}: {e}")

  def _remember(self, keys, stored) -> None:
    with self._lock:
      for key, s in zip(keys, stored):
        if s:
          self._known[key] = None
          self._known.move_to_end(key)
        else:
          self._known.pop(key, None)
      while len(self._known) > self._max_known_keys:
        self._known.popitem(last=False)

  # --- Backend ---------------------------------------------------------------------------

  def describe(self) -> str:
    capacity = ("unbounded (server)" if self.capacity_bytes is None
                else f"{self.capacity_bytes / 2**30:.2f}GiB")
    return f"tier=remote url={self.url} ttl={self.ttl_s}s capacity={capacity}"

  def contains(self, key: bytes) -> bool:
    with self._lock:
      return key in self._known

  def exists_many(self, keys: list[bytes]) -> list[bool]:
    pipe = self._client.pipeline(transaction=False)
    for key in keys:
      pipe.exists(self._name(key))
    try:
      stored = [bool(n) for n in pipe.execute()]
    except self._redis.RedisError as e:
      raise self._error("exists", e) from None
    self._remember(keys, stored)
    return stored

  def put_many(self, items: list[tuple[bytes, bytes]]) -> list[str | None]:
    reasons: list[str | None] = []
    start = 0
    while start < len(items):
      end, nbytes = start, 0
      while end < len(items) and (end == start or nbytes < self._max_batch_bytes):
        nbytes += len(items[end][1])
        end += 1
      pipe = self._client.pipeline(transaction=False)
      for key, blob in items[start:end]:
        pipe.set(self._name(key), blob, ex=self.ttl_s)
      try:
        pipe.execute()
      except self._redis.RedisError as e:
        if start == 0:
          raise self._error("store", e) from None
        # Earlier batches are stored; this one and the rest are not.
        return reasons + [self._error("store", e).reason] * (len(items) - start)
      self._remember([key for key, _ in items[start:end]], [True] * (end - start))
      reasons += [None] * (end - start)
      start = end
    return reasons

  def get_many(self, keys: list[bytes]) -> list[bytes | None]:
    names = [self._name(key) for key in keys]
    pipe = self._client.pipeline(transaction=False)
    pipe.mget(names)
    for name in names:
      pipe.expire(name, self.ttl_s)  # a hit stays as long as it is used
    try:
      blobs = pipe.execute()[0]
    except self._redis.RedisError as e:
      raise self._error("load", e) from None
    self._remember(keys, [b is not None for b in blobs])
    return blobs

  def delete(self, key: bytes) -> None:
    self._remember([key], [False])
    try:
      self._client.delete(self._name(key))
    except self._redis.RedisError as e:
      raise self._error("delete", e) from None

  def usage(self) -> Usage:
    with self._lock:
      num = len(self._known)
    return Usage(num * self._stored_nbytes, num, self.capacity_bytes, 0)

  def extra_stats(self) -> dict:
    return {"url": self.url, "ttl_s": self.ttl_s}

  def close(self) -> None:
    self._client.close()

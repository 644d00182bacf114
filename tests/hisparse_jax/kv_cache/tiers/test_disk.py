"""KVTier over DiskBackend: exact bytes, keys, files and counters after stores, loads,
restarts, eviction, a full disk, corrupt files and a foreign manifest."""

import dataclasses
import os
import time

import numpy as np
import pytest

from hisparse_jax.kv_cache.tiers import payload
from hisparse_jax.kv_cache.tiers.base import LookupResult, TierError
from hisparse_jax.kv_cache.tiers.disk import DiskBackend
from hisparse_jax.kv_cache.tiers.keys import Namespace, chain_keys
from hisparse_jax.kv_cache.tiers.testing import ArrayBlockIO, ThrottledBackend, wait_finished
from hisparse_jax.kv_cache.tiers.tier import KVTier

NBYTES = 1000  # payload bytes per block
STORED = payload.stored_nbytes(NBYTES)  # 1084: bytes per file
NS = Namespace("tiny", "float32", 4, "k/v 2x[4,1,31.25]", "tp0of1", NBYTES)
SENTINEL = 0xAA


def make_tier(path, capacity_blocks=64, io=None, min_free_bytes=0, **kw):
  io = io or ArrayBlockIO.random(32, NBYTES)
  backend = DiskBackend(path, capacity_blocks * STORED, NS, min_free_bytes=min_free_bytes)
  return KVTier(backend, io, **kw), io


def keys_of(n, first_token=0):
  return chain_keys(range(first_token, first_token + 4 * n), 4, NS)


def run(tier, kind, keys, host_ids):
  submit = tier.submit_store if kind == "store" else tier.submit_load
  job_id = submit(keys, host_ids)
  (job,) = wait_finished(tier, 1)
  assert job.job_id == job_id and job.kind == kind
  return job


def test_store_then_load_round_trips_exact_bytes(tmp_path):
  tier, io = make_tier(tmp_path)
  keys = keys_of(5)
  job = run(tier, "store", keys, [1, 2, 3, 4, 5])
  assert job.success == [True] * 5 and job.nbytes == 5 * NBYTES and job.error == ""
  for key in keys:
    with open(tier.backend.file_path(key), "rb") as f:
      assert len(f.read()) == STORED
  assert tier.backend.file_path(keys[0]).endswith(f"{keys[0].hex()[:2]}/{keys[0].hex()}.kv")
  assert tier.lookup(keys[2]) is LookupResult.HIT
  assert tier.lookup(keys_of(1, first_token=99)[0]) is LookupResult.MISS
  assert tier.exists(keys) == 5 and tier.exists(keys_of(6)) == 5

  io.pool[10:15] = SENTINEL
  job = run(tier, "load", keys, [10, 11, 12, 13, 14])
  assert job.success == [True] * 5 and job.nbytes == 5 * NBYTES
  np.testing.assert_array_equal(io.pool[10:15], io.pool[1:6])

  again = run(tier, "store", keys[:2] + keys_of(1, first_token=50), [1, 2, 7])
  assert again.num_skipped == 2 and again.keys == keys_of(1, first_token=50)
  s = tier.stats()
  assert (s["used_bytes"], s["used_blocks"], s["capacity_bytes"], s["capacity_blocks"]) == (
    6 * STORED, 6, 64 * STORED, 64)
  assert (s["store_jobs"], s["store_blocks"], s["store_bytes"], s["store_skipped"]) == (
    2, 6, 6 * NBYTES, 2)
  assert (s["load_jobs"], s["load_blocks"], s["load_bytes"]) == (1, 5, 5 * NBYTES)
  assert (s["lookups"], s["hits"], s["failures"], s["corrupt"], s["evictions"]) == (
    2, 1, {}, 0, 0)
  assert s["load_bytes_per_s"] > 0 and s["pending_stores"] == 0
  assert tier.describe().startswith(f"tier=disk path={tmp_path}")
  tier.close()


def test_restart_finds_and_serves_stored_blocks(tmp_path):
  tier, io = make_tier(tmp_path)
  keys = keys_of(3)
  run(tier, "store", keys, [4, 5, 6])
  tier.close()
  tier2, io2 = make_tier(tmp_path, io=ArrayBlockIO(np.zeros((32, NBYTES), np.uint8)))
  assert tier2.exists(keys) == 3 and tier2.stats()["used_blocks"] == 3
  assert [tier2.lookup(k) for k in keys] == [LookupResult.HIT] * 3
  job = run(tier2, "load", keys, [0, 1, 2])
  assert job.success == [True] * 3
  np.testing.assert_array_equal(io2.pool[0:3], io.pool[4:7])
  tier2.close()


def test_lru_eviction_under_the_byte_cap_survives_restart(tmp_path):
  tier, io = make_tier(tmp_path, capacity_blocks=3)
  k0, k1, k2, k3, k4 = keys_of(5)
  for key, row in [(k0, 0), (k1, 1), (k2, 2)]:
    run(tier, "store", [key], [row])
  now = time.time()
  for age, key in [(300, k0), (200, k1), (100, k2)]:  # mtimes: k0 oldest
    os.utime(tier.backend.file_path(key), (now - age, now - age))
  assert run(tier, "load", [k0], [9]).success == [True]  # a hit: k0 most recent
  tier.close()

  tier, io = make_tier(tmp_path, capacity_blocks=3, io=io)  # recency from mtime
  assert tier.backend.keys() == [k1, k2, k0]
  run(tier, "store", [k3], [3])
  assert tier.backend.keys() == [k2, k0, k3]  # k1, least recently used, evicted
  assert not os.path.exists(tier.backend.file_path(k1))
  assert tier.lookup(k1) is LookupResult.MISS
  run(tier, "store", [k4], [4])
  assert tier.backend.keys() == [k0, k3, k4]
  s = tier.stats()
  assert (s["evictions"], s["used_blocks"], s["used_bytes"]) == (2, 3, 3 * STORED)
  tier.close()


def test_free_space_floor_refuses_the_store(tmp_path):
  tier, _ = make_tier(tmp_path, min_free_bytes=1 << 62)
  keys = keys_of(3)
  job = run(tier, "store", keys, [0, 1, 2])
  assert job.success == [False] * 3 and job.nbytes == 0
  assert job.error.startswith("disk_full")
  s = tier.stats()
  assert s["failures"] == {"disk_full": 3} and s["used_blocks"] == 0 and s["store_blocks"] == 0
  assert not any(os.path.exists(tier.backend.file_path(k)) for k in keys)
  assert tier.exists(keys) == 0
  tier.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_file_is_dropped_and_never_served(tmp_path, damage):
  tier, io = make_tier(tmp_path)
  keys = keys_of(3)
  run(tier, "store", keys, [0, 1, 2])
  path = tier.backend.file_path(keys[1])
  with open(path, "r+b") as f:
    if damage == "flip":
      f.seek(500)
      byte = f.read(1)
      f.seek(500)
      f.write(bytes([byte[0] ^ 0x01]))
    else:
      f.truncate(STORED - 10)
  io.pool[10:13] = SENTINEL
  job = run(tier, "load", keys, [10, 11, 12])
  # The prefix before the bad key is served; the bad key and every later one are not.
  assert job.success == [True, False, False] and job.nbytes == NBYTES
  assert job.error.startswith("corrupt: key " + keys[1].hex()[:16])
  np.testing.assert_array_equal(io.pool[10], io.pool[0])
  assert (io.pool[11:13] == SENTINEL).all()
  assert not os.path.exists(path)
  assert tier.lookup(keys[1]) is LookupResult.MISS and tier.exists(keys) == 1
  s = tier.stats()
  assert (s["corrupt"], s["failures"], s["used_blocks"]) == (1, {"corrupt": 1}, 2)
  tier.close()


def test_scan_drops_files_of_the_wrong_size_and_stray_temp_files(tmp_path):
  tier, _ = make_tier(tmp_path)
  keys = keys_of(2)
  run(tier, "store", keys, [0, 1])
  tier.close()
  fan = os.path.dirname(tier.backend.file_path(keys[0]))
  stray = os.path.join(fan, f".{keys[0].hex()}.1234.5678.tmp")
  with open(stray, "wb") as f:
    f.write(b"half a block")
  os.truncate(tier.backend.file_path(keys[1]), 100)

  tier, _ = make_tier(tmp_path)
  assert not os.path.exists(stray)
  assert not os.path.exists(tier.backend.file_path(keys[1]))
  assert tier.backend.keys() == [keys[0]]
  s = tier.stats()
  assert (s["stray_removed"], s["scan_dropped"], s["used_blocks"]) == (1, 1, 1)
  tier.close()


def test_exists_is_the_longest_stored_prefix(tmp_path):
  tier, _ = make_tier(tmp_path)
  keys = keys_of(5)
  run(tier, "store", [keys[0], keys[1], keys[3]], [0, 1, 3])
  assert tier.exists(keys) == 2
  assert tier.exists(keys[3:]) == 1
  assert tier.exists([]) == 0
  tier.close()


def test_namespace_mismatch_names_the_flag_and_fields(tmp_path):
  tier, _ = make_tier(tmp_path)
  tier.close()
  other = dataclasses.replace(NS, dtype="bfloat16", block_size=16)
  with pytest.raises(TierError, match=(
      rf"^--disk_cache_dir={tmp_path}: manifest written by a different engine \(this engine "
      r"vs the manifest: dtype 'bfloat16' vs 'float32', block_size 16 vs 4\)")):
    DiskBackend(tmp_path, 64 * STORED, other)


def test_construction_errors_name_the_flag(tmp_path):
  with pytest.raises(TierError, match=r"^--disk_cache_gib=0: must be positive"):
    DiskBackend(tmp_path, 0, NS)
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(TierError, match=rf"^--disk_cache_dir={a_file}/sub: cannot create"):
    DiskBackend(a_file / "sub", 1 << 20, NS)
  first = DiskBackend(tmp_path / "d", 1 << 20, NS)
  with pytest.raises(TierError, match="in use by another engine process"):
    DiskBackend(tmp_path / "d", 1 << 20, NS)
  first.close()
  DiskBackend(tmp_path / "d", 1 << 20, NS).close()  # the lock is released by close
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "manifest.json").write_text("{not json")
  with pytest.raises(TierError, match=r"manifest.json unreadable"):
    DiskBackend(tmp_path / "bad", 1 << 20, NS)


def test_in_flight_store_counts_in_exists_and_lookup(tmp_path):
  io = ArrayBlockIO.random(32, NBYTES)
  backend = ThrottledBackend(DiskBackend(tmp_path, 64 * STORED, NS, min_free_bytes=0),
                             bytes_per_s=1e9, latency_s=0.3)
  tier = KVTier(backend, io)
  keys = keys_of(2)
  tier.submit_store(keys, [0, 1])
  assert tier.lookup(keys[0]) is LookupResult.IN_FLIGHT
  assert tier.exists(keys) == 2  # a load submitted now runs after the store (one FIFO)
  load_id = tier.submit_load(keys, [5, 6])
  assert tier.stats()["pending_stores"] == 2 and tier.stats()["pending_loads"] == 2
  jobs = wait_finished(tier, 2)
  assert [j.kind for j in jobs] == ["store", "load"] and jobs[1].job_id == load_id
  assert jobs[1].success == [True, True]
  np.testing.assert_array_equal(io.pool[5:7], io.pool[0:2])
  assert tier.lookup(keys[0]) is LookupResult.HIT
  tier.close()


def test_backlog_cap_refuses_a_store(tmp_path):
  tier, _ = make_tier(tmp_path, max_pending_bytes=3 * NBYTES)
  job_id = tier.submit_store(keys_of(4), [0, 1, 2, 3])
  (job,) = wait_finished(tier, 1)
  assert job.job_id == job_id and job.success == [False] * 4
  assert job.error.startswith("backlog: 4000 pending bytes")
  assert tier.stats()["failures"] == {"backlog": 4} and tier.stats()["used_blocks"] == 0
  tier.close()


def test_close_finishes_stores_and_cancels_loads(tmp_path):
  io = ArrayBlockIO.random(32, NBYTES)
  inner = DiskBackend(tmp_path, 64 * STORED, NS, min_free_bytes=0)
  tier = KVTier(ThrottledBackend(inner, bytes_per_s=1e9, latency_s=0.2), io)
  keys = keys_of(2)
  tier.submit_store(keys, [0, 1])
  tier.submit_load(keys, [2, 3])
  tier.close()
  store, load = tier.finished()
  assert store.success == [True, True]
  assert load.success == [False, False] and load.error == "cancelled: tier closed"
  assert io.num_writes == 0
  late = tier.submit_store(keys_of(1, first_token=77), [4])
  (job,) = tier.finished()
  assert job.job_id == late and job.error == "closed: tier is closed"
  assert tier.stats()["failures"] == {"cancelled": 2, "closed": 1}
  assert len(inner.keys()) == 2
  tier.close()  # idempotent


class _BrokenBackend(ThrottledBackend):
  def get_many(self, keys):
    raise OSError(5, "Input/output error")

  def exists_many(self, keys):
    raise OSError(5, "Input/output error")


def test_backend_errors_become_counted_misses_and_one_log_line(tmp_path):
  io = ArrayBlockIO.random(32, NBYTES)
  inner = DiskBackend(tmp_path, 64 * STORED, NS, min_free_bytes=0)
  tier = KVTier(_BrokenBackend(inner, bytes_per_s=1e12), io)
  keys = keys_of(2)
  for _ in range(5):
    tier.submit_load(keys, [0, 1])
  jobs = wait_finished(tier, 5)
  assert all(j.success == [False, False] and j.error.startswith("io: ") for j in jobs)
  assert tier.exists(keys) == 0
  assert tier.stats()["failures"] == {"io": 11}  # 5 loads x 2 keys, 1 exists call
  assert tier._log.num_lines == 1 and io.num_writes == 0  # rate-limited: one line
  tier.close()


def test_load_bandwidth_estimate_tracks_a_throttled_backend(tmp_path):
  io = ArrayBlockIO.random(32, NBYTES)
  inner = DiskBackend(tmp_path, 64 * STORED, NS, min_free_bytes=0)
  keys = keys_of(20)
  with KVTier(inner, io) as tier:
    run(tier, "store", keys, list(range(20)))
  inner = DiskBackend(tmp_path, 64 * STORED, NS, min_free_bytes=0)
  with KVTier(ThrottledBackend(inner, bytes_per_s=100_000), io) as tier:
    assert tier.stats()["load_bytes_per_s"] is None
    run(tier, "load", keys, list(range(20)))  # 21,680 stored bytes: about 0.22 s
    rate = tier.stats()["load_bytes_per_s"]
    assert 0.5 * 100_000 < rate <= 100_000 * NBYTES / STORED


def test_random_stores_and_loads_never_serve_wrong_bytes(tmp_path):
  """Stores, loads (some submitted right behind a store of the same chain) and pool
  rewrites under eviction: every row a load reports loaded holds exactly the bytes its
  key had when it was stored (the snapshot), and every other row is untouched."""
  rng = np.random.default_rng(1)
  tier, io = make_tier(tmp_path, capacity_blocks=8)
  chains = [keys_of(4, first_token=100 * c) for c in range(6)]
  truth = {}  # key -> the bytes stored under it
  for _ in range(80):
    chain = chains[rng.integers(len(chains))]
    n = int(rng.integers(1, 5))
    op = rng.choice(["store", "load", "store+load"])
    jobs = []
    if op != "load":
      rows = rng.choice(32, n, replace=False)
      snapshot = io.pool[rows].copy()
      jobs.append(tier.submit_store(chain[:n], rows))
      for key, row in zip(chain[:n], snapshot):
        truth.setdefault(key, row)  # a stored key is skipped and keeps its bytes
      io.pool[rows] = rng.integers(0, 256, (n, NBYTES), dtype=np.uint8)  # after the snapshot
    if op != "store":
      rows = rng.choice(32, n, replace=False)
      before = io.pool[rows].copy()
      jobs.append(tier.submit_load(chain[:n], rows))
    done = wait_finished(tier, len(jobs))
    assert [j.job_id for j in done] == jobs
    stored = set(tier.backend.keys())
    if op != "store":
      load = done[-1]
      # Loaded: the longest stored prefix (after a store+load: including what the store
      # just wrote, since the load ran after it in the one FIFO worker).
      assert load.success == list(np.cumprod([k in stored for k in chain[:n]]).astype(bool))
      for i, (key, row) in enumerate(zip(chain[:n], rows)):
        expected = truth[key] if load.success[i] else before[i]
        np.testing.assert_array_equal(io.pool[row], expected)
    truth = {k: v for k, v in truth.items() if k in stored}  # evicted keys may come back
  s = tier.stats()
  assert s["evictions"] > 0 and s["load_blocks"] > 0 and s["store_skipped"] > 0
  assert s["corrupt"] == 0 and s["used_blocks"] <= 8
  tier.close()

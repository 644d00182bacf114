"""The third KV tier in the engine (engine/tier_connector.py): a restarted engine and a
second engine serve a repeated prompt's blocks from the disk tier and from a shared
Redis-protocol store, with the recomputed greedy tokens (dense and HiSparse); faults
(a killed server, a full disk, a corrupt file, a namespace mismatch, an unreachable URL)
leave the engine serving with a counted failure and one log line; the capacity lines
equal the configured and stored bytes; the gate refuses a load slower than recomputing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.kv_cache.tiers import disk as disk_module
from hisparse_jax.kv_cache.tiers import payload
from hisparse_jax.kv_cache.tiers.testing import (
  RedisServer,
  RedisUnavailable,
  ThrottledBackend,
  free_port,
)

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(5, 250, n).tolist() for n in (200, 163, 97)]
FIELDS = dict(block_size=BLOCK_SIZE, max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=128, device_kv_gib=0.01, host_pool_gib=0.01)
# Every decode of a prompt above 48 tokens is sparse (top-k 32 tokens = 2 blocks).
SPARSE = HiSparseConfig(top_k_tokens=32, hot_buffer_tokens=32, sink_tokens=16,
                        local_tokens=16, sparse_threshold_tokens=48,
                        resident_sparse_min_tokens=0)


def _engine(**overrides) -> Engine:
  return Engine(EngineConfig(**{**FIELDS, **overrides}))


def _run(engine: Engine, prompts=PROMPTS) -> list[list[int]]:
  """Greedy tokens of each prompt (added together), checking invariants every step."""
  ids = [engine.add_request(prompt_token_ids=p, sampling_params=GREEDY) for p in prompts]
  done = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        done[out.request_id] = out.outputs[0].token_ids
    engine.check_invariants()
  return [list(done[i]) for i in ids]


def _tier_metric(engine: Engine, name: str, tier: str, **labels) -> float:
  inner = ",".join([f'tier="{tier}"', *(f'{k}="{v}"' for k, v in labels.items())])
  return engine.metrics().get(f"hisparse_kv_tier_{name}{{{inner}}}", 0.0)


@pytest.fixture(scope="module")
def reference() -> dict:
  """Recomputed tokens (no third tier), dense and HiSparse."""
  return {"dense": _run(_engine()), "sparse": _run(_engine(hisparse=SPARSE))}


@pytest.fixture
def redis_server(tmp_path):
  try:
    server = RedisServer(tmp_path)
  except RedisUnavailable as e:
    pytest.skip(str(e))
  yield server
  server.stop()


def _no_leaks(engine: Engine) -> None:
  bm = engine.block_manager
  assert not bm.tier_holds.held and engine.tier.num_loading == 0
  assert bm.host_pool.num_free_blocks == bm.host_pool.num_usable_blocks
  assert bm.device_pool.num_free_blocks == bm.device_pool.num_usable_blocks


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_restarted_engine_serves_the_disk_tier_with_the_recomputed_tokens(
    tmp_path, reference, kind):
  hisparse = SPARSE if kind == "sparse" else None
  first = _engine(disk_cache_dir=str(tmp_path), hisparse=hisparse)
  assert _run(first) == reference[kind]
  first.close()  # its stores finish
  stored = sorted(os.listdir(tmp_path / f"blocks-{first.tier_namespace.digest()[:16]}"))
  assert stored, "nothing stored"

  second = _engine(disk_cache_dir=str(tmp_path), hisparse=hisparse)
  assert _run(second) == reference[kind]
  full = sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS)
  assert _tier_metric(second, "loaded_blocks_total", "disk") == full
  assert _tier_metric(second, "hit_tokens_total", "disk") == full * BLOCK_SIZE
  assert second.metrics()['hisparse_prefix_cache_hits_total{memory_kind="pinned_host"}'] > 0
  assert _tier_metric(second, "load_bytes_total", "disk") == (
      full * second.tier.block_nbytes)
  _no_leaks(second)
  second.close()


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_second_engine_serves_the_shared_store(redis_server, reference, kind):
  hisparse = SPARSE if kind == "sparse" else None
  first = _engine(remote_cache_url=redis_server.url, hisparse=hisparse)
  second = _engine(remote_cache_url=redis_server.url, hisparse=hisparse)
  assert _run(first) == reference[kind]
  first.close()
  assert _run(second) == reference[kind]
  full = sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS)
  assert _tier_metric(second, "loaded_blocks_total", "remote") == full
  _no_leaks(second)
  second.close()


def test_capacity_lines_equal_the_configured_and_stored_bytes(tmp_path, redis_server, caplog):
  first = _engine(disk_cache_dir=str(tmp_path / "d"), disk_cache_gib=0.25,
                  remote_cache_url=redis_server.url)
  _run(first, PROMPTS[:1])
  first.close()
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="absl"):
    second = _engine(disk_cache_dir=str(tmp_path / "d"), disk_cache_gib=0.25,
                     remote_cache_url=redis_server.url)
  lines = [r.getMessage() for r in caplog.records if "KV cache capacity [tier=" in r.getMessage()]
  assert len(lines) == 2, lines
  disk, remote = second.capacity.third_tiers
  root = tmp_path / "d" / f"blocks-{second.tier_namespace.digest()[:16]}"
  files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
  on_disk = sum(os.path.getsize(f) for f in files)
  stored = payload.stored_nbytes(second.tier.block_nbytes)
  assert disk.capacity_bytes == int(0.25 * 2**30)
  assert disk.used_bytes == on_disk == len(files) * stored
  assert f"used {on_disk:,} bytes = {len(files):,} blocks" in lines[0]
  assert f"[tier=disk path={tmp_path / 'd'}]: 0.25 GiB" in lines[0]
  names = [k for k in redis_server.client.scan_iter(match=b"hisparse:*") if b"manifest" not in k]
  assert remote.used_blocks == len(names) == (len(PROMPTS[0])) // BLOCK_SIZE
  assert remote.used_bytes == sum(redis_server.client.strlen(k) for k in names)
  assert f"[tier=remote url={redis_server.url}]" in lines[1]
  assert second.metrics()['hisparse_kv_tier_used_bytes{tier="disk"}'] == on_disk
  second.close()


def test_the_capacity_command_prints_a_line_per_tier(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "hisparse_jax", "capacity", f"--disk_cache_dir={tmp_path}",
       "--disk_cache_gib=0.5", f"--remote_cache_url=redis://127.0.0.1:{free_port()}/0",
       "--block_size=16"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert any(f"[tier=disk path={tmp_path}]: 0.50 GiB" in line for line in lines), lines
  assert any("[tier=remote url=redis://127.0.0.1:" in line and "unavailable" in line
             for line in lines), lines
  assert "behind them tier=disk" in lines[-1]


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records
          if r.levelno >= logging.WARNING and "tier" in r.getMessage().lower()]


def test_an_unreachable_url_at_start_is_one_line_and_a_counted_failure(reference, caplog):
  with caplog.at_level(logging.INFO, logger="absl"):
    engine = _engine(remote_cache_url=f"redis://127.0.0.1:{free_port()}/0")
    assert _run(engine) == reference["dense"]
  assert len(_warnings(caplog)) == 1, _warnings(caplog)
  assert "--remote_cache_url" in _warnings(caplog)[0]
  assert _tier_metric(engine, "failures_total", "remote", reason="open") == 1
  engine.close()


def test_a_namespace_mismatch_is_refused_and_the_engine_recomputes(tmp_path, reference,
                                                                   caplog):
  other = _engine(disk_cache_dir=str(tmp_path), block_size=32)
  _run(other, PROMPTS[:1])
  other.close()
  with caplog.at_level(logging.INFO, logger="absl"):
    engine = _engine(disk_cache_dir=str(tmp_path))
    assert _run(engine) == reference["dense"]
  warnings = _warnings(caplog)
  assert len(warnings) == 1 and "manifest written by a different engine" in warnings[0]
  assert "block_size 16 vs 32" in warnings[0]
  assert _tier_metric(engine, "failures_total", "disk", reason="open") == 1
  engine.close()


def test_a_corrupt_file_is_dropped_and_the_rest_recomputed(tmp_path, reference, caplog):
  first = _engine(disk_cache_dir=str(tmp_path))
  _run(first)
  first.close()
  backend_keys = sorted(os.listdir(tmp_path))  # (the manifest, the lock, the blocks dir)
  assert "manifest.json" in backend_keys
  second = _engine(disk_cache_dir=str(tmp_path))
  # The 4th block of the first prompt: its file's payload flipped in the middle.
  key = second.tier.tiers[0].backend  # DiskBackend
  from hisparse_jax.kv_cache.tiers.keys import chain_keys
  keys = chain_keys(PROMPTS[0], BLOCK_SIZE, second.tier_namespace)
  path = key.file_path(keys[3])
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 0xFF]))
  with caplog.at_level(logging.INFO, logger="absl"):
    assert _run(second) == reference["dense"]
  stats = second.tier.stats()["disk"]
  assert stats["failures"].get("corrupt", 0) == 1
  assert stats["partial_loads"] == 1
  assert stats["loaded_blocks"] == sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS) - (
      (len(PROMPTS[0]) - 1) // BLOCK_SIZE - 3)  # the first prompt's first 3 blocks only
  assert len([w for w in _warnings(caplog) if "corrupt" in w]) == 1
  _no_leaks(second)
  block_nbytes = second.tier.block_nbytes
  second.close()
  # Dropped, recomputed, and stored again (write-through): the file now verifies.
  with open(path, "rb") as f:
    blob = f.read()
  payload.decode(blob, bytes.fromhex(second.tier_namespace.digest()), keys[3], block_nbytes)


def test_a_full_disk_evicts_the_oldest_blocks_and_the_engine_serves(tmp_path, reference):
  probe = _engine(disk_cache_dir=str(tmp_path / "probe"))
  stored = payload.stored_nbytes(probe.tier.block_nbytes)
  probe.close()
  # The cap holds 8 blocks: the prompts' 28 full blocks evict the oldest (LRU).
  cap_gib = 8 * stored / 2**30
  engine = _engine(disk_cache_dir=str(tmp_path / "cap"), disk_cache_gib=cap_gib)
  assert _run(engine) == reference["dense"]
  engine.tier.tiers[0].close()  # (its stores finish)
  assert _tier_metric(engine, "evictions_total", "disk") > 0
  engine.close()
  again = _engine(disk_cache_dir=str(tmp_path / "cap"), disk_cache_gib=cap_gib)
  assert 0 < again.tier.stats()["disk"]["used_blocks"] <= 8
  assert _run(again) == reference["dense"]
  _no_leaks(again)
  again.close()


def test_a_disk_full_store_failure_is_counted(tmp_path, reference, monkeypatch, caplog):
  monkeypatch.setattr(disk_module, "DEFAULT_MIN_FREE_BYTES", 1 << 62)
  with caplog.at_level(logging.INFO, logger="absl"):
    engine = _engine(disk_cache_dir=str(tmp_path))
    assert _run(engine) == reference["dense"]
    tier = engine.tier.tiers[0]
    tier.close()  # (waits for the stores)
  assert tier.stats()["failures"].get("disk_full", 0) > 0
  assert tier.stats()["used_blocks"] == 0
  assert _tier_metric(engine, "failures_total", "disk", reason="disk_full") > 0
  assert len([w for w in _warnings(caplog) if "disk_full" in w]) == 1, _warnings(caplog)
  engine.close()


def test_the_server_killed_mid_store_leaves_the_engine_serving(redis_server, reference,
                                                               caplog):
  caplog.set_level(logging.INFO, logger="absl")
  engine = _engine(remote_cache_url=redis_server.url)
  tier = engine.tier.tiers[0]
  tier.backend = ThrottledBackend(tier.backend, bytes_per_s=2e6)  # stores take a while
  ids = [engine.add_request(prompt_token_ids=p, sampling_params=GREEDY) for p in PROMPTS]
  killed = False
  done = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        done[out.request_id] = list(out.outputs[0].token_ids)
    if not killed and tier.stats()["pending_stores"]:
      redis_server.stop()  # mid-store
      killed = True
    engine.check_invariants()
  assert killed
  assert [done[i] for i in ids] == reference["dense"]
  tier.close()
  failures = tier.stats()["failures"]
  assert sum(failures.values()) > 0, failures
  # Still serving: the same prompts again (recomputed; the tier's loads fail or miss).
  assert _run(engine) == reference["dense"]
  assert _tier_metric(engine, "failures_total", "remote", reason="connection") > 0
  # One line for the failure's reason (rate-limited; the later calls that fail the same
  # way are counted, not logged again).
  lines = [w for w in _warnings(caplog) if "connection" in w.lower()]
  assert len(lines) == 1, _warnings(caplog)
  engine.close()


def test_the_gate_refuses_a_load_slower_than_recomputing(tmp_path, reference):
  first = _engine(disk_cache_dir=str(tmp_path))
  _run(first)
  first.close()
  engine = _engine(disk_cache_dir=str(tmp_path))
  tier = engine.tier.tiers[0]
  tier.backend = ThrottledBackend(tier.backend, bytes_per_s=1e5)  # ~100 KB/s
  # Prompts the tier lacks: their prefill steps measure the per-token prefill time (not a
  # step that compiled its program: the second prompt's chunks run the first's programs).
  compiled = []
  dispatch = engine.runner.dispatch

  def recording(batch, prev_tokens=None):
    handle = dispatch(batch, prev_tokens)
    compiled.append(handle.compiled)
    return handle

  engine.runner.dispatch = recording
  _run(engine, [RNG.integers(5, 250, 150).tolist()])
  measured = engine.tier.prefill_s_per_token
  assert (measured is None) == compiled[0]  # a compiling first chunk: not measured
  _run(engine, [RNG.integers(5, 250, 150).tolist()])
  assert engine.tier.prefill_s_per_token is not None
  engine.runner.dispatch = dispatch
  # The first stored prompt's load is allowed (no load measured yet) and measures ~100 KB/s.
  assert _run(engine, PROMPTS[:1]) == reference["dense"][:1]
  load_s, recompute_s = engine.tier.expected_seconds(tier, 10)
  assert load_s is not None and recompute_s is not None and load_s > recompute_s
  # The others are refused and recomputed.
  assert _run(engine, PROMPTS[1:]) == reference["dense"][1:]
  stats = engine.tier.stats()["disk"]
  assert stats["gate_refusals"] == 2 and stats["load_jobs"] == 1
  assert _tier_metric(engine, "gate_refusals_total", "disk") == 2
  engine.close()


def test_write_back_stores_at_host_eviction_and_at_close(tmp_path, reference):
  engine = _engine(disk_cache_dir=str(tmp_path), kv_tier_write_policy="write_back")
  assert _run(engine) == reference["dense"]
  assert engine.tier.stats()["disk"]["store_jobs"] == 0  # nothing evicted yet
  engine.close()  # flushes the host pool's cached blocks
  again = _engine(disk_cache_dir=str(tmp_path))
  full = sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS)
  assert _run(again) == reference["dense"]
  assert _tier_metric(again, "loaded_blocks_total", "disk") == full
  again.close()


def test_config_refusals_name_the_field():
  with pytest.raises(ValueError, match="disk_cache_dir: .*enable_prefix_caching"):
    EngineConfig(disk_cache_dir="/tmp/x", enable_prefix_caching=False)
  with pytest.raises(ValueError, match="disk_cache_gib must be a positive number"):
    EngineConfig(disk_cache_gib=float("nan"))
  with pytest.raises(ValueError, match="kv_tier_write_policy"):
    EngineConfig(kv_tier_write_policy="sometimes")
  with pytest.raises(ValueError, match="remote_cache_url: .*host_pool_gib"):
    EngineConfig(remote_cache_url="redis://x", host_pool_gib=0)


def test_a_request_aborted_while_its_load_runs_frees_everything(tmp_path, reference):
  first = _engine(disk_cache_dir=str(tmp_path))
  _run(first, PROMPTS[:1])
  first.close()
  engine = _engine(disk_cache_dir=str(tmp_path))
  tier = engine.tier.tiers[0]
  tier.backend = ThrottledBackend(tier.backend, bytes_per_s=2e5)  # a ~1 s load
  rid = engine.add_request(prompt_token_ids=PROMPTS[0], sampling_params=GREEDY)
  engine.step()
  assert engine.scheduler.loading and engine.tier.num_loading == 1
  assert engine.metrics()["hisparse_kv_tier_loading_requests"] == 1
  engine.check_invariants()  # (the load's host blocks are held, and counted)
  assert engine.abort_request(rid)
  engine.check_invariants()
  while engine.tier.num_loading:  # the load finishes; its blocks become host prefix hits
    engine.step()
    engine.check_invariants()
  _no_leaks(engine)
  assert engine.block_manager.host_pool.num_cached_blocks == (len(PROMPTS[0]) - 1) // BLOCK_SIZE
  # Served from those host blocks, with the recomputed tokens.
  assert _run(engine, PROMPTS[:1]) == reference["dense"][:1]
  engine.close()


def test_llm_and_the_generate_command_take_the_tier(tmp_path):
  from hisparse_jax.entrypoints.llm import LLM

  kwargs = dict(FIELDS, disk_cache_dir=str(tmp_path / "llm"))
  with LLM(**kwargs) as llm:
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
  with LLM(**kwargs) as llm:
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    assert llm.metrics()['hisparse_kv_tier_loaded_blocks_total{tier="disk"}'] > 0
  assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids

  def generate(*extra):
    out = subprocess.run(
        [sys.executable, "-m", "hisparse_jax", "generate", "--prompt=" + "bafu: bapo " * 40,
         "--max_new_tokens=6", f"--disk_cache_dir={tmp_path / 'cli'}", "--block_size=16",
         f"--metrics_json={tmp_path / 'm.json'}", *extra],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import json
    return out.stdout, json.loads((tmp_path / "m.json").read_text())

  text1, m1 = generate()
  text2, m2 = generate()
  assert text1.splitlines()[0].startswith("[0] ")
  assert text1.splitlines()[0] == text2.splitlines()[0]  # (the answer; timings differ)
  assert m1['hisparse_kv_tier_loaded_blocks_total{tier="disk"}'] == 0
  assert m2['hisparse_kv_tier_loaded_blocks_total{tier="disk"}'] > 0

"""At load, on a device with an allocator limit (GPU, TPU), the engine compiles its largest
prefill and decode steps and refuses a config whose step temporaries do not fit what the
weights and KV pools left (aot.check_step_footprint), instead of failing at the first
step. CPU reports no limit: nothing is compiled there. Here a CPU engine stands in for a
GPU by answering the free bytes itself."""

from __future__ import annotations

import pytest
from engine_fixtures import BLOCK_SIZE, MAX_MODEL_LEN, gib_for_blocks, tiny_model

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine import aot
from hisparse_jax.engine.engine import Engine, EngineConfig

HISPARSE = HiSparseConfig(top_k_tokens=16, hot_buffer_tokens=16, sink_tokens=8,
                          local_tokens=8, sparse_threshold_tokens=16)


def make_engine(model, hisparse=None) -> Engine:
  config = EngineConfig(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                        max_num_batched_tokens=16, hisparse=hisparse,
                        device_kv_gib=gib_for_blocks(model.config, 17),
                        host_pool_gib=gib_for_blocks(model.config, 33))
  return Engine(config, model=model, model_config=model.config)


def test_the_cpu_reports_no_limit_and_compiles_nothing_at_load(monkeypatch):
  calls = []
  monkeypatch.setattr(aot, "step_batches", lambda *a, **k: calls.append(a) or [])
  make_engine(tiny_model())
  assert aot.device_free_bytes(make_engine(tiny_model()).device_pool.device) is None
  assert calls == []


@pytest.mark.parametrize("hisparse", [None, HISPARSE], ids=["dense", "hisparse"])
def test_step_temporaries_over_the_free_device_memory_are_refused_at_load(monkeypatch,
                                                                          hisparse):
  monkeypatch.setattr(aot, "device_free_bytes", lambda device: 1024)
  with pytest.raises(ValueError, match=r"--device_kv_gib: the step program 'prefill' needs "
                                       r"[\d.]+ KiB of device memory beyond its arguments, "
                                       r"but the weights and the KV pools leave 1\.0 KiB"):
    make_engine(tiny_model(), hisparse)
  # With room for them the engine loads (every kind it checks compiled).
  seen = []
  real = aot.step_batches

  def recording(*args, **kwargs):
    out = real(*args, **kwargs)
    seen.extend(name for name, _, _ in out)
    return out

  monkeypatch.setattr(aot, "device_free_bytes", lambda device: 2**30)
  monkeypatch.setattr(aot, "step_batches", recording)
  engine = make_engine(tiny_model(), hisparse)
  assert sorted(seen) == sorted(["prefill", "decode" if hisparse is None else "tiered_decode"])
  assert engine.capacity is not None

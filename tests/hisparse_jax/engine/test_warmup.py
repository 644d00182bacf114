"""The warm-up (engine/warmup.py): which chunks a lone request runs; a warmed engine's
state is the state it had (pools bit for bit, block pools, metrics, the disk tier); and
after it, a restarted engine's disk-tier hits and their decodes lower no new program
(jax.monitoring's lowering events counted) and give the tokens the writer computed,
dense and HiSparse, with and without compile_in_background."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import pytest
from jax._src import monitoring

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine import warmup
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.engine.warmup import WarmChunk, lone_request_chunks

BLOCK_SIZE = 16
FIELDS = dict(block_size=BLOCK_SIZE, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, device_kv_gib=0.004, host_pool_gib=0.004)
RNG = np.random.default_rng(53)
# Tails of 8, 16 (a whole block: the last token is computed) and 4 tokens, widths 4 and 8.
PROMPTS = [RNG.integers(5, 250, n).tolist() for n in (40, 48, 100)]
# Decodes of the two longer prompts are sparse (top-k 32 tokens = 2 blocks).
SPARSE = HiSparseConfig(top_k_tokens=32, hot_buffer_tokens=32, sink_tokens=16,
                        local_tokens=16, sparse_threshold_tokens=48,
                        resident_sparse_min_tokens=0)
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def test_lone_request_chunks_cover_every_width_and_tail():
  # max_model_len 100, block 16: 7 blocks, widths 4 (contexts 1-64) and 7 (65-100), each
  # at its shortest and longest context; token buckets 16 and 32 (max_num_batched_tokens
  # 32); tails up to 16 tokens.
  chunks = lone_request_chunks(16, 100, 32, warmup.KINDS)
  assert chunks == [
      WarmChunk("decode", 1, 1, 1), WarmChunk("decode", 63, 63, 1),
      WarmChunk("decode", 64, 64, 1), WarmChunk("decode", 99, 99, 1),
      # (a one-token chunk is a decode row to the attention: a shape of its own)
      WarmChunk("tail", 2, 1, 1), WarmChunk("tail", 2, 0, 2),
      WarmChunk("tail", 64, 63, 1), WarmChunk("tail", 64, 48, 16),
      WarmChunk("tail", 65, 64, 1), WarmChunk("tail", 65, 49, 16),
      WarmChunk("tail", 99, 98, 1), WarmChunk("tail", 99, 83, 16),
      WarmChunk("prefill", 64, 32, 32), WarmChunk("prefill", 65, 33, 32),
      WarmChunk("prefill", 99, 67, 32)]
  assert lone_request_chunks(16, 100, 32) == chunks[:12]  # DEFAULT_KINDS: decode, tail
  with pytest.raises(ValueError, match="kinds must be among"):
    lone_request_chunks(16, 100, 32, ("decode", "prefil"))


@contextlib.contextmanager
def _lowerings():
  """Counts the programs JAX lowers inside the block (each new jit signature, whether
  the persistent cache then holds it or not)."""
  events = []

  def listener(name, seconds, **kwargs):
    del seconds, kwargs
    if name == LOWERING:
      events.append(name)

  monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    monitoring.unregister_event_duration_listener(listener)


def _engine(tmp_path, **overrides) -> Engine:
  return Engine(EngineConfig(**{**FIELDS, "disk_cache_dir": str(tmp_path / "disk"),
                                **overrides}))


def _serve(engine: Engine, prompt, sampling: SamplingParams) -> list[int]:
  rid = engine.add_request(prompt_token_ids=prompt, sampling_params=sampling)
  tokens = None
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.request_id == rid and out.finished:
        tokens = list(out.outputs[0].token_ids)
  return tokens


def _drop_cached_blocks(engine: Engine) -> None:
  """Forgets every cached block of both pools, so the next request's prefix comes from
  the disk tier."""
  for pool in engine.block_manager.pools.values():
    for block_id in pool.cached_block_ids_lru():
      pool.evict(block_id)


def _state(engine: Engine) -> dict:
  """What a warm-up must leave as it was: every device array of the runner and both
  pools (bytes), the block pools (free queue order, cached blocks, prefix-cache
  counters), the step clock, the metrics, the disk tier's blocks."""
  runner = engine.runner
  arrays = [*engine.device_pool.arrays(), *engine.host_pool.arrays(), *runner.bounds,
            *(runner.hot_state or ())]
  pools = {kind: (pool.free_block_ids(), pool.num_cached_blocks, pool.num_used_blocks,
                  pool.prefix_cache_queries, pool.prefix_cache_hits)
           for kind, pool in engine.block_manager.pools.items()}
  metrics = {k: v for k, v in engine.metrics().items()
             if k != 'hisparse_step_compiles{where="warmup"}'}
  return {"arrays": [np.asarray(jax.device_get(a)).tobytes() for a in arrays],
          "pools": pools, "clock": runner.step_clock, "metrics": metrics,
          "tier": engine.tier.stats()["disk"]["used_blocks"]}


@pytest.mark.parametrize("hisparse,background", [(None, True), (SPARSE, True),
                                                 (None, False)],
                         ids=["dense", "hisparse", "dense-jit"])
def test_restart_after_warm_up_lowers_nothing_and_keeps_tokens(tmp_path, hisparse,
                                                               background):
  greedy = SamplingParams(temperature=0.0, max_tokens=6)
  seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=6)
  writer = _engine(tmp_path, hisparse=hisparse)
  expected = [_serve(writer, p, sp) for p in PROMPTS for sp in (greedy, seeded)]
  writer.close()

  engine = _engine(tmp_path, hisparse=hisparse, compile_in_background=background)
  before = _state(engine)
  report = warmup.warm_up(engine)
  assert _state(engine) == before
  assert report.step_programs > 0 and report.block_programs > 0
  assert report.num_programs == report.step_programs + report.block_programs
  assert f"warm-up: {report.num_programs} programs" in report.log_line()
  if background:
    assert engine.runner.compiler.warmed == report.step_programs
    assert engine.runner.compiler.foreground == 0
    assert engine.metrics()['hisparse_step_compiles{where="warmup"}'] == report.step_programs

  got, loaded = [], 0
  with _lowerings() as lowered:
    for p in PROMPTS:
      for sp in (greedy, seeded):
        _drop_cached_blocks(engine)  # (each a lone request served from the disk tier)
        before_loads = engine.tier.stats()["disk"]["loaded_blocks"]
        got.append(_serve(engine, p, sp))
        loaded += engine.tier.stats()["disk"]["loaded_blocks"] - before_loads
  assert got == expected
  assert loaded == 2 * sum((len(p) - 1) // BLOCK_SIZE for p in PROMPTS)
  assert lowered == []
  if background:
    assert engine.runner.compiler.foreground == 0
    assert engine.runner.compiler.covered == 0
  engine.close()


def test_warm_up_refuses_an_engine_with_requests(tmp_path):
  engine = Engine(EngineConfig(**FIELDS))
  engine.add_request(prompt_token_ids=PROMPTS[0], sampling_params=SamplingParams())
  with pytest.raises(ValueError, match="before it takes any"):
    warmup.warm_up(engine)


def test_warm_up_keeps_within_its_share_of_max_step_programs(tmp_path):
  engine = Engine(EngineConfig(**FIELDS, compile_in_background=True, max_step_programs=6))
  report = warmup.warm_up(engine)
  assert report.step_programs == 3 and len(engine.runner.compiler.ready) == 3
  assert report.skipped_shapes > 0
  assert f"{report.skipped_shapes} step shapes left out" in report.log_line()


def test_a_dsa_engine_warms_up_unchanged_and_its_lone_requests_lower_nothing(tmp_path):
  """A DeepSeek-V3.2 engine (its own runner: latent + indexer-key caches, the learned
  indexer, HiSparse's token-granular hot buffer) warms up the same way."""
  from models import deepseek_v32_checkpoint, testing  # noqa: PLC0415 (transformers: DSA only)

  testing.save_random_dsa(tmp_path / "ckpt", "deepseek_v32")
  model, _ = deepseek_v32_checkpoint.load_pretrained(tmp_path / "ckpt")
  lightning = HiSparseConfig(indexer="lightning", hot_buffer_tokens=16,
                             sparse_threshold_tokens=16)
  config = EngineConfig(block_size=4, max_model_len=32, max_num_seqs=4,
                        max_num_batched_tokens=32, device_kv_gib=0.001, host_pool_gib=0.0004,
                        hisparse=lightning, compile_in_background=True)
  prompts = [RNG.integers(2, 97, n).tolist() for n in (5, 13, 20)]
  greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
  reference = Engine(config, model=model, model_config=model.config)
  expected = [_serve(reference, p, greedy) for p in prompts]
  engine = Engine(config, model=model, model_config=model.config)
  runner = engine.runner
  before = [np.asarray(jax.device_get(a)).tobytes()
            for a in (*engine.device_pool.arrays(), *runner.bounds, *runner.hot_state)]
  report = warmup.warm_up(engine)
  assert report.step_programs > 0 and report.block_programs > 0
  assert [np.asarray(jax.device_get(a)).tobytes()
          for a in (*engine.device_pool.arrays(), *runner.bounds, *runner.hot_state)] == before
  with _lowerings() as lowered:
    got = [_serve(engine, p, greedy) for p in prompts]
  assert got == expected and lowered == []

"""HiSparse's admission by offload (#53): a waiting request is admitted by offloading
running sparse decoders, and streamed in when its whole prompt does not fit even then, so
as many requests decode at once as the capacity line's "HiSparse runs N at once" says;
admission "wait" (the policy hisparse_throughput compares) waits for free blocks."""

import re

import numpy as np
import pytest

from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.engine import Engine
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.sparse.config import HiSparseConfig

MAX_MODEL_LEN = 512
PROMPT_LEN, NEW_TOKENS = 300, 212  # each request reaches max_model_len


def _engine(admission: str) -> Engine:
  # hisparse-tiny: 1,024 bytes of KV per token, 16 KiB a block of 16; the device holds
  # 5.7 requests of 512 tokens, the host pool 40.
  return Engine(EngineConfig(
      model=None, block_size=16, max_model_len=MAX_MODEL_LEN, device_kv_gib=0.0035,
      host_pool_gib=0.02, max_num_seqs=64, max_num_batched_tokens=128,
      enable_prefix_caching=False,
      hisparse=HiSparseConfig(top_k_tokens=64, admission=admission)))


def _run(engine: Engine, num_requests: int) -> dict:
  rng = np.random.default_rng(0)
  params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
  for i in range(num_requests):
    engine.add_request(str(i), prompt_token_ids=[int(t) for t in rng.integers(5, 200, PROMPT_LEN)],
                       sampling_params=params)
  most, streamed, tokens = 0, set(), {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        tokens[out.request_id] = list(out.outputs[0].token_ids)
    decoding = [r for r in engine.scheduler.running if not r.is_prefilling]
    most = max(most, len(decoding))
    streamed |= {r.request_id for r in engine.scheduler.running if r.streamed}
  return {"most": most, "streamed": streamed, "tokens": tokens, "metrics": engine.metrics()}


def _line_running(engine: Engine) -> int:
  line = engine.capacity.log_lines(MAX_MODEL_LEN)[-1]
  return int(re.search(r"HiSparse runs (\d+) at once", line).group(1))


def test_as_many_decode_at_once_as_the_capacity_line_says():
  engine = _engine("offload")
  running = _line_running(engine)
  device_only = engine.capacity.max_concurrency(MAX_MODEL_LEN, ("device",))
  assert running > 2 * device_only  # (17 here, against 5.7; 30 at 0.0055 GiB, 9.6)
  result = _run(engine, running + 4)
  assert result["most"] == running
  # Prompts that fit the device pool were streamed in beside the offloaded decoders.
  assert result["streamed"]
  m = result["metrics"]
  assert m["hisparse_offloads_total"] > 0
  assert m['hisparse_blocks_selected_total{source="host"}'] > 0
  # Nothing leaked: every block is back.
  assert engine.block_manager.device_pool.num_free_blocks == engine.device_pool.num_blocks - 1
  assert engine.block_manager.host_pool.num_free_blocks == engine.host_pool.num_blocks - 1


def test_admission_wait_runs_fewer_and_says_so():
  engine = _engine("wait")
  line = engine.capacity.log_lines(MAX_MODEL_LEN)[-1]
  assert "HiSparse admission 'wait': a waiting request waits for free device blocks" in line
  result = _run(engine, 21)
  offload = _line_running(_engine("offload"))
  assert not result["streamed"]  # every prompt fits the pool: none streams when waiting
  assert result["most"] < offload
  assert len(result["tokens"]) == 21


def test_unknown_admission_is_refused_naming_the_field():
  with pytest.raises(ValueError, match=r"HiSparseConfig.admission must be one of"):
    HiSparseConfig(admission="eager")

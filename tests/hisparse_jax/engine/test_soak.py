"""Soak: many short and long retrieval requests on the default model, arriving in waves on
a device pool too small for them, against an unpressured run of the same requests.

The pressured engine's device pool holds one long request and a few short ones; as they
decode they outgrow it, and the newest running requests are swapped out to the host pool
and come back later. The unpressured run is a fresh engine of the same shapes (so the
compiled programs are shared) fed groups that fit its device pool at once: no preemption,
no transfer. Every request's tokens must be identical; no block may leak; every request
ends exactly once. (Measured: 7 preemptions; 21 blocks copied to the host pool and 7
back, the other swapped-out blocks found again in the device prefix cache; ~1,750 steps.)
"""

import pytest
from engine_fixtures import assert_all_blocks_free, run

from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec
from models.data import make_retrieval_prompts
from models.loader import load_pretrained

BLOCK_SIZE = 16
MAX_MODEL_LEN = 384  # 24 blocks
LONG = [p.token_ids for p in make_retrieval_prompts(8, 300, seed=9101)]  # 19 blocks each
SHORT = [p.token_ids for p in make_retrieval_prompts(40, 40, seed=9102)]  # 3 blocks each
MAX_TOKENS = {"l": 64, "s": 32}  # by request kind: +4 blocks (long), +2 (short)
# 30 usable device blocks: one long request and a few short ones. Four sequences and
# 16 tokens per step keep the compiled shapes to three (compilation is most of this test).
DEVICE_BLOCKS = 1 + 30
HOST_BLOCKS = 1 + 4 * (MAX_MODEL_LEN // BLOCK_SIZE)


@pytest.fixture(scope="module")
def default_model():
  return load_pretrained(None)


def _engine(default_model, num_device_blocks: int) -> Engine:
  model, config, tokenizer = default_model
  spec = KVCacheSpec.from_model_config(config, "float32", BLOCK_SIZE)
  gib = lambda n: (n + 0.5) * spec.bytes_per_block / 2**30
  engine = Engine(EngineConfig(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                               max_num_seqs=4, max_num_batched_tokens=16,
                               device_kv_gib=gib(num_device_blocks),
                               host_pool_gib=gib(HOST_BLOCKS)),
                  model=model, model_config=config, tokenizer=tokenizer)
  assert engine.device_pool.num_blocks == num_device_blocks
  return engine


def _requests():
  """(request id, prompt) in arrival order: a long request after every five short ones."""
  out = []
  for i, prompt in enumerate(SHORT):
    out.append((f"s{i}", prompt))
    if i % 5 == 4:
      out.append((f"l{i // 5}", LONG[i // 5]))
  return out


def test_soak_many_short_and_long_requests_match_an_unpressured_run(default_model):
  requests = _requests()
  params = {kind: SamplingParams(temperature=0.0, max_tokens=n) for kind, n in MAX_TOKENS.items()}

  pressured = _engine(default_model, DEVICE_BLOCKS)
  outputs = {}
  for wave in range(0, len(requests), 6):  # waves of 6 arrivals, 3 steps apart
    for request_id, prompt in requests[wave:wave + 6]:
      pressured.add_request(request_id, prompt_token_ids=prompt,
                            sampling_params=params[request_id[0]])
    for _ in range(3):
      for out in pressured.step():
        if out.finished:
          assert out.request_id not in outputs, f"{out.request_id} finished twice"
          outputs[out.request_id] = out
      pressured.check_invariants()
  outputs.update(run(pressured))
  assert sorted(outputs) == sorted(r for r, _ in requests)
  m = pressured.metrics()
  assert m["hisparse_preemptions_total"] > 0
  assert m['hisparse_transfer_blocks_total{direction="d2h"}'] > 0
  assert any(o.metrics.num_preemptions for o in outputs.values())
  assert_all_blocks_free(pressured)

  unpressured = _engine(default_model, DEVICE_BLOCKS)
  # The short requests together (4 at most run, 5 blocks each at the end), long ones alone.
  groups = [[r for r in requests if r[0][0] == "s"]] + [[r] for r in requests if r[0][0] == "l"]
  expected = {}
  for group in groups:
    for request_id, prompt in group:
      unpressured.add_request(request_id, prompt_token_ids=prompt,
                            sampling_params=params[request_id[0]])
    expected.update(run(unpressured))
  mu = unpressured.metrics()
  assert mu["hisparse_preemptions_total"] == 0
  assert mu['hisparse_transfer_blocks_total{direction="d2h"}'] == 0
  assert_all_blocks_free(unpressured)

  for request_id, _ in requests:
    got, want = outputs[request_id], expected[request_id]
    assert got.outputs[0].finish_reason == want.outputs[0].finish_reason != "error", request_id
    assert got.outputs[0].token_ids == want.outputs[0].token_ids, request_id

"""HiSparse in the engine: sparse decode rows over the indexer's selection (device-resident).

The tiny random Llama of engine_fixtures (block_size 8, max_model_len 64), the full-recompute
dense reference, invariants after every step (`run`). A device budget of 15 dense blocks
plans 13 blocks with HiSparse (an eighth of a block's bytes per block go to key bounds), so
the six prompts swap out to the host pool and back as in test_engine. Steps compute at most
16 tokens (prefill in chunks of 16), so every step pads to one token bucket and the file
compiles few programs (compilation is nearly all of its time).
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver
from engine_fixtures import (
  BLOCK_SIZE,
  MAX_MODEL_LEN,
  NUM_HOST_BLOCKS,
  add_all,
  assert_all_blocks_free,
  gib_for_blocks,
  random_prompts,
  reference_greedy,
  run,
  tiny_model,
)

import kernels_pallas
import models
from hisparse_jax import HiSparseConfig, cli, generate_cmd  # noqa: F401 (cli defines the flags)
from hisparse_jax.engine import Engine, EngineConfig
from hisparse_jax.runner import bounds_bytes_per_block
from hisparse_jax.sampling import SamplingParams
from models import data

PROMPTS = random_prompts((5, 17, 40, 33, 9, 3), seed=0)
NUM_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NUM_TOKENS)
# top_k covers max_model_len (8 blocks): every sparse row selects all its blocks.
FULL = HiSparseConfig(top_k_tokens=MAX_MODEL_LEN, sink_tokens=8, local_tokens=8,
                      sparse_threshold_tokens=16)
# Two blocks per sparse step: the sink block and the newest one.
SMALL = HiSparseConfig(top_k_tokens=16, sink_tokens=8, local_tokens=8,
                       sparse_threshold_tokens=16)
BLOCKS = '{source="device"}'


def _engine(hisparse, num_dense_blocks=15, model=None, **overrides):
  model = model if model is not None else tiny_model()
  fields = dict(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                max_num_batched_tokens=16,
                device_kv_gib=gib_for_blocks(model.config, num_dense_blocks),
                host_pool_gib=gib_for_blocks(model.config, NUM_HOST_BLOCKS), hisparse=hisparse)
  return Engine(EngineConfig(**{**fields, **overrides}), model=model, model_config=model.config)


def _count_sparse_rows(engine):
  """Wraps build_batch; returns a list that gets each step's number of sparse rows."""
  counts, build = [], engine.runner.build_batch

  def recording(chunks, tables):
    batch = build(chunks, tables)
    counts.append(int(batch.metadata.sparse_rows.sum()))
    return batch

  engine.runner.build_batch = recording
  return counts


def _assert_bounds_exact(engine):
  """The bounds of every block a running request holds equal the reference recomputed from
  the pages over its valid tokens (exactly)."""
  bs = engine.config.block_size
  slots = []
  for request in engine.scheduler.running:
    for i, block_id in enumerate(engine.block_manager.block_table(request.request_id)):
      fill = min(bs, request.num_computed_tokens - i * bs)
      if fill > 0:
        slots.append(block_id * bs + fill - 1)
  padded = np.full(engine.device_pool.num_blocks, -1, np.int32)
  padded[:len(slots)] = slots
  ids = np.array(slots, np.int64) // bs
  for layer, bounds in enumerate(engine.runner.bounds):
    k_pages = engine.device_pool.k[layer]
    expected = kernels_pallas.block_key_bounds_reference(jnp.zeros_like(bounds), k_pages,
                                                         jnp.asarray(padded))
    np.testing.assert_array_equal(np.asarray(bounds)[ids], np.asarray(expected)[ids])
  return len(slots)


@pytest.fixture(scope="module")
def reference():
  return reference_greedy(tiny_model(), PROMPTS, NUM_TOKENS)


def test_full_top_k_gives_the_dense_tokens_under_swap_pressure_with_exact_bounds(reference):
  engine = _engine(FULL)
  assert engine.device_pool.num_blocks == 13
  sparse_rows = _count_sparse_rows(engine)
  checked = []
  step = engine.step

  def checking_step():
    outputs = step()
    checked.append(_assert_bounds_exact(engine))
    return outputs

  engine.step = checking_step
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  assert [outputs[f"r{i}"].token_ids for i in range(len(PROMPTS))] == reference
  assert sum(sparse_rows) > 50  # most decode rows of the longer prompts took the sparse path
  assert sum(checked) > 100
  m = engine.metrics()
  assert m["hisparse_preemptions_total"] > 0 and m[f"hisparse_blocks_selected_total{BLOCKS}"] > 0
  assert_all_blocks_free(engine)


def test_key_bounds_are_device_reserved_bytes_in_the_capacity_report():
  engine = _engine(FULL)
  spec_bytes = bounds_bytes_per_block(engine.device_pool.spec)
  assert spec_bytes == 2 * 2 * 2 * 8 * 4  # layers x (min, max) x kv heads x head_dim x f32
  assert engine.runner.reserved_bytes == engine.device_pool.num_blocks * spec_bytes
  assert engine.capacity["device"].reserved_bytes == engine.runner.reserved_bytes
  for bounds in engine.runner.bounds:
    assert bounds.shape == (13, 2, 2, 8) and bounds.sharding.memory_kind == "device"
  dense = _engine(None)
  assert dense.runner.bounds == () and dense.capacity["device"].reserved_bytes == 0
  assert dense.device_pool.num_blocks == 15


@pytest.mark.parametrize("hisparse", [None, SMALL], ids=["dense", "top_k_2_blocks"])
def test_blocks_selected_counts_what_attention_read(hisparse):
  engine = _engine(hisparse, num_dense_blocks=40)
  prompt = random_prompts((40,), seed=5)[0]
  engine.add_request("a", prompt_token_ids=prompt, sampling_params=GREEDY)
  out = run(engine)["a"]
  assert len(out.token_ids) == NUM_TOKENS
  # Prefill in chunks of 16, 16, 8 tokens: 2 + 4 + 5 blocks; then 19 decode steps over
  # 41..59 tokens, each reading all its blocks (dense) or 2 (the sink and newest blocks).
  dense_decode = sum(-(-(40 + i) // BLOCK_SIZE) for i in range(1, NUM_TOKENS))
  expected = 11 + (dense_decode if hisparse is None else 2 * (NUM_TOKENS - 1))
  assert (dense_decode, expected) == (128, 139 if hisparse is None else 49)
  assert out.blocks_selected == {"device": expected, "hot": 0, "host": 0}
  assert engine.metrics()[f"hisparse_blocks_selected_total{BLOCKS}"] == expected
  assert_all_blocks_free(engine)


def test_small_top_k_runs_every_request_to_completion(reference):
  engine = _engine(SMALL)
  sparse_rows = _count_sparse_rows(engine)
  add_all(engine, PROMPTS[2:], SamplingParams(max_tokens=12))
  outputs = run(engine)
  assert {o.finish_reason for o in outputs.values()} == {"length"}
  assert all(len(o.token_ids) == 12 for o in outputs.values())
  assert sum(sparse_rows) > 20
  # The 3-token prompt never has more than 14 tokens in the cache: dense throughout.
  assert outputs["r3"].token_ids == reference[5][:12]
  assert_all_blocks_free(engine)


def test_engine_config_validates_hisparse():
  with pytest.raises(ValueError, match="per_kv_head"):
    EngineConfig(hisparse=HiSparseConfig(top_k_tokens=64, sink_tokens=16, local_tokens=16,
                                         selection="per_kv_head"))
  with pytest.raises(ValueError, match="round to 1 \\+ 1 blocks"):
    EngineConfig(block_size=16, hisparse=HiSparseConfig(top_k_tokens=16, sink_tokens=8,
                                                        local_tokens=8))
  with pytest.raises(ValueError, match="must be a HiSparseConfig"):
    EngineConfig(hisparse={"top_k_tokens": 64})
  assert EngineConfig().hisparse is None  # off by default


def test_cli_flags_build_the_hisparse_config():
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", "--hisparse", "--top_k_tokens=256", "--sink_tokens=16",
                 "--local_tokens=32", "--sparse_threshold_tokens=300"])
    assert generate_cmd.engine_kwargs_from_flags()["hisparse"] == HiSparseConfig(
        top_k_tokens=256, hot_buffer_tokens=512, sink_tokens=16, local_tokens=32,
        sparse_threshold_tokens=300)
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", "--hisparse", "--top_k_tokens=64", "--hot_buffer_tokens=32"])
    with pytest.raises(ValueError, match="^--hot_buffer_tokens \\(32\\) must be >= "):
      generate_cmd.hisparse_from_flags()
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", "--top_k_tokens=64"])
    with pytest.raises(ValueError, match="--top_k_tokens is a HiSparse setting; add --hisparse"):
      generate_cmd.hisparse_from_flags()
  with flagsaver.flagsaver():
    flags.FLAGS(["prog"])
    assert generate_cmd.engine_kwargs_from_flags()["hisparse"] is None


def test_default_model_sparse_equals_dense_on_retrieval_prompts():
  from hisparse_jax.llm import LLM

  if not os.path.isfile(os.path.join(models.DEFAULT_MODEL_DIR, "model.safetensors")):
    pytest.skip("the default model is not trained yet")
  prompts = data.make_retrieval_prompts(2, 150, seed=21)
  full = HiSparseConfig(top_k_tokens=192, sink_tokens=16, local_tokens=16,
                        sparse_threshold_tokens=32)
  llm = LLM(hisparse=full, block_size=16, max_model_len=192, max_num_seqs=2,
            max_num_batched_tokens=16, device_kv_gib=0.002, host_pool_gib=0.002)
  sparse_rows = _count_sparse_rows(llm.engine)
  outputs = llm.generate([p.text for p in prompts], SamplingParams(max_tokens=5,
                                                                   ignore_eos=True))
  dense = reference_greedy(llm.engine.model, [p.token_ids for p in prompts], 5)
  assert [o.token_ids for o in outputs] == dense
  assert sum(sparse_rows) == 2 * 4  # every decode step of both prompts

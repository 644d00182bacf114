"""What test_hisparse_engine.py and test_hisparse_engine_resources.py share: the prompts
and sampling, the two HiSparse configs (FULL: top-k covering max_model_len; SMALL: two
blocks a step), the engine over the tiny random Llama of engine_fixtures with a device
budget of `num_dense_blocks` dense blocks, and a counter of each step's sparse rows."""

from engine_fixtures import (
  BLOCK_SIZE,
  MAX_MODEL_LEN,
  NUM_HOST_BLOCKS,
  SIX_PROMPTS,
  gib_for_blocks,
  tiny_model,
)

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams

PROMPTS = SIX_PROMPTS
NUM_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
# The configs below take the sparse path for every long decode row, offloaded or resident
# (resident_sparse_min_tokens=0: the toy's rows are far too short for the default cost
# rule, which would decode resident ones densely; that rule has its own test).
# top_k covers max_model_len (8 blocks): every sparse row selects all its blocks.
FULL = HiSparseConfig(top_k_tokens=MAX_MODEL_LEN, hot_buffer_tokens=MAX_MODEL_LEN,
                      sink_tokens=8, local_tokens=8, sparse_threshold_tokens=16,
                      resident_sparse_min_tokens=0)
# Two blocks per sparse step: the sink block and the newest one; a hot buffer of 2 blocks.
SMALL = HiSparseConfig(top_k_tokens=16, hot_buffer_tokens=16, sink_tokens=8, local_tokens=8,
                       sparse_threshold_tokens=16, resident_sparse_min_tokens=0)
BLOCKS = '{source="device"}'


def make_engine(hisparse, num_dense_blocks=17, model=None, **overrides):
  """An Engine over `model` (default: the tiny random Llama) with HiSparse config
  `hisparse` (None: dense); `overrides`: other EngineConfig fields."""
  model = model if model is not None else tiny_model()
  fields = dict(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                max_num_batched_tokens=16,
                device_kv_gib=gib_for_blocks(model.config, num_dense_blocks),
                host_pool_gib=gib_for_blocks(model.config, NUM_HOST_BLOCKS), hisparse=hisparse)
  return Engine(EngineConfig(**{**fields, **overrides}), model=model, model_config=model.config)


def count_sparse_rows(engine):
  """Wraps build_batch; returns a list that gets each step's number of sparse rows."""
  counts, build = [], engine.runner.build_batch

  def recording(chunks, tables, tiers=None):
    batch = build(chunks, tables, tiers)
    counts.append(int(batch.metadata.sparse_rows.sum()))
    return batch

  engine.runner.build_batch = recording
  return counts

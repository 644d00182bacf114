"""The engine on the Pallas kernels (interpret mode on this CPU) gives the tokens of the
xla backend, dense and HiSparse with blocks loaded from the host pool inside the step.

The same kernel bodies lower through Triton on a GPU (test_lowering_cuda.py), so this is
the CPU check that the engine drives them right: block tables, ragged rows, 0-token rows,
key bounds and hot-buffer loads. Small on purpose: interpret mode runs each kernel's grid
as loops.
"""

from __future__ import annotations

import pytest
from engine_fixtures import (
  BLOCK_SIZE,
  MAX_MODEL_LEN,
  NUM_HOST_BLOCKS,
  SIX_PROMPTS,
  add_all,
  assert_all_blocks_free,
  gib_for_blocks,
  run,
  tiny_model,
)

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)
# Every long decode row sparse, resident or not (resident_sparse_min_tokens=0).
FULL = HiSparseConfig(top_k_tokens=MAX_MODEL_LEN, hot_buffer_tokens=MAX_MODEL_LEN,
                      sink_tokens=8, local_tokens=8, sparse_threshold_tokens=16,
                      resident_sparse_min_tokens=0)


def _tokens(kernel_backend, hisparse=None):
  model = tiny_model()
  engine = Engine(EngineConfig(
      block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
      max_num_batched_tokens=16, device_kv_gib=gib_for_blocks(model.config, 17),
      host_pool_gib=gib_for_blocks(model.config, NUM_HOST_BLOCKS), hisparse=hisparse,
      kernel_backend=kernel_backend), model=model, model_config=model.config)
  assert engine.runner.ops.backend == kernel_backend
  add_all(engine, SIX_PROMPTS, GREEDY)
  outputs = run(engine)
  assert_all_blocks_free(engine)
  return [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(SIX_PROMPTS))], engine


def test_dense_engine_on_pallas_kernels_equals_xla():
  pallas, _ = _tokens("pallas")
  xla, _ = _tokens("xla")
  assert pallas == xla


@pytest.mark.parametrize("hisparse", [FULL], ids=["full_top_k"])
def test_hisparse_engine_on_pallas_kernels_equals_xla(hisparse):
  pallas, engine = _tokens("pallas", hisparse)
  m = engine.metrics()
  # The Pallas engine took the sparse path and loaded blocks from the host pool.
  assert m["hisparse_hot_buffer_loads_total"] > 0
  assert m['hisparse_blocks_selected_total{source="host"}'] > 0
  xla, _ = _tokens("xla", hisparse)
  assert pallas == xla

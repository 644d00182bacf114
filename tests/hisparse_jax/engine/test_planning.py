"""The settings an engine decides from its budget (engine/planning.resolve_config, #53):
max_num_batched_tokens left unset is 2,048 (max_model_len without chunked prefill), and
with HiSparse the largest prefill chunk the device budget streams a prompt longer than
the device pool through, so such a prompt is served at the flags' budget instead of
refused; only when not even a one-block chunk streams does the engine refuse, naming the
flags that help. The hot-buffer state has a row per sequence that can be offloaded at once
(each holds a hot buffer of device blocks), not one per seat."""

import dataclasses

import pytest
from engine_fixtures import assert_all_blocks_free, gib_for_blocks, random_prompts, run, tiny_model

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.planning import resolve_config
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.kv_cache.capacity import num_hot_rows
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec

MAX_MODEL_LEN = 256
# hot buffer 4 blocks of 8 tokens; a prompt of 25 blocks streams through a smaller pool.
HISPARSE = HiSparseConfig(top_k_tokens=32, hot_buffer_tokens=32, sink_tokens=8,
                          local_tokens=8, sparse_threshold_tokens=32)


def _config(device_blocks, hisparse=HISPARSE, **overrides):
  model = tiny_model()
  fields = dict(block_size=8, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                device_kv_gib=gib_for_blocks(model.config, device_blocks),
                host_pool_gib=gib_for_blocks(model.config, 80), hisparse=hisparse)
  return EngineConfig(**{**fields, **overrides}), model


def _resolve(config, model):
  spec = KVCacheSpec.from_model_config(model.config, config.dtype, config.block_size)
  return resolve_config(config, spec, is_dsa=False)


def test_an_unset_chunk_is_the_default_or_max_model_len_without_chunked_prefill():
  config, model = _config(64, hisparse=None)
  assert config.max_num_batched_tokens is None
  assert _resolve(config, model).max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
  long = dataclasses.replace(config, max_model_len=4096, enable_chunked_prefill=False,
                             device_kv_gib=gib_for_blocks(model.config, 600))
  assert _resolve(long, model).max_num_batched_tokens == 4096
  given = dataclasses.replace(config, max_num_batched_tokens=48)
  assert _resolve(given, model).max_num_batched_tokens == 48
  # HiSparse with room for the default chunk: the default.
  roomy, model = _config(600)
  assert _resolve(roomy, model).max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS


def test_hisparse_chunk_is_what_the_device_budget_streams():
  # 24 planned blocks: 16 usable after the key bounds (test_streamed_prefill's budget),
  # where a 2,048-token chunk (256 blocks) could never stream: 16 - 4 hot - 2 = 10 blocks.
  config, model = _config(24)
  assert _resolve(config, model).max_num_batched_tokens == 10 * 8
  engine = Engine(config, model=model, model_config=model.config)
  assert engine.config.max_num_batched_tokens == 80
  assert engine.scheduler.max_num_batched_tokens == engine.runner.max_num_batched_tokens == 80
  assert engine.device_pool.num_blocks - 1 == 16
  assert ("its prefill streams through 16 device blocks (chunks of 80 tokens)"
          in engine.capacity.log_lines(MAX_MODEL_LEN)[-1])
  prompt = random_prompts([200], seed=3)[0]  # 25 blocks > 16: streams
  engine.add_request("long", prompt_token_ids=prompt,
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=4))
  outputs = run(engine)
  assert len(outputs["long"].outputs[0].token_ids) == 4
  assert engine.metrics()["hisparse_offloads_total"] >= 1
  assert_all_blocks_free(engine)


def test_no_chunk_streams_refused_naming_the_flags_that_help():
  # 6 usable blocks < 4 hot + 1 + 2: not even one block's chunk streams (14: 7 do).
  config, model = _config(13)
  with pytest.raises(ValueError) as e:
    _resolve(config, model)
  message = str(e.value)
  assert "--device_kv_gib" in message and "\n" not in message
  assert "a prefill chunk of one block at the least" in message
  assert "raise --device_kv_gib or lower --max_model_len or --hot_buffer_tokens" in message
  assert "--max_num_batched_tokens" not in message  # (there is no smaller chunk)


def test_hot_state_rows_are_the_offloaded_sequences_the_device_holds():
  assert num_hot_rows(256, 167, 128) == 1  # 166 usable blocks: one hot buffer of 128
  assert num_hot_rows(256, 1025, 64) == 16
  assert num_hot_rows(4, 1025, 64) == 4  # (at most a row per seat)
  assert num_hot_rows(4, 10, 64) == 1  # (at least one)
  config, model = _config(24, max_num_seqs=64)
  engine = Engine(config, model=model, model_config=model.config)
  assert engine.runner.num_hot_rows == 16 // 4  # 16 usable blocks, hot buffers of 4
  assert engine.runner.hot_state[0].shape[0] == 4


def test_a_default_hot_buffer_gives_way_to_the_prefill_chunk():
  # Hot buffer left to its default (2 x 32 = 8 blocks): 17 usable (2 hot-state rows, not
  # 4) - 8 - 2 = 7 blocks of chunk (56 tokens, below MIN_AUTO_CHUNK_TOKENS); lowered to
  # the top-k (4 blocks), 16 - 4 - 2 = 10.
  default_hot = HiSparseConfig(top_k_tokens=32, sink_tokens=8, local_tokens=8)
  config, model = _config(24, hisparse=default_hot)
  resolved = _resolve(config, model)
  assert (resolved.hisparse.hot_buffer_tokens, resolved.hisparse.sparse_threshold_tokens,
          resolved.max_num_batched_tokens) == (32, 32, 80)
  # One given keeps its value: the chunk is what is left beside it.
  given = dataclasses.replace(default_hot, hot_buffer_tokens=64)
  config, model = _config(24, hisparse=given)
  resolved = _resolve(config, model)
  assert (resolved.hisparse.hot_buffer_tokens, resolved.max_num_batched_tokens) == (64, 56)

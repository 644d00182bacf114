"""HiSparseConfig: defaults, validation naming the field, token -> block conversion."""

import dataclasses
import re

import pytest

from hisparse_jax.sparse.config import HiSparseConfig


def test_defaults_follow_top_k():
  config = HiSparseConfig(top_k_tokens=512)
  assert config.hot_buffer_tokens == 1024  # 2 x top_k, as SGLang's device buffer
  assert config.sparse_threshold_tokens == 1024  # the hot-buffer size
  assert config.indexer == "block_bounds" and config.selection == "union"
  assert config.streamed_prefill == "exact"
  assert not config.is_sparse(1024) and config.is_sparse(1025)


def test_sink_and_local_defaults_follow_top_k():
  assert (HiSparseConfig().sink_tokens, HiSparseConfig().local_tokens) == (64, 256)
  assert (HiSparseConfig(top_k_tokens=1024).sink_tokens,
          HiSparseConfig(top_k_tokens=1024).local_tokens) == (64, 256)
  small = HiSparseConfig(top_k_tokens=256)  # was refused: 64 + 256 > 256
  assert (small.sink_tokens, small.local_tokens) == (32, 64)
  assert small.blocks(16).sink_blocks + small.blocks(16).local_blocks <= 16
  assert HiSparseConfig(top_k_tokens=256, sink_tokens=0).local_tokens == 64  # given wins


@pytest.mark.parametrize("max_model_len, block_size, top_k, hot, sink, local", [
    (2048, 16, 512, 1024, 64, 128),  # the CLI's defaults: past 1,024 tokens, sparse
    (2048, 4, 512, 1024, 64, 128),
    (4096, 16, 1024, 2048, 64, 256),
    (32768, 16, 2048, 4096, 64, 256),  # at most the library default
    (1000, 16, 256, 512, 32, 64),  # a quarter, rounded up to whole blocks
    (64, 16, 64, 128, 8, 16),  # at least 4 blocks
    (64, 128, 512, 1024, 64, 128),
])
def test_settings_derived_from_max_model_len(max_model_len, block_size, top_k, hot, sink,
                                             local):
  config = HiSparseConfig.for_max_model_len(max_model_len, block_size)
  assert (config.top_k_tokens, config.hot_buffer_tokens, config.sink_tokens,
          config.local_tokens, config.sparse_threshold_tokens) == (top_k, hot, sink, local, hot)
  config.blocks(block_size)  # the rounding keeps sink + local inside the top-k
  if max_model_len > 2 * top_k:
    assert config.is_sparse(max_model_len - 1)


def test_given_settings_win_over_derived_ones():
  config = HiSparseConfig.for_max_model_len(2048, 16, top_k_tokens=256, hot_buffer_tokens=None,
                                            sparse_threshold_tokens=300)
  assert (config.top_k_tokens, config.hot_buffer_tokens, config.sink_tokens,
          config.local_tokens, config.sparse_threshold_tokens) == (256, 512, 32, 64, 300)


def test_blocks_round_up_and_keep_one_local_block():
  config = HiSparseConfig(top_k_tokens=100, hot_buffer_tokens=130, sink_tokens=1,
                          local_tokens=0, sparse_threshold_tokens=200)
  blocks = config.blocks(16)
  assert (blocks.top_k_blocks, blocks.hot_buffer_blocks, blocks.sink_blocks,
          blocks.local_blocks, blocks.sparse_threshold_blocks) == (7, 9, 1, 1, 13)
  assert config.blocks(64).top_k_blocks == 2


@pytest.mark.parametrize("kwargs, field", [
    ({"top_k_tokens": 0}, "top_k_tokens"),
    ({"top_k_tokens": 64, "hot_buffer_tokens": 32}, "hot_buffer_tokens"),
    ({"sink_tokens": -1}, "sink_tokens"),
    ({"local_tokens": -4}, "local_tokens"),
    ({"top_k_tokens": 64, "sink_tokens": 32, "local_tokens": 48}, "sink_tokens + local_tokens"),
    ({"sparse_threshold_tokens": 0}, "sparse_threshold_tokens"),
    ({"thrash_window_steps": -1}, "thrash_window_steps"),
    ({"indexer": "random"}, "indexer"),
    ({"selection": "per_token"}, "selection"),
    ({"streamed_prefill": "dense"}, "streamed_prefill"),
    ({"top_k_tokens": 64.0}, "top_k_tokens"),
    ({"sink_tokens": True}, "sink_tokens"),
])
def test_invalid_field_is_named(kwargs, field):
  with pytest.raises(ValueError, match=re.escape(f"HiSparseConfig.{field}")):
    HiSparseConfig(**kwargs)


def test_lightning_takes_the_model_index_topk():
  # A DSA model's learned indexer: its index_topk is the top-k, no sink / local window;
  # the hot buffer must hold index_topk tokens; index_topk must be below max_model_len.
  config = HiSparseConfig(indexer="lightning", hot_buffer_tokens=64)
  runs = config.for_index_topk(32, max_model_len=128)
  assert (runs.top_k_tokens, runs.sink_tokens, runs.local_tokens) == (32, 0, 0)
  assert runs.blocks(4).hot_buffer_blocks == 16 and runs.blocks(4).top_k_blocks == 8
  with pytest.raises(ValueError, match=re.escape("hot_buffer_tokens (64) must be >= the "
                                                 "model's index_topk (128)")):
    config.for_index_topk(128, max_model_len=256)
  with pytest.raises(ValueError, match="index_topk=128 .* is not below max_model_len=128"):
    config.for_index_topk(128, max_model_len=128)
  with pytest.raises(ValueError, match="use indexer='lightning'"):
    HiSparseConfig(top_k_tokens=64, indexer="block_bounds").for_index_topk(32, 128)


def test_dsa_defaults_follow_the_model_index_topk():
  # Settings left to their defaults follow index_topk (#53), not the block top-k's
  # default (2,048: a hot buffer of 4,096); the ones given win.
  runs = HiSparseConfig().for_index_topk(9, max_model_len=64)
  assert (runs.indexer, runs.top_k_tokens, runs.hot_buffer_tokens,
          runs.sparse_threshold_tokens) == ("lightning", 9, 18, 18)
  # At most half of max_model_len (never below index_topk): long requests offload.
  runs = HiSparseConfig(indexer="lightning").for_index_topk(2048, max_model_len=4096)
  assert (runs.hot_buffer_tokens, runs.sparse_threshold_tokens) == (2048, 2048)
  runs = HiSparseConfig().for_index_topk(2048, max_model_len=163_840)
  assert (runs.hot_buffer_tokens, runs.sparse_threshold_tokens) == (4096, 4096)
  runs = HiSparseConfig(indexer="lightning", hot_buffer_tokens=40).for_index_topk(9, 64)
  assert (runs.hot_buffer_tokens, runs.sparse_threshold_tokens) == (40, 40)
  runs = HiSparseConfig(sparse_threshold_tokens=30).for_index_topk(9, 64)
  assert (runs.hot_buffer_tokens, runs.sparse_threshold_tokens) == (18, 30)
  # What was given counts as given through dataclasses.replace too.
  given = dataclasses.replace(HiSparseConfig(), hot_buffer_tokens=4096, indexer="lightning")
  assert given.for_index_topk(9, max_model_len=64).hot_buffer_tokens == 4096


def test_rounding_that_breaks_the_budget_is_refused():
  # 20 + 20 <= 40 tokens. 32-token blocks: 1 + 1 <= 2 blocks, fine; 16-token blocks:
  # 2 + 2 > 3 blocks, refused.
  config = HiSparseConfig(top_k_tokens=40, sink_tokens=20, local_tokens=20)
  assert config.blocks(32).top_k_blocks == 2
  with pytest.raises(ValueError, match="round to 2 \\+ 2 blocks"):
    config.blocks(16)
  with pytest.raises(ValueError, match="block_size"):
    config.blocks(0)


def test_frozen():
  config = HiSparseConfig()
  with pytest.raises(AttributeError):
    config.top_k_tokens = 1

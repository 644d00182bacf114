"""HiSparse's resources in the engine: what the in-step host loads move (exactly the
misses; lowered on CPU and GPU, no copy or host gather without one), the device bytes it
reserves (key bounds, hot-buffer state) and logs, the blocks it counts as selected; its
config as EngineConfig validates it and as the CLI's flags build it.

Same set-up as test_hisparse_engine.py (hisparse_engine_fixtures: the tiny random Llama,
a device budget of 17 dense blocks, prefill chunks of 16 tokens).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver
from engine_fixtures import (
  BLOCK_SIZE,
  MAX_MODEL_LEN,
  add_all,
  assert_all_blocks_free,
  random_prompts,
  run,
)
from hisparse_engine_fixtures import (
  BLOCKS,
  FULL,
  GREEDY,
  NUM_TOKENS,
  PROMPTS,
  SMALL,
  make_engine,
)

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import EngineConfig
from hisparse_jax.engine.runner import bounds_bytes_per_block
from hisparse_jax.entrypoints.cli import generate as generate_cmd
from hisparse_jax.entrypoints.cli import main as cli  # noqa: F401 (defines the flags)
from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, KVCacheSpec, KVPool
from hisparse_jax.sparse import resolver


def test_host_loads_move_the_misses_and_metrics_count_them(reference):
  # Every step's in-step host loads move, per layer, exactly its misses on CPU (block
  # copies; GPU's host gather: the smallest load size holding them, as the resolver
  # tests check): nothing when every selected block is resident or hot. The h2d bytes
  # metric is exactly the swap-ins' blocks plus what those loads moved.
  engine = make_engine(FULL)
  results, collect = [], engine.runner.collect

  def recording(handle):
    result = collect(handle)
    results.append(result)
    return result

  engine.runner.collect = recording
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
  no_miss = with_miss = 0
  for result in results:
    misses = result.counts[:, :, 2].sum(axis=1)  # [layers] (COUNT_FIELDS: host)
    np.testing.assert_array_equal(result.loaded, misses)
    no_miss += int((misses == 0).sum())
    with_miss += int((misses > 0).sum())
  assert no_miss > 0 and with_miss > 0
  m = engine.metrics()
  spec = engine.device_pool.spec
  moved = sum(r.loaded_block_layers for r in results)
  assert m['hisparse_transfer_bytes_total{direction="h2d"}'] == (
      m['hisparse_transfer_blocks_total{direction="h2d"}'] * spec.bytes_per_block
      + moved * spec.bytes_per_block // spec.num_layers)
  assert m["hisparse_hot_buffer_loads_total"] == sum(int(r.counts[:, :, 2].sum())
                                                     for r in results)
  assert_all_blocks_free(engine)


def _lowered_load(one_memory):
  spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float32",
                     block_size=4)
  device_pool, host_pool = KVPool(spec, 16, DEVICE), KVPool(spec, 24, PINNED_HOST)
  load = jax.jit(functools.partial(resolver.load_blocks, device_sharding=device_pool.sharding,
                                   host_sharding=host_pool.sharding, one_memory=one_memory))
  ids = jnp.zeros(40, jnp.int32)
  return load.lower(host_pool.arrays(), device_pool.arrays(), ids, ids).as_text()


def test_a_step_without_a_miss_copies_no_block_on_cpu():
  # The lowered load on CPU (one memory): the host pages are read only inside a loop
  # whose trip count is the number of loads (0 without a miss), one block per iteration;
  # no gather or scatter touches them.
  text = _lowered_load(None)
  pages = ("tensor<24x4x2x8xf32>", "tensor<16x4x2x8xf32>")  # host and device pages
  for line in text.splitlines():
    if '"stablehlo.gather"' in line or '"stablehlo.scatter"' in line:
      assert not any(p in line for p in pages), line  # only the id lists are gathered
  assert text.count("stablehlo.while") == 1
  loop = text[text.index("stablehlo.while"):]
  cond = loop[loop.index("cond {"):loop.index("} do {")]
  assert re.search(r"stablehlo.compare\s+LT, %iterArg_\d+, %iterArg_\d+", cond)  # i < loads
  body = loop[loop.index("} do {"):]
  slices = re.findall(r"stablehlo.dynamic_slice .*tensor<1x4x2x8xf32>", body)
  assert len(slices) == 2  # one block of K and one of V per iteration


def test_a_step_without_a_miss_runs_no_host_gather():
  # The lowered load on GPU (forced here): a while loop of 8-block trips whose trip
  # count is ceil(loads / 8) (0 without a miss), the only host computation inside its
  # body; no conditional (XLA's host offloader rejects a host computation in a branch:
  # jax 0.11.2 on an H200).
  text = _lowered_load(False)
  assert '"stablehlo.case"' not in text and "stablehlo.if" not in text
  assert text.count("stablehlo.while") == 1
  loop = text[text.index("stablehlo.while"):]
  cond = loop[loop.index("cond {"):loop.index("} do {")]
  assert re.search(r"stablehlo.compare\s+LT, %iterArg_\d+, %iterArg_\d+", cond)  # i < trips
  body = loop[loop.index("} do {"):]
  body = body[:body.index("\n    }")]
  assert text.count("func.call @gather") == body.count("func.call @gather") == 1

  def function(name):
    fn = text[text.index(f"func.func private @{name}("):]
    return fn[:fn.index("\n  }")]

  (callee,) = re.findall(r"func.call @(gather\w*)", body)
  gather = function(callee)
  # (the host computation is a function of its own: kv_cache/host_compute.on_host)
  for inner in re.findall(r"call @(compute_on\w*)\(", gather):
    gather += function(inner)
  gathers = [ln for ln in gather.splitlines() if '"stablehlo.gather"' in ln]
  assert len(gathers) == 2  # K and V
  for line in gathers:
    assert '_xla_compute_type = "host"' in line and "tensor<8x4x2x8xf32>" in line
  host_lines = [ln for ln in text.splitlines() if 'compute_type = "host"' in ln]
  assert host_lines and all(ln in gather for ln in host_lines)


@pytest.mark.parametrize(("bounds_dtype", "itemsize", "storage", "num_device_blocks"),
                         [("float32", 4, np.float32, 11), ("bfloat16", 2, np.uint16, 14),
                          ("int8", 1, np.int8, 15)])
def test_hisparse_device_bytes_are_reserved_and_logged(bounds_dtype, itemsize, storage,
                                                       num_device_blocks):
  engine = make_engine(dataclasses.replace(FULL, bounds_dtype=bounds_dtype))
  spec = engine.device_pool.spec
  spec_bytes = bounds_bytes_per_block(spec, bounds_dtype)
  # layers x (min, max) x kv heads x (head_dim x itemsize + int8's float32 scale)
  assert spec_bytes == 2 * 2 * 2 * (8 * itemsize + (4 if bounds_dtype == "int8" else 0))
  # Half-size bounds leave room for more device blocks in the same budget.
  assert engine.device_pool.num_blocks == num_device_blocks
  num_blocks = engine.device_pool.num_blocks + engine.host_pool.num_blocks
  assert engine.runner.indexer_bytes == num_blocks * spec_bytes
  # state: layers x rows x (2 x 8 slots + 8 max blocks) int32, a row per request the
  # device can hold offloaded (capacity.num_hot_rows): 10 or 13 usable blocks hold one hot
  # buffer of 8, so 1 row, not one per seat (max_num_seqs 4)
  assert engine.runner.num_hot_rows == 1
  assert engine.runner.reserved_bytes == num_blocks * spec_bytes + 2 * 1 * (2 * 8 + 8) * 4
  assert engine.capacity["device"].reserved_bytes == engine.runner.reserved_bytes
  rows = num_device_blocks + engine.host_pool.num_blocks
  for bounds in engine.runner.bounds:  # device blocks' rows, then host blocks'
    if bounds_dtype == "int8":  # QuantizedBounds: int8 values, a scale per side and head
      assert bounds.scales.shape == (rows, 2, 2, 1) and bounds.scales.dtype == np.float32
      assert bounds.scales.sharding.memory_kind == "device"
      bounds = bounds.values
    assert bounds.shape == (rows, 2, 2, 8)
    assert bounds.dtype == storage  # bfloat16 as its uint16 bits on CPU
    assert bounds.sharding.memory_kind == "device"
  lines = engine.capacity.log_lines(MAX_MODEL_LEN)
  assert (f"HiSparse: indexer key bounds ({bounds_dtype}) {num_blocks * spec_bytes:,} bytes "
          f"+ hot-buffer state {2 * 1 * 24 * 4:,} bytes; hot buffer 8 blocks = 64 tokens per "
          "offloaded request") in lines[0]
  # (what the scheduler admits: test_admission_offload.py)
  running = engine.capacity.hisparse_concurrency(MAX_MODEL_LEN)
  assert running >= 1 and f"HiSparse runs {running} at once" in lines[-1]
  dense = make_engine(None)
  assert dense.runner.bounds == () and dense.capacity["device"].reserved_bytes == 0
  assert dense.device_pool.num_blocks == 17
  assert "HiSparse" not in " ".join(dense.capacity.log_lines(MAX_MODEL_LEN))


@pytest.mark.parametrize("hisparse", [None, SMALL], ids=["dense", "top_k_2_blocks"])
def test_blocks_selected_counts_what_attention_read(hisparse):
  engine = make_engine(hisparse, num_dense_blocks=50)
  prompt = random_prompts((40,), seed=5)[0]
  engine.add_request("a", prompt_token_ids=prompt, sampling_params=GREEDY)
  out = run(engine)["a"]
  assert len(out.outputs[0].token_ids) == NUM_TOKENS
  # Prefill in chunks of 16, 16, 8 tokens: 2 + 4 + 5 blocks; then 19 decode steps over
  # 41..59 tokens, each reading all its blocks (dense) or 2 (the sink and newest blocks).
  dense_decode = sum(-(-(40 + i) // BLOCK_SIZE) for i in range(1, NUM_TOKENS))
  expected = 11 + (dense_decode if hisparse is None else 2 * (NUM_TOKENS - 1))
  assert (dense_decode, expected) == (128, 139 if hisparse is None else 49)
  assert out.metrics.blocks_selected == {"device": expected, "hot": 0, "host": 0}
  assert engine.metrics()[f"hisparse_blocks_selected_total{BLOCKS}"] == expected
  assert_all_blocks_free(engine)


def test_engine_config_validates_hisparse():
  with pytest.raises(ValueError, match="selection='per_query_head' is not available with "
                                       "tensor_parallel_size=2"):
    EngineConfig(tensor_parallel_size=2,
                 hisparse=HiSparseConfig(top_k_tokens=64, sink_tokens=16, local_tokens=16,
                                         selection="per_query_head"))
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
  # Not given: derived from --max_model_len (a quarter: requests past 1,024 tokens decode
  # sparse at the default 2,048) and the block size; sink and local follow the top-k.
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", "--hisparse"])
    assert generate_cmd.engine_kwargs_from_flags()["hisparse"] == HiSparseConfig(
        top_k_tokens=512, hot_buffer_tokens=1024, sink_tokens=64, local_tokens=128,
        sparse_threshold_tokens=1024)
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", "--hisparse", "--max_model_len=8192", "--block_size=4"])
    assert generate_cmd.hisparse_from_flags() == HiSparseConfig(
        top_k_tokens=2048, sink_tokens=64, local_tokens=256)
  with flagsaver.flagsaver():  # was refused: the sink and local defaults were 64 and 256
    flags.FLAGS(["prog", "--hisparse", "--top_k_tokens=256"])
    assert generate_cmd.hisparse_from_flags() == HiSparseConfig(
        top_k_tokens=256, hot_buffer_tokens=512, sink_tokens=32, local_tokens=64,
        sparse_threshold_tokens=512)
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", "--hisparse", "--top_k_tokens=64", "--hot_buffer_tokens=32"])
    with pytest.raises(ValueError, match="^--hot_buffer_tokens \\(32\\) must be >= "):
      generate_cmd.hisparse_from_flags()
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", "--hisparse", "--top_k_tokens=256", "--bounds_dtype=float32"])
    assert generate_cmd.hisparse_from_flags().bounds_dtype == "float32"
    flags.FLAGS(["prog", "--hisparse", "--top_k_tokens=256", "--bounds_dtype=int8"])
    assert generate_cmd.hisparse_from_flags().bounds_dtype == "int8"
    assert HiSparseConfig().bounds_dtype == "bfloat16"
  with pytest.raises(ValueError, match="HiSparseConfig.bounds_dtype must be one of"):
    HiSparseConfig(bounds_dtype="float16")
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", "--bounds_dtype=float32"])
    with pytest.raises(ValueError, match="--bounds_dtype is a HiSparse setting"):
      generate_cmd.hisparse_from_flags()
  with flagsaver.flagsaver():
    flags.FLAGS(["prog", "--top_k_tokens=64"])
    with pytest.raises(ValueError, match="--top_k_tokens is a HiSparse setting; add --hisparse"):
      generate_cmd.hisparse_from_flags()
  with flagsaver.flagsaver():
    flags.FLAGS(["prog"])
    assert generate_cmd.engine_kwargs_from_flags()["hisparse"] is None

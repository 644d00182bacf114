"""The engine's GPU programs lowered for `cuda` from this CPU-only host: the whole step,
dense and HiSparse (with its in-step host loads), and the swap programs.

A CPU engine runs a few steps on the xla backend; the batches it built are then lowered
with `ModelRunner.lower(batch, platform="cuda")` (the 8-bit cases lower the engine's
largest HiSparse decode as its batch builder makes it, without running the engine),
which builds the same step for a GPU target: the compiled Pallas kernels (Triton), and
HiSparse loads that cross from a separate pinned-host memory. The lowered modules must
call the expected Triton kernels, keep the host pool in `pinned_host`, gather on the host
and place the gathered blocks on the device. Nothing here needs a GPU; `make gpu-check`
compiles and runs them on one.
"""

from __future__ import annotations

import copy
import re
from collections import Counter

import jax.numpy as jnp
import pytest
from engine_fixtures import (
  BLOCK_SIZE,
  MAX_MODEL_LEN,
  NUM_HOST_BLOCKS,
  SIX_PROMPTS,
  add_all,
  gib_for_blocks,
  tiny_config,
)

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine import aot
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.kv_cache import transfer
from models.llama import LlamaForCausalLM

TRITON_CALL = "__gpu$xla.gpu.triton"
NUM_LAYERS = 2
# Every long decode row sparse, resident or not (resident_sparse_min_tokens=0).
SMALL = HiSparseConfig(top_k_tokens=16, hot_buffer_tokens=16, sink_tokens=8, local_tokens=8,
                       sparse_threshold_tokens=16, resident_sparse_min_tokens=0)


def _kernels(text: str) -> list[str]:
  calls = set(re.findall(r"custom_call @([\w$.]+)\(", text)) - {"annotate_device_placement"}
  assert calls == {TRITON_CALL}, calls
  return sorted(re.findall(r'\bname = "(\w+)"', text))


def _attrs(text: str, name: str) -> Counter:
  return Counter(re.findall(name + r' = "(\w+)"', text))


@pytest.fixture(scope="module")
def model():
  # head_dim 32: the Triton lowering needs power-of-two tiles of at least 16 rows.
  return LlamaForCausalLM(tiny_config(head_dim=32), seed=0)


def _batches(engine: Engine, until) -> list:
  """Runs the (CPU, xla backend) engine until `until(batches)`; returns the batches its
  runner dispatched (copies: the runner reuses its host arrays)."""
  batches, dispatch = [], engine.runner.dispatch

  def recording(batch, prev_tokens=None):
    batches.append(copy.deepcopy(batch))
    return dispatch(batch, prev_tokens)

  engine.runner.dispatch = recording
  add_all(engine, SIX_PROMPTS, SamplingParams(temperature=0.0, max_tokens=20))
  while engine.has_unfinished_requests() and not until(batches):
    engine.step()
  assert until(batches)
  return batches


def _sparse_batch(engine: Engine):
  """The engine's largest HiSparse decode step, every row sparse and offloaded (the
  tiered_decode that aot.py builds with the engine's own batch builder; nothing run)."""
  [(_, batch, _)] = aot.step_batches(engine.runner, engine.config, False,
                                     only={"tiered_decode"})
  assert batch.metadata.sparse_rows[:batch.num_seqs].all()
  return batch


def _engine(model, **overrides) -> Engine:
  fields = dict(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                max_num_batched_tokens=16, device_kv_gib=gib_for_blocks(model.config, 17),
                host_pool_gib=gib_for_blocks(model.config, NUM_HOST_BLOCKS))
  return Engine(EngineConfig(**{**fields, **overrides}), model=model, model_config=model.config)


def test_the_dense_step_lowers_for_cuda_on_the_pallas_kernels(model):
  engine = _engine(model)
  assert engine.runner.ops.backend == "xla"  # what runs here
  batches = _batches(engine, lambda b: any(int(x.metadata.cu_q_lens[1]) == 1 for x in b))
  for batch in (batches[0], batches[-1]):  # a prefill step and one with decode rows
    text = engine.runner.lower(batch, platform="cuda").as_text()
    assert _kernels(text) == ["ragged_paged_attention", "write_kv"]
    assert "pinned_host" not in text
  # The same batch lowered for the host's own platform takes no Triton kernel.
  assert TRITON_CALL not in engine.runner.lower(batches[0], platform="cpu").as_text()


def test_the_hisparse_step_lowers_for_cuda_with_in_step_host_loads(model):
  engine = _engine(model, hisparse=SMALL)
  batches = _batches(engine, lambda b: any(x.metadata.sparse_rows.any() for x in b))
  sparse = next(b for b in batches if b.metadata.sparse_rows.any())
  text = engine.runner.lower(sparse, platform="cuda").as_text()
  # (block_scores: the select scores the key bounds in place, kernels_pallas.block_scores)
  assert _kernels(text) == ["block_key_bounds", "block_scores", "paged_attention",
                            "ragged_paged_attention", "write_kv"]
  # The host pool's K and V of every layer stay in pinned_host; the misses are gathered
  # by host computations and only the gathered blocks are placed on the device.
  assert _attrs(text, "mhlo.memory_kind")["pinned_host"] == 2 * NUM_LAYERS
  assert _attrs(text, "_xla_compute_type")["host"] > 0
  assert _attrs(text, "_xla_buffer_placement")["device"] > 0
  # On CPU (one memory) the same step copies blocks in place: no host computation.
  cpu = engine.runner.lower(sparse, platform="cpu").as_text()
  assert _attrs(cpu, "_xla_compute_type")["host"] == 0
  # A batch without sparse rows lowers too (the dense kernels, bounds kept).
  assert "ragged_paged_attention" in _kernels(
      engine.runner.lower(batches[0], platform="cuda").as_text())


def test_the_swap_programs_lower_for_cuda(model):
  engine = _engine(model)
  gpu = transfer.TransferEngine(engine.device_pool, engine.host_pool, one_memory=False)
  ids = jnp.zeros(8, jnp.int32)
  device, host = engine.device_pool.arrays(), engine.host_pool.arrays()
  out = gpu._swap_out.trace(device, host, ids, ids).lower(lowering_platforms=("cuda",))
  into = gpu._swap_in.trace(host, device, ids, ids).lower(lowering_platforms=("cuda",))
  for text, src, dst in ((out.as_text(), "device", "pinned_host"),
                         (into.as_text(), "pinned_host", "device")):
    kinds = _attrs(text, "mhlo.memory_kind")
    assert kinds["pinned_host"] >= 2 * NUM_LAYERS and kinds["device"] >= 2 * NUM_LAYERS
    assert _attrs(text, "_xla_compute_type")["host"] > 0  # indexing on the host side
    assert _attrs(text, "_xla_buffer_placement")[dst] > 0, (src, dst)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_the_8bit_hisparse_step_lowers_for_cuda_with_values_and_scales(model, kv_cache_dtype):
  # An 8-bit cache on the GPU target: every layer's pool is 4 arrays (K, V and their
  # scales), all 4 in pinned_host, the Triton kernels read the 8-bit values with their
  # scales (write_kv runs twice a layer: values, then scales as pages of head_dim 1).
  # (The step the engine builds for its offloaded rows, not recorded from a run: the
  # float32 case above lowers recorded batches.)
  engine = _engine(model, hisparse=SMALL, kv_cache_dtype=kv_cache_dtype)
  sparse = _sparse_batch(engine)
  text = engine.runner.lower(sparse, platform="cuda").as_text()
  assert _kernels(text) == ["block_key_bounds", "block_scores", "paged_attention",
                            "ragged_paged_attention", "write_kv",
                            "write_kv"]  # the values' and the scales' shapes
  assert _attrs(text, "mhlo.memory_kind")["pinned_host"] == 4 * NUM_LAYERS
  assert _attrs(text, "_xla_compute_type")["host"] > 0
  # The pallas calls take the 8-bit values (i8 / ui8 tensors) and float32 scales.
  storage = "i8" if kv_cache_dtype == "int8" else "ui8"
  assert re.search(rf"tensor<\d+x{BLOCK_SIZE}x\d+x32x{storage}>", text)
  assert re.search(rf"tensor<\d+x{BLOCK_SIZE}x\d+x1xf32>", text)


@pytest.mark.parametrize("mode", ["exact", "sparse"])
def test_a_streamed_prefill_chunk_lowers_for_cuda(model, mode):
  # A later chunk of a 127-token prompt through 9 device blocks (72 tokens), as the
  # engine's batch builder makes it (aot.step_batches' streamed_prefill; nothing run): a
  # sparse row whose earlier blocks are on the host. Exact: the chunk loads them in groups
  # inside while loops (the host gathers inside the loop body); sparse: selected by
  # CHUNK_QUERIES queries, then attended in the ragged kernel over a rewritten table.
  hisparse = HiSparseConfig(top_k_tokens=16, hot_buffer_tokens=16, sink_tokens=8,
                            local_tokens=8, sparse_threshold_tokens=16,
                            streamed_prefill=mode)
  engine = _engine(model, hisparse=hisparse, max_model_len=128,
                   device_kv_gib=gib_for_blocks(model.config, 9 + 2))
  [(_, chunk, _)] = aot.step_batches(engine.runner, engine.config, False,
                                     only={"streamed_prefill"})
  meta = chunk.metadata
  q_lens = meta.cu_q_lens[1:chunk.num_seqs + 1] - meta.cu_q_lens[:chunk.num_seqs]
  assert (meta.sparse_rows[:chunk.num_seqs] & (q_lens > 1)).any()
  assert chunk.metadata.chunk_queries == (1 if mode == "exact" else 8)
  text = engine.runner.lower(chunk, platform="cuda").as_text()
  assert _attrs(text, "_xla_compute_type")["host"] > 0  # the loads cross from the host
  assert _attrs(text, "mhlo.memory_kind")["pinned_host"] == 2 * NUM_LAYERS
  whiles = text.count("stablehlo.while")
  if mode == "exact":  # rows x groups, per layer, around the host gathers
    assert whiles >= 2 * NUM_LAYERS
    assert "paged_attention" in _kernels(text)
  else:
    assert "ragged_paged_attention" in _kernels(text)
  assert engine.runner.lower(chunk, platform="cpu") is not None
  assert chunk.metadata.sparse_chunks
  # A sparse decode step (the engine's tiered_decode: offloaded rows) leaves the chunk path
  # out of its program (StepMetadata.sparse_chunks).
  [(_, decode, _)] = aot.step_batches(engine.runner, engine.config, False,
                                      only={"tiered_decode"})
  assert decode.metadata.sparse_rows.any() and not decode.metadata.sparse_chunks
  # (exact: the group loops; sparse: chunk_tables' sort)
  op = "stablehlo.while" if mode == "exact" else "stablehlo.sort"
  assert engine.runner.lower(decode, platform="cuda").as_text().count(op) < text.count(op)

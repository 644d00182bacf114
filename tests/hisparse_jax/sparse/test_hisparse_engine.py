"""HiSparse in the engine: sparse decode rows over the indexer's selection, with blocks
written through to the host pool, dropped from the device under pressure, and loaded back
into per-request hot buffers inside the step.

The tiny random Llama of engine_fixtures (block_size 8, max_model_len 64), the full-recompute
dense reference, invariants after every step (`run`). A device budget of 17 dense blocks
plans 11 blocks with HiSparse (key bounds of every device and host block, an eighth of a
block's bytes each, and the hot-buffer state come out of it), so the six prompts are
preempted, come back offloaded and read blocks from the host pool. Steps compute at most
16 tokens (prefill in chunks of 16), so every step pads to one token bucket and the file
compiles few programs (compilation is nearly all of its time). The tokens: sparse rows
give the dense reference's (or the all-resident run's) tokens. What the host loads move,
what HiSparse reserves and counts, and its config: test_hisparse_engine_resources.py.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import (
  add_all,
  assert_all_blocks_free,
  random_prompts,
  reference_greedy,
  run,
  run_alone,
  tiny_model,
)
from hisparse_engine_fixtures import (
  FULL,
  GREEDY,
  NUM_TOKENS,
  PROMPTS,
  SMALL,
  count_sparse_rows,
  make_engine,
)

import kernels_pallas
import models
from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.kv_cache import transfer
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec
from hisparse_jax.sparse import indexer
from models import data


def _assert_bounds_exact(engine):
  """The bounds of every device block a running request holds equal the reference
  recomputed from the pages over its valid tokens (exactly), and the host-indexed bounds of
  its host copies equal the reference over the host pages. Returns the blocks checked."""
  bs = engine.config.block_size
  slots, host_ids = [], []
  for request in engine.scheduler.running:
    host_ids += engine.block_manager.host_copy_ids(request.request_id)
    for i, block_id in enumerate(engine.block_manager.block_table(request.request_id)):
      fill = min(bs, request.num_computed_tokens - i * bs)
      if fill > 0 and block_id != 0:
        slots.append(block_id * bs + fill - 1)
  engine.transfer.wait()
  num_device_blocks = engine.device_pool.num_blocks
  bounds_dtype = engine.config.hisparse.bounds_dtype
  logical = [indexer.bounds_view(b, bounds_dtype) for b in engine.runner.bounds]
  # (int8 bounds: their values and scales both, each exactly.)
  arrays = lambda b: [np.asarray(a) for a in jax.tree.leaves(b)]  # noqa: E731
  for layer, bounds in enumerate(logical):
    host_bounds = jax.tree.map(lambda a: a[num_device_blocks:], bounds)  # host j: nd + j
    host_k = jnp.asarray(np.asarray(engine.host_pool.k[layer]))
    full = jnp.asarray(np.arange(host_k.shape[0], dtype=np.int32) * bs + bs - 1)
    expected = kernels_pallas.block_key_bounds_reference(
        jax.tree.map(jnp.zeros_like, host_bounds), host_k, full)
    for got, want in zip(arrays(host_bounds), arrays(expected)):
      np.testing.assert_array_equal(got[host_ids], want[host_ids])
  padded = np.full(num_device_blocks, -1, np.int32)
  padded[:len(slots)] = slots
  ids = np.array(slots, np.int64) // bs
  for layer, bounds in enumerate(logical):
    k_pages = engine.device_pool.k[layer]
    device_bounds = jax.tree.map(lambda a: a[:num_device_blocks], bounds)
    expected = kernels_pallas.block_key_bounds_reference(
        jax.tree.map(jnp.zeros_like, device_bounds), k_pages, jnp.asarray(padded))
    for got, want in zip(arrays(device_bounds), arrays(expected)):
      np.testing.assert_array_equal(got[ids], want[ids])
  return len(slots) + len(host_ids)


@pytest.mark.parametrize(("bounds_dtype", "num_device_blocks", "selection"),
                         [("bfloat16", 14, "union"), ("float32", 11, "shared"),
                          ("int8", 15, "union")])
def test_full_top_k_gives_the_dense_tokens_with_blocks_from_the_host(reference, bounds_dtype,
                                                                     num_device_blocks,
                                                                     selection):
  # bfloat16 bounds (the default) take half the device bytes of float32 ones: more blocks.
  # (The float32 run selects "shared": one engine for both, as the suite's time asks;
  # union, the default, and the per-head selections: below.)
  engine = make_engine(dataclasses.replace(FULL, bounds_dtype=bounds_dtype,
                                           selection=selection))
  assert engine.device_pool.num_blocks == num_device_blocks
  sparse_rows = count_sparse_rows(engine)
  checked = []
  step = engine.step

  def checking_step():
    outputs = step()
    checked.append(_assert_bounds_exact(engine))
    return outputs

  engine.step = checking_step
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
  assert sum(sparse_rows) > 50  # most decode rows of the longer prompts took the sparse path
  assert sum(checked) > 100
  m = engine.metrics()
  # Preempted sparse requests came back offloaded: their selected blocks were loaded from
  # the host pool into their hot buffers inside the step, and hit there afterwards.
  assert m["hisparse_preemptions_total"] > 0
  assert m["hisparse_hot_buffer_loads_total"] > 0 and m["hisparse_hot_buffer_hits_total"] > 0
  assert m['hisparse_blocks_selected_total{source="host"}'] > 0
  assert m['hisparse_blocks_selected_total{source="hot"}'] > 0
  assert 0 < m["hisparse_hot_buffer_hit_rate"] < 1
  assert sum(o.metrics.blocks_selected["hot"] for o in outputs.values()) == pytest.approx(
      m['hisparse_blocks_selected_total{source="hot"}'])
  # Every load is h2d bytes: block-layers x bytes of one block of one layer.
  spec = engine.device_pool.spec
  assert m['hisparse_transfer_bytes_total{direction="h2d"}'] >= (
      m["hisparse_hot_buffer_loads_total"] * spec.bytes_per_block // spec.num_layers)
  assert_all_blocks_free(engine)


@pytest.mark.parametrize("host_copy", ["xla", "kernel"])
def test_the_gpu_host_paths_forced_on_cpu_give_the_dense_tokens(reference, host_copy,
                                                                monkeypatch):
  # The step and the swaps built as for a GPU (host and device kinds different memories):
  # XLA's host gather + crossing, or the zero-copy block-copy kernel (interpret mode here;
  # transfer.host_copy_mode). The loads and swaps must move the same bytes either way.
  monkeypatch.setenv(transfer.HOST_COPY_ENV, host_copy)
  engine = make_engine(FULL)
  engine.runner._step = engine.runner._step_for(engine.runner.ops, one_memory=False)
  engine.transfer = transfer.TransferEngine(engine.device_pool, engine.host_pool,
                                            engine.metrics_registry, one_memory=False)
  assert engine.transfer.host_copy == host_copy
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
  m = engine.metrics()
  assert m["hisparse_hot_buffer_loads_total"] > 0  # blocks crossed inside the step ...
  assert m['hisparse_transfer_blocks_total{direction="d2h"}'] > 0  # ... and by swaps
  assert_all_blocks_free(engine)


# (per_kv_head at full top-k: test_overlap_loads.py's per-head run, the same engine with
# HISPARSE_JAX_OVERLAP_LOADS=1; with the option off its offloaded run is
# test_offloaded_decoding_... below. One engine, for the suite's time.)
@pytest.mark.parametrize("selection", ["per_query_head"])
def test_every_selection_at_full_top_k_gives_the_dense_tokens(reference, selection):
  # Top-k covering max_model_len: every head of every selection attends to every block,
  # offloaded requests loading theirs from the host pool; per-head selections go through
  # paged_attention_per_head. ("union", the default, and "shared" are the test above.)
  engine = make_engine(dataclasses.replace(FULL, selection=selection), num_dense_blocks=14)
  sparse_rows = count_sparse_rows(engine)
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
  assert sum(sparse_rows) > 50
  assert engine.metrics()["hisparse_hot_buffer_loads_total"] > 0
  assert_all_blocks_free(engine)


def test_small_top_k_runs_every_request_to_completion(reference):
  engine = make_engine(SMALL)
  sparse_rows = count_sparse_rows(engine)
  add_all(engine, PROMPTS[2:], SamplingParams(temperature=0.0, max_tokens=12))
  outputs = run(engine)
  assert {o.outputs[0].finish_reason for o in outputs.values()} == {"length"}
  assert all(len(o.outputs[0].token_ids) == 12 for o in outputs.values())
  assert sum(sparse_rows) > 20
  assert engine.metrics()["hisparse_hot_buffer_loads_total"] > 0
  # The 3-token prompt never has more than 14 tokens in the cache: dense throughout.
  assert outputs["r3"].outputs[0].token_ids == reference[5][:12]
  assert_all_blocks_free(engine)


# (per_query_head, the same per-head hot buffers as per_kv_head with a row per query head:
# ~65 s on 2 cores, left out of the suite for its time; its offloaded full-top-k run is
# test_every_selection_at_full_top_k_... above.)
@pytest.mark.parametrize("selection", ["shared", "per_kv_head"])
def test_offloaded_decoding_gives_the_all_resident_tokens(selection):
  # One HiSparse config (top-k 3 blocks: the sink, the newest and one chosen by the
  # indexer each step, per sequence or per head) on one engine whose device pool offloads:
  # each prompt alone first (nothing offloaded, every selected block resident), then all
  # six at once (preempted requests come back with their blocks in the host pool and load
  # the selected ones into hot buffers). The tokens are the same. Per-head selections get
  # a hot buffer of 4 blocks: the union of their heads' blocks is bounded by it.
  hot = 24 if selection == "shared" else 32
  mid = HiSparseConfig(top_k_tokens=24, hot_buffer_tokens=hot, sink_tokens=8, local_tokens=8,
                       sparse_threshold_tokens=16, selection=selection,
                       resident_sparse_min_tokens=0)
  engine = make_engine(mid, num_dense_blocks=17)
  sparse_rows = count_sparse_rows(engine)

  def from_host(m):
    return (m['hisparse_blocks_selected_total{source="hot"}']
            + m['hisparse_blocks_selected_total{source="host"}'])

  resident = run_alone(engine, PROMPTS, GREEDY)
  m = engine.metrics()
  assert sum(sparse_rows) > 20
  assert m["hisparse_offloads_total"] == m["hisparse_preemptions_total"] == 0
  assert from_host(m) == 0
  assert_all_blocks_free(engine)
  sparse_rows.clear()
  loads = m["hisparse_hot_buffer_loads_total"]
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  m = engine.metrics()
  assert sum(sparse_rows) > 20
  assert m["hisparse_offloads_total"] > 0 and from_host(m) > 0
  assert m["hisparse_hot_buffer_loads_total"] > loads
  assert_all_blocks_free(engine)
  assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == resident


@pytest.mark.parametrize("min_tokens", [4096, 60])
def test_resident_rows_decode_dense_below_resident_sparse_min_tokens(min_tokens):
  # Nothing offloaded (a device pool for every block): a step takes the sparse path only
  # when its long decode rows together skip >= resident_sparse_min_tokens tokens of
  # attention (kv_len - top-k each); below it they decode densely, exactly as dense (the
  # default, 0, is always sparse). At 4,096 no step of this toy does; at 60, two or three
  # rows of 40-60 tokens do (4 and 3 blocks past top-k's 2) and a lone one not.
  config = dataclasses.replace(SMALL, resident_sparse_min_tokens=min_tokens)
  engine = make_engine(config, num_dense_blocks=64)
  prompts = random_prompts((40, 33, 26), seed=5)
  steps, build = [], engine.runner.build_batch

  def recording(chunks, tables, tiers=None):
    batch = build(chunks, tables, tiers)
    # The rows that may decode sparse: one output token past a long sequence's prefill.
    lens = [c.start + 1 for c in chunks if c.num_tokens == 1
            and c.start >= c.request.prefill_len and config.is_sparse(c.start + 1)]
    assert tiers is None or (tiers.hot_rows < 0).all()  # nothing offloaded
    steps.append((sum(n - config.top_k_tokens for n in lens),
                  int(batch.metadata.sparse_rows.sum()), len(lens)))
    return batch

  # A step with no sparse row runs without the host pool's and the hot-buffer state's
  # arrays (fewer arguments to the call) and leaves the state as it was; the others pass
  # both in full.
  runner, calls = engine.runner, []
  step_args, dispatch = runner._step_args, runner.dispatch

  def recording_args(batch, prev):
    args = step_args(batch, prev)
    calls.append((batch.metadata.num_sparse_rows, len(args[4]), len(args[5])))
    return args

  def recording_dispatch(batch, prev=None):
    before = runner.hot_state
    handle = dispatch(batch, prev)
    assert (runner.hot_state is before) == (batch.metadata.num_sparse_rows == 0)
    return handle

  runner._step_args, runner.dispatch = recording_args, recording_dispatch
  engine.runner.build_batch = recording
  add_all(engine, prompts, GREEDY)
  tokens = [o.outputs[0].token_ids for o in run(engine).values()]
  layers = len(runner.bounds)
  assert calls and all((state, host) == ((0, 0) if n == 0 else (3 * layers, 2 * layers))
                       for n, state, host in calls), calls
  for skipped, sparse, candidates in steps:
    assert sparse == (candidates if skipped >= min_tokens else 0), (skipped, sparse)
  if min_tokens == 4096:  # every row dense: the dense engine's tokens, exactly
    assert tokens == reference_greedy(tiny_model(), prompts, NUM_TOKENS)
    assert all(sparse == 0 for _, sparse, _ in steps)
  else:  # both branches taken
    assert any(s for _, s, _ in steps) and any(c and not s for _, s, c in steps)
  m = engine.metrics()
  # The long rows were written through all the same (they may be offloaded later).
  assert m['hisparse_transfer_bytes_total{direction="d2h"}'] > 0
  assert m["hisparse_offloads_total"] == 0
  assert_all_blocks_free(engine)


def test_default_model_sparse_equals_dense_with_blocks_from_the_host():
  from hisparse_jax.entrypoints.llm import LLM
  from hisparse_jax.kv_cache.capacity import hisparse_capacity
  from models.loader import load_config

  if not os.path.isfile(os.path.join(models.DEFAULT_MODEL_DIR, "model.safetensors")):
    pytest.skip("the default model is not trained yet")
  prompts = data.make_retrieval_prompts(2, 150, seed=21)
  assert [len(p.token_ids) for p in prompts] <= [150, 150]
  # top-k and hot buffer cover max_model_len: sparse rows attend over every block.
  full = HiSparseConfig(top_k_tokens=192, hot_buffer_tokens=192, sink_tokens=16,
                        local_tokens=16, sparse_threshold_tokens=32,
                        resident_sparse_min_tokens=0)
  # A device pool of 21 usable blocks: both prompts (10 blocks each) are admitted, the
  # second is preempted when both cross into an 11th block, and it comes back offloaded
  # (its written-through blocks stay on the host and are loaded into its hot buffer).
  spec = KVCacheSpec.from_model_config(load_config(None), "float32", 16)
  device_blocks, host_blocks = 22, 40
  gib = 2**30

  def reserved(num_device_blocks):
    return hisparse_capacity(spec, full, num_device_blocks=num_device_blocks,
                             num_host_blocks=host_blocks, max_num_seqs=2,
                             max_model_len=192).reserved_bytes

  # The engine reserves, beside its blocks, what exactly those blocks need.
  extra = reserved(device_blocks)
  llm = LLM(hisparse=full, block_size=16, max_model_len=192, max_num_seqs=2,
            max_num_batched_tokens=512,  # both prompts prefill in one step, then decode
            device_kv_gib=(device_blocks * spec.bytes_per_block + extra + 512) / gib,
            host_pool_gib=(host_blocks * spec.bytes_per_block + 512) / gib)
  assert llm.engine.device_pool.num_blocks == device_blocks
  sparse_rows = count_sparse_rows(llm.engine)
  outputs = llm.generate([p.text for p in prompts], SamplingParams(temperature=0.0, max_tokens=16,
                                                                   ignore_eos=True))
  dense = reference_greedy(llm.engine.model, [p.token_ids for p in prompts], 16)
  assert [o.outputs[0].token_ids for o in outputs] == dense
  assert sum(sparse_rows) == 2 * 15  # every decode step of both prompts
  m = llm.metrics()
  assert m["hisparse_preemptions_total"] == 1
  assert m["hisparse_hot_buffer_loads_total"] > 0  # blocks came from the host pool
  assert m['hisparse_blocks_selected_total{source="host"}'] > 0


def test_mixed_batches_read_no_full_table_of_a_sparse_row(monkeypatch, reference):
  # A counting reference of the kernels: the dense (ragged) call reads keys [0, kv_len)
  # of each row's table, the paged call the listed blocks up to each row's length. Every
  # step of a run that mixes prefill, dense and sparse rows: no sparse row gets a key in
  # the dense call, and the paged call reads at most top-k blocks of a row.
  import kernels_pallas

  calls = {"ragged": [], "paged": []}
  xla = kernels_pallas.ops("xla")

  def ragged(q, k, v, tables, kv_lens, cu_q_lens, **kw):
    jax.debug.callback(lambda lens, cu: calls["ragged"].append((np.asarray(lens),
                                                                np.asarray(cu))),
                       kv_lens, cu_q_lens)
    return xla.ragged_paged_attention(q, k, v, tables, kv_lens, cu_q_lens, **kw)

  def paged(q, k, v, tables, lengths, **kw):
    jax.debug.callback(lambda n: calls["paged"].append(np.asarray(n)), lengths)
    return xla.paged_attention(q, k, v, tables, lengths, **kw)

  counting = xla._replace(ragged_paged_attention=ragged, paged_attention=paged)
  monkeypatch.setattr(kernels_pallas, "ops", lambda backend=None, **kw: counting)
  engine = make_engine(SMALL)
  sparse_rows = []
  build = engine.runner.build_batch

  def recording(chunks, tables, tiers=None):
    batch = build(chunks, tables, tiers)
    meta = batch.metadata
    sparse_rows.append((meta.sparse_rows.copy(), meta.kv_lens.copy()))
    return batch

  engine.runner.build_batch = recording
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine, max_steps=400)
  assert all(o.outputs[0].finish_reason == "length" for o in outputs.values())
  layers = engine.model_config.num_hidden_layers
  ragged_calls = iter(calls["ragged"])
  mixed = 0
  for step, (is_sparse, kv_lens) in enumerate(sparse_rows):
    if not (~is_sparse & (kv_lens > 0)).any():
      continue  # no dense row: the step skips the dense call
    mixed += bool(is_sparse.any())
    for _ in range(layers):
      lens, _ = next(ragged_calls)
      assert not lens[is_sparse].any(), step  # no key of a sparse row in the dense call
      np.testing.assert_array_equal(lens[~is_sparse], kv_lens[~is_sparse])
  assert next(ragged_calls, None) is None
  for lengths in calls["paged"]:
    assert (lengths <= SMALL.top_k_tokens).all()  # the selected blocks only
  assert mixed > 0 and len(calls["paged"]) > 0
  assert_all_blocks_free(engine)


def test_prefill_of_a_prompt_that_decodes_sparse_carries_the_sparse_path():
  # A step prefilling a prompt that will decode sparse runs the program with the sparse
  # path (8 rows) before any row is sparse, as the later steps holding its decode rows; a
  # short prompt's prefill (and a short decode) runs without it.
  engine = make_engine(SMALL)
  steps, build = [], engine.runner.build_batch

  def recording(chunks, tables, tiers=None):
    batch = build(chunks, tables, tiers)
    steps.append((max(c.num_tokens for c in chunks), int(batch.metadata.sparse_rows.sum()),
                  batch.metadata.num_sparse_rows))
    return batch

  engine.runner.build_batch = recording
  short = SamplingParams(temperature=0.0, max_tokens=2)
  engine.add_request(prompt_token_ids=[5, 6, 7, 8, 9], sampling_params=short)
  run(engine, max_steps=20)
  assert steps and all(rows == 0 for _, _, rows in steps)  # never longer than 16 tokens
  steps.clear()
  engine.add_request(prompt_token_ids=list(range(3, 43)), sampling_params=short)  # 40
  run(engine, max_steps=20)
  prefill = [s for s in steps if s[0] > 1]
  assert prefill and all(sparse == 0 and rows == 8 for _, sparse, rows in prefill)
  assert any(sparse == 1 for n, sparse, _ in steps if n == 1)  # it decodes sparse

"""HISPARSE_JAX_OVERLAP_LOADS=1 (#55): a sparse decode row attends the blocks already on
the device (resident ones, hot-buffer hits, the newest partly filled block) over the pages
as they are before the step's host loads, then the loaded misses, and merges the two by
log-sum-exp (sparse.resolver.split_loaded, kernels_pallas.merge_attention).

Unit: the split + merge equals one attention over the whole table (float32, every backend
that has a CPU path: the jnp reference, the Triton kernel in interpret mode, the xla
backend, per-head tables), rows with no miss, only misses, no key. Engine: the tokens
equal the dense reference at top-k covering every block, and at a small top-k the
offloaded requests' tokens equal each request's alone (nothing loaded: the option-off
attention), on the CPU path and with the GPU load paths forced on CPU, for every
selection and 8-bit KV. (The schedule of the compiled H200 step: test_aot_h200.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import (
  BLOCK_SIZE,
  GIB,
  add_all,
  assert_all_blocks_free,
  run,
  run_alone,
  tiny_model,
)
from hisparse_engine_fixtures import FULL, GREEDY, PROMPTS, count_sparse_rows, make_engine

import kernels_pallas
from hisparse_jax import HiSparseConfig
from hisparse_jax.kv_cache import transfer
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec
from hisparse_jax.sparse import resolver
from kernels_pallas import xla_attention
from kernels_pallas.common import MASK_VALUE
from kernels_pallas.paged_attention import paged_attention_per_head
from kernels_pallas.quant import QuantizedPages, quantize

BS, NUM_BLOCKS, KV_HEADS, GROUP, HEAD_DIM, WIDTH = 8, 40, 2, 4, 16, 6


def _pages(seed=0):
  kk, kv = jax.random.split(jax.random.key(seed))
  shape = (NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM)
  return jax.random.normal(kk, shape, jnp.float32), jax.random.normal(kv, shape, jnp.float32)


# Rows: (table, kv_len, which of its blocks are loaded this step).
ROWS = [
    ([3, 7, 9, 12, 0, 0], 4 * BS - 3, {7, 9}),  # misses between, partial newest resident
    ([5, 6, 8, 0, 0, 0], 3 * BS, set()),  # no miss
    ([13, 14, 15, 16, 17, 18], 6 * BS, {13, 14, 15, 16, 17, 18}),  # only misses
    ([20, 0, 0, 0, 0, 0], 5, set()),  # one partial block
    ([21, 22, 0, 0, 0, 0], 0, {21}),  # no key (padding row): zeros
    ([23, 24, 25, 26, 27, 0], 5 * BS - 1, {23, 26}),  # the first block a miss
]


def _rows():
  tables = jnp.array([r[0] for r in ROWS], jnp.int32)
  lens = jnp.array([r[1] for r in ROWS], jnp.int32)
  loaded = np.zeros(NUM_BLOCKS, bool)
  for _, _, ids in ROWS:
    loaded[list(ids)] = True
  return tables, lens, jnp.asarray(loaded)


def test_split_loaded_keeps_each_parts_blocks_in_order_and_counts_their_tokens():
  tables, lens, loaded = _rows()
  (dev, dev_lens), (miss, miss_lens) = resolver.split_loaded(tables, lens, loaded, BS)
  np.testing.assert_array_equal(dev, [[3, 12, 0, 0, 0, 0], [5, 6, 8, 0, 0, 0],
                                      [0] * 6, [20, 0, 0, 0, 0, 0], [0] * 6,
                                      [24, 25, 27, 0, 0, 0]])
  np.testing.assert_array_equal(dev_lens, [2 * BS - 3, 3 * BS, 0, 5, 0, 3 * BS - 1])
  np.testing.assert_array_equal(miss, [[7, 9, 0, 0, 0, 0], [0] * 6,
                                       [13, 14, 15, 16, 17, 18], [0] * 6, [0] * 6,
                                       [23, 26, 0, 0, 0, 0]])
  np.testing.assert_array_equal(miss_lens, [2 * BS, 0, 6 * BS, 0, 0, 2 * BS])
  np.testing.assert_array_equal(dev_lens + miss_lens, lens)


def _split_merge(attend, q, k, v, tables, lens, loaded):
  (dev, dev_lens), (miss, miss_lens) = resolver.split_loaded(tables, lens, loaded, BS)
  out_a, lse_a = attend(q, k, v, dev, dev_lens, return_lse=True)
  out_b, lse_b = attend(q, k, v, miss, miss_lens, return_lse=True)
  return kernels_pallas.merge_attention(out_a, lse_a, out_b, lse_b), (lse_a, lse_b)


@pytest.mark.parametrize("backend", ["reference", "pallas", "xla"])
def test_split_and_merge_equal_one_attention_over_the_whole_table(backend):
  attend = {"reference": kernels_pallas.paged_attention_reference,
            "pallas": kernels_pallas.paged_attention,  # Triton, interpret mode on CPU
            "xla": xla_attention.paged_attention_xla}[backend]
  k, v = _pages()
  tables, lens, loaded = _rows()
  q = jax.random.normal(jax.random.key(5), (len(ROWS), KV_HEADS * GROUP, HEAD_DIM))
  whole = kernels_pallas.paged_attention_reference(q, k, v, tables, lens)
  merged, (lse_dev, lse_miss) = _split_merge(attend, q, k, v, tables, lens, loaded)
  np.testing.assert_allclose(merged, whole, rtol=2e-6, atol=2e-6)
  np.testing.assert_array_equal(merged[4], 0.0)  # no key at all
  # A part with no key has lse MASK_VALUE (weight 0): rows 2 (no device block), 1 and 3.
  assert (lse_dev[2] == MASK_VALUE).all() and (lse_miss[np.array([1, 3, 4])] == MASK_VALUE).all()
  # The lse is the log-sum-exp of the scaled scores over the part's keys (row 1: all).
  keys = k[tables[1, :3]].reshape(-1, KV_HEADS, HEAD_DIM)
  s = jnp.einsum("hgd,thd->hgt", q[1].reshape(KV_HEADS, GROUP, HEAD_DIM), keys,
                 precision="highest") * HEAD_DIM**-0.5
  np.testing.assert_allclose(lse_dev[1], jax.nn.logsumexp(s, axis=-1).reshape(-1),
                             rtol=1e-6)


def test_the_triton_kernels_lse_equals_the_references_with_splits_and_a_soft_cap():
  k, v = _pages(1)
  tables, lens, _ = _rows()
  q = jax.random.normal(jax.random.key(6), (len(ROWS), KV_HEADS * GROUP, HEAD_DIM))
  for num_splits in (1, 3):
    out, lse = kernels_pallas.paged_attention(q, k, v, tables, lens, soft_cap=5.0,
                                              num_splits=num_splits, return_lse=True)
    ref, ref_lse = kernels_pallas.paged_attention_reference(q, k, v, tables, lens,
                                                            soft_cap=5.0, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


@pytest.mark.parametrize("heads", ["kv", "query"])
def test_split_and_merge_with_a_table_per_head(heads):
  k, v = _pages(2)
  num_heads = KV_HEADS if heads == "kv" else KV_HEADS * GROUP
  rng = np.random.default_rng(3)
  tables = np.zeros((len(ROWS), num_heads, WIDTH), np.int32)
  lens = np.zeros((len(ROWS), num_heads), np.int32)
  for i, (table, kv_len, _) in enumerate(ROWS):
    for h in range(num_heads):  # each head its own permutation of the row's full blocks
      n = -(-kv_len // BS)
      full = rng.permutation(table[:max(n - 1, 0)])
      tables[i, h, :n] = [*full, table[n - 1]][:n] if n else []
      lens[i, h] = kv_len
  _, _, loaded = _rows()
  q = jax.random.normal(jax.random.key(7), (len(ROWS), KV_HEADS * GROUP, HEAD_DIM))
  tables, lens = jnp.asarray(tables), jnp.asarray(lens)
  whole = paged_attention_per_head(q, k, v, tables, lens)
  merged, _ = _split_merge(paged_attention_per_head, q, k, v, tables, lens, loaded)
  np.testing.assert_allclose(merged, whole, rtol=2e-6, atol=2e-6)


def test_split_and_merge_over_8bit_pages():
  k, v = _pages(4)
  (kq, ks), (vq, vs) = quantize(k, "int8"), quantize(v, "int8")
  kp, vp = QuantizedPages(kq, ks, jnp.float32), QuantizedPages(vq, vs, jnp.float32)
  tables, lens, loaded = _rows()
  q = jax.random.normal(jax.random.key(8), (len(ROWS), KV_HEADS * GROUP, HEAD_DIM))
  for attend in (kernels_pallas.paged_attention_reference, kernels_pallas.paged_attention):
    whole = kernels_pallas.paged_attention_reference(q, kp, vp, tables, lens)
    merged, _ = _split_merge(attend, q, kp, vp, tables, lens, loaded)
    np.testing.assert_allclose(merged, whole, rtol=2e-6, atol=2e-6)


def test_the_option_is_read_from_the_environment(monkeypatch):
  monkeypatch.delenv(resolver.OVERLAP_LOADS_ENV, raising=False)
  assert resolver.overlap_loads_mode() is False
  monkeypatch.setenv(resolver.OVERLAP_LOADS_ENV, "1")
  assert resolver.overlap_loads_mode() is True
  monkeypatch.setenv(resolver.OVERLAP_LOADS_ENV, "yes")
  with pytest.raises(ValueError, match="HISPARSE_JAX_OVERLAP_LOADS must be '0' or '1'"):
    resolver.overlap_loads_mode()


def _splits_traced(monkeypatch):
  """Counts the traces of the overlapped path (split_loaded), so a test sees it ran."""
  calls = []
  split = resolver.split_loaded

  def counting(*args, **kwargs):
    calls.append(1)
    return split(*args, **kwargs)

  monkeypatch.setattr(resolver, "split_loaded", counting)
  return calls


def _tokens(engine):
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  assert_all_blocks_free(engine)
  return [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize("host_copy", [None, "xla"])
def test_overlapped_loads_give_the_dense_tokens(reference, host_copy, monkeypatch):
  # None: the CPU path (one memory); "xla": the GPU load path forced on CPU (the one whose
  # copy overlaps; with HISPARSE_JAX_HOST_COPY=kernel the same split runs around
  # resolver.load_blocks' kernel, which test_hisparse_engine checks with the option off:
  # left out of the suite for its time).
  monkeypatch.setenv(resolver.OVERLAP_LOADS_ENV, "1")
  splits = _splits_traced(monkeypatch)
  if host_copy is not None:
    monkeypatch.setenv(transfer.HOST_COPY_ENV, host_copy)
  engine = make_engine(FULL)
  if host_copy is not None:
    engine.runner._step = engine.runner._step_for(engine.runner.ops, one_memory=False)
    engine.transfer = transfer.TransferEngine(engine.device_pool, engine.host_pool,
                                              engine.metrics_registry, one_memory=False)
  sparse_rows = count_sparse_rows(engine)
  assert _tokens(engine) == reference
  assert sum(sparse_rows) > 50 and splits  # the sparse rows took the overlapped path ...
  m = engine.metrics()
  assert m["hisparse_hot_buffer_loads_total"] > 0  # ... with misses loaded in the step
  assert m['hisparse_blocks_selected_total{source="hot"}'] > 0


# (per_query_head's tables take the same paged_attention_per_head split as per_kv_head's:
# test_split_and_merge_with_a_table_per_head checks both at the kernel level; one engine
# run here, for the suite's time. This is also per_kv_head's full-top-k engine run:
# test_hisparse_engine.py's selection test runs per_query_head.)
@pytest.mark.parametrize("selection", ["per_kv_head"])
def test_overlapped_loads_with_per_head_selections_give_the_dense_tokens(
    reference, selection, monkeypatch):
  monkeypatch.setenv(resolver.OVERLAP_LOADS_ENV, "1")
  splits = _splits_traced(monkeypatch)
  engine = make_engine(dataclasses.replace(FULL, selection=selection), num_dense_blocks=14)
  sparse_rows = count_sparse_rows(engine)
  assert _tokens(engine) == reference and splits
  assert sum(sparse_rows) > 50
  assert engine.metrics()["hisparse_hot_buffer_loads_total"] > 0


# (union with 8-bit KV: both parts non-empty, values and scales split; float32 union and
# per_kv_head were checked the same way when the option was written, and are left out of
# the suite for its time.)
@pytest.mark.parametrize(("selection", "kv_cache_dtype"), [("union", "int8")])
def test_overlapped_loads_give_the_all_resident_tokens_at_a_small_top_k(
    selection, kv_cache_dtype, monkeypatch):
  # Top-k 3 blocks of up to 8, the option on, one engine: each prompt alone first (every
  # selected block resident: the first part holds the whole selection, the loaded part is
  # empty, which is the option-off attention), then all six (offloaded requests: most
  # selected blocks are hot-buffer hits or misses, the two parts both non-empty). 8-bit KV
  # (int8 values + scales), its budget 20 of its own blocks (test_kv_quant_engine's
  # offloaded case, which gives these tokens with the option off).
  hot = 24 if selection == "union" else 32
  mid = HiSparseConfig(top_k_tokens=24, hot_buffer_tokens=hot, sink_tokens=8, local_tokens=8,
                       sparse_threshold_tokens=16, selection=selection,
                       resident_sparse_min_tokens=0)
  monkeypatch.setenv(resolver.OVERLAP_LOADS_ENV, "1")
  splits = _splits_traced(monkeypatch)
  overrides = {}
  if kv_cache_dtype == "int8":
    spec = KVCacheSpec.from_model_config(tiny_model().config, "float32", BLOCK_SIZE, "int8")
    overrides = dict(device_kv_gib=20.5 * spec.bytes_per_block / GIB,
                     host_pool_gib=33.5 * spec.bytes_per_block / GIB)
  engine = make_engine(mid, kv_cache_dtype=kv_cache_dtype, **overrides)
  resident = run_alone(engine, PROMPTS, GREEDY)
  m = engine.metrics()
  assert m["hisparse_offloads_total"] == 0 and splits
  assert m['hisparse_blocks_selected_total{source="host"}'] == 0
  loads = m["hisparse_hot_buffer_loads_total"]
  assert _tokens(engine) == resident
  m = engine.metrics()
  assert m["hisparse_offloads_total"] > 0 and m["hisparse_hot_buffer_loads_total"] > loads
  assert m['hisparse_blocks_selected_total{source="hot"}'] > 0


@pytest.mark.parametrize("loads", [3, 13])
def test_staged_loads_then_the_loop_move_every_miss(loads):
  # load_blocks(staged=8) as the overlapped step calls it where host and device are
  # different memories (forced on CPU): the first 8 packed loads by staged_gather (padding
  # included), the rest by the loop's trips; every listed block lands, nothing else moves.
  device = jax.devices()[0]
  device_s = jax.sharding.make_single_device_sharding(device, memory_kind="device")
  host_s = jax.sharding.make_single_device_sharding(device, memory_kind="pinned_host")
  rng = np.random.default_rng(loads)
  host = [rng.standard_normal((30, BS, KV_HEADS, HEAD_DIM)).astype(np.float32)
          for _ in range(2)]
  before = [rng.standard_normal((NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM)).astype(np.float32)
            for _ in range(2)]
  total = 20
  host_ids = rng.permutation(np.arange(1, 30))[:total].astype(np.int32)
  device_ids = np.full(total, NUM_BLOCKS, np.int32)  # out of range: no load
  where = np.sort(rng.permutation(total)[:loads])  # the loads among the padding
  device_ids[where] = rng.permutation(np.arange(1, NUM_BLOCKS))[:loads]
  load = jax.jit(lambda h, d, hi, di: resolver.load_blocks(
      h, d, hi, di, device_sharding=device_s, host_sharding=host_s, one_memory=False,
      host_copy="xla", staged=resolver.OVERLAP_STAGED_BLOCKS), donate_argnums=(1,))
  new, moved = load(tuple(jax.device_put(h, host_s) for h in host),
                    tuple(jax.device_put(b, device_s) for b in before),
                    jnp.asarray(host_ids), jnp.asarray(device_ids))
  # 8 staged, then the loop's trips of 8 over the rest: the misses rounded up.
  assert int(moved) == 8 + -(-max(loads - 8, 0) // 8) * 8
  for h, b, n in zip(host, before, new):
    want = b.copy()
    want[device_ids[where]] = h[host_ids[where]]
    np.testing.assert_array_equal(np.asarray(n), want)

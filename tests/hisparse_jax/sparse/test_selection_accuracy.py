"""The selection-accuracy evaluator: a budget covering every block decodes exactly as dense
(which matches a full recompute), and per-KV-head masks really differ per head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import random_prompts, reference_greedy, tiny_model

from hisparse_jax.bench import selection_accuracy as sa
from hisparse_jax.sparse.config import HiSparseBlocks, HiSparseConfig

BLOCK = 8
selection_mask = jax.jit(sa.selection_mask, static_argnames=("blocks", "selection"))


def _blocks(top_k_blocks: int, block_size: int = BLOCK) -> HiSparseBlocks:
  # A hot buffer of 2 x top-k (the default): room for two KV heads' own selections.
  return HiSparseBlocks(block_size=block_size, top_k_blocks=top_k_blocks,
                        hot_buffer_blocks=2 * top_k_blocks, sink_blocks=1, local_blocks=1,
                        sparse_threshold_blocks=1)


def test_full_budget_equals_dense_and_small_budget_counts_blocks():
  model = tiny_model()
  prompts = random_prompts([40, 40, 40], seed=3)
  new_tokens = 4  # sparse steps at positions 39..42: 5, 6, 6, 6 valid blocks of 8
  full = HiSparseConfig(top_k_tokens=48, sink_tokens=8, local_tokens=8).blocks(BLOCK)
  modes = [sa.Mode("dense", None), sa.Mode("shared_all", full, "shared"),
           sa.Mode("per_head_all", full, "per_kv_head"),
           sa.Mode("per_head_3", _blocks(3), "per_kv_head")]
  out, _ = sa.generate(model, np.asarray(prompts, np.int32), modes, BLOCK, new_tokens)
  dense = out["dense"]
  np.testing.assert_array_equal(dense.tokens, reference_greedy(model, prompts, new_tokens))
  np.testing.assert_array_equal(dense.attended, 1.0)
  np.testing.assert_array_equal(dense.touched, 1.0)
  np.testing.assert_allclose(dense.query_mass, 1.0, rtol=1e-6)
  for name in ("shared_all", "per_head_all"):
    np.testing.assert_array_equal(out[name].tokens, dense.tokens)
    np.testing.assert_array_equal(out[name].attended, 1.0)
    np.testing.assert_array_equal(out[name].touched, 1.0)
    np.testing.assert_array_equal(out[name].query_mass, dense.query_mass)
  small = out["per_head_3"]
  np.testing.assert_allclose(small.attended, np.mean([3 / 5, 3 / 6, 3 / 6, 3 / 6]), rtol=1e-6)
  assert np.all(small.touched >= small.attended) and np.all(small.touched <= 1)
  assert np.all(small.query_mass > 0) and np.all(small.query_mass < 1)


def test_per_kv_head_masks_differ_per_head():
  head_dim, capacity, seq_len = 4, 24, 22  # 6 blocks of 4; the last one partly filled
  rng = np.random.default_rng(0)
  k = rng.normal(size=(1, capacity, 2, head_dim)).astype(np.float32) * 0.01
  k[0, 9, 0, 0] = 10.0  # KV head 0's best key: block 2
  k[0, 17, 1, 0] = 10.0  # KV head 1's best key: block 4
  q = jnp.ones((1, 4, head_dim), jnp.float32)  # 2 query heads per KV head
  lens = jnp.array([seq_len], jnp.int32)
  blocks = _blocks(3, block_size=4)  # sink block 0, local block 5, one scored block

  per_head = selection_mask(q, jnp.asarray(k), lens, blocks, "per_kv_head")
  attended, touched = sa.block_fractions(per_head, lens, 4)
  per_head = np.asarray(per_head)
  chosen = per_head.reshape(1, 2, 6, 4).any(axis=-1)[0]
  np.testing.assert_array_equal(chosen, [[1, 0, 1, 0, 0, 1], [1, 0, 0, 0, 1, 1]])
  assert not per_head[..., seq_len:].any()
  assert per_head[0, 0, 8:12].all() and not per_head[0, 1, 8:12].any()
  np.testing.assert_allclose(attended, [3 / 6])
  np.testing.assert_allclose(touched, [4 / 6])  # the union: blocks 0, 2, 4, 5

  shared = selection_mask(q, jnp.asarray(k), lens, blocks, "shared")
  attended, touched = sa.block_fractions(shared, lens, 4)
  shared = np.asarray(shared)
  np.testing.assert_array_equal(shared[:, 0], shared[:, 1])
  chosen = shared.reshape(1, 2, 6, 4).any(axis=-1)[0, 0]
  assert chosen.sum() == 3 and chosen[[0, 5]].all() and chosen[[2, 4]].sum() == 1
  np.testing.assert_allclose(attended, [3 / 6])
  np.testing.assert_allclose(touched, [3 / 6])

  dense = selection_mask(q, jnp.asarray(k), lens, None)
  np.testing.assert_array_equal(np.asarray(dense),
                                np.broadcast_to(np.arange(capacity) < seq_len, (1, 2, capacity)))
  np.testing.assert_allclose(sa.block_fractions(dense, lens, 4), [[1.0], [1.0]])


def test_block_bounds_cover_only_valid_keys():
  k = jnp.arange(2 * 8 * 1 * 2, dtype=jnp.float32).reshape(2, 8, 1, 2)
  bounds = np.asarray(sa.block_bounds(k, jnp.array([6, 8], jnp.int32), 4))
  np.testing.assert_array_equal(bounds[0, 1, :, 0], [[8, 9], [10, 11]])  # keys 4, 5 only
  np.testing.assert_array_equal(bounds[1, 1, :, 0], [[24, 25], [30, 31]])  # keys 4..7


def test_bfloat16_block_bounds_enclose_the_float32_ones():
  # What the engine stores with HiSparseConfig.bounds_dtype="bfloat16": rounded outward.
  k = jnp.asarray(np.random.default_rng(2).normal(size=(2, 16, 2, 8)), jnp.float32)
  lens = jnp.array([13, 16], jnp.int32)
  f32 = np.asarray(sa.block_bounds(k, lens, 4))
  bf16 = sa.block_bounds(k, lens, 4, "bfloat16")
  assert bf16.dtype == jnp.bfloat16
  bf16 = np.asarray(bf16, np.float32)
  assert (bf16[:, :, 0] <= f32[:, :, 0]).all() and (bf16[:, :, 1] >= f32[:, :, 1]).all()
  assert (bf16 != f32).mean() > 0.9  # random float32 keys are almost never bf16 values
  np.testing.assert_allclose(bf16, f32, rtol=2 ** -7)  # within one bf16 step


def test_int8_block_bounds_enclose_the_float32_ones():
  # HiSparseConfig.bounds_dtype="int8": values x a scale per (block, side, KV head), outward.
  k = jnp.asarray(np.random.default_rng(3).normal(size=(2, 16, 2, 8)), jnp.float32)
  lens = jnp.array([13, 16], jnp.int32)
  f32 = np.asarray(sa.block_bounds(k, lens, 4))
  q8 = np.asarray(sa.block_bounds(k, lens, 4, "int8"))
  assert (q8[:, :, 0] <= f32[:, :, 0]).all() and (q8[:, :, 1] >= f32[:, :, 1]).all()
  step = np.abs(f32).max(-1, keepdims=True) / 127  # one int8 step of the side's scale
  assert (q8 - f32 <= step * 1.001).all() and (f32 - q8 <= step * 1.001).all()


def test_evaluate_rejects_a_non_dense_reference():
  with pytest.raises(ValueError, match="modes\\[0\\] must be dense"):
    sa.evaluate(tiny_model(), None, 64, 1, 0, [sa.Mode("shared", _blocks(3))], BLOCK, 1)


def test_masked_attention_and_mass_match_numpy():
  rng = np.random.default_rng(1)
  q = rng.normal(size=(2, 4, 8)).astype(np.float32)
  k, v = rng.normal(size=(2, 2, 12, 2, 8)).astype(np.float32)
  valid = np.arange(12)[None, :] < np.array([[10], [12]])
  mask = valid[:, None, :] & (rng.random((2, 2, 12)) < 0.5)
  mask[:, :, 0] = True  # every head keeps a key
  out, mass = sa.masked_decode_attention(*map(jnp.asarray, (q, k, v, mask, valid)))
  scores = np.einsum("bhgd,bkhd->bhgk", q.reshape(2, 2, 2, 8), k) / np.sqrt(8)

  def softmax(x, keep):
    e = np.where(keep, np.exp(x - x.max(-1, keepdims=True)), 0.0)
    return e / e.sum(-1, keepdims=True)

  w = softmax(scores, mask[:, :, None])
  np.testing.assert_allclose(out, np.einsum("bhgk,bkhd->bhgd", w, v).reshape(2, 4, 8),
                             rtol=1e-5, atol=1e-6)
  dense = softmax(scores, valid[:, None, None])
  np.testing.assert_allclose(mass, (dense * mask[:, :, None]).sum(-1).mean((1, 2)), rtol=1e-5)

"""HiSparse's block scores read in place (kernels_pallas/block_scores.py): the kernel in
interpret mode against its elementwise reference and against the indexer's gathered jnp
path, the selection it feeds equal to the jnp path's, and the kernel lowered and compiled
for an H200 (no GPU) at Llama-3.1-8B's shape at 64k tokens; the same over int8 bounds
(`QuantizedBounds`)."""

from __future__ import annotations

import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

import kernels_pallas
from hisparse_jax.sparse import indexer
from hisparse_jax.sparse.config import HiSparseConfig
from kernels_pallas.block_key_bounds import QuantizedBounds, quantize_bounds
from kernels_pallas.block_scores import block_scores, block_scores_reference


def _inputs(seed, batch, num_q_heads, num_kv_heads, head_dim, num_rows, max_blocks,
            q_dtype, bounds_dtype):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((batch, num_q_heads, head_dim)), q_dtype)
  keys = rng.standard_normal((num_rows, 4, num_kv_heads, head_dim)).astype(np.float32)
  bounds = jnp.asarray(np.stack([keys.min(1), keys.max(1)], axis=1), bounds_dtype)
  rows = jnp.asarray(rng.integers(0, num_rows, (batch, max_blocks)), jnp.int32)
  if bounds_dtype == jnp.int8:
    bounds = quantize_bounds(jnp.asarray(keys.min(1)), jnp.asarray(keys.max(1)))
  return q, bounds, rows


CASES = [  # batch, q heads, KV heads, head_dim, bounds rows, max_blocks, q dtype, bounds dtype
    (2, 8, 2, 64, 40, 37, jnp.float32, jnp.bfloat16),     # the CPU engine's: float32 q
    (3, 4, 4, 96, 20, 5, jnp.bfloat16, jnp.bfloat16),     # MHA, head_dim padded to 128
    (1, 16, 2, 32, 50, 130, jnp.float32, jnp.float32),    # group 8, two tiles of blocks
    (2, 12, 2, 64, 30, 16, jnp.bfloat16, jnp.float32),    # group 6 (padded rows)
]


INT8_CASES = [  # batch, q heads, KV heads, head_dim, bounds rows, max_blocks, q dtype
    (2, 8, 2, 128, 40, 37, jnp.bfloat16),  # GQA 4:1, the GPU engine's bfloat16 q
    (2, 8, 2, 64, 40, 37, jnp.float32),    # GQA 4:1, float32 q (float32 dots)
    (3, 4, 4, 96, 20, 5, jnp.bfloat16),    # MHA, head_dim padded to 128
    (1, 16, 2, 64, 50, 130, jnp.float32),  # group 8, two tiles of blocks
    (2, 12, 2, 128, 30, 16, jnp.bfloat16),  # group 6 (padded rows)
]
# (int8: the q dtype, then the bounds' int8; looser: the scales' products round apart.)
ALL_CASES = ([pytest.param(c, 1e-6, id=f"float{i}") for i, c in enumerate(CASES)]
             + [pytest.param((*c, jnp.int8), 1e-5, id=f"int8_{i}")
                for i, c in enumerate(INT8_CASES)])


def _gathered(bounds, rows):
  """`bounds[rows]` as the indexer's jnp path scores them (int8: dequantized)."""
  if isinstance(bounds, QuantizedBounds):
    return bounds.rows(rows).dequantize()
  return bounds[rows]


@pytest.mark.parametrize(("case", "atol"), ALL_CASES)
@pytest.mark.parametrize("per_query_head", [True, False])
def test_scores_equal_the_reference_and_the_indexers_gathered_scores(case, atol,
                                                                     per_query_head):
  q, bounds, rows = _inputs(0, *case)
  assert isinstance(bounds, QuantizedBounds) == (case[-1] == jnp.int8)
  got = block_scores(q, bounds, rows, per_query_head=per_query_head)  # interpret mode
  want = block_scores_reference(q, bounds, rows, per_query_head=per_query_head)
  heads = q.shape[1] if per_query_head else bounds.shape[2]
  assert got.shape == want.shape == (q.shape[0], heads, rows.shape[1])
  assert got.dtype == jnp.float32
  scale = float(jnp.abs(want).max())
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=atol * scale)
  gathered = indexer.block_scores(q, _gathered(bounds, rows), per_query_head=per_query_head)
  np.testing.assert_allclose(np.asarray(got), np.asarray(gathered), rtol=0, atol=atol * scale)


def test_uint16_bits_and_out_of_range_rows_read_as_the_jnp_gather_does():
  q, bounds, rows = _inputs(1, 2, 4, 2, 32, 12, 9, jnp.float32, jnp.bfloat16)
  rows = rows.at[0, 0].set(-5).at[1, 3].set(40)  # read as bounds[rows]: row 7, row 11
  bits = jax.lax.bitcast_convert_type(bounds, jnp.uint16)  # the CPU engine's storage
  got = block_scores(q, bits, rows, per_query_head=True)
  want = indexer.block_scores(q, bounds[rows], per_query_head=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


def test_an_upper_bound_of_every_keys_dot_product():
  rng = np.random.default_rng(2)
  keys = jnp.asarray(rng.standard_normal((6, 16, 2, 64)), jnp.bfloat16)  # 6 blocks of 16
  slots = jnp.arange(6 * 16, dtype=jnp.int32)
  bounds = kernels_pallas.block_key_bounds_reference(
      jnp.zeros((6, 2, 2, 64), jnp.bfloat16), keys, slots)
  q = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.bfloat16)
  rows = jnp.arange(6, dtype=jnp.int32)[None]
  scores = block_scores(q, bounds, rows, per_query_head=True)[0]  # [4, 6]
  dots = jnp.einsum("hd,mthd->hmt", q[0].astype(jnp.float32),
                    keys.astype(jnp.float32)[:, :, jnp.arange(4) // 2])
  assert bool((scores[:, :, None] >= dots - 1e-4).all())


SELECTIONS = ["union", "shared", "per_kv_head", "per_query_head"]


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize(("q_dtype", "bounds_dtype"), [(jnp.float32, jnp.bfloat16),
                                                        (jnp.bfloat16, jnp.int8)])
def test_the_selection_from_the_kernels_scores_is_the_gathered_paths(selection, q_dtype,
                                                                      bounds_dtype):
  # (int8: select_rows' jnp path scores the dequantized gathered rows)
  q, bounds, rows = _inputs(3, 3, 8, 2, 64, 200, 64, q_dtype, bounds_dtype)
  lens = jnp.asarray([64 * 4, 37 * 4 + 1, 9 * 4], jnp.int32)  # block 4; one row short
  blocks = HiSparseConfig(top_k_tokens=40, sink_tokens=4, local_tokens=8,
                          hot_buffer_tokens=96).blocks(4)
  select = functools.partial(indexer.select_rows, q, bounds, rows, lens, blocks, selection)
  got, want = select(scores_kernel=block_scores), select()
  for name in ("logical_ids", "num_selected", "kv_lens"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                  np.asarray(getattr(want, name)), err_msg=name)


def test_the_gpu_backends_bind_it_and_the_others_gather():
  assert kernels_pallas.ops("pallas", platform="gpu").block_scores.func is block_scores
  assert kernels_pallas.ops("pallas", platform="gpu").block_scores.keywords == {
      "interpret": False}
  assert kernels_pallas.ops("pallas_mgpu", platform="gpu").block_scores.func is block_scores
  assert kernels_pallas.ops("xla").block_scores is None
  assert kernels_pallas.ops("reference").block_scores is None


def test_bad_shapes_are_refused_naming_them():
  q, bounds, rows = _inputs(4, 2, 6, 4, 32, 8, 4, jnp.float32, jnp.float32)
  with pytest.raises(ValueError, match="not a multiple of the bounds' num_kv_heads 4"):
    block_scores(q, bounds, rows)
  with pytest.raises(ValueError, match=r"rows must be \[batch=2, max_blocks\]"):
    block_scores(q[:, :4], bounds, rows[0])
  with pytest.raises(ValueError, match="of one head_dim"):
    block_scores(q[:, :4, :16], bounds, rows)


# -- int8 bounds (QuantizedBounds): int8 values, a float32 scale per row, side and KV head --


@pytest.mark.parametrize("head_dim", [64, 96])
def test_int8_scores_bound_every_keys_dot_product(head_dim):
  rng = np.random.default_rng(6)
  keys = rng.standard_normal((6, 16, 2, head_dim)) * rng.choice([0.01, 1.0, 30.0], head_dim)
  keys = jnp.asarray(keys, jnp.bfloat16)  # 6 blocks of 16, outlier channels
  kf = keys.astype(jnp.float32)
  qb = quantize_bounds(kf.min(1), kf.max(1))
  q = jnp.asarray(rng.standard_normal((1, 8, head_dim)), jnp.bfloat16)
  rows = jnp.arange(6, dtype=jnp.int32)[None]
  scores = block_scores(q, qb, rows, per_query_head=True)[0]  # [8, 6]
  dots = jnp.einsum("hd,mthd->hmt", q[0].astype(jnp.float32), kf[:, :, jnp.arange(8) // 4])
  assert bool((scores[:, :, None] >= dots - 1e-4 * float(jnp.abs(dots).max())).all())
  # (and the bfloat16 bounds' score is at most it: the int8 bound is looser, not wrong)
  tight = block_scores_reference(q, jnp.stack([kf.min(1), kf.max(1)], 1), rows,
                                 per_query_head=True)[0]
  assert bool((scores >= tight - 1e-4 * float(jnp.abs(tight).max())).all())


def test_bad_int8_bounds_are_refused():
  q, qb, rows = _inputs(8, 2, 4, 2, 32, 8, 4, jnp.float32, jnp.int8)
  with pytest.raises(ValueError, match="QuantizedBounds must be int8 values"):
    block_scores(q, QuantizedBounds(qb.values, qb.scales[..., 0]), rows)


# Llama-3.1-8B's attention (GQA 32:8, head_dim 128), block 16, 64k tokens = 4,096 blocks a
# row, batch 32; the bounds of 32 such rows plus the null row, bfloat16 (or int8).
S = jax.ShapeDtypeStruct
LLAMA_8B_64K = (S((32, 32, 128), jnp.bfloat16), S((32 * 4096 + 1, 2, 8, 128), jnp.bfloat16),
                S((32, 4096), jnp.int32))
SCORES = functools.partial(block_scores, per_query_head=True)


LLAMA_8B_64K_INT8 = (LLAMA_8B_64K[0],
                     QuantizedBounds(S((32 * 4096 + 1, 2, 8, 128), jnp.int8),
                                     S((32 * 4096 + 1, 2, 8, 1), jnp.float32)),
                     LLAMA_8B_64K[2])


@pytest.mark.parametrize("args", [LLAMA_8B_64K, LLAMA_8B_64K_INT8], ids=["bf16", "int8"])
def test_it_lowers_for_cuda_to_one_triton_call_with_no_gathered_copy(args):
  _, lowered = lib.lower_for_h200(SCORES, *args)
  text = lowered.as_text()
  assert re.findall(r"custom_call @([\w$.]+)\(", text) == ["__gpu$xla.gpu.triton"]
  assert len(re.findall(r'\bname = "block_scores"', text)) == 1
  # Nothing of the bounds' size ([blocks, 2, 8, 128]) is gathered outside the kernel.
  assert not re.search(r"stablehlo\.gather.*tensor<32x4096x2x8x", text)


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="XLA's GPU compiler is not installed (jax[cuda13])")
@pytest.mark.parametrize("args", [LLAMA_8B_64K, LLAMA_8B_64K_INT8], ids=["bf16", "int8"])
def test_it_compiles_for_an_h200_at_llama_8b_64k_with_small_temporaries(args):
  target, lowered = lib.lower_for_h200(SCORES, *args)
  executable = target.compile(lowered)
  # Temporaries (2.5 MiB, bf16 and int8 alike): q's halves padded to Triton's 16 dot rows
  # (2 x 32 x 8 x 16 x 128 bf16, 2 MiB) and the clamped row ids (0.5 MiB); the [32, 8, 4,
  # 4096] float32 scores are the output (the padding rows are not stored). No copy of the
  # bounds (a gathered copy alone would be 512 MiB in bfloat16, 264 MiB in int8 with its
  # scales); int8: the scales' [rows, 2, 8] view of [rows, 2, 8, 1] is a bitcast.
  temp = executable.get_compiled_memory_stats().temp_size_in_bytes
  print(f"block_scores {'int8' if isinstance(args[1], QuantizedBounds) else 'bf16'} "
        f"temporaries: {temp} B")
  assert temp < 20 * 2**20, temp

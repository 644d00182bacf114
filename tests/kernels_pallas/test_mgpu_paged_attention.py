"""The Mosaic GPU decode kernel: run on CPU by jax's GPU interpreter, and lowered for cuda.

Interpret mode. jax ships a Mosaic GPU interpreter (``interpret=InterpretGPUParams()`` on
``plgpu.kernel``/``pallas_call``) that runs the kernel body on CPU with simulated GMEM and
SMEM, barriers (it raises when an arrival completes twice before a wait observed it) and
TMA copies, filling unwritten SMEM with NaN. jax 0.10.2's interpreter had two gaps this
file used to fill with monkeypatches: no CPU rule for ``plgpu.layout_cast`` and no WGMMA
operand given transposed (K^T in ``q @ k^T``, ``ref.transpose``). jax 0.11 closes both
(``layout_cast`` is a no-op of its jaxpr interpreter; its ``wgmma`` callback reads
operands through ``to_access``, which folds transposes), and its callbacks take
``mesh_location``/``thread`` where 0.10.2's took ``device_id``/``thread_id``, so the
kernel runs on the interpreter as shipped.

Lowering. ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` inside
``kernels_pallas.backend.abstract_gpu()`` (the target GPU of the Triton kernels beside it)
runs Pallas -> Mosaic GPU from this CPU host: layout inference, WGMMA/TMA shape and swizzle checks
(e.g. "WGMMA rhs swizzle must match lhs swizzle" was found this way). The module must call
exactly the Mosaic GPU custom call and no Triton kernel. What only a Hopper GPU can
check: the PTX compile, SMEM limits at run time, numbers and speed.
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

import kernels_pallas
from kernels_pallas.paged_attention import paged_attention_reference
from kernels_pallas.paged_attention_mgpu import (
  MAX_SPLITS,
  MIN_STEPS_PER_SPLIT,
  combine_splits,
  default_num_splits,
  paged_attention_mgpu,
  scales_by_row,
)
from kernels_pallas.quant import STORAGE_DTYPES, QuantizedPages, quantize

MGPU_CALL = "mosaic_gpu_v2"
TRITON_CALL = "__gpu$xla.gpu.triton"
NUM_BLOCKS = 64
S = jax.ShapeDtypeStruct
I32 = jnp.int32


def _case(rng, group, block_size, head_dim, dtype, lengths, num_kv_heads=2):
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, num_kv_heads, head_dim, dtype)
  max_blocks = max(-(-n // block_size) for n in lengths) + 1  # one spare 0 (null) column
  tables = lib.make_tables(rng, lengths, block_size, max_blocks, NUM_BLOCKS)
  q = jnp.asarray(rng.standard_normal((len(lengths), group * num_kv_heads, head_dim)), dtype)
  return (q, pool.k_pages, pool.v_pages, jnp.asarray(tables), jnp.asarray(lengths, I32))


# (group, block_size, head_dim, dtype, tokens_per_step, attention kwargs). Lengths: the
# kernel tests' 1, bs-1, bs, bs+1, 5*bs+3 and 0, plus 300 (5 steps of 64 keys: both
# buffer slots reused); tables are random, non-monotonic.
INTERPRET_GRID = (
    (1, 16, 64, jnp.bfloat16, 64, {}),
    (4, 8, 64, jnp.bfloat16, 64, {}),
    (8, 64, 128, jnp.bfloat16, 64, {"sm_scale": 0.2, "soft_cap": 3.0}),
    (2, 32, 32, jnp.float16, 128, {}),
    (16, 8, 64, jnp.bfloat16, 64, {}),
)


@pytest.mark.parametrize(("group", "block_size", "head_dim", "dtype", "tokens_per_step",
                          "attn_kw"), INTERPRET_GRID)
def test_interpreted_kernel_matches_reference(gpu_interpreter, rng, group, block_size,
                                              head_dim, dtype, tokens_per_step, attn_kw):
  lengths = [*lib.grid_lengths(block_size)[:-1], 300, 0]
  args = _case(rng, group, block_size, head_dim, dtype, lengths)
  out = paged_attention_mgpu(*args, interpret=gpu_interpreter,
                             tokens_per_step=tokens_per_step, **attn_kw)
  ref = paged_attention_reference(*args, **attn_kw)
  chex.assert_shape(out, args[0].shape)
  assert out.dtype == args[0].dtype
  assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= 2e-2
  np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)  # length 0 -> zeros
  assert not gpu_callbacks.get_races().races_found


def test_interpreted_sparse_table_equals_attention_over_selected_tokens(gpu_interpreter, rng):
  """A table listing a subset of one sequence's blocks == plain softmax over their tokens
  (independent numpy; the newest, partly filled block is last)."""
  block_size, num_kv_heads, head_dim, group = 16, 1, 64, 4
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, num_kv_heads, head_dim, jnp.bfloat16)
  seq_blocks = rng.choice(np.arange(1, NUM_BLOCKS), size=20, replace=False)
  picks = [[0, 5, 11], [11, 2, 7, 3, 19], [4], [19, 0, 9, 1, 12, 6, 3, 17]]
  tables = np.zeros((len(picks), 8), np.int32)
  for b, p in enumerate(picks):
    tables[b, :len(p)] = seq_blocks[p]
  lengths = np.array([len(p) * block_size - 5 for p in picks], np.int32)
  q = np.asarray(jnp.asarray(rng.standard_normal((len(picks), group, head_dim)),
                             jnp.bfloat16).astype(jnp.float32))
  out = paged_attention_mgpu(jnp.asarray(q, jnp.bfloat16), pool.k_pages, pool.v_pages,
                             jnp.asarray(tables), jnp.asarray(lengths),
                             interpret=gpu_interpreter)
  seq_k = pool.k_np[seq_blocks].reshape(-1, num_kv_heads, head_dim)
  seq_v = pool.v_np[seq_blocks].reshape(-1, num_kv_heads, head_dim)
  for b, p in enumerate(picks):
    token_block = np.arange(len(seq_blocks) * block_size) // block_size
    order = np.concatenate([np.flatnonzero(token_block == i) for i in p])[:lengths[b]]
    want = lib.naive_attention(q[b:b + 1], seq_k[order], seq_v[order])
    assert lib.max_abs_err(out[b:b + 1].astype(jnp.float32), want) <= 2e-2, b


def test_refuses_what_wgmma_and_tma_cannot_take(rng):
  q, k, v, tables, lengths = _case(rng, 4, 8, 64, jnp.bfloat16, [3, 9])
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  with pytest.raises(ValueError, match="bfloat16 or float16 KV, got float32"):
    paged_attention_mgpu(*f32, tables, lengths)
  q4, k4, v4, t4, l4 = _case(rng, 4, 4, 64, jnp.bfloat16, [3, 9])
  with pytest.raises(ValueError, match="got block_size 4"):
    paged_attention_mgpu(q4, k4, v4, t4, l4)
  with pytest.raises(ValueError, match="block_size a multiple of 8 that divides "
                                       "tokens_per_step=64, got block_size 128"):
    paged_attention_mgpu(*_case(rng, 1, 128, 64, jnp.bfloat16, [3]))
  q_wide = jnp.zeros((2, 2 * 65, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="query heads per KV head 65"):
    paged_attention_mgpu(q_wide, k, v, tables, lengths)
  with pytest.raises(ValueError, match="head_dim a multiple of 32, got 48"):
    paged_attention_mgpu(*_case(rng, 1, 8, 48, jnp.bfloat16, [3]))
  with pytest.raises(ValueError, match="tokens_per_step must be a multiple of 64"):
    paged_attention_mgpu(q, k, v, tables, lengths, tokens_per_step=96)
  with pytest.raises(ValueError, match="InterpretGPUParams"):
    paged_attention_mgpu(q, k, v, tables, lengths, interpret=True)
  with pytest.raises(ValueError, match=r"\(3, 8\)"):  # the shared shape checks
    paged_attention_mgpu(q, k, v, jnp.zeros((3, 8), I32), lengths)


def lower_for_cuda(fn, *args) -> str:
  with kernels_pallas.backend.abstract_gpu():  # the target GPU of the Triton lowering
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(text: str) -> set[str]:
  return set(re.findall(r"custom_call @([\w$.]+)\(", text))


def mgpu_signature(text: str) -> tuple[str, str]:
  """(operand types, result types) of the (first) Mosaic GPU call: the first signature
  after it (its serialized module in between is bytes, newlines included)."""
  tail = text[text.index(f"custom_call @{MGPU_CALL}("):]
  sig = re.search(r"\} : \(((?:tensor<[^>]*>(?:, )?)+)\) -> ([^\n]*)", tail)
  return sig[1], sig[2]


# (group, block_size, head_dim, dtype, tokens_per_step): GQA 1 to 64, block sizes 8 to 64,
# head_dim 32 to 256 (swizzles 64 and 128 bytes), both 16-bit dtypes.
LOWERING_GRID = (
    (1, 8, 64, "bfloat16", 64),
    (4, 16, 128, "bfloat16", 64),
    (8, 32, 128, "float16", 128),
    (2, 64, 32, "bfloat16", 64),
    (64, 16, 64, "bfloat16", 64),
    (4, 64, 256, "bfloat16", 64),
    (6, 8, 96, "float16", 128),
)


@pytest.mark.parametrize(("group", "block_size", "head_dim", "dtype", "tokens_per_step"),
                         LOWERING_GRID)
def test_kernel_lowers_for_cuda_to_one_mosaic_gpu_call(group, block_size, head_dim, dtype,
                                                       tokens_per_step):
  num_kv_heads, batch = 2, 4
  pages = S((NUM_BLOCKS, block_size, num_kv_heads, head_dim), dtype)
  args = (S((batch, group * num_kv_heads, head_dim), dtype), pages, pages,
          S((batch, 8), I32), S((batch,), I32))
  text = lower_for_cuda(
      functools.partial(paged_attention_mgpu, tokens_per_step=tokens_per_step), *args)
  assert custom_calls(text) == {MGPU_CALL}
  assert text.count(f"custom_call @{MGPU_CALL}(") == 1
  assert TRITON_CALL not in text


def test_pallas_mgpu_backend_lowers_mosaic_gpu_decode_and_ragged_triton_others():
  ops = kernels_pallas.ops("pallas_mgpu", platform="cuda")
  pages = S((NUM_BLOCKS, 16, 2, 64), jnp.bfloat16)
  decode = lower_for_cuda(ops.paged_attention, S((4, 8, 64), jnp.bfloat16), pages, pages,
                          S((4, 8), I32), S((4,), I32))
  assert custom_calls(decode) == {MGPU_CALL}
  ragged = lower_for_cuda(ops.ragged_paged_attention, S((64, 8, 64), jnp.bfloat16), pages,
                          pages, S((4, 8), I32), S((4,), I32), S((5,), I32))
  assert custom_calls(ragged) == {MGPU_CALL}  # kernels_pallas.ragged_paged_attention_mgpu
  # Pages the Mosaic GPU kernels cannot take (block_size 4) keep the Triton ragged kernel.
  small = S((NUM_BLOCKS, 4, 2, 64), jnp.bfloat16)
  ragged = lower_for_cuda(ops.ragged_paged_attention, S((64, 8, 64), jnp.bfloat16), small,
                          small, S((4, 8), I32), S((4,), I32), S((5,), I32))
  assert custom_calls(ragged) == {TRITON_CALL}


def test_lowering_refuses_a_step_that_overflows_shared_memory():
  # head_dim 256 at 128 keys per step: q + 2 slots of K and V + p = 304 KiB > 227 KiB.
  pages = S((NUM_BLOCKS, 64, 2, 256), jnp.bfloat16)
  args = (S((4, 8, 256), jnp.bfloat16), pages, pages, S((4, 8), I32), S((4,), I32))
  with pytest.raises(ValueError, match="exceeds available shared memory"):
    lower_for_cuda(functools.partial(paged_attention_mgpu, tokens_per_step=128), *args)


# 8-bit pages: (kind, group, block_size, head_dim, dtype, tokens_per_step, attention kwargs).
QUANTIZED_GRID = (
    ("int8", 4, 16, 64, jnp.bfloat16, 64, {}),
    ("fp8_e4m3", 8, 32, 128, jnp.bfloat16, 128, {"soft_cap": 3.0}),
    ("int8", 1, 8, 32, jnp.float16, 64, {"sm_scale": 0.2}),
)


def _quantized_case(rng, kind, group, block_size, head_dim, dtype, lengths, num_kv_heads=2):
  """_case with 8-bit pages: per-token magnitudes spread over [1/4, 4], so each token's
  scale differs (a scale read for the wrong token or head shows)."""
  q, *_, tables, lens = _case(rng, group, block_size, head_dim, dtype, lengths, num_kv_heads)
  shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)

  def pages():
    x = rng.standard_normal(shape) * 2.0 ** rng.uniform(-2, 2, shape[:3] + (1,))
    return QuantizedPages(*quantize(jnp.asarray(x, jnp.float32), kind), dtype=dtype)

  return q, pages(), pages(), tables, lens


@pytest.mark.parametrize(("kind", "group", "block_size", "head_dim", "dtype",
                          "tokens_per_step", "attn_kw"), QUANTIZED_GRID)
def test_interpreted_kernel_reads_8bit_pages_as_the_reference(
    gpu_interpreter, rng, kind, group, block_size, head_dim, dtype, tokens_per_step, attn_kw):
  lengths = [*lib.grid_lengths(block_size)[:-1], 300, 0]
  args = _quantized_case(rng, kind, group, block_size, head_dim, dtype, lengths)
  assert args[1].values.dtype == STORAGE_DTYPES[kind]
  out = paged_attention_mgpu(*args, interpret=gpu_interpreter,
                             tokens_per_step=tokens_per_step, **attn_kw)
  ref = paged_attention_reference(*args, **attn_kw)  # gathers and dequantizes the blocks
  assert out.dtype == dtype
  assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= 2e-2
  np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)
  assert not gpu_callbacks.get_races().races_found


def test_scales_by_row_lists_each_rows_token_scales_per_kv_head(rng):
  scales = jnp.asarray(rng.standard_normal((NUM_BLOCKS, 8, 3)), jnp.float32)
  tables = jnp.asarray([[5, 2, 0], [7, 7, 9]], I32)
  got = np.asarray(scales_by_row(scales, tables))
  assert got.shape == (2, 3, 3 * 8)
  for b, h, t in np.ndindex(got.shape):
    assert got[b, h, t] == scales[tables[b, t // 8], t % 8, h]


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("group", "block_size", "head_dim", "dtype", "tokens_per_step"),
                         [(4, 16, 128, "bfloat16", 64), (8, 32, 64, "float16", 128),
                          (1, 8, 32, "bfloat16", 64), (4, 64, 256, "bfloat16", 64)])
def test_8bit_pages_lower_for_cuda_to_one_mosaic_gpu_call_reading_bytes(
    kind, group, block_size, head_dim, dtype, tokens_per_step):
  num_kv_heads, batch = 2, 4
  shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
  values = S(shape, STORAGE_DTYPES[kind])
  pages = QuantizedPages(values, S(shape[:3] + (1,), jnp.float32), dtype)
  args = (S((batch, group * num_kv_heads, head_dim), dtype), pages, pages,
          S((batch, 8), I32), S((batch,), I32))
  text = lower_for_cuda(
      functools.partial(paged_attention_mgpu, tokens_per_step=tokens_per_step,
                        num_splits=1), *args)
  assert custom_calls(text) == {MGPU_CALL}
  assert text.count(f"custom_call @{MGPU_CALL}(") == 1
  # The kernel's operands: the pools' 8-bit values as they are (1 byte per value), and
  # each row's scales gathered per KV head [batch, num_kv_heads, keys] float32.
  operands = mgpu_signature(text)[0]
  values_type = "x".join(map(str, shape)) + ("xi8" if kind == "int8" else "xui8")
  assert operands.count(f"tensor<{values_type}>") == 2, operands
  blocks_per_step = tokens_per_step // block_size
  # The table padded to whole steps, at least the 2 the prologue fetches.
  keys = max(-(-8 // blocks_per_step), 2) * blocks_per_step * block_size
  assert operands.count(f"tensor<{batch}x{num_kv_heads}x{keys}xf32>") == 2, operands


def test_8bit_pages_read_as_float32_are_refused(rng):
  q, k, v, tables, lengths = _quantized_case(rng, "int8", 4, 8, 64, jnp.float32, [3, 9])
  with pytest.raises(ValueError, match=r"bfloat16 or float16 KV \(8-bit pages read as\), "
                                       "got float32"):
    paged_attention_mgpu(q, k, v, tables, lengths)


# Split-K.


def test_default_num_splits_fills_the_sms_of_small_batches_only():
  # batch 1, 8 KV heads, 32k and 128k tokens at 64 keys per step: 17 splits, 136 programs.
  assert default_num_splits(1, 8, 512) == 17
  assert default_num_splits(1, 8, 2048) == 17
  assert default_num_splits(1, 1, 2048) == MAX_SPLITS  # MQA: capped
  assert default_num_splits(2, 8, 512) == 9  # 144 programs
  assert default_num_splits(32, 8, 2048) == 1  # 256 programs fill the 132 SMs already
  assert default_num_splits(1, 8, 7) == 1  # under 2 * MIN_STEPS_PER_SPLIT steps
  assert default_num_splits(1, 8, 8) == 2
  # As few splits as cover the steps at their size: 25 steps and room for 6 splits give
  # 5 of 5 steps (6 splits of 5 would leave the last one empty).
  assert default_num_splits(1, 1, 25, num_sms=6) == 5
  for batch, heads, steps in [(1, 8, 100), (3, 2, 999), (1, 4, 33)]:
    n = default_num_splits(batch, heads, steps)
    per = -(-steps // n)
    assert (n - 1) * per < steps <= n * per
    assert n == 1 or per >= MIN_STEPS_PER_SPLIT


def test_combine_splits_equals_softmax_over_all_keys(rng):
  s = rng.standard_normal((3, 5))  # 3 splits of 5 keys, one query row
  v = rng.standard_normal((3, 5, 4))
  p = np.exp(s - s.max(axis=1, keepdims=True))
  o = np.einsum("sk,skd->sd", p / p.sum(axis=1, keepdims=True), v)
  lse = s.max(axis=1) + np.log(p.sum(axis=1))
  flat = np.exp(s.ravel() - s.max())
  want = flat / flat.sum() @ v.reshape(15, 4)  # softmax over the 15 keys at once
  got = combine_splits(jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  # A split without keys (lse MASK_VALUE, o 0) weighs nothing; none with keys gives 0.
  empty = jnp.asarray([kernels_pallas.common.MASK_VALUE], jnp.float32)
  got = combine_splits(jnp.concatenate([jnp.asarray(o, jnp.float32), jnp.zeros((1, 4))]),
                       jnp.concatenate([jnp.asarray(lse, jnp.float32), empty]))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  got = combine_splits(jnp.zeros((2, 4)), jnp.concatenate([empty, empty]))
  np.testing.assert_array_equal(np.asarray(got), 0.0)


@pytest.mark.parametrize(("quantized", "num_splits"), [(False, 3), (True, 2)])
def test_interpreted_split_k_matches_reference(gpu_interpreter, rng, quantized, num_splits):
  # 16-token blocks, 64 keys per step; lengths 0 to 10 steps over an 11-step table (41
  # blocks): 3 splits of 4 steps or 2 of 6, the later ones empty for the short rows.
  lengths = [1, 63, 64, 65, 300, 577, 640, 0]
  if quantized:
    args = _quantized_case(rng, "int8", 4, 16, 64, jnp.bfloat16, lengths)
  else:
    args = _case(rng, 4, 16, 64, jnp.bfloat16, lengths)
  out = paged_attention_mgpu(*args, interpret=gpu_interpreter, num_splits=num_splits)
  ref = paged_attention_reference(*args)
  # Each split's output is rounded to bf16 before the combine, then the sum again: up to 2
  # bf16 steps of the output (the 8-bit case's values reach 4x, outputs past 2).
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=2.0**-7)
  np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)
  assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize(("num_slots", "quantized", "num_splits"),
                         [(1, False, 1), (3, False, 1), (3, True, 2), (4, False, 1)])
def test_interpreted_pipeline_of_any_depth_matches_reference(gpu_interpreter, rng, num_slots,
                                                             quantized, num_splits):
  # The K/V pipeline's slots (make gpu-bench's tuning rows time 3): rows of 0 to 10 steps,
  # so a slot is refilled several times and the prologue's fetches outnumber short rows'
  # steps; with 8-bit pages each slot's scales ride with it; 1 slot: no overlap, same sums.
  lengths = [1, 63, 64, 65, 130, 300, 577, 640, 0]
  if quantized:
    args = _quantized_case(rng, "int8", 4, 16, 64, jnp.bfloat16, lengths)
  else:
    args = _case(rng, 4, 16, 64, jnp.bfloat16, lengths)
  out = paged_attention_mgpu(*args, interpret=gpu_interpreter, num_slots=num_slots,
                             num_splits=num_splits)
  ref = paged_attention_reference(*args)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=2.0**-7)
  np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)
  assert not gpu_callbacks.get_races().races_found
  with pytest.raises(ValueError, match="num_slots must be >= 1, got 0"):
    paged_attention_mgpu(*args, interpret=gpu_interpreter, num_slots=0)


def test_split_k_lowers_for_cuda_to_one_mosaic_gpu_call_and_a_combine():
  # Batch 1 over a 32k-token table (8 KV heads, 64-token blocks): the default splits.
  pages = S((NUM_BLOCKS, 64, 8, 128), jnp.bfloat16)
  args = (S((1, 32, 128), jnp.bfloat16), pages, pages, S((1, 512), I32), S((1,), I32))
  text = lower_for_cuda(paged_attention_mgpu, *args)
  assert custom_calls(text) == {MGPU_CALL}
  assert text.count(f"custom_call @{MGPU_CALL}(") == 1
  results = mgpu_signature(text)[1]
  assert "tensor<17x1x8x64x128xbf16>" in results and "tensor<17x1x8x64xf32>" in results
  with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
    lower_for_cuda(functools.partial(paged_attention_mgpu, num_splits=0), *args)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_interpreted_kernel_returns_the_references_log_sum_exp(gpu_interpreter, rng,
                                                               num_splits):
  # return_lse (HiSparse's overlapped loads merge two attentions by it): one split writes
  # its lse too; over splits, combine_splits' lse of theirs.
  lengths = [1, 63, 64, 65, 300, 0]
  args = _case(rng, 4, 16, 64, jnp.bfloat16, lengths)
  out, lse = paged_attention_mgpu(*args, interpret=gpu_interpreter, num_splits=num_splits,
                                  return_lse=True)
  ref, ref_lse = paged_attention_reference(*args, return_lse=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=2.0**-7)
  assert lse.dtype == jnp.float32 and lse.shape == args[0].shape[:2]
  np.testing.assert_allclose(np.asarray(lse[:-1]), np.asarray(ref_lse[:-1]), rtol=1e-5,
                             atol=1e-4)
  np.testing.assert_array_equal(np.asarray(lse[-1]), np.float32(kernels_pallas.common.MASK_VALUE))
  np.testing.assert_array_equal(
      np.asarray(paged_attention_mgpu(*args, interpret=gpu_interpreter,
                                      num_splits=num_splits), np.float32),
      np.asarray(out, np.float32))  # the output does not change with return_lse
  assert not gpu_callbacks.get_races().races_found

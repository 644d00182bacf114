"""8-bit KV pages: the quantization round trip, and every attention path that reads
`QuantizedPages` (the Pallas kernels in interpret mode, the xla backend and the
references) against the same attention over pages dequantized first."""

import jax
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

from kernels_pallas import (
    block_key_bounds,
    block_key_bounds_reference,
    paged_attention,
    paged_attention_reference,
    paged_attention_xla,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    ragged_paged_attention_xla,
    write_kv,
    write_kv_reference,
)
from kernels_pallas.quant import (
    FP8_E4M3_MAX,
    QuantizedPages,
    dequantize,
    dequantize_int8,
    quantize,
    quantize_fp8_e4m3,
    quantize_int8,
)

NUM_BLOCKS = 24
# (kind, block_size, group) where the Pallas kernels (interpret mode: slow) run too: a
# pairwise cover of the grid below (every pair of values meets once).
PALLAS_CASES = {("int8", 4, 1), ("int8", 16, 4), ("fp8_e4m3", 4, 4), ("fp8_e4m3", 16, 1)}


def test_quantize_round_trip_is_within_half_a_step():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 4, 32)).astype(np.float32) * np.exp(rng.normal(size=(64, 4, 1)))
  x[3, 1] = 0.0  # an all-zero row
  values, scales = quantize_int8(jnp.asarray(x))
  assert values.dtype == jnp.int8 and scales.dtype == jnp.float32
  assert values.shape == x.shape and scales.shape == (64, 4, 1)
  v = np.asarray(values, np.int32)
  assert np.abs(v).max() == 127 and (np.abs(v).max(axis=-1)[np.abs(x).max(-1) > 0] == 127).all()
  back = np.asarray(dequantize_int8(values, scales))
  err = np.abs(back - x)
  assert (err <= np.asarray(scales) / 2 * (1 + 1e-6)).all()  # half a quantization step
  assert (err <= np.abs(x).max(-1, keepdims=True) / 254 * (1 + 1e-6)).all()
  np.testing.assert_array_equal(back[3, 1], 0.0)
  assert err.max() > 0  # float inputs are not all on the grid


def test_fp8_e4m3_round_trip_is_within_its_rounding():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((64, 4, 32)).astype(np.float32) * np.exp(rng.normal(size=(64, 4, 1)))
  x[5, 2] = 0.0
  values, scales = quantize_fp8_e4m3(jnp.asarray(x))
  assert values.dtype == jnp.uint8 and scales.shape == (64, 4, 1)
  decoded = np.asarray(jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn), np.float32)
  assert np.isfinite(decoded).all() and np.abs(decoded).max() == FP8_E4M3_MAX  # the row max
  back = np.asarray(dequantize(values, scales))
  err = np.abs(back - x)
  s = np.asarray(scales)
  # 3 mantissa bits, round to nearest: half a step is |x| / 16 for normals; subnormal
  # steps (below 2^-6 before scaling) are 2^-9, half of that 2^-10, times the scale.
  assert (err <= np.maximum(np.abs(x) / 16, s * 2.0 ** -10) * (1 + 1e-6)).all()
  np.testing.assert_array_equal(back[5, 2], 0.0)
  np.testing.assert_array_equal(np.asarray(quantize(jnp.asarray(x), "fp8_e4m3")[0]), values)
  assert err.max() > 0


def _quantized_pool(rng, block_size, num_kv_heads, head_dim, dtype=jnp.float32,
                    kind="int8"):
  shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
  k = quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32), kind)
  v = quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32), kind)
  return QuantizedPages(*k, dtype=dtype), QuantizedPages(*v, dtype=dtype)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 4])  # query heads per KV head (GQA)
def test_attention_over_8bit_pages_equals_attention_over_dequantized_pages(rng, block_size,
                                                                           group, kind):
  num_kv_heads, head_dim = 2, 32
  k_q, v_q = _quantized_pool(rng, block_size, num_kv_heads, head_dim, kind=kind)
  k_f, v_f = k_q.dequantize(), v_q.dequantize()
  kv_lens = np.array([37, 5, 64, 1], np.int32)
  tables = lib.make_tables(rng, kv_lens, block_size, -(-64 // block_size) + 1, NUM_BLOCKS)
  tables, lens = jnp.asarray(tables), jnp.asarray(kv_lens)
  q = jnp.asarray(rng.standard_normal((4, num_kv_heads * group, head_dim)), jnp.float32)
  pallas = (kind, block_size, group) in PALLAS_CASES
  want = np.asarray(paged_attention_reference(q, k_f, v_f, tables, lens))
  for fn in (paged_attention,) * pallas + (paged_attention_xla, paged_attention_reference):
    got = np.asarray(fn(q, k_q, v_q, tables, lens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=fn.__name__)
  # Ragged: a prefill chunk of 5, a decode row, a chunk of 9, a decode row.
  q_lens = np.array([5, 1, 9, 1], np.int32)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
  qr = jnp.asarray(rng.standard_normal((int(q_lens.sum()), num_kv_heads * group, head_dim)),
                   jnp.float32)
  want = np.asarray(ragged_paged_attention_reference(qr, k_f, v_f, tables, lens, cu))
  for fn in (ragged_paged_attention,) * pallas + (ragged_paged_attention_xla,
                                                  ragged_paged_attention_reference):
    got = np.asarray(fn(qr, k_q, v_q, tables, lens, cu))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=fn.__name__)


def test_int8_pages_read_as_the_model_dtype():
  rng = np.random.default_rng(3)
  k_q, v_q = _quantized_pool(rng, 4, 2, 16, dtype=jnp.bfloat16)
  assert k_q.dtype == jnp.bfloat16 and k_q[jnp.array([1, 2])].dtype == jnp.bfloat16
  q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.bfloat16)
  tables = jnp.asarray([[1, 2, 3], [4, 5, 0]], jnp.int32)
  lens = jnp.asarray([10, 7], jnp.int32)
  got = paged_attention_xla(q, k_q, v_q, tables, lens)
  want = paged_attention_reference(q, k_q.dequantize(), v_q.dequantize(), tables, lens)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)
  with pytest.raises(TypeError, match="whole blocks"):
    _ = k_q[1, 2]


def test_write_kv_moves_values_and_scales_and_bounds_read_dequantized_keys(rng):
  # What the engine does: quantize the new tokens, write values and scales (pages of
  # head_dim 1) with write_kv, then compute the key bounds over the dequantized keys.
  shape = (NUM_BLOCKS, 4, 2, 32)
  k_vals, v_vals = jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8)
  k_sc, v_sc = (jnp.zeros(shape[:3] + (1,), jnp.float32) for _ in range(2))
  new = jnp.asarray(rng.standard_normal((6, 2, 32)), jnp.float32)
  slots = jnp.asarray([8, 9, 10, 11, 20, -1], jnp.int32)  # block 2 full, block 5 1 token
  (kq, ks), (vq, vs) = quantize_int8(new), quantize_int8(-new)
  k_vals, v_vals = write_kv_reference(k_vals, v_vals, kq, vq, slots)
  k_sc, v_sc = write_kv_reference(k_sc, v_sc, ks, vs, slots)
  pages = QuantizedPages(k_vals, k_sc)
  got = np.asarray(pages[jnp.asarray([2, 5])]).reshape(8, 2, 32)
  want = np.asarray(dequantize_int8(kq, ks))
  np.testing.assert_array_equal(got[:5], want[:5])
  np.testing.assert_allclose(got[:5], np.asarray(new[:5]), atol=float(ks.max()) / 2 + 1e-6)
  np.testing.assert_array_equal(np.asarray(QuantizedPages(v_vals, v_sc)[jnp.asarray([2])])[0],
                                -want[:4])
  bounds = block_key_bounds_reference(jnp.zeros((NUM_BLOCKS, 2, 2, 32), jnp.float32), pages,
                                      slots)
  b = np.asarray(bounds)
  np.testing.assert_array_equal(b[2, 0], want[:4].min(axis=0))
  np.testing.assert_array_equal(b[2, 1], want[:4].max(axis=0))
  np.testing.assert_array_equal(b[5, 0], want[4])
  assert jax.tree_util.tree_leaves(pages)[0] is k_vals  # a pytree of its two arrays


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_pallas_kernels_dequantize_8bit_pages_of_padded_head_dim_in_the_model_dtype(kind):
  # head_dim 40 is tiled at 64 (masked columns), the model dtype is bfloat16: the kernels
  # dequantize as the references' gather does ((values * scale) in bfloat16), GQA 4; pages
  # past every listed range hold NaN scales, which no kernel may read into its output.
  rng = np.random.default_rng(4)
  num_kv_heads, head_dim, block_size = 2, 40, 16
  k_q, v_q = _quantized_pool(rng, block_size, num_kv_heads, head_dim, jnp.bfloat16, kind)
  k_q = QuantizedPages(k_q.values, k_q.scales.at[20:].set(jnp.nan), jnp.bfloat16)
  v_q = QuantizedPages(v_q.values, v_q.scales.at[20:].set(jnp.nan), jnp.bfloat16)
  k_f, v_f = k_q.dequantize(), v_q.dequantize()
  tables = jnp.asarray([[3, 7, 1, 20], [5, 2, 21, 0]], jnp.int32)  # 20, 21 past the lens
  lens = jnp.asarray([41, 27], jnp.int32)
  q = jnp.asarray(rng.standard_normal((2, num_kv_heads * 4, head_dim)), jnp.bfloat16)
  got = paged_attention(q, k_q, v_q, tables, lens)
  want = paged_attention_reference(q, k_f, v_f, tables, lens)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)
  cu = jnp.asarray([0, 3, 4], jnp.int32)  # a chunk of 3, a decode row
  qr = jnp.asarray(rng.standard_normal((4, num_kv_heads * 4, head_dim)), jnp.bfloat16)
  got = ragged_paged_attention(qr, k_q, v_q, tables, lens, cu)
  want = ragged_paged_attention_reference(qr, k_f, v_f, tables, lens, cu)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_pallas_write_kv_and_block_key_bounds_take_8bit_pages(rng, kind):
  # The engine's write of an 8-bit cache through the Pallas kernels: values and scales
  # (pages of head_dim 1) by write_kv, then the bounds over the dequantized keys, equal
  # to the references' (bounds in bfloat16: rounded outward alike).
  shape = (NUM_BLOCKS, 4, 2, 40)
  values_dtype = jnp.int8 if kind == "int8" else jnp.uint8
  pages = [jnp.zeros(shape, values_dtype) for _ in range(2)]
  scales = [jnp.zeros(shape[:3] + (1,), jnp.float32) for _ in range(2)]
  new = jnp.asarray(rng.standard_normal((6, 2, 40)), jnp.float32)
  slots = jnp.asarray([8, 9, 10, 11, 20, -1], jnp.int32)  # block 2 full, block 5 1 token
  (kq, ks), (vq, vs) = quantize(new, kind), quantize(-new, kind)
  out = {}
  for name, wkv, bkb in (("pallas", write_kv, block_key_bounds),
                         ("reference", write_kv_reference, block_key_bounds_reference)):
    k_vals, v_vals = wkv(*(jnp.copy(p) for p in pages), kq, vq, slots)
    k_sc, v_sc = wkv(*(jnp.copy(s) for s in scales), ks, vs, slots)
    bounds = bkb(jnp.zeros((NUM_BLOCKS, 2, 2, 40), jnp.bfloat16), QuantizedPages(k_vals, k_sc),
                 slots)
    out[name] = [np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)
                 for x in (k_vals, v_vals, k_sc, v_sc, bounds)]
  for got, want in zip(out["pallas"], out["reference"], strict=True):
    np.testing.assert_array_equal(got, want)
  keys = np.asarray(dequantize(kq, ks))
  b = out["pallas"][4]
  assert (b[2, 0] <= keys[:4].min(axis=0)).all() and (b[2, 1] >= keys[:4].max(axis=0)).all()
  assert (b[5, 0] <= keys[4]).all() and (b[5, 1] >= keys[4]).all() and b[4].max() == 0


def test_kernels_refuse_a_mixed_pair_and_bad_scales():
  k_q, v_q = _quantized_pool(np.random.default_rng(5), 4, 2, 32)
  q = jnp.zeros((1, 2, 32), jnp.float32)
  tables, lens = jnp.asarray([[1]], jnp.int32), jnp.asarray([3], jnp.int32)
  with pytest.raises(ValueError, match="both be 8-bit"):
    paged_attention(q, k_q, v_q.dequantize(), tables, lens)
  bad = QuantizedPages(k_q.values, k_q.scales[..., :1, :])
  with pytest.raises(ValueError, match=r"k_pages scales must be .*\(24, 4, 2, 1\)"):
    ragged_paged_attention(q, bad, v_q, tables, lens, jnp.asarray([0, 1], jnp.int32))


def test_the_mosaic_gpu_decode_kernel_refuses_a_mixed_pair():
  # (It reads 8-bit pages since h54-mgpu: tests/kernels_pallas/test_mgpu_paged_attention.py;
  # what it still refuses is a K/V pair of which only one side is 8-bit.)
  from kernels_pallas.paged_attention_mgpu import paged_attention_mgpu  # noqa: PLC0415

  k_q, v_q = _quantized_pool(np.random.default_rng(6), 8, 2, 64, jnp.bfloat16)
  q = jnp.zeros((1, 4, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="both be 8-bit"):
    paged_attention_mgpu(q, k_q, v_q.dequantize(), jnp.asarray([[1]], jnp.int32),
                         jnp.asarray([3], jnp.int32))

"""DSA's lightning-indexer scores read in place (kernels_pallas/index_scores.py): the kernel
in interpret mode against its reference and the model's `index_scores` over gathered keys
(host copies of dropped blocks included), over bf16 / float32 keys and over 8-bit ones
(int8, fp8_e4m3: QuantizedPages, scored as their dequantized keys), and lowered and
compiled for an H200 (no GPU) at DeepSeek-V3.2's indexer with 64k tokens, bf16 and fp8
keys. (The engine on the Pallas kernels, offloaded DSA rows included, gives transformers'
tokens: test_engine_dsa.py.)"""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas.index_scores import index_scores, index_scores_reference
from kernels_pallas.quant import QuantizedPages, quantize
from models.mla_attention import index_scores as model_index_scores


def _inputs(seed, tokens, heads, dim, num_blocks, num_host, block_size, width, q_dtype,
            k_dtype):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((tokens, heads, dim)), q_dtype)
  w = jnp.asarray(rng.standard_normal((tokens, heads)), jnp.float32)
  pages = jnp.asarray(rng.standard_normal((num_blocks, block_size, 1, dim)), k_dtype)
  tables = jnp.asarray(rng.integers(0, num_blocks, (tokens, width)), jnp.int32)
  if not num_host:
    return q, w, pages, tables, None, None
  host = jnp.asarray(rng.standard_normal((num_host, block_size, 1, dim)), k_dtype)
  host_tables = jnp.asarray(rng.integers(0, num_host, (tokens, width)), jnp.int32)
  return q, w, pages, tables, host, host_tables


CASES = [  # tokens, heads, dim, blocks, host blocks, block_size, width, q / key dtypes
    (3, 4, 32, 20, 10, 4, 7, jnp.float32, jnp.float32),      # host copies of dropped blocks
    (2, 8, 64, 30, 0, 16, 5, jnp.bfloat16, jnp.bfloat16),    # all resident, bf16 dots
    (4, 3, 48, 12, 9, 8, 33, jnp.float32, jnp.bfloat16),     # dim padded, 3 heads, 2 tiles
    (2, 16, 64, 40, 40, 64, 3, jnp.bfloat16, jnp.bfloat16),  # DSA's block 64
]


@pytest.mark.parametrize("case", CASES)
def test_scores_equal_the_reference_and_the_models_over_gathered_keys(case):
  q, w, pages, tables, host, host_tables = _inputs(0, *case)
  got = index_scores(q, w, pages, tables, host, host_tables)  # interpret mode
  want = index_scores_reference(q, w, pages, tables, host, host_tables)
  tokens, width, block_size = q.shape[0], tables.shape[1], pages.shape[1]
  assert got.shape == want.shape == (tokens, width * block_size) and got.dtype == jnp.float32
  keys = pages[tables]
  if host is not None:  # a dropped block (table entry 0) is read from the host copy
    keys = jnp.where((tables != 0)[..., None, None, None], keys, host[host_tables])
  model = model_index_scores(q, keys.reshape(tokens, width * block_size, -1), w)
  scale = float(jnp.abs(want).max())
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6 * scale)
  np.testing.assert_allclose(np.asarray(got), np.asarray(model), rtol=0, atol=1e-6 * scale)


def test_uint16_bits_read_as_bfloat16_and_topk_agrees():
  q, w, pages, tables, host, host_tables = _inputs(1, 4, 8, 64, 24, 12, 16, 8, jnp.bfloat16,
                                                   jnp.bfloat16)
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731 (CPU storage)
  got = index_scores(q, w, bits(pages), tables, bits(host), host_tables)
  want = index_scores_reference(q, w, pages, tables, host, host_tables)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-4)
  k = 32
  assert (np.sort(np.asarray(jax.lax.top_k(got, k)[1]), axis=1)
          == np.sort(np.asarray(jax.lax.top_k(want, k)[1]), axis=1)).all()


def test_the_gpu_backends_bind_it_and_the_others_gather():
  for name in ("pallas", "pallas_mgpu"):
    bound = kernels_pallas.ops(name, platform="gpu").index_scores
    assert bound.func is index_scores and bound.keywords == {"interpret": False}
  assert kernels_pallas.ops("xla").index_scores is None
  assert kernels_pallas.ops("reference").index_scores is None


def test_bad_shapes_are_refused_naming_them():
  q, w, pages, tables, host, host_tables = _inputs(2, 2, 4, 32, 8, 4, 4, 3, jnp.float32,
                                                   jnp.float32)
  with pytest.raises(ValueError, match=r"index_w must be \[tokens=2, heads=4\]"):
    index_scores(q, w[:, :3], pages, tables)
  with pytest.raises(ValueError, match=r"index_pages must be \[blocks, block_size, 1, dim=32\]"):
    index_scores(q, w, pages[..., :16], tables)
  with pytest.raises(ValueError, match="host_index and host_tables go together"):
    index_scores(q, w, pages, tables, host, None)
  with pytest.raises(ValueError, match=r"tables must be \[tokens=2, width\]"):
    index_scores(q, w, pages, tables[:1])


Q8_CASES = [  # tokens, heads, dim, blocks, host blocks, block_size, width, q dtype
    (3, 4, 32, 20, 10, 4, 7, jnp.float32),     # host copies, float32 dots
    (2, 8, 64, 30, 0, 16, 5, jnp.bfloat16),    # all resident, bf16 dots
    (4, 3, 48, 12, 9, 8, 33, jnp.bfloat16),    # dim padded, 3 heads, 2 tiles, host copies
    (2, 16, 64, 40, 40, 64, 3, jnp.float32),   # DSA's block 64, host copies
]


def _quantized(pages, kind):
  return None if pages is None else QuantizedPages(*quantize(pages, kind), pages.dtype)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("case", Q8_CASES)
def test_8bit_keys_score_as_their_dequantized_keys(case, kind):
  """int8 / fp8_e4m3 keys with a float32 scale per token: the kernel's 8-bit dot, each
  key's scale applied after it, equals the reference over values * scale and the model's
  index_scores over the gathered blocks dequantized in float32."""
  q, w, pages, tables, host, host_tables = _inputs(3, *case, jnp.bfloat16)
  pages, host = _quantized(pages, kind), _quantized(host, kind)
  got = index_scores(q, w, pages, tables, host, host_tables)  # interpret mode
  want = index_scores_reference(q, w, pages, tables, host, host_tables)
  tokens, width, block_size = q.shape[0], tables.shape[1], pages.shape[1]
  assert got.shape == want.shape == (tokens, width * block_size) and got.dtype == jnp.float32
  as_f32 = lambda p: QuantizedPages(p.values, p.scales, jnp.float32)  # noqa: E731
  keys = as_f32(pages)[tables]  # QuantizedPages' gather: the blocks dequantized
  if host is not None:
    keys = jnp.where((tables != 0)[..., None, None, None], keys, as_f32(host)[host_tables])
  model = model_index_scores(q, keys.reshape(tokens, width * block_size, -1), w)
  scale = float(jnp.abs(want).max())
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6 * scale)
  np.testing.assert_allclose(np.asarray(want), np.asarray(model), rtol=0, atol=1e-6 * scale)


def test_mixed_8bit_and_float_keys_are_refused():
  q, w, pages, tables, host, host_tables = _inputs(4, 2, 4, 32, 8, 4, 4, 3, jnp.float32,
                                                   jnp.float32)
  fp8, int8 = _quantized(pages, "fp8_e4m3"), _quantized(host, "int8")
  with pytest.raises(ValueError, match="must both be 8-bit .* or both float pages"):
    index_scores(q, w, fp8, tables, host, host_tables)
  with pytest.raises(ValueError, match="must both be 8-bit .* or both float pages"):
    index_scores_reference(q, w, pages, tables, int8, host_tables)
  with pytest.raises(ValueError, match="must store one 8-bit kind"):
    index_scores(q, w, fp8, tables, int8, host_tables)
  bad = QuantizedPages(fp8.values, fp8.scales[..., 0], jnp.float32)
  with pytest.raises(ValueError, match=r"scales \[blocks, block_size, 1, 1\]"):
    index_scores(q, w, bad, tables)


# DeepSeek-V3.2's indexer (64 heads of 128, bf16 keys), block 64, 64k tokens = 1,024 blocks
# a row, 32 decode tokens; the keys of 32 such rows + the null block, and their host copy.
S = jax.ShapeDtypeStruct
NB = 32 * 1024 + 1
DSA_64K = (S((32, 64, 128), jnp.bfloat16), S((32, 64), jnp.float32),
           S((NB, 64, 1, 128), jnp.bfloat16), S((32, 1024), jnp.int32),
           S((NB, 64, 1, 128), jnp.bfloat16), S((32, 1024), jnp.int32))


# The same with fp8_e4m3 keys (the engine's index_cache_dtype): uint8 bits and a float32
# scale per token, 132 B a token against bf16's 256.
FP8 = lambda: QuantizedPages(S((NB, 64, 1, 128), jnp.uint8),  # noqa: E731
                             S((NB, 64, 1, 1), jnp.float32), jnp.bfloat16)
DSA_64K_FP8 = (*DSA_64K[:2], FP8(), DSA_64K[3], FP8(), DSA_64K[5])
KEYS_64K = {"bf16": DSA_64K, "fp8": DSA_64K_FP8}


@pytest.mark.parametrize("keys", KEYS_64K)
def test_it_lowers_for_cuda_to_one_triton_call_with_no_gathered_keys(keys):
  _, lowered = lib.lower_for_h200(index_scores, *KEYS_64K[keys])
  text = lowered.as_text()
  assert re.findall(r"custom_call @([\w$.]+)\(", text) == ["__gpu$xla.gpu.triton"]
  assert len(re.findall(r'\bname = "index_scores"', text)) == 1
  assert "stablehlo.gather" not in text  # the keys are read by the kernel, where they lie


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="XLA's GPU compiler is not installed (jax[cuda13])")
@pytest.mark.parametrize("keys", KEYS_64K)
def test_it_compiles_for_an_h200_at_deepseek_v32_64k_with_no_temporaries_for_keys(keys):
  target, lowered = lib.lower_for_h200(index_scores, *KEYS_64K[keys])
  executable = target.compile(lowered)
  # The output [32, 65,536] float32 (8 MiB) is the program's; its temporaries hold no copy
  # of the keys (a gathered copy of one token's would be 16 MiB, the batch's 512 MiB; fp8:
  # 8.25 and 264 MiB). (fp8 converts to bf16 with sm_89+ instructions: the H200's sm_90.)
  temp = executable.get_compiled_memory_stats().temp_size_in_bytes
  print(f"index_scores {keys} keys at 64k: temporaries {temp} B")
  assert temp < 2**20

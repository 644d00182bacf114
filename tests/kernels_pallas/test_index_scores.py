"""DSA's lightning-indexer scores read in place (kernels_pallas/index_scores.py): the kernel
in interpret mode against its reference and the model's `index_scores` over gathered keys
(host copies of dropped blocks included), and lowered and compiled for an H200 (no GPU) at
DeepSeek-V3.2's indexer with 64k tokens. (The engine on the Pallas kernels, offloaded DSA
rows included, gives transformers' tokens: test_engine_dsa.py.)"""

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


# DeepSeek-V3.2's indexer (64 heads of 128, bf16 keys), block 64, 64k tokens = 1,024 blocks
# a row, 32 decode tokens; the keys of 32 such rows + the null block, and their host copy.
S = jax.ShapeDtypeStruct
NB = 32 * 1024 + 1
DSA_64K = (S((32, 64, 128), jnp.bfloat16), S((32, 64), jnp.float32),
           S((NB, 64, 1, 128), jnp.bfloat16), S((32, 1024), jnp.int32),
           S((NB, 64, 1, 128), jnp.bfloat16), S((32, 1024), jnp.int32))


def test_it_lowers_for_cuda_to_one_triton_call_with_no_gathered_keys():
  _, lowered = lib.lower_for_h200(index_scores, *DSA_64K)
  text = lowered.as_text()
  assert re.findall(r"custom_call @([\w$.]+)\(", text) == ["__gpu$xla.gpu.triton"]
  assert len(re.findall(r'\bname = "index_scores"', text)) == 1
  assert "stablehlo.gather" not in text  # the keys are read by the kernel, where they lie


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="XLA's GPU compiler is not installed (jax[cuda13])")
def test_it_compiles_for_an_h200_at_deepseek_v32_64k_with_no_temporaries_for_keys():
  target, lowered = lib.lower_for_h200(index_scores, *DSA_64K)
  executable = target.compile(lowered)
  # The output [32, 65,536] float32 (8 MiB) is the program's; its temporaries hold no copy
  # of the keys (a gathered copy of one token's would be 16 MiB, the batch's 512 MiB).
  assert executable.get_compiled_memory_stats().temp_size_in_bytes < 2**20

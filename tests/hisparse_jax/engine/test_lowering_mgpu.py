"""The HiSparse step lowered for `cuda` with the Mosaic GPU decode kernel
(``kernel_backend="pallas_mgpu"``): the sparse rows' paged attention and (over 16-bit KV)
the dense rows' ragged attention become Mosaic GPU calls per layer, the other kernels stay
on Triton.

The Mosaic GPU kernel takes bfloat16 KV (or 8-bit KV read as bfloat16) with blocks of a
multiple of 8 tokens and head_dim a multiple of 32, so this engine is a bfloat16 one at
block size 8 and head_dim 32. The step lowered is the engine's largest HiSparse decode
(every row sparse and offloaded: aot.step_batches' tiered_decode, built by the engine's
own batch builder without running it; test_lowering_cuda.py lowers batches recorded from
a running engine). What only a Hopper GPU can check (the numbers, the speed) is owed to
one; the compile for sm_90a is test_aot_h200's.
"""

from __future__ import annotations

import re
from collections import Counter

import jax.numpy as jnp
import pytest
from engine_fixtures import BLOCK_SIZE, tiny_config
from test_lowering_cuda import NUM_LAYERS, SMALL, _engine, _sparse_batch

from models.llama import LlamaForCausalLM

MGPU_CALL = "mosaic_gpu_v2"
TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture(scope="module")
def model():
  return LlamaForCausalLM(tiny_config(head_dim=32), dtype=jnp.bfloat16, seed=0)


def test_the_hisparse_step_lowers_for_cuda_with_the_mosaic_gpu_decode_kernel(model):
  assert BLOCK_SIZE % 8 == 0
  # The float32 engine's budgets: twice the blocks at bfloat16.
  engine = _engine(model, hisparse=SMALL, dtype="bfloat16")
  sparse = _sparse_batch(engine)
  text = engine.runner.lower(sparse, platform="cuda", kernel_backend="pallas_mgpu").as_text()
  calls = Counter(re.findall(r"custom_call @([\w$.]+)\(", text))
  # Each jitted kernel is one function holding its one Mosaic GPU call, called per layer:
  # the decode kernel (sparse rows) and the ragged one (dense rows).
  assert calls[MGPU_CALL] == 2, calls
  assert len(re.findall(r"= call @paged_attention_mgpu\(", text)) == NUM_LAYERS
  # (the dense rows' attention sits in a branch of a conditional: a func.call there)
  assert len(re.findall(r"= func.call @ragged_paged_attention_mgpu\(", text)) == NUM_LAYERS
  # The other kernels are the Triton ones, named as on "pallas".
  assert sorted(set(re.findall(r'\bname = "(\w+)"', text))) == [
      "block_key_bounds", "block_scores", "write_kv"]
  assert TRITON_CALL in calls
  # The same batch on "pallas" has no Mosaic GPU call: the backend is what picks it.
  pallas = engine.runner.lower(sparse, platform="cuda", kernel_backend="pallas").as_text()
  assert MGPU_CALL not in pallas and "paged_attention" in re.findall(r'name = "(\w+)"', pallas)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_the_hisparse_step_over_8bit_kv_lowers_with_the_mosaic_gpu_decode_kernel(
    model, kv_cache_dtype):
  # The Mosaic GPU kernel reads 8-bit pages (values + per-token scales) itself: the sparse
  # rows take it as with bfloat16 KV, no fallback to Triton's paged_attention.
  engine = _engine(model, hisparse=SMALL, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
  sparse = _sparse_batch(engine)
  text = engine.runner.lower(sparse, platform="cuda", kernel_backend="pallas_mgpu").as_text()
  calls = Counter(re.findall(r"custom_call @([\w$.]+)\(", text))
  assert calls[MGPU_CALL] == 1, calls
  assert len(re.findall(r"= call @paged_attention_mgpu\(", text)) == NUM_LAYERS
  # The dense rows' ragged attention stays on Triton: the Mosaic GPU ragged kernel takes
  # 16-bit pages only.
  assert sorted(set(re.findall(r'\bname = "(\w+)"', text))) == [
      "block_key_bounds", "block_scores", "ragged_paged_attention", "write_kv"]
  values = "i8" if kv_cache_dtype == "int8" else "ui8"
  tail = text[text.index(f"custom_call @{MGPU_CALL}("):]  # its module bytes, then types
  operands = re.search(r"\} : \(((?:tensor<[^>]*>(?:, )?)+)\) ->", tail)[1]
  assert len(re.findall(rf"tensor<[\dx]+x{values}>", operands)) == 2, operands

"""The GPU path cannot rot without a GPU: every Pallas kernel lowered for `cuda` from this
CPU-only host, through its public function, at the shapes real checkpoints use.

`jax.jit(kernel).trace(...).lower(lowering_platforms=("cuda",))`, inside
`kernels_pallas.backend.abstract_gpu()` (from jax 0.11 the Triton lowering asks for the
GPU it targets), runs the Pallas -> Triton lowering (what a GPU machine would run before
compiling the Triton IR to PTX) without a GPU or CUDA; a kernel that stops lowering (a
compiler parameter dropped, a shape Triton refuses, an op the Triton lowering lacks) fails
here. Each lowered module must hold
exactly one Triton kernel call, named after the kernel. What only a GPU can check (the
PTX compile, shared-memory limits, numbers) is `make gpu-check`'s.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as triton_lowering
from kernels_testlib import PAIRWISE_GRID

import kernels_pallas
from kernels_pallas.block_key_bounds import block_key_bounds
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.quant import QuantizedPages
from kernels_pallas.ragged_paged_attention import ragged_paged_attention
from kernels_pallas.write_kv import write_kv

S = jax.ShapeDtypeStruct
I32 = jnp.int32
TRITON_CALL = "__gpu$xla.gpu.triton"
NUM_KV_HEADS, NUM_BLOCKS, BATCH, WIDTH, TOKENS = 2, 64, 4, 8, 64
# The pairwise grid of the kernel tests, with the block sizes 4 and 64 the engine uses
# (HiSparse at block size 4; large blocks), and head_dim 32.
GRID = PAIRWISE_GRID + ((2, 4, 32, "bfloat16"), (1, 64, 32, "float32"),
                        (8, 4, 128, "float32"), (4, 64, 64, "bfloat16"))
# Sizes that are not powers of 2, padded inside the kernels: GQA groups (20 as in jax's own
# GPU paged-attention test, 5, 7, 3) and head_dims of real checkpoints (80: phi-2/stablelm,
# 96: phi-3, 112; 40 and 192 beside them).
ODD_GRID = ((20, 16, 64, "bfloat16"), (20, 16, 80, "float32"), (20, 4, 96, "bfloat16"),
            (5, 16, 96, "float32"), (7, 8, 112, "bfloat16"), (3, 16, 112, "float32"),
            (4, 16, 80, "bfloat16"), (1, 16, 40, "float32"), (2, 64, 192, "bfloat16"))


def triton_kernels(lowered: jax.stages.Lowered) -> list[str]:
  """Names of the Triton kernels a lowered module calls (one entry per distinct call)."""
  text = lowered.as_text()
  calls = re.findall(r"custom_call @([\w$.]+)\(", text)
  assert calls and set(calls) == {TRITON_CALL}, calls
  return sorted(re.findall(r'\bname = "(\w+)"', text))


def lower_for_cuda(fn, *args) -> jax.stages.Lowered:
  with kernels_pallas.backend.abstract_gpu():  # the target GPU of the Triton lowering
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _cases(group, block_size, head_dim, dtype):
  pages = S((NUM_BLOCKS, block_size, NUM_KV_HEADS, head_dim), dtype)
  heads = group * NUM_KV_HEADS
  return {
      "paged_attention": (paged_attention, S((BATCH, heads, head_dim), dtype), pages, pages,
                          S((BATCH, WIDTH), I32), S((BATCH,), I32)),
      "ragged_paged_attention": (ragged_paged_attention, S((TOKENS, heads, head_dim), dtype),
                                 pages, pages, S((BATCH, WIDTH), I32), S((BATCH,), I32),
                                 S((BATCH + 1,), I32)),
      "write_kv": (write_kv, pages, pages, S((TOKENS, NUM_KV_HEADS, head_dim), dtype),
                   S((TOKENS, NUM_KV_HEADS, head_dim), dtype), S((TOKENS,), I32)),
      "block_key_bounds": (block_key_bounds,
                           S((NUM_BLOCKS, 2, NUM_KV_HEADS, head_dim), jnp.float32), pages,
                           S((TOKENS,), I32)),
  }


@pytest.mark.parametrize(("group", "block_size", "head_dim", "dtype"), GRID + ODD_GRID)
def test_every_kernel_lowers_for_cuda(group, block_size, head_dim, dtype):
  for name, (kernel, *args) in _cases(group, block_size, head_dim, dtype).items():
    lowered = lower_for_cuda(functools.partial(kernel, interpret=False), *args)
    assert triton_kernels(lowered) == [name]


def triton_module_asm(lowered: jax.stages.Lowered) -> str:
  """The Triton IR of the module's one Triton call, as text (jax keeps it as MLIR bytecode
  in an escaped string attribute; jax 0.10.2's private Triton context parses it)."""
  (escaped,) = re.findall(r'\bir = "((?:[^"\\]|\\.)*)"', lowered.as_text())
  raw = re.sub(rb"\\([0-9A-Fa-f]{2}|.)",
               lambda m: bytes([int(m[1], 16)]) if len(m[1]) == 2 else m[1], escaped.encode())
  with triton_lowering._new_ir_context():
    return ir.Module.parse(raw).operation.get_asm(enable_debug_info=False)


# Masked page accesses in each kernel's Triton IR when head_dim is padded (0 when not):
# (loads, stores). The attention kernels gather K and V blocks; write_kv stores a K and a
# V row (each store a swap: a masked load of the old row, then the store); block_key_bounds
# loads a key block and stores a min and a max row.
MASKED_ACCESSES = {"paged_attention": (2, 0), "ragged_paged_attention": (2, 0),
                   "write_kv": (2, 2), "block_key_bounds": (3, 2)}


@pytest.mark.parametrize("head_dim", [80, 64])
def test_padded_head_dim_masks_every_page_access(head_dim):
  # Interpret mode cannot see a store into the padding columns (its padding is a copy, the
  # GPU's is the next KV head's row or past the pool): the Triton IR must mask those
  # accesses, and the power-of-2 head_dim keeps its unmasked accesses.
  for name, (kernel, *args) in _cases(4, 16, head_dim, "bfloat16").items():
    asm = triton_module_asm(lower_for_cuda(functools.partial(kernel, interpret=False), *args))
    ops = re.findall(r"\btt\.(load|store) (%[^:]*):", asm)
    masked = tuple(sum(op == kind and operands.count(",") == 2 for op, operands in ops)
                   for kind in ("load", "store"))
    assert masked == (MASKED_ACCESSES[name] if head_dim == 80 else (0, 0)), (name, ops)
    if head_dim == 80 and name in ("write_kv", "block_key_bounds"):  # every store is masked
      assert all(operands.count(",") == 2 for op, operands in ops if op == "store"), ops


def test_paged_attention_splits_a_group_above_block_h():
  # block_h=16 with 20 q heads per KV head (jax's GPU paged-attention test): 2 programs of
  # 16 rows per KV head, not a refusal.
  _, *args = _cases(20, 16, 80, "bfloat16")["paged_attention"]
  kernel = functools.partial(paged_attention, interpret=False, block_h=16)
  assert triton_kernels(lower_for_cuda(kernel, *args)) == ["paged_attention"]


def test_unpaddable_sizes_are_refused_with_their_names():
  # The KV block size is a tile of the pool, not padded: a clear refusal names it.
  _, *args = _cases(4, 12, 64, "float32")["block_key_bounds"]
  with pytest.raises(ValueError, match=r"power-of-2 tile sizes, got \{'block_size': 12\}"):
    lower_for_cuda(functools.partial(block_key_bounds, interpret=False), *args)


def test_the_engines_gpu_kernels_lower_for_cuda():
  # What ModelRunner gets for a GPU target: "auto" resolves to the compiled kernels.
  ops = kernels_pallas.ops(None, platform="cuda")
  for name, (_, *args) in _cases(4, 16, 64, "bfloat16").items():
    assert triton_kernels(lower_for_cuda(getattr(ops, name), *args)) == [name]


def test_interpret_mode_lowers_no_triton_call():
  # The check above can fail: the CPU path (interpret mode) has no Triton call at all.
  _, *args = _cases(1, 16, 64, "float32")["paged_attention"]
  text = lower_for_cuda(functools.partial(paged_attention, interpret=True), *args).as_text()
  assert TRITON_CALL not in text


def test_bfloat16_bounds_of_float32_keys_lower_for_cuda():
  # The outward rounding (integer ops on the float32 bits) inside the Triton kernel.
  _, bounds, pages, slots = _cases(4, 16, 64, "float32")["block_key_bounds"]
  bounds = S(bounds.shape, jnp.bfloat16)
  lowered = lower_for_cuda(functools.partial(block_key_bounds, interpret=False), bounds, pages,
                           slots)
  assert triton_kernels(lowered) == ["block_key_bounds"]


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("group", "block_size", "head_dim", "dtype"),
                         [(4, 16, 80, "bfloat16"), (1, 4, 32, "float32"),
                          (8, 64, 128, "bfloat16")])
def test_8bit_pages_lower_for_cuda_read_as_bytes_and_converted_in_registers(
    kind, group, block_size, head_dim, dtype):
  # The kernels take 8-bit pages (QuantizedPages: int8 or fp8_e4m3 bits as uint8, float32
  # scales): the Triton IR loads the pages as i8 (one byte per value from HBM) and converts
  # each loaded tile in registers (int8: sitofp; fp8: a bitcast to f8E4M3FN, then
  # fp_to_fp, which Triton emits for sm_89+), once per page load.
  values_dtype = jnp.int8 if kind == "int8" else jnp.uint8
  shape = (NUM_BLOCKS, block_size, NUM_KV_HEADS, head_dim)
  pages = QuantizedPages(S(shape, values_dtype), S(shape[:3] + (1,), jnp.float32), dtype)
  cases = _cases(group, block_size, head_dim, dtype)
  page_loads = {"paged_attention": 2, "ragged_paged_attention": 2, "block_key_bounds": 1}
  for name, loads in page_loads.items():
    kernel, *args = cases[name]
    args = [pages if isinstance(a, S) and a.shape == shape else a for a in args]
    lowered = lower_for_cuda(functools.partial(kernel, interpret=False), *args)
    assert triton_kernels(lowered) == [name]
    asm = triton_module_asm(lowered)
    signature = re.search(r"tt\.func public @\w+\((.*)\)", asm)[1]
    assert signature.count("!tt.ptr<i8>") == loads, signature  # the values, as bytes
    if kind == "int8":
      assert len(re.findall(r"arith\.sitofp %\w+ : tensor<[\dx]+xi8>", asm)) == loads
      assert "f8E4M3FN" not in asm
    else:
      assert len(re.findall(r"tt\.bitcast %\w+ : tensor<[\dx]+xi8> -> tensor<[\dx]+xf8E4M3FN>",
                            asm)) == loads
      assert len(re.findall(r"tt\.fp_to_fp %\w+ : tensor<[\dx]+xf8E4M3FN> -> "
                            r"tensor<[\dx]+xf32>", asm)) == loads


# DSA models' attention at DeepSeek-V3.2's sizes (128 heads, latent 512 + rope 64, top-k
# 2,048 tokens; its 64-token pages and token pages), a 16-head tile, and a small case.
SPARSE_MLA_CASES = ((128, 512, 64, 64, 2048, "bfloat16"), (16, 512, 64, 1, 2048, "bfloat16"),
                    (4, 32, 16, 4, 64, "float32"))


@pytest.mark.parametrize(("heads", "rank", "rope", "block_size", "topk", "dtype"),
                         SPARSE_MLA_CASES)
def test_sparse_mla_decode_lowers_for_cuda(heads, rank, rope, block_size, topk, dtype):
  kernel = functools.partial(kernels_pallas.sparse_mla_decode, sm_scale=0.1,
                             kv_lora_rank=rank, interpret=False)
  lowered = lower_for_cuda(kernel, S((BATCH, heads, rank + rope), dtype),
                           S((NUM_BLOCKS, block_size, 1, rank + rope), dtype),
                           S((BATCH, topk), I32))
  assert triton_kernels(lowered) == ["sparse_mla_decode"]

"""The GPU path cannot rot without a GPU: every Pallas kernel lowered for `cuda` from this
CPU-only host, through its public function, at the shapes real checkpoints use.

`jax.jit(kernel).trace(...).lower(lowering_platforms=("cuda",))` runs the Pallas -> Triton
lowering (what a GPU machine would run before compiling the Triton IR to PTX) without a
GPU or CUDA; a kernel that stops lowering (a compiler parameter dropped, a shape Triton
refuses, an op the Triton lowering lacks) fails here. Each lowered module must hold
exactly one Triton kernel call, named after the kernel. What only a GPU can check (the
PTX compile, shared-memory limits, numbers) is `make gpu-check`'s.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from kernels_testlib import PAIRWISE_GRID

import kernels_pallas
from kernels_pallas.block_key_bounds import block_key_bounds
from kernels_pallas.paged_attention import paged_attention
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


def triton_kernels(lowered: jax.stages.Lowered) -> list[str]:
  """Names of the Triton kernels a lowered module calls (one entry per distinct call)."""
  text = lowered.as_text()
  calls = re.findall(r"custom_call @([\w$.]+)\(", text)
  assert calls and set(calls) == {TRITON_CALL}, calls
  return sorted(re.findall(r'\bname = "(\w+)"', text))


def lower_for_cuda(fn, *args) -> jax.stages.Lowered:
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


@pytest.mark.parametrize(("group", "block_size", "head_dim", "dtype"), GRID)
def test_every_kernel_lowers_for_cuda(group, block_size, head_dim, dtype):
  for name, (kernel, *args) in _cases(group, block_size, head_dim, dtype).items():
    lowered = lower_for_cuda(functools.partial(kernel, interpret=False), *args)
    assert triton_kernels(lowered) == [name]


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

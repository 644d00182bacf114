"""Backend selection: one place decides interpret mode and pallas vs xla."""

import pytest

import kernels_pallas
from kernels_pallas import backend


def test_cpu_defaults():
  assert backend.platform() == "cpu"
  assert backend.resolve_interpret(None) is True
  assert backend.resolve_interpret(False) is False
  assert backend.resolve_backend(None) == "xla"
  assert backend.resolve_backend("auto") == "xla"
  assert backend.resolve_backend("pallas") == "pallas"
  assert backend.resolve_backend("reference") == "reference"
  with pytest.raises(ValueError, match="'triton'"):
    backend.resolve_backend("triton")


def test_ops_binds_kernels_xla_attention_or_references():
  auto, pallas, xla, ref = (kernels_pallas.ops(b) for b in (None, "pallas", "xla", "reference"))
  assert auto.backend == "xla" and pallas.backend == "pallas" and ref.backend == "reference"
  # The Pallas kernels come bound to interpret mode for this (CPU) platform.
  assert pallas.paged_attention.func is kernels_pallas.paged_attention
  assert pallas.paged_attention.keywords == {"interpret": True}
  assert xla.paged_attention is kernels_pallas.paged_attention_xla
  assert xla.ragged_paged_attention is kernels_pallas.ragged_paged_attention_xla
  assert ref.paged_attention is kernels_pallas.paged_attention_reference
  assert ref.ragged_paged_attention is kernels_pallas.ragged_paged_attention_reference
  assert auto.write_kv is kernels_pallas.write_kv_reference
  assert pallas.block_key_bounds.func is kernels_pallas.block_key_bounds
  # Static sizes of the ragged call: the xla backend's prefill tiles, nothing elsewhere.
  assert xla.ragged_hints([1, 37, 1, 300]) == {"prefill_tile": 128, "num_prefill_tiles": 4,
                                               "num_decode_rows": 8}
  assert xla.ragged_hints([1, 1]) == {"prefill_tile": 16, "num_prefill_tiles": 0,
                                      "num_decode_rows": 8}
  assert xla.ragged_hints([37])["num_decode_rows"] == 0  # no decode work compiled
  assert ref.ragged_hints([1, 37]) == {} and pallas.ragged_hints([5]) == {}
  assert kernels_pallas.ops("pallas") is pallas  # one KernelOps per backend: one step program


def test_ops_for_a_gpu_target_from_this_cpu_host():
  # Built for the target, not the host: "auto" is the compiled Pallas kernels on a GPU.
  for target in ("gpu", "cuda", "rocm"):
    gpu = kernels_pallas.ops(None, platform=target)
    assert gpu.backend == "pallas"
    assert gpu.ragged_paged_attention.keywords == {"interpret": False}
  assert kernels_pallas.ops(None, platform="tpu").backend == "xla"
  assert backend.resolve_interpret(None, "cuda") is False
  assert backend.resolve_interpret(None, "cpu") is True
  with pytest.raises(ValueError, match="platform must be one of .* got 'metal'"):
    kernels_pallas.ops(None, platform="metal")
  # A compiled kernel gets Triton's parameters whatever the host (their type is what picks
  # the Triton lowering for cuda); interpret mode gets none.
  from jax.experimental.pallas import triton as pltriton
  assert isinstance(backend.compiler_params(False), pltriton.CompilerParams)
  assert backend.compiler_params(True) is None


def test_triton_size_check_names_bad_sizes():
  backend.check_triton_sizes(True, head_dim=96)  # interpret mode: anything goes
  with pytest.raises(ValueError, match="head_dim"):
    backend.check_triton_sizes(False, head_dim=96, block_size=16)


def test_pallas_mgpu_binds_the_mosaic_gpu_decode_kernel_and_triton_others():
  from kernels_pallas.paged_attention_mgpu import paged_attention_mgpu
  from kernels_pallas.sparse_mla_mgpu import sparse_mla_decode_mgpu
  mgpu = kernels_pallas.ops("pallas_mgpu", platform="gpu")
  assert mgpu.backend == "pallas_mgpu" and backend.resolve_backend("pallas_mgpu") == "pallas_mgpu"
  # Paged decode: the Mosaic GPU kernel within its limits, else the Triton one.
  assert mgpu.paged_attention.func is backend._paged_mgpu_or_triton
  mgpu_paged, triton_paged = mgpu.paged_attention.args
  assert mgpu_paged.func is paged_attention_mgpu
  assert triton_paged.func is kernels_pallas.paged_attention
  # Ragged: the Mosaic GPU kernel within its limits, else the Triton one (compiled).
  assert mgpu.ragged_paged_attention.func is backend._ragged_mgpu_or_triton
  (triton,) = mgpu.ragged_paged_attention.args
  assert triton.func is kernels_pallas.ragged_paged_attention
  assert mgpu.write_kv.func is kernels_pallas.write_kv
  assert mgpu.block_key_bounds.func is kernels_pallas.block_key_bounds
  assert mgpu.sparse_mla_decode.func is sparse_mla_decode_mgpu  # DSA's decode too
  assert {f.keywords["interpret"]
          for f in (mgpu_paged, triton_paged, triton, *mgpu[3:5], mgpu.sparse_mla_decode)
          } == {False}
  # Triton's sparse MLA stays the pallas backend's.
  assert kernels_pallas.ops("pallas", platform="gpu").sparse_mla_decode.func is (
      kernels_pallas.sparse_mla_decode)
  with pytest.raises(ValueError, match="'pallas_mgpu' targets a GPU, got platform None"):
    kernels_pallas.ops("pallas_mgpu")  # this CPU host

"""Backend selection: one place decides interpret mode and pallas vs xla."""

import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
import kernels_testlib as lib
from kernels_pallas import backend


def test_cpu_defaults():
  assert backend.platform() == "cpu"
  assert backend.resolve_interpret(None) is True
  assert backend.resolve_interpret(False) is False
  assert backend.resolve_backend(None) == "xla"
  assert backend.resolve_backend("auto") == "xla"
  assert backend.resolve_backend("pallas") == "pallas"
  with pytest.raises(ValueError, match="'triton'"):
    backend.resolve_backend("triton")


def test_ops_binds_kernels_or_references():
  auto, pallas, xla = (kernels_pallas.ops(b) for b in (None, "pallas", "xla"))
  assert auto.backend == "xla" and pallas.backend == "pallas"
  assert pallas.paged_attention is kernels_pallas.paged_attention
  assert xla.paged_attention is kernels_pallas.paged_attention_reference
  assert auto.write_kv is kernels_pallas.write_kv_reference
  assert pallas.block_key_bounds is kernels_pallas.block_key_bounds


def test_triton_size_check_names_bad_sizes():
  backend.check_triton_sizes(True, head_dim=96)  # interpret mode: anything goes
  with pytest.raises(ValueError, match="head_dim"):
    backend.check_triton_sizes(False, head_dim=96, block_size=16)


def test_both_backends_agree_through_ops(rng):
  pool = lib.make_pool(rng, 12, 4, 1, 16, jnp.float32)
  q = jnp.asarray(rng.standard_normal((2, 2, 16)), jnp.float32)
  tables = jnp.asarray([[3, 7, 1], [5, 0, 0]], jnp.int32)
  lengths = jnp.asarray([10, 2], jnp.int32)
  outs = [kernels_pallas.ops(b).paged_attention(q, pool.k_pages, pool.v_pages, tables, lengths)
          for b in ("pallas", "xla")]
  assert lib.max_abs_err(*outs) <= 1e-5
  k = lib.gather_tokens(pool.k_np, [3, 7, 1], 10)
  v = lib.gather_tokens(pool.v_np, [3, 7, 1], 10)
  np.testing.assert_allclose(outs[0][:1], lib.naive_attention(np.asarray(q[:1]), k, v),
                             atol=1e-5)

"""KVCacheSpec and KVPool: sizes, memory kinds, storage dtypes, in-place block writes."""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.kv_pool import DEVICE, PINNED_HOST, KVCacheSpec, KVPool, storage_dtype


def _config(**overrides):
  fields = dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=64, hidden_size=256)
  fields.update(overrides)
  return types.SimpleNamespace(**fields)


def test_spec_from_any_model_config():
  spec = KVCacheSpec.from_model_config(_config(), "bfloat16", 16)
  assert spec == KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                             block_size=16)
  assert spec.bytes_per_token == 2 * 4 * 2 * 64 * 2 == 2048  # K+V, 4 layers, bf16
  assert spec.bytes_per_block == 16 * 2048
  assert KVCacheSpec.from_model_config(_config(), "float32", 16).bytes_per_token == 4096


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=12), "--block_size must be a power of two"),
    (dict(dtype="int8"), "--dtype"),
    (dict(num_kv_heads=0), "num_kv_heads"),
])
def test_spec_refuses_bad_fields(kwargs, match):
  fields = dict(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
  fields.update(kwargs)
  with pytest.raises(ValueError, match=match):
    KVCacheSpec(**fields)


def test_spec_names_a_missing_config_field():
  config = types.SimpleNamespace(num_hidden_layers=2, head_dim=8)
  with pytest.raises(ValueError, match="num_key_value_heads"):
    KVCacheSpec.from_model_config(config, "float32", 16)


def test_storage_dtype_avoids_bf16_scatter_on_cpu_only():
  assert storage_dtype("bfloat16", "cpu") == np.uint16
  assert storage_dtype("bfloat16", "gpu") == jnp.bfloat16
  assert storage_dtype("float16", "cpu") == np.float16
  assert storage_dtype("float32", "cpu") == np.float32


@pytest.mark.parametrize("memory_kind, dtype, stored", [
    (DEVICE, "float32", np.float32),
    (PINNED_HOST, "bfloat16", np.uint16),
    (PINNED_HOST, "float16", np.float16),
])
def test_pool_arrays_live_in_their_memory_kind(memory_kind, dtype, stored):
  spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=4)
  pool = KVPool(spec, num_blocks=10, memory_kind=memory_kind)
  assert len(pool.k) == len(pool.v) == 3
  for a in pool.arrays():
    chex.assert_shape(a, (10, 4, 2, 8))
    assert a.dtype == stored
    assert a.sharding.memory_kind == memory_kind
  assert pool.nbytes == 10 * spec.bytes_per_block
  assert pool.num_null_blocks == 1 and pool.num_usable_blocks == 9


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_blocks_round_trip_in_place(dtype, rng):
  spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=4)
  pool = KVPool(spec, num_blocks=6, memory_kind=DEVICE)
  pointers = [a.unsafe_buffer_pointer() for a in pool.arrays()]
  k = jnp.asarray(rng.standard_normal((2, 4, 2, 8)), dtype)
  v = jnp.asarray(rng.standard_normal((2, 4, 2, 8)), dtype)
  pool.write_blocks(1, [5, 2], k, v)
  assert [a.unsafe_buffer_pointer() for a in pool.arrays()] == pointers
  got_k, got_v = pool.read_blocks(1, [5, 2, 0])
  assert got_k.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(np.asarray(got_k[:2]), np.asarray(k))
  np.testing.assert_array_equal(np.asarray(got_v[:2]), np.asarray(v))
  assert not np.asarray(got_k[2]).any()  # the null block was not written
  other_k, _ = pool.read_blocks(0, [5, 2])
  assert not np.asarray(other_k).any()  # nor the other layer


def test_host_pool_is_written_only_by_transfers():
  spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
  pool = KVPool(spec, num_blocks=4, memory_kind=PINNED_HOST)
  with pytest.raises(ValueError, match="TransferEngine"):
    pool.write_blocks(0, [1], np.zeros((1, 4, 1, 8)), np.zeros((1, 4, 1, 8)))


def test_set_arrays_refuses_the_wrong_memory_kind():
  spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
  pool = KVPool(spec, num_blocks=4, memory_kind=PINNED_HOST)
  on_device = jax.device_put(np.zeros((4, 4, 1, 8), np.float32), jax.devices()[0])
  with pytest.raises(ValueError, match="must live in pinned_host"):
    pool.set_arrays((on_device, on_device))

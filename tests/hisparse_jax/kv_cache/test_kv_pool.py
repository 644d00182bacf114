"""KVCacheSpec and KVPool: sizes, memory kinds, storage dtypes, in-place block writes."""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, KVCacheSpec, KVPool, storage_dtype


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
  assert pool.num_usable_blocks == 9


def test_set_arrays_refuses_the_wrong_memory_kind():
  spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
  pool = KVPool(spec, num_blocks=4, memory_kind=PINNED_HOST)
  on_device = jax.device_put(np.zeros((4, 4, 1, 8), np.float32), jax.devices()[0])
  with pytest.raises(ValueError, match="must live in pinned_host"):
    pool.set_arrays((on_device, on_device))

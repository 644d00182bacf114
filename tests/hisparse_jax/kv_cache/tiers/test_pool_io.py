"""HostPoolIO: the third tier's BlockIO over a pinned_host KVPool moves each block's bytes
bit for bit (float32, bfloat16, 8-bit with scales, a DSA model's latent + indexer keys)
and touches no other block."""

import numpy as np
import pytest

from hisparse_jax.kv_cache.kv_pool import KVCacheSpec, KVPool, MLACacheSpec
from hisparse_jax.kv_cache.tiers.pool_io import HostPoolIO

SPECS = {
  "float32": KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
                         block_size=4),
  "bfloat16": KVCacheSpec(num_layers=3, num_kv_heads=1, head_dim=16, dtype="bfloat16",
                          block_size=8),
  "int8": KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32",
                      block_size=4, kv_cache_dtype="int8"),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_write_then_read_is_bit_exact_and_leaves_other_blocks(name):
  spec = SPECS[name]
  pool = KVPool(spec, 12, "pinned_host")
  io = HostPoolIO(pool)
  assert io.block_nbytes == sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize
                                for a in pool.arrays())
  rng = np.random.default_rng(0)
  # Random bytes: NaN and denormal patterns included, which must survive untouched.
  data = rng.integers(0, 256, (5, io.block_nbytes), dtype=np.uint8)
  ids = [9, 2, 11, 5, 1]
  io.write(ids, data)
  np.testing.assert_array_equal(io.read(ids), data)
  np.testing.assert_array_equal(io.read([3, 4, 10]), 0)  # untouched
  io.write([2], data[4:5])  # overwrite one
  np.testing.assert_array_equal(io.read([2, 9]), np.stack([data[4], data[0]]))
  assert io.layout().startswith("k 2x" if name != "bfloat16" else "k 3x")


def test_a_dsa_pool_round_trips():
  spec = MLACacheSpec(num_layers=3, kv_lora_rank=16, rope_dim=8, index_head_dim=8,
                      index_layers=(0, 2), dtype="float32", block_size=4)
  pool = KVPool(spec, 6, "pinned_host")
  io = HostPoolIO(pool)
  data = np.random.default_rng(1).integers(0, 256, (2, io.block_nbytes), dtype=np.uint8)
  io.write([4, 1], data)
  np.testing.assert_array_equal(io.read([4, 1]), data)
  assert "latent" in io.layout()


def test_bad_ids_and_shapes_raise():
  pool = KVPool(SPECS["float32"], 6, "pinned_host")
  io = HostPoolIO(pool)
  with pytest.raises(ValueError, match="host block ids"):
    io.read([0])
  with pytest.raises(ValueError, match="host block ids"):
    io.read([6])
  with pytest.raises(ValueError, match="data must be uint8"):
    io.write([1], np.zeros((1, io.block_nbytes + 1), np.uint8))
  with pytest.raises(ValueError, match="pinned_host"):
    HostPoolIO(KVPool(SPECS["float32"], 6, "device"))

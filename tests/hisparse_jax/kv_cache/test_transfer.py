"""TransferEngine: bit-exact batched swaps over all layers, in place, one call each, counted."""

import jax.numpy as jnp
import numpy as np
import pytest
from pool_helpers import read_blocks, write_blocks

from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, KVCacheSpec, KVPool
from hisparse_jax.kv_cache.transfer import TransferEngine, bucket_size
from hisparse_jax.observability import metrics as m

NUM_LAYERS, NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS = 3, 16, 24


def _random_bits(rng, shape, dtype):
  """Random bit patterns of `dtype` (NaN payloads, infinities and subnormals included)."""
  bits = np.dtype(dtype).itemsize * 8
  raw = rng.integers(0, 2**bits, size=shape, dtype=np.uint64).astype(f"uint{bits}")
  return jnp.asarray(raw).view(dtype)


def _bits(x):
  x = np.asarray(x)
  return x.view(f"uint{x.dtype.itemsize * 8}")


def _filled_pools(dtype, rng, head_dim=8):
  """Pools with random K/V in every usable device block; returns them and that data."""
  spec = KVCacheSpec(num_layers=NUM_LAYERS, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                     block_size=4)
  device_pool = KVPool(spec, NUM_DEVICE_BLOCKS, DEVICE)
  host_pool = KVPool(spec, NUM_HOST_BLOCKS, PINNED_HOST)
  data = {}
  ids = np.arange(1, NUM_DEVICE_BLOCKS)
  for layer in range(NUM_LAYERS):
    shape = (len(ids), 4, 2, head_dim)
    data[layer] = (_random_bits(rng, shape, dtype), _random_bits(rng, shape, dtype))
    write_blocks(device_pool, layer, ids, *data[layer])
  return device_pool, host_pool, data


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("one_memory", [None, False], ids=["platform", "host_gather"])
def test_round_trip_is_bit_exact_and_in_place(dtype, one_memory, rng):
  # Both mechanisms run on CPU: the platform's (block copies, one memory) and GPU's
  # (gather on the host under compute_on, the gathered blocks cross, scatter).
  device_pool, host_pool, data = _filled_pools(dtype, rng)
  registry = m.MetricsRegistry()
  engine = TransferEngine(device_pool, host_pool, registry, one_memory=one_memory)
  assert engine.one_memory == (one_memory is None)  # CPU: device and host are one DRAM
  pointers = [a.unsafe_buffer_pointer() for a in device_pool.arrays() + host_pool.arrays()]

  src = rng.choice(np.arange(1, NUM_DEVICE_BLOCKS), size=6, replace=False).astype(np.int32)
  host_ids = rng.choice(np.arange(1, NUM_HOST_BLOCKS), size=6, replace=False).astype(np.int32)
  engine.swap_out(src, host_ids)
  # Bring them back into other device blocks, in another order.
  perm = rng.permutation(6)
  free = np.setdiff1d(np.arange(1, NUM_DEVICE_BLOCKS), src)
  dst = rng.choice(free, size=6, replace=False).astype(np.int32)
  engine.swap_in(host_ids[perm], dst)
  engine.wait()

  assert [a.unsafe_buffer_pointer() for a in device_pool.arrays() + host_pool.arrays()] \
      == pointers
  for layer in range(NUM_LAYERS):
    k_ref, v_ref = data[layer]
    want = src[perm] - 1  # row of each moved block in the written data
    k, v = read_blocks(device_pool, layer, dst)
    np.testing.assert_array_equal(_bits(k), _bits(k_ref[want]))
    np.testing.assert_array_equal(_bits(v), _bits(v_ref[want]))
    hk, hv = read_blocks(host_pool, layer, host_ids)
    np.testing.assert_array_equal(_bits(hk), _bits(k_ref[src - 1]))
    np.testing.assert_array_equal(_bits(hv), _bits(v_ref[src - 1]))
    # Padding wrote nothing: untouched host blocks and both null blocks stay zero.
    untouched = np.setdiff1d(np.arange(NUM_HOST_BLOCKS), host_ids)
    assert not _bits(read_blocks(host_pool, layer, untouched)[0]).any()
    assert not _bits(read_blocks(device_pool, layer, [0])[1]).any()

  bytes_moved = 6 * device_pool.spec.bytes_per_block
  assert bytes_moved == 6 * 4 * NUM_LAYERS * 2 * 2 * 8 * np.dtype(device_pool.spec.dtype).itemsize
  d = registry.to_dict()
  for direction in ("d2h", "h2d"):
    assert d[f'hisparse_transfers_total{{direction="{direction}"}}'] == 1
    assert d[f'hisparse_transfer_blocks_total{{direction="{direction}"}}'] == 6
    assert d[f'hisparse_transfer_bytes_total{{direction="{direction}"}}'] == bytes_moved
    assert d[f'hisparse_transfer_seconds_count{{direction="{direction}"}}'] == 1


def test_one_program_call_per_swap_and_bounded_compiles(rng):
  # A head_dim no other test uses, so every compile of these shapes happens here.
  device_pool, host_pool, _ = _filled_pools("float32", rng, head_dim=4)
  engine = TransferEngine(device_pool, host_pool, min_bucket=8)
  calls = []
  program = engine._swap_out
  compiled_before = program._cache_size()  # a private jax API, present in 0.10.2

  def counting(*args):
    calls.append(len(args[2]))
    return program(*args)

  engine._swap_out = counting
  engine.swap_out(np.arange(1, 4, dtype=np.int32), np.arange(1, 4, dtype=np.int32))
  engine.swap_out(np.arange(4, 11, dtype=np.int32), np.arange(4, 11, dtype=np.int32))
  engine.swap_out(np.arange(1, 10, dtype=np.int32), np.arange(11, 20, dtype=np.int32))
  assert engine.num_pending == 3
  engine.wait()
  assert engine.num_pending == 0
  assert calls == [8, 8, 16]  # 3, 7 and 9 blocks of 3 layers: one padded call each
  assert engine.buckets_used == {("d2h", 8), ("d2h", 16)}
  assert program._cache_size() - compiled_before == 2
  assert [bucket_size(n, 8) for n in (1, 8, 9, 100)] == [8, 8, 16, 128]


def test_poll_records_finished_transfers(rng):
  device_pool, host_pool, _ = _filled_pools("float32", rng)
  registry = m.MetricsRegistry()
  engine = TransferEngine(device_pool, host_pool, registry)
  engine.swap_in(np.array([1, 2], np.int32), np.array([3, 4], np.int32))
  device_pool.k[0].block_until_ready()  # the pool array is the transfer's output
  assert engine.poll() == 0
  assert registry.get(m.TRANSFER_SECONDS).count(direction="h2d") == 1


@pytest.mark.parametrize("src, dst, match", [
    ([0, 1], [1, 2], r"device block ids must be in \[1, 16\), got \[0\]"),
    ([1, 2], [1, 24], r"pinned_host block ids must be in \[1, 24\), got \[24\]"),
    ([1, 2], [5, 5], "destination pinned_host block ids repeat"),
    ([1, 2, 3], [1, 2], "differ in length"),
    ([[1, 2]], [[3, 4]], "1-D integer array"),
])
def test_bad_ids_are_refused(src, dst, match):
  spec = KVCacheSpec(num_layers=NUM_LAYERS, num_kv_heads=2, head_dim=8, dtype="float32",
                     block_size=4)
  device_pool = KVPool(spec, NUM_DEVICE_BLOCKS, DEVICE)
  host_pool = KVPool(spec, NUM_HOST_BLOCKS, PINNED_HOST)
  registry = m.MetricsRegistry()
  engine = TransferEngine(device_pool, host_pool, registry)
  with pytest.raises(ValueError, match=match):
    engine.swap_out(np.asarray(src), np.asarray(dst))
  assert registry.get(m.TRANSFERS_TOTAL).value(direction="d2h") == 0


def test_empty_swap_is_a_no_op():
  spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
  engine = TransferEngine(KVPool(spec, 4, DEVICE), KVPool(spec, 4, PINNED_HOST))
  engine.swap_in(np.zeros(0, np.int32), np.zeros(0, np.int32))
  assert engine.num_pending == 0 and not engine.buckets_used


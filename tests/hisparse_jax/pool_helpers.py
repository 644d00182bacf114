"""Test helpers that read and write a KVPool's blocks directly (the engine never does:
its pools change only through transfers and the jitted step)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, make_single_device_sharding

from hisparse_jax.kv_cache.host_compute import on_host
from hisparse_jax.kv_cache.kv_pool import DEVICE, KVPool


def read_blocks(pool: KVPool, layer: int, block_ids) -> tuple[jax.Array, jax.Array]:
  """Copies of K and V of `block_ids` in `layer`, in the logical dtype, on the device
  (each [len(block_ids), block_size, num_kv_heads, head_dim]); the result shares no
  buffer with the pool, so later donations stay in place."""
  ids = np.asarray(block_ids, np.int32)
  k, v = _gather_fn(pool.memory_kind, pool.device)(pool.k[layer], pool.v[layer], ids)
  return pool.from_storage(k), pool.from_storage(v)


def write_blocks(pool: KVPool, layer: int, block_ids, k, v) -> None:
  """Writes K and V (logical dtype, [n, block_size, num_kv_heads, head_dim]) into
  `block_ids` of `layer` of a device pool, in place (donated)."""
  assert pool.memory_kind == DEVICE, "the host pool is written by TransferEngine.swap_out"
  ids = np.asarray(block_ids, np.int32)
  new_k, new_v = _scatter_fn(pool.sharding)(
      pool.k[layer], pool.v[layer], ids, pool.to_storage(jnp.asarray(k)),
      pool.to_storage(jnp.asarray(v)))
  k_arrays, v_arrays = list(pool.k), list(pool.v)
  k_arrays[layer], v_arrays[layer] = new_k, new_v
  pool.set_arrays((*k_arrays, *v_arrays))


@functools.cache
def _gather_fn(memory_kind: str, device: jax.Device):
  device_sharding = make_single_device_sharding(device, memory_kind=DEVICE)

  def gather(k, v, ids):
    if memory_kind == DEVICE:
      return k[ids], v[ids]
    ids = jax.device_put(ids, make_single_device_sharding(device, memory_kind=memory_kind))
    k, v = on_host(lambda a, b, i: (a[i], b[i]))(k, v, ids)
    return jax.device_put(k, device_sharding), jax.device_put(v, device_sharding)

  return jax.jit(gather, out_shardings=(device_sharding, device_sharding))


@functools.cache
def _scatter_fn(sharding: Sharding):
  def scatter(k_pool, v_pool, ids, k, v):
    return k_pool.at[ids].set(k), v_pool.at[ids].set(v)

  return jax.jit(scatter, donate_argnums=(0, 1), out_shardings=(sharding, sharding))

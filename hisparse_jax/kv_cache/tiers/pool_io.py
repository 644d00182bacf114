"""HostPoolIO: the third tier's `BlockIO` over an engine's pinned_host `KVPool`.

A tier moves whole host blocks as bytes: a block's payload is every array of the pool
(`KVPool.arrays()` order: K of every layer, V of every layer, then an 8-bit cache's
scales; a DSA model's latent and indexer keys) at that block id, each array's block as
its raw bytes, concatenated:

    payload of host block b = k[0][b] | k[1][b] | ... | v[L-1][b] (| k_scale[0][b] ...)

`layout()` names that layout (dtypes and per-block shapes), so a tier's namespace refuses
blocks written by an engine whose layout differs.

Both directions are one jitted program over all arrays (never a call per block or per
layer), padded to power-of-two id buckets so a run compiles a handful of programs:
- read: a gather of the listed blocks into device memory (on CPU both kinds are one DRAM:
  the host arrays are viewed as device arrays for free; elsewhere the gather runs on the
  host and only the gathered blocks cross), then one device-to-numpy copy;
- write: the pool's arrays donated and updated in place (`.at[ids].set`, padded ids out
  of range and dropped), the result pinned to the pinned_host kind, installed with
  `KVPool.set_arrays` as every transfer does.
Both run on the engine's thread only (BlockIO's contract): JAX orders them after the
transfers already dispatched on the pool, so a read sees the blocks a swap-out wrote.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import make_single_device_sharding

from hisparse_jax.kv_cache.host_compute import on_host
from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, KVPool
from hisparse_jax.kv_cache.transfer import (
  bucket_size,
  gather_to_device,
  hop_free,
  warm_buckets,
)


@functools.cache
def _read_program(num_arrays: int, device_sharding, host_sharding, one_memory: bool):
  """(host arrays, ids) -> the listed blocks of each array, in device memory."""

  def read(host_arrays, ids):
    if one_memory:
      return tuple(jax.device_put(h, device_sharding)[ids] for h in host_arrays)
    return gather_to_device(host_arrays, ids, device_sharding=device_sharding,
                            host_sharding=host_sharding)

  return jax.jit(read, out_shardings=tuple([device_sharding] * num_arrays))


@functools.cache
def _write_program(num_arrays: int, device_sharding, host_sharding, one_memory: bool):
  """(host arrays [donated], blocks per array, ids) -> host arrays with the blocks set."""

  def write(host_arrays, blocks, ids):
    if one_memory:
      out = tuple(jax.device_put(h, device_sharding).at[ids].set(b, mode="drop")
                  for h, b in zip(host_arrays, blocks))
      return tuple(jax.device_put(a, host_sharding) for a in out)
    ids = jax.device_put(ids, host_sharding)
    out = []
    for h, b in zip(host_arrays, blocks):
      b = jax.device_put(b, host_sharding)
      out.append(on_host(lambda a, i, v: a.at[i].set(v, mode="drop"))(h, ids, b))
    return tuple(out)

  return jax.jit(write, donate_argnums=(0,),
                 out_shardings=tuple([host_sharding] * num_arrays))


class HostPoolIO:
  """`BlockIO` over the blocks of a pinned_host `KVPool` (engine thread only).

  Invariants: `block_nbytes` is the sum over the pool's arrays of one block's bytes;
  read(ids)[i] is host block ids[i]'s payload as laid out above, and write(ids, data)
  makes read(ids) == data (bit for bit) without touching any other block.
  """

  def __init__(self, pool: KVPool, min_bucket: int = 8, one_memory: bool | None = None):
    """one_memory: how the blocks cross (None: as the device does, `transfer.hop_free`;
    False forces the host gather / host scatter that GPUs use, which runs on CPU too)."""
    if pool.memory_kind != PINNED_HOST:
      raise ValueError(f"HostPoolIO needs a pinned_host pool, got {pool.memory_kind}")
    if pool.mesh is not None:
      raise ValueError("the third KV tier does not support tensor parallelism yet "
                       "(--tensor_parallel_size > 1)")
    self.pool = pool
    self.min_bucket = min_bucket
    arrays = pool.arrays()
    self._shapes = [tuple(a.shape[1:]) for a in arrays]
    self._dtypes = [np.dtype(a.dtype) for a in arrays]
    self._nbytes = [int(np.prod(s)) * d.itemsize for s, d in zip(self._shapes, self._dtypes)]
    self._offsets = np.concatenate([[0], np.cumsum(self._nbytes)]).astype(int).tolist()
    self.block_nbytes = int(sum(self._nbytes))
    device_sharding = make_single_device_sharding(pool.device, memory_kind=DEVICE)
    one_memory = hop_free(device_sharding) if one_memory is None else one_memory
    self._read = _read_program(len(arrays), device_sharding, pool.sharding, one_memory)
    self._write = _write_program(len(arrays), device_sharding, pool.sharding, one_memory)

  def layout(self) -> str:
    """The payload layout, for the tier's namespace: per kind, count x dtype[shape]."""
    parts = []
    for kind in self.pool.kinds:
      dtype = self.pool.kind_dtype(kind)
      shape = (self.pool.spec.block_size, *kind.tail)
      parts.append(f"{kind.name} {kind.count}x{dtype.name}{list(shape)}")
    return "; ".join(parts)

  def _padded(self, host_ids) -> tuple[np.ndarray, int]:
    ids = np.asarray(host_ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 1 or ids.max() >= self.pool.num_blocks):
      raise ValueError(f"host block ids must be in [1, {self.pool.num_blocks}), got "
                       f"{ids[(ids < 1) | (ids >= self.pool.num_blocks)].tolist()}")
    n = len(ids)
    padded = np.full(bucket_size(n, self.min_bucket), self.pool.num_blocks, np.int32)
    padded[:n] = ids
    return padded, n

  def lowered_programs(self, max_blocks: int) -> list[jax.stages.Lowered]:
    """The read and write programs of every id bucket up to the one of `max_blocks` ids,
    lowered from the pool's types: what a server's warm-up compiles (engine/warmup.py).
    No block is read or written."""
    out = []
    for n in warm_buckets(max_blocks, self.min_bucket):
      ids = np.zeros(n, np.int32)
      blocks = tuple(jax.ShapeDtypeStruct((n, *shape), dtype)
                     for shape, dtype in zip(self._shapes, self._dtypes))
      out.append(self._read.lower(self.pool.arrays(), ids))
      out.append(self._write.lower(self.pool.arrays(), blocks, ids))
    return out

  def read(self, host_ids) -> np.ndarray:
    """uint8 [n, block_nbytes]: the payloads of host blocks `host_ids`."""
    ids, n = self._padded(host_ids)
    out = np.empty((n, self.block_nbytes), np.uint8)
    if n == 0:
      return out
    read_ids = np.where(ids < self.pool.num_blocks, ids, 0).astype(np.int32)
    blocks = self._read(self.pool.arrays(), read_ids)
    for j, b in enumerate(jax.device_get(blocks)):
      out[:, self._offsets[j]:self._offsets[j + 1]] = (
          np.ascontiguousarray(b[:n]).view(np.uint8).reshape(n, -1))
    return out

  def write(self, host_ids, data: np.ndarray) -> None:
    """Host blocks `host_ids` := the payload rows `data` (uint8 [n, block_nbytes])."""
    ids, n = self._padded(host_ids)
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.shape != (n, self.block_nbytes):
      raise ValueError(f"HostPoolIO.write: data must be uint8{[n, self.block_nbytes]}, got "
                       f"{data.dtype}{list(data.shape)}")
    if n == 0:
      return
    padded = len(ids)
    blocks = []
    for j, (shape, dtype) in enumerate(zip(self._shapes, self._dtypes)):
      b = np.zeros((padded, *shape), dtype)
      b[:n] = np.ascontiguousarray(
          data[:, self._offsets[j]:self._offsets[j + 1]]).view(dtype).reshape(n, *shape)
      blocks.append(b)
    self.pool.set_arrays(self._write(self.pool.arrays(), tuple(blocks), ids))

"""KV block pools by JAX memory kind, and the spec of one KV block.

Owns the arrays that hold the KV cache. A pool is one memory kind of one device:
the device pool (`memory_kind="device"`, accelerator memory) or the host pool
(`memory_kind="pinned_host"`, pinned host DRAM). Both use the same block-major layout,
one K and one V array per layer::

    pool.k[layer], pool.v[layer]   # [num_blocks, block_size, num_kv_heads, head_dim]
      block 0 | block 1 | ... | block num_blocks-1      (each block one contiguous chunk)
      ^ null block: padding target of block tables and transfers, never handed out
        (both pools reserve it, as the block manager's BlockPool of each tier does)

A block id names the same block in every layer, so one block is `spec.bytes_per_block`
bytes (K and V, all layers). The arrays are replaced, never copied: every update is a
jitted call that donates the old arrays and gets back new ones in the same buffers
(`set_arrays`).

Storage dtype: XLA:CPU scatters into a bfloat16 array by converting the whole array to
float32 and back (about 40 ms per 64 MiB, measured, see DESIGN.md), while uint16,
float16 and float32 scatters touch only the updated blocks. So on CPU a bfloat16 cache
is stored bit-for-bit as uint16 (`storage_dtype`), converted at the pool boundary with
`to_storage`/`from_storage` (a bitcast, free). On accelerators bfloat16 is stored as is.
float32 and float16 are always stored as themselves.

Quantized cache (`KVCacheSpec.kv_cache_dtype="int8"`, kernels_pallas.quant): the K and V
arrays hold int8 values and the pool holds, beside them in the same memory kind, one
float32 scale per token and KV head::

    pool.k_scale[layer], pool.v_scale[layer]   # [num_blocks, block_size, num_kv_heads, 1]

`arrays()` is then `k..., v..., k_scale..., v_scale...` (4 x num_layers arrays, all
block-major, so every block move moves a block's scales with its values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, make_single_device_sharding

from hisparse_jax.distributed import parallel
from hisparse_jax.kv_cache.cache_spec import (  # noqa: F401 (re-exported: the pool's API)
  DEVICE,
  KV_CACHE_DTYPES,
  KV_DTYPES,
  MEMORY_KINDS,
  NULL_BLOCK_ID,
  PINNED_HOST,
  SCALE_BYTES,
  ArrayKind,
  KVCacheSpec,
  MLACacheSpec,
  check_kv_cache_dtype,
  check_kv_cache_dtype_devices,
  num_usable_blocks,
)
from hisparse_jax.kv_cache.host_compute import on_host


def storage_dtype(dtype: str, platform: str) -> np.dtype:
  """The dtype a pool stores for logical `dtype` on `platform` (see module docstring)."""
  if dtype == "bfloat16" and platform == "cpu":
    return np.dtype(np.uint16)
  return jnp.dtype(dtype)


def memory_sharding(device: jax.Device, memory_kind: str) -> Sharding:
  """A single-device sharding of `memory_kind`; ValueError when the device lacks it."""
  kinds = {m.kind for m in device.addressable_memories()}
  if memory_kind not in kinds:
    raise ValueError(f"device {device} has no memory kind {memory_kind!r} "
                     f"(it has {sorted(kinds)})")
  return make_single_device_sharding(device, memory_kind=memory_kind)


def to_storage(x: jax.Array, kv_dtype, storage_dtype) -> jax.Array:
  """Logical dtype -> storage dtype: a bitcast for bfloat16 stored as uint16 (CPU), else
  identity. Traceable (the step program calls it on each layer's new K/V)."""
  if x.dtype == storage_dtype:
    return x
  return jax.lax.bitcast_convert_type(x.astype(kv_dtype), storage_dtype)


def from_storage(x: jax.Array, kv_dtype) -> jax.Array:
  """Storage dtype -> logical dtype (the inverse bitcast of `to_storage`). Traceable."""
  kv_dtype = jnp.dtype(kv_dtype)
  return x if x.dtype == kv_dtype else jax.lax.bitcast_convert_type(x, kv_dtype)


def check_mesh(spec, mesh: jax.sharding.Mesh) -> None:
  """ValueError naming --tensor_parallel_size when a pool of `spec` cannot be split by KV
  head over `mesh`."""
  if spec.is_mla:
    raise ValueError("--tensor_parallel_size > 1: DSA models (MLA latent cache) are "
                     "not supported with tensor parallelism; use 1")
  if spec.num_kv_heads % parallel.tp_size(mesh):
    raise ValueError(f"--tensor_parallel_size={parallel.tp_size(mesh)} does not divide "
                     f"the KV cache's num_kv_heads={spec.num_kv_heads}")


class KVPool:
  """The cache block arrays of every layer in one memory kind of one device.

  Invariants: the arrays are those of `spec.array_kinds()` (K and V per layer, or a DSA
  model's latent and indexer-key arrays: MLACacheSpec), each of shape [num_blocks,
  block_size, *tail], of its kind's dtype (the storage dtype unless the kind names one)
  and a sharding of kind `memory_kind`; block `NULL_BLOCK_ID` (0, the null block, in both
  memory kinds) is reserved, so usable ids are `[1, num_blocks)`. The arrays change only
  through `set_arrays`, with arrays returned by a donating jitted update.
  """

  def __init__(self, spec: KVCacheSpec | MLACacheSpec, num_blocks: int, memory_kind: str,
               device: jax.Device | None = None, mesh: jax.sharding.Mesh | None = None):
    """mesh: tensor parallelism, the arrays split by KV head over its devices
    (`hisparse_jax.distributed.parallel`); `device` is then the mesh's first."""
    if memory_kind not in MEMORY_KINDS:
      raise ValueError(f"memory_kind must be one of {MEMORY_KINDS}, got {memory_kind!r}")
    self.spec = spec
    self.memory_kind = memory_kind
    self.mesh = mesh
    if mesh is not None:  # its first device of this process (multi-host: not all are)
      device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    self.device = device if device is not None else jax.devices()[0]
    self.sharding = memory_sharding(self.device, memory_kind)
    # What is not split (the runner's hot-buffer state, step inputs): one copy per device.
    self.replicated = self.sharding
    if mesh is not None:
      check_mesh(spec, mesh)
      self.sharding = parallel.kv_sharding(mesh, memory_kind)
      self.replicated = parallel.replicated(mesh, memory_kind)
    if num_usable_blocks(num_blocks) < 1:
      raise ValueError(f"a {memory_kind} pool needs more than 1 blocks (the null block), "
                       f"got {num_blocks}")
    self.num_blocks = int(num_blocks)
    self.storage_dtype = (np.dtype(spec.cache_dtype) if spec.quantized
                          else storage_dtype(spec.dtype, self.device.platform))
    self.kinds = spec.array_kinds()
    self._arrays: dict[str, tuple[jax.Array, ...]] = {
        kind.name: tuple(self._zeros(self.kind_shape(kind), kind.dtype)
                         for _ in range(kind.count))
        for kind in self.kinds}

  def kind_shape(self, kind: ArrayKind) -> tuple[int, ...]:
    return (self.num_blocks, self.spec.block_size, *kind.tail)

  def kind_dtype(self, kind: ArrayKind) -> np.dtype:
    return self.storage_dtype if kind.dtype is None else np.dtype(kind.dtype)

  def _zeros(self, shape: tuple[int, ...], dtype=None) -> jax.Array:
    dtype = self.storage_dtype if dtype is None else np.dtype(dtype)
    if self.memory_kind == DEVICE:
      # Built on the device: no host buffer, no host-to-device copy.
      return device_full_fn(shape, dtype, 0, self.sharding)()
    # Host kind. The array must come out of a jitted program: measured on jax 0.10.2 CPU,
    # an array device_put from numpy is donated in place only some of the time (60-95% of
    # first donations reused the buffer), a jitted program's output every time. And its
    # type must carry the host memory space: a jitted jnp.zeros with a pinned_host
    # out_sharding yields `f32[...]`, not `f32<host>[...]`, which host-side ops reject.
    if self.device.platform == "cpu":
      # zeros, then device_put to the host kind inside the program: on CPU both kinds are
      # the same RAM, and this is the fastest (2.4 s vs 5.9 s for 1 GiB, measured).
      return _host_zeros_fn(shape, dtype, self.sharding)()
    # Elsewhere never through device memory: staged from a host buffer one layer at a
    # time, then copied by a jitted host-side program.
    staged = jax.device_put(np.zeros(shape, dtype), self.sharding, may_alias=False)
    return _host_copy_fn(self.sharding)(staged)

  def kind(self, name: str) -> tuple[jax.Array, ...]:
    """The arrays of kind `name` (() when the spec has no such kind)."""
    return self._arrays.get(name, ())

  # K/V caches (KVCacheSpec): pool.k[layer], pool.v[layer], and a quantized cache's scales.
  k = property(lambda self: self.kind("k"))
  v = property(lambda self: self.kind("v"))
  k_scale = property(lambda self: self.kind("k_scale"))
  v_scale = property(lambda self: self.kind("v_scale"))
  # DSA caches (MLACacheSpec): pool.latent[layer], pool.index_k[spec.index_slot(layer)].
  latent = property(lambda self: self.kind("latent"))
  index_k = property(lambda self: self.kind("index_k"))
  index_scale = property(lambda self: self.kind("index_scale"))  # (8-bit indexer keys)

  def index_keys(self) -> tuple:
    """Each indexer layer's keys as the attention reads them: its `index_k` array, or
    with 8-bit keys the (values, scales) pair."""
    if not self.index_scale:
      return self.index_k
    return tuple(zip(self.index_k, self.index_scale))

  @property
  def num_usable_blocks(self) -> int:
    return num_usable_blocks(self.num_blocks)

  @property
  def num_layers(self) -> int:
    return self.spec.num_layers

  def arrays(self) -> tuple[jax.Array, ...]:
    """All arrays as one flat tuple, kind after kind: `k[0], ..., k[L-1], v[0], ...,
    v[L-1]` (then `k_scale[0], ..., v_scale[L-1]` for a quantized cache); a DSA model's:
    `latent[0], ..., latent[L-1], index_k[0], ...` (then `index_scale[0], ...` with
    8-bit indexer keys)."""
    return tuple(a for kind in self.kinds for a in self._arrays[kind.name])

  def set_arrays(self, arrays: tuple[jax.Array, ...]) -> None:
    """Installs the arrays returned by a donating update (same order as `arrays()`)."""
    arrays = tuple(arrays)
    want = sum(kind.count for kind in self.kinds)
    if len(arrays) != want:
      raise ValueError(f"expected {want} arrays, got {len(arrays)}")
    new, start = {}, 0
    for kind in self.kinds:
      shape, dtype = self.kind_shape(kind), self.kind_dtype(kind)
      for a in arrays[start:start + kind.count]:
        if a.shape != shape or a.dtype != dtype:
          raise ValueError(f"pool array must be {dtype}{list(shape)}, "
                           f"got {a.dtype}{list(a.shape)}")
        if a.sharding.memory_kind != self.memory_kind:
          raise ValueError(f"pool array must live in {self.memory_kind}, "
                           f"got {a.sharding.memory_kind}")
      new[kind.name] = arrays[start:start + kind.count]
      start += kind.count
    self._arrays = new

  def cache_bytes(self) -> dict[str, int]:
    """Allocated bytes of each cache the capacity lines name (`spec.caches`): a DSA
    model's latent and indexer-key arrays apart, K/V (with scales) as one."""
    if self.spec.is_mla:
      kinds = (("latent",), ("index_k", "index_scale"))
      return {name: sum(int(a.nbytes) for kind in group for a in self.kind(kind))
              for (name, _), group in zip(self.spec.caches, kinds)}
    return {self.spec.caches[0][0]: self.nbytes}

  @property
  def nbytes(self) -> int:
    """Bytes of all arrays of this pool, as allocated (all shards together)."""
    return sum(int(a.nbytes) for a in self.arrays())

  @property
  def devices(self) -> tuple[jax.Device, ...]:
    """The devices holding a shard of every array (one without a mesh)."""
    return (self.device,) if self.mesh is None else tuple(self.mesh.devices.flat)

  @property
  def local_devices(self) -> tuple[jax.Device, ...]:
    """`devices` of this process (multi-host: each process holds its devices' shards)."""
    return tuple(d for d in self.devices if d.process_index == jax.process_index())

  def to_storage(self, x: jax.Array) -> jax.Array:
    """Logical dtype -> this pool's storage dtype (`to_storage`)."""
    return to_storage(x, self.spec.dtype, self.storage_dtype)

  def from_storage(self, x: jax.Array) -> jax.Array:
    """This pool's storage dtype -> logical dtype (`from_storage`)."""
    return from_storage(x, self.spec.dtype)

  def __repr__(self) -> str:
    kinds = " + ".join(
        f"{kind.count} x {self.kind_dtype(kind)}{list(self.kind_shape(kind))}"
        for kind in self.kinds)
    return f"KVPool({self.memory_kind}, {kinds}, {self.nbytes:,} bytes)"


@functools.cache
def _host_copy_fn(sharding: Sharding):
  def host_copy(x):
    return on_host(lambda y: y + jnp.zeros((), y.dtype))(x)

  return jax.jit(host_copy, out_shardings=sharding)


@functools.cache  # one compile per shape, shared by every layer and every pool
def device_full_fn(shape: tuple[int, ...], dtype, value, sharding: Sharding):
  """A jitted program returning a `shape` array of `value`, built where `sharding` says
  (no host buffer, no host-to-device copy): pools, the runner's bounds and hot state."""
  return jax.jit(functools.partial(jnp.full, shape, value, dtype), out_shardings=sharding)


@functools.cache
def _host_zeros_fn(shape: tuple[int, ...], dtype: np.dtype, sharding: Sharding):
  if isinstance(sharding, jax.sharding.NamedSharding):
    # Split (tensor parallel): the device_put inside keeps the host kind in the type, the
    # out_shardings the split (measured, jax 0.10.2: device_put alone replicates).
    return jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), sharding),
                   out_shardings=sharding)
  return jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), sharding))

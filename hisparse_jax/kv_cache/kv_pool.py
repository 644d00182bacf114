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

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding, make_single_device_sharding

from hisparse_jax.distributed import parallel
from hisparse_jax.kv_cache.host_compute import on_host
from kernels_pallas.quant import STORAGE_DTYPES

DEVICE = "device"
PINNED_HOST = "pinned_host"
MEMORY_KINDS = (DEVICE, PINNED_HOST)
KV_DTYPES = ("float32", "bfloat16", "float16")
# What the cache stores: "auto" = the model's dtype; "int8" / "fp8_e4m3" = 8-bit values
# (fp8 as its uint8 bits) + a float32 scale per token and KV head (kernels_pallas.quant).
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
SCALE_BYTES = 4  # float32 scale per token and KV head of a quantized cache
NULL_BLOCK_ID = 0  # block 0 of each pool (and of each tier's BlockPool): the null block


def num_usable_blocks(num_blocks: int) -> int:
  """Blocks of a pool of `num_blocks` that can be handed out: all but the null block."""
  return num_blocks - 1


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
  """Shape and dtype of the KV cache. Invariant: all fields positive, `block_size` a
  power of two, `dtype` one of `KV_DTYPES` (the logical dtype the model reads),
  `kv_cache_dtype` "auto" (stored as `dtype`), "int8" or "fp8_e4m3" (stored quantized)."""

  num_layers: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  block_size: int
  kv_cache_dtype: str = "auto"

  def __post_init__(self):
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"KVCacheSpec.{name} must be a positive integer, got {value!r}")
    if self.block_size & (self.block_size - 1):
      raise ValueError(f"--block_size must be a power of two, got {self.block_size}")
    dtype = jnp.dtype(self.dtype).name if not isinstance(self.dtype, str) else self.dtype
    if dtype not in KV_DTYPES:
      raise ValueError(f"--dtype: KV cache dtype must be one of {KV_DTYPES}, got {dtype!r}")
    object.__setattr__(self, "dtype", dtype)
    check_kv_cache_dtype(self.kv_cache_dtype)

  @classmethod
  def from_model_config(cls, config: Any, dtype: str, block_size: int,
                        kv_cache_dtype: str = "auto") -> KVCacheSpec:
    """From any config with `num_hidden_layers`, `num_key_value_heads`, `head_dim`."""
    try:
      return cls(num_layers=int(config.num_hidden_layers),
                 num_kv_heads=int(config.num_key_value_heads),
                 head_dim=int(config.head_dim), dtype=dtype, block_size=int(block_size),
                 kv_cache_dtype=kv_cache_dtype)
    except AttributeError as e:
      raise ValueError(f"model config lacks a field the KV cache needs: {e}") from None

  @property
  def quantized(self) -> bool:
    """Whether the cache stores 8-bit values and per-token, per-KV-head scales."""
    return self.kv_cache_dtype != "auto"

  @property
  def cache_dtype(self) -> str:
    """The dtype of the stored K/V values: `dtype`, int8, or uint8 (fp8_e4m3 bits)."""
    if not self.quantized:
      return self.dtype
    return jnp.dtype(STORAGE_DTYPES[self.kv_cache_dtype]).name

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.cache_dtype).itemsize

  @property
  def bytes_per_token(self) -> int:
    """K and V of one token over all layers (with their scales when quantized)."""
    per_head = self.head_dim * self.itemsize + (SCALE_BYTES if self.quantized else 0)
    return 2 * self.num_layers * self.num_kv_heads * per_head

  def describe(self) -> str:
    """The stored dtype, as the capacity log names it."""
    return f"{self.kv_cache_dtype} + float32 scales" if self.quantized else self.dtype

  @property
  def bytes_per_block(self) -> int:
    """K and V of one block id over all layers."""
    return self.block_size * self.bytes_per_token

  def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
    return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

  def scale_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
    """The scales of a quantized cache: one per token and KV head."""
    return (num_blocks, self.block_size, self.num_kv_heads, 1)

  def array_kinds(self) -> tuple[ArrayKind, ...]:
    """The pool's arrays by kind, in `KVPool.arrays()` order: k, v (and the scales of a
    quantized cache), one array per layer each."""
    values = (self.num_kv_heads, self.head_dim)
    kinds = (ArrayKind("k", self.num_layers, values), ArrayKind("v", self.num_layers, values))
    if self.quantized:
      scales = (self.num_kv_heads, 1)
      kinds += (ArrayKind("k_scale", self.num_layers, scales, "float32"),
                ArrayKind("v_scale", self.num_layers, scales, "float32"))
    return kinds

  @property
  def caches(self) -> tuple[tuple[str, int], ...]:
    """(name, bytes per token over all layers) of each cache the capacity lines name."""
    return (("K/V", self.bytes_per_token),)

  @property
  def is_mla(self) -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class ArrayKind:
  """`count` arrays of a pool (one per layer, or per layer with an indexer), each
  [num_blocks, block_size, *tail]; `dtype` None: the pool's storage dtype."""

  name: str
  count: int
  tail: tuple[int, ...]
  dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class MLACacheSpec:
  """The caches of a DSA model (MLA + lightning indexer, models/deepseek_v32.py), paged
  like K/V with shared block ids in both memory kinds::

    latent[l]   [num_blocks, block_size, 1, kv_lora_rank + rope_dim]   every layer l:
                the normalized kv latent, then the roped shared key (MLA's absorbed form:
                one entry per token for all heads; DeepSeek-V3.2: 512 + 64)
    index_k[j]  [num_blocks, block_size, 1, index_head_dim]   every layer with an indexer
                (`index_layers`; GLM-MoE-DSA's "shared" layers have none): the lightning
                indexer's key of each token

  Invariants as KVCacheSpec's; `kv_cache_dtype` "auto" only (8-bit DSA caches are not
  built); `index_layers` sorted, within [0, num_layers), the first layer among them."""

  num_layers: int
  kv_lora_rank: int
  rope_dim: int
  index_head_dim: int
  index_layers: tuple[int, ...]
  dtype: str
  block_size: int
  kv_cache_dtype: str = "auto"

  def __post_init__(self):
    for name in ("num_layers", "kv_lora_rank", "rope_dim", "index_head_dim", "block_size"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"MLACacheSpec.{name} must be a positive integer, got {value!r}")
    if self.block_size & (self.block_size - 1):
      raise ValueError(f"--block_size must be a power of two, got {self.block_size}")
    dtype = jnp.dtype(self.dtype).name if not isinstance(self.dtype, str) else self.dtype
    if dtype not in KV_DTYPES:
      raise ValueError(f"--dtype: KV cache dtype must be one of {KV_DTYPES}, got {dtype!r}")
    object.__setattr__(self, "dtype", dtype)
    if self.kv_cache_dtype != "auto":
      raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype}: 8-bit caches of DSA models "
                       "(MLA latent + indexer keys) are not supported; use kv_cache_dtype=auto")
    layers = tuple(int(i) for i in self.index_layers)
    if not layers or list(layers) != sorted(set(layers)) or layers[0] != 0 or (
        layers[-1] >= self.num_layers):
      raise ValueError(f"MLACacheSpec.index_layers must be sorted distinct layers of "
                       f"[0, {self.num_layers}) starting at 0, got {self.index_layers!r}")
    object.__setattr__(self, "index_layers", layers)

  @classmethod
  def from_model_config(cls, config: Any, dtype: str, block_size: int,
                        kv_cache_dtype: str = "auto") -> MLACacheSpec:
    """From a models.deepseek_v32.DeepseekV32Config."""
    return cls(num_layers=config.num_hidden_layers, kv_lora_rank=config.kv_lora_rank,
               rope_dim=config.qk_rope_head_dim, index_head_dim=config.index_head_dim,
               index_layers=tuple(i for i, t in enumerate(config.indexer_types)
                                  if t == "full"),
               dtype=dtype, block_size=int(block_size), kv_cache_dtype=kv_cache_dtype)

  quantized = False
  is_mla = True
  num_kv_heads = 1  # (one latent "head" shared by every query head)

  @property
  def latent_dim(self) -> int:
    return self.kv_lora_rank + self.rope_dim

  @property
  def cache_dtype(self) -> str:
    return self.dtype

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def latent_bytes_per_token(self) -> int:
    return self.num_layers * self.latent_dim * self.itemsize

  @property
  def index_bytes_per_token(self) -> int:
    return len(self.index_layers) * self.index_head_dim * self.itemsize

  @property
  def bytes_per_token(self) -> int:
    """Both caches of one token over all layers."""
    return self.latent_bytes_per_token + self.index_bytes_per_token

  @property
  def bytes_per_block(self) -> int:
    return self.block_size * self.bytes_per_token

  @property
  def caches(self) -> tuple[tuple[str, int], ...]:
    return (("MLA latent", self.latent_bytes_per_token),
            ("indexer keys", self.index_bytes_per_token))

  def describe(self) -> str:
    return self.dtype

  def array_kinds(self) -> tuple[ArrayKind, ...]:
    return (ArrayKind("latent", self.num_layers, (1, self.latent_dim)),
            ArrayKind("index_k", len(self.index_layers), (1, self.index_head_dim)))

  def index_slot(self, layer: int) -> int | None:
    """Which `index_k` array holds `layer`'s indexer keys (None: the layer has none)."""
    return self.index_layers.index(layer) if layer in self.index_layers else None


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
  """ValueError naming the kv_cache_dtype field for a name this engine cannot store
  (the CLI prefixes it with "--")."""
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f"kv_cache_dtype must be auto, int8 or fp8_e4m3, got "
                     f"{kv_cache_dtype!r}")


# float8_e4m3fn -> float32 conversion in the Pallas (Triton) kernels: NVIDIA sm_89 and up.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)


def check_kv_cache_dtype_devices(kv_cache_dtype: str, devices) -> None:
  """ValueError naming the kv_cache_dtype field when a device cannot read the cache in
  its kernels: fp8_e4m3 on an NVIDIA GPU below compute capability 8.9 (Triton converts
  float8_e4m3fn with sm_89 instructions). CPUs store fp8 as bits and convert in XLA."""
  if kv_cache_dtype != "fp8_e4m3":
    return
  for device in devices:
    cc = str(getattr(device, "compute_capability", "") or "")
    parts = cc.split(".")
    if device.platform != "gpu" or not all(p.isdigit() for p in parts) or len(parts) != 2:
      continue  # CPU, TPU, ROCm ("gfx90a"): nothing to check here
    if (int(parts[0]), int(parts[1])) < FP8_MIN_COMPUTE_CAPABILITY:
      raise ValueError(
          f"kv_cache_dtype=fp8_e4m3 needs a GPU of compute capability 8.9 or newer (its "
          f"kernels convert float8_e4m3fn with sm_89 instructions); {device.device_kind} "
          f"has {cc}: use kv_cache_dtype=int8")


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

  @property
  def num_usable_blocks(self) -> int:
    return num_usable_blocks(self.num_blocks)

  @property
  def num_layers(self) -> int:
    return self.spec.num_layers

  def arrays(self) -> tuple[jax.Array, ...]:
    """All arrays as one flat tuple, kind after kind: `k[0], ..., k[L-1], v[0], ...,
    v[L-1]` (then `k_scale[0], ..., v_scale[L-1]` for a quantized cache); a DSA model's:
    `latent[0], ..., latent[L-1], index_k[0], ...`."""
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
      return {name: sum(int(a.nbytes) for a in self.kind(kind))
              for (name, _), kind in zip(self.spec.caches, ("latent", "index_k"))}
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

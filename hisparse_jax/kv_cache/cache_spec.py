"""The spec of a KV cache: its shape, dtypes and arrays by kind (a llama model's K/V,
a DSA model's MLA latent and indexer keys), the bytes of one block, and the checks of
the cache dtypes. `kv_pool.KVPool` allocates the arrays a spec names (re-exported there).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

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


def stored_dtype(dtype: str, cache_dtype: str) -> str:
  """The dtype a cache of logical `dtype` stores its values as under `cache_dtype` (a
  KV_CACHE_DTYPES name): `dtype` for auto, int8, or uint8 (fp8_e4m3 bits)."""
  return dtype if cache_dtype == "auto" else jnp.dtype(STORAGE_DTYPES[cache_dtype]).name


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
    return stored_dtype(self.dtype, self.kv_cache_dtype)

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
    index_scale[j]  float32 [num_blocks, block_size, 1, 1]   with 8-bit indexer keys
                (`index_cache_dtype` int8 / fp8_e4m3: index_k holds int8, or fp8_e4m3
                bits as uint8, and one scale per token, kernels_pallas.quant's layout)

  Why 8-bit indexer keys (DeepSeek-V3.2's reference indexer and vLLM cache them in fp8
  with a float32 scale per 128 values): the indexer reads EVERY key of a row each step,
  the sparse attention only top-k of them; at 64k tokens and index_head_dim 128 a row's
  bf16 keys are 16 MiB a layer against 2.3 MiB of selected latent entries, and 8-bit keys
  + scales are 132 bytes a token against 256. The keys are stored rotated by a Hadamard
  matrix (sparse.dsa_attention.hadamard, as DeepSeek's `rotate_activation`: an
  orthogonal map, so q . k is unchanged, and it spreads outlier dims before quantizing).

  Invariants as KVCacheSpec's; `kv_cache_dtype` "auto" only (an 8-bit latent cache is not
  built); `index_layers` sorted, within [0, num_layers), the first layer among them."""

  num_layers: int
  kv_lora_rank: int
  rope_dim: int
  index_head_dim: int
  index_layers: tuple[int, ...]
  dtype: str
  block_size: int
  kv_cache_dtype: str = "auto"
  index_cache_dtype: str = "auto"  # the indexer keys: auto (dtype), int8 or fp8_e4m3

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
    if self.index_cache_dtype not in KV_CACHE_DTYPES:
      raise ValueError(f"index_cache_dtype must be auto, int8 or fp8_e4m3, got "
                       f"{self.index_cache_dtype!r}")
    layers = tuple(int(i) for i in self.index_layers)
    if not layers or list(layers) != sorted(set(layers)) or layers[0] != 0 or (
        layers[-1] >= self.num_layers):
      raise ValueError(f"MLACacheSpec.index_layers must be sorted distinct layers of "
                       f"[0, {self.num_layers}) starting at 0, got {self.index_layers!r}")
    object.__setattr__(self, "index_layers", layers)

  @classmethod
  def from_model_config(cls, config: Any, dtype: str, block_size: int,
                        kv_cache_dtype: str = "auto",
                        index_cache_dtype: str = "auto") -> MLACacheSpec:
    """From a models.deepseek_v32.DeepseekV32Config."""
    return cls(num_layers=config.num_hidden_layers, kv_lora_rank=config.kv_lora_rank,
               rope_dim=config.qk_rope_head_dim, index_head_dim=config.index_head_dim,
               index_layers=tuple(i for i, t in enumerate(config.indexer_types)
                                  if t == "full"),
               dtype=dtype, block_size=int(block_size), kv_cache_dtype=kv_cache_dtype,
               index_cache_dtype=index_cache_dtype)

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
  def index_quantized(self) -> bool:
    """Whether the indexer keys are 8-bit values with a float32 scale per token."""
    return self.index_cache_dtype != "auto"

  @property
  def index_dtype(self) -> str:
    """The stored dtype of the indexer keys: `dtype`, int8 or uint8 (fp8_e4m3 bits)."""
    return stored_dtype(self.dtype, self.index_cache_dtype)

  @property
  def index_bytes_per_token(self) -> int:
    """The indexer keys of one token over the layers with an indexer (with their scales
    when 8-bit)."""
    per_layer = self.index_head_dim * jnp.dtype(self.index_dtype).itemsize + (
        SCALE_BYTES if self.index_quantized else 0)
    return len(self.index_layers) * per_layer

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
    if self.index_quantized:
      return f"{self.dtype}, indexer keys {self.index_cache_dtype} + float32 scales"
    return self.dtype

  def array_kinds(self) -> tuple[ArrayKind, ...]:
    """latent, index_k (and index_scale with 8-bit indexer keys), in `KVPool.arrays()`
    order."""
    num_index = len(self.index_layers)
    if not self.index_quantized:
      return (ArrayKind("latent", self.num_layers, (1, self.latent_dim)),
              ArrayKind("index_k", num_index, (1, self.index_head_dim)))
    return (ArrayKind("latent", self.num_layers, (1, self.latent_dim)),
            ArrayKind("index_k", num_index, (1, self.index_head_dim), self.index_dtype),
            ArrayKind("index_scale", num_index, (1, 1), "float32"))

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


def check_kv_cache_dtype_devices(kv_cache_dtype: str, devices,
                                 field: str = "kv_cache_dtype") -> None:
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
          f"{field}=fp8_e4m3 needs a GPU of compute capability 8.9 or newer (its "
          f"kernels convert float8_e4m3fn with sm_89 instructions); {device.device_kind} "
          f"has {cc}: use {field}=int8")

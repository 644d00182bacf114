"""EngineConfig: everything an engine is built from, validated on construction.

The CLI's flags and `LLM(...)`'s keyword arguments are its fields (`hisparse-jax
generate --help` lists them); a bad value raises ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hisparse_jax.kv_cache.kv_pool import KV_CACHE_DTYPES, check_kv_cache_dtype
from hisparse_jax.sparse.config import HiSparseConfig


def default_block_size(hisparse: bool = False) -> int:
  """The block size when none is given: 128 tokens on CPU, as vLLM's CPU backend (a decode
  reads each block as one contiguous run; measured here on the prefill_heavy workload:
  19% faster than 16), 16 on accelerators and with HiSparse (the indexer selects whole
  blocks, and smaller blocks select more precisely)."""
  if hisparse:
    return 16
  import kernels_pallas  # the platform query starts jax's backends: only when needed

  return 128 if kernels_pallas.backend.platform() == "cpu" else 16


# The prefill chunk when max_num_batched_tokens is left to the engine (vLLM's default for
# online serving).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Everything an engine is built from; validated on construction (fields = CLI flags)."""

  model: str | None = None  # HF checkpoint directory; None = the embedded hisparse-tiny
  dtype: str = "float32"  # weights and KV cache
  # What the KV cache stores: "auto" (the model's dtype) or "int8" (int8 values and a
  # float32 scale per token and KV head, dequantized where attention reads them).
  kv_cache_dtype: str = "auto"
  # What a DSA model's indexer-key cache stores: "auto" (the model's dtype) or "int8" /
  # "fp8_e4m3" (8-bit values of the Hadamard-rotated keys and a float32 scale per token,
  # DeepSeek-V3.2's fp8 indexer cache: kv_cache.cache_spec.MLACacheSpec).
  index_cache_dtype: str = "auto"
  # None: default_block_size, resolved when the engine is built (128 on CPU, 16 otherwise).
  block_size: int | None = None
  device_kv_gib: float | None = None
  host_pool_gib: float = 1.0
  max_model_len: int = 2048
  max_num_seqs: int = 256
  # Tokens one step schedules (the prefill chunk). None: the engine decides
  # (planning.resolve_config): DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len where larger
  # without chunked prefill, and with HiSparse no more than the device budget streams.
  max_num_batched_tokens: int | None = None
  enable_chunked_prefill: bool = True
  enable_prefix_caching: bool = True
  kernel_backend: str | None = None  # "auto" (None), "pallas", "xla" or "reference"
  # Overlap the host's work for step t + 1 with the device's step t (vLLM V1's async
  # scheduling); False finishes each step within its step() call.
  async_scheduling: bool = True
  # A batch whose step shape has no compiled program yet runs padded to the cheapest
  # compiled shape that covers it while its own compiles in a background thread
  # (step_shapes.py): no compile stall while serving. Off: each new shape compiles
  # before its step runs (reproducible to the bit: the padding never depends on timing).
  compile_in_background: bool = False
  # The compiled step programs kept (compile_in_background; step_shapes.StepCompiler): at
  # the cap a batch a kept program covers runs padded to it (no new program), one none
  # covers compiles and the least recently run are dropped. What bounds a serving
  # process' memory: each program holds ~20-50 MB on CPU (bench/soak.py).
  max_step_programs: int = 128
  seed: int = 0
  hisparse: HiSparseConfig | None = None  # None: dense attention only
  # Devices of the one mesh the engine runs over (heads, MLP and KV cache split); 1: one
  # device, no mesh (hisparse_jax.distributed.parallel).
  tensor_parallel_size: int = 1
  # The third KV tier (engine/tier_connector.py): a local directory of block files with a
  # byte cap, and/or a Redis-protocol store shared by engines (redis://host:port/db).
  # Prompt blocks missing in device and host are loaded from it into the host pool, and
  # computed prompt blocks are stored to it (write_through: once the prompt is computed;
  # write_back: when the host pool evicts them, and at close).
  disk_cache_dir: str | None = None
  disk_cache_gib: float = 16.0
  remote_cache_url: str | None = None
  remote_cache_ttl_s: int = 86400
  kv_tier_write_policy: str = "write_through"

  def __post_init__(self):
    tp = self.tensor_parallel_size
    if not isinstance(tp, (int, np.integer)) or isinstance(tp, bool) or tp < 1:
      raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if self.block_size is None and self.hisparse is not None:
      object.__setattr__(self, "block_size", default_block_size(hisparse=True))
    if self.block_size is not None and (self.block_size <= 0
                                        or self.block_size & (self.block_size - 1)):
      raise ValueError(f"block_size must be a power of two, got {self.block_size}")
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
      if name == "max_num_batched_tokens" and self.max_num_batched_tokens is None:
        continue  # (decided by the engine)
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.seed < 0:
      raise ValueError(f"seed must be >= 0, got {self.seed}")
    if self.max_step_programs < 1:
      raise ValueError(f"max_step_programs must be >= 1, got {self.max_step_programs}")
    if self.dtype not in ("auto", "float32", "bfloat16"):
      raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
    check_kv_cache_dtype(self.kv_cache_dtype)
    if self.index_cache_dtype not in KV_CACHE_DTYPES:
      raise ValueError(f"index_cache_dtype must be auto, int8 or fp8_e4m3, got "
                       f"{self.index_cache_dtype!r}")
    if self.host_pool_gib is not None and self.host_pool_gib < 0:
      raise ValueError(f"host_pool_gib must be >= 0, got {self.host_pool_gib}")
    if self.device_kv_gib is not None and self.device_kv_gib <= 0:
      raise ValueError(f"device_kv_gib must be > 0, got {self.device_kv_gib}")
    if (not self.enable_chunked_prefill and self.max_num_batched_tokens is not None
        and self.max_num_batched_tokens < self.max_model_len):
      # A recomputed request prefills up to max_model_len tokens in one step.
      raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                       f"max_model_len={self.max_model_len} without chunked prefill")
    if not (math.isfinite(self.disk_cache_gib) and self.disk_cache_gib > 0):
      raise ValueError(f"disk_cache_gib must be a positive number, got {self.disk_cache_gib}")
    if (not isinstance(self.remote_cache_ttl_s, (int, np.integer))
        or isinstance(self.remote_cache_ttl_s, bool) or self.remote_cache_ttl_s <= 0):
      raise ValueError(f"remote_cache_ttl_s must be a positive integer, got "
                       f"{self.remote_cache_ttl_s!r}")
    if self.kv_tier_write_policy not in ("write_through", "write_back"):
      raise ValueError(f"kv_tier_write_policy must be write_through or write_back, got "
                       f"{self.kv_tier_write_policy!r}")
    if self.disk_cache_dir or self.remote_cache_url:
      flag = "disk_cache_dir" if self.disk_cache_dir else "remote_cache_url"
      if not self.enable_prefix_caching:
        raise ValueError(f"{flag}: the third KV tier serves prefix-cache hits; it needs "
                         "enable_prefix_caching=True")
      if self.host_pool_gib is not None and self.host_pool_gib <= 0:
        raise ValueError(f"{flag}: the third KV tier loads blocks through the host pool; "
                         f"host_pool_gib must be > 0, got {self.host_pool_gib}")
    if self.hisparse is not None:
      if not isinstance(self.hisparse, HiSparseConfig):
        raise ValueError(f"hisparse must be a HiSparseConfig or None, got "
                         f"{type(self.hisparse).__name__}")
      try:
        self.hisparse.blocks(self.block_size)  # top-k, sink, local in whole blocks
      except ValueError as e:
        raise ValueError(f"hisparse: {e}") from None
      if (self.hisparse.selection not in ("union", "shared")
          and self.tensor_parallel_size > 1):
        raise ValueError(
            f"hisparse: selection={self.hisparse.selection!r} is not available with "
            f"tensor_parallel_size={self.tensor_parallel_size} (the heads' selections would "
            "need every head's scores on every device); use selection='union' or 'shared'")

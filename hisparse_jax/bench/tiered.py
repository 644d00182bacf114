"""Bench set-ups shared by the HiSparse suites: random K/V pools, decode rows, and a
decode batch whose sequences are offloaded (every block in the pinned_host pool, the
device holding only what the engine keeps of an offloaded request)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import ModelRunner, SparseTiers
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.engine.scheduler import ScheduledChunk
from hisparse_jax.kv_cache.kv_pool import (
  DEVICE,
  PINNED_HOST,
  KVCacheSpec,
  KVPool,
  from_storage,
)
from hisparse_jax.sparse import indexer
from hisparse_jax.sparse.config import HiSparseConfig
from kernels_pallas.block_key_bounds import quantize_bounds, round_bounds
from models.llama import LlamaForCausalLM


@functools.cache
def _copy_program(sharding):
  return jax.jit(lambda a: a, out_shardings=sharding)


def to_device(x: jax.Array, sharding) -> jax.Array:
  """A copy of `x` (a pinned_host pool array) in `sharding`'s memory, made by a jitted
  copy. (jax 0.12.1's eager `device_put` of a program's pinned_host output fails on the
  CPU: "UNIMPLEMENTED: Unsupported layout used for PjRt CPU buffers: {...:S(5)}"; the
  copy inside a program works on 0.11.2 and 0.12.1 alike.)"""
  return _copy_program(sharding)(x)


@functools.cache
def random_fn(shape, dtype, sharding, positive: bool = False):
  """A jitted maker of random values: normal floats (their magnitude when `positive`: a
  quantized cache's scales), int8 in [-127, 127], uint8 as fp8_e4m3 bits of normal
  values (kernels_pallas.quant's 8-bit layouts), made where `sharding` says."""
  dtype = jnp.dtype(dtype)

  def make(key):
    if dtype == jnp.int8:
      return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)
    if dtype == jnp.uint8:
      values = jax.random.normal(key, shape, jnp.float32).astype(jnp.float8_e4m3fn)
      return jax.lax.bitcast_convert_type(values, jnp.uint8)
    values = jax.random.normal(key, shape, dtype)
    return jnp.abs(values) if positive else values

  return jax.jit(make, out_shardings=sharding)


def fill(pool: KVPool, seed: int) -> None:
  """Random K/V in every block of the pool (made on the device, installed as the pool's)."""
  make = random_fn(pool.spec.block_shape(pool.num_blocks), jnp.dtype(pool.storage_dtype),
                   pool.sharding)
  keys = jax.random.split(jax.random.key(seed), 2 * pool.num_layers)
  pool.set_arrays(tuple(make(k) for k in keys))


def decode_chunks(contexts_len: int, tables: np.ndarray, block_size: int, vocab: int,
                  rng: np.random.Generator) -> list[ScheduledChunk]:
  """One decode row per sequence: its last token, written into its newest block."""
  chunks = []
  for i, table in enumerate(tables):
    prompt = rng.integers(0, vocab, contexts_len).tolist()
    request = Request(f"seq-{i}", prompt, SamplingParams(temperature=0.0), seed=i)
    pos = contexts_len - 1
    slot = np.asarray([table[pos // block_size] * block_size + pos % block_size], np.int32)
    chunks.append(ScheduledChunk(request, pos, 1, slot))
  return chunks


@functools.partial(jax.jit, static_argnames=("bounds_dtype",))
def host_bounds(k_host: jax.Array, bounds_dtype: str = "float32"):
  """[blocks, 2, kv heads, head_dim]: min and max over each block's tokens (all full), in
  `bounds_dtype` rounded outward as kernels_pallas.block_key_bounds stores them (int8:
  QuantizedBounds)."""
  k = k_host.astype(jnp.float32)
  if bounds_dtype == "int8":
    return quantize_bounds(k.min(axis=1), k.max(axis=1))
  return jnp.stack(round_bounds(k.min(axis=1), k.max(axis=1), bounds_dtype), axis=1)


@dataclasses.dataclass
class TieredBatch:
  """A decode batch whose sequences are offloaded: every block in the host pool, the
  device holding the resident blocks and the hot buffers (`tiered_decode`)."""

  runner: ModelRunner
  batch: object  # StepBatch
  cold_state: tuple[np.ndarray, ...]  # the runner's hot-buffer state, every slot empty
  block_bytes: int  # K + V bytes of one block of one layer


def tiered_decode(model: LlamaForCausalLM, spec: KVCacheSpec, hisparse: HiSparseConfig,
                  batch_size: int, context: int, seed: int) -> TieredBatch:
  """A ModelRunner and one decode row per sequence, each sequence `context` tokens of
  random K/V in the pinned_host pool (the key bounds of every block in the indexer's
  host rows), its sink and local blocks resident on the device."""
  blocks = hisparse.blocks(spec.block_size)
  num_logical = math.ceil(context / spec.block_size)
  host_pool = KVPool(spec, 1 + batch_size * num_logical, PINNED_HOST)
  make = random_fn(spec.block_shape(host_pool.num_blocks), jnp.dtype(host_pool.storage_dtype),
                    host_pool.sharding)
  keys = jax.random.split(jax.random.key(seed), 2 * spec.num_layers)
  host_pool.set_arrays(tuple(make(k) for k in keys))
  resident = np.r_[np.arange(blocks.sink_blocks),
                   np.arange(num_logical - blocks.local_blocks, num_logical)]
  slots = blocks.hot_buffer_blocks
  per_seq = len(resident) + slots
  device_pool = KVPool(spec, 1 + batch_size * per_seq, DEVICE)
  runner = ModelRunner(model, device_pool, hisparse=hisparse, host_pool=host_pool,
                       max_model_len=context, max_num_seqs=batch_size,
                       max_num_batched_tokens=batch_size)
  host_tables = (1 + np.arange(batch_size)[:, None] * num_logical
                 + np.arange(num_logical)).astype(np.int32)
  device_tables = np.zeros_like(host_tables)
  hot_slots = np.zeros((batch_size, slots), np.int32)
  copy_src, copy_dst = [], []
  for i in range(batch_size):
    ids = 1 + i * per_seq + np.arange(per_seq)
    device_tables[i, resident] = ids[:len(resident)]
    hot_slots[i] = ids[len(resident):]
    copy_src += list(host_tables[i, resident])
    copy_dst += list(ids[:len(resident)])
  # The resident blocks' pages and every block's key bounds, as an offload leaves them.
  src, dst = np.asarray(copy_src), np.asarray(copy_dst)
  device_pool.set_arrays(tuple(
      d.at[dst].set(to_device(h, device_pool.sharding)[src])
      for d, h in zip(device_pool.arrays(), host_pool.arrays())))
  nd = device_pool.num_blocks
  bounds_dtype = runner.hisparse.bounds_dtype
  runner.bounds = tuple(
      jax.tree.map(lambda whole, rows: whole.at[nd:].set(rows), b, indexer.bounds_storage(
          host_bounds(from_storage(to_device(k, device_pool.sharding), spec.dtype),
                      bounds_dtype), bounds_dtype, b))
      for b, k in zip(runner.bounds, host_pool.arrays()[:spec.num_layers]))
  runner.refresh_bounds(dst)
  rng = np.random.default_rng(seed)
  chunks = decode_chunks(context, device_tables, spec.block_size, model.config.vocab_size,
                          rng)
  # The newest token's slot is in the newest (resident) block: its device id.
  tiers = SparseTiers(host_tables=host_tables, hot_slots=hot_slots,
                      hot_rows=np.arange(batch_size, dtype=np.int32),
                      hot_reset=np.zeros(batch_size, bool))
  batch = runner.build_batch(chunks, device_tables, tiers)
  if not batch.metadata.sparse_rows[:batch_size].all():
    raise ValueError(f"context {context} is not above the sparse threshold")
  cold = runner.hot_state_arrays()
  return TieredBatch(runner, batch, cold, 2 * spec.block_size * spec.num_kv_heads
                     * spec.head_dim * spec.itemsize)




def fill_kinds(pool: KVPool, seed: int) -> None:
  """Random values in every block of every array of the pool, whatever its kinds (a DSA
  model's latent and indexer-key arrays), made on the device of its memory kind."""
  keys = iter(jax.random.split(jax.random.key(seed), len(pool.arrays())))
  arrays = []
  for kind in pool.kinds:
    make = random_fn(pool.kind_shape(kind), jnp.dtype(pool.kind_dtype(kind)), pool.sharding,
                     positive=kind.name.endswith("scale"))
    arrays += [make(next(keys)) for _ in range(kind.count)]
  pool.set_arrays(tuple(arrays))


def dsa_tiered_decode(model, spec, hisparse: HiSparseConfig, batch_size: int, context: int,
                      seed: int) -> TieredBatch:
  """`tiered_decode` for a DSA model (models/deepseek_v32.py, kv_pool.MLACacheSpec): a
  DsaModelRunner and one decode row per sequence, each `context` tokens of random latent
  entries and indexer keys in the pinned_host pool (the indexer keys of every host block
  on the device, as written through), only its newest block resident and a token-granular
  hot buffer of `hisparse.hot_buffer_tokens`. `hisparse`: the settings the engine runs
  the model with (`HiSparseConfig.for_index_topk`). block_bytes: one loaded token's
  latent entry (the step's loads move tokens)."""
  from hisparse_jax.engine.dsa_runner import DsaModelRunner  # noqa: PLC0415

  blocks = hisparse.blocks(spec.block_size)
  num_logical = math.ceil(context / spec.block_size)
  host_pool = KVPool(spec, 1 + batch_size * num_logical, PINNED_HOST)
  fill_kinds(host_pool, seed)
  slots = blocks.hot_buffer_blocks
  per_seq = 1 + slots
  device_pool = KVPool(spec, 1 + batch_size * per_seq, DEVICE)
  runner = DsaModelRunner(model, device_pool, hisparse=hisparse, host_pool=host_pool,
                          max_model_len=context, max_num_seqs=batch_size,
                          max_num_batched_tokens=batch_size)
  host_tables = (1 + np.arange(batch_size)[:, None] * num_logical
                 + np.arange(num_logical)).astype(np.int32)
  device_tables = np.zeros_like(host_tables)
  hot_slots = np.zeros((batch_size, slots), np.int32)
  newest = []
  for i in range(batch_size):
    ids = 1 + i * per_seq + np.arange(per_seq)
    device_tables[i, -1] = ids[0]
    hot_slots[i] = ids[1:]
    newest.append(ids[0])
  src, dst = host_tables[:, -1], np.asarray(newest)
  device_pool.set_arrays(tuple(
      d.at[dst].set(to_device(h, device_pool.sharding)[src])
      for d, h in zip(device_pool.arrays(), host_pool.arrays())))
  # The indexer keys of every host block, on the device (written through as blocks fill).
  runner.bounds = jax.tree.map(lambda k: to_device(k, device_pool.sharding),
                               host_pool.index_keys())
  rng = np.random.default_rng(seed)
  chunks = decode_chunks(context, device_tables, spec.block_size, model.config.vocab_size,
                         rng)
  tiers = SparseTiers(host_tables=host_tables, hot_slots=hot_slots,
                      hot_rows=np.arange(batch_size, dtype=np.int32),
                      hot_reset=np.zeros(batch_size, bool))
  batch = runner.build_batch(chunks, device_tables, tiers)
  if not batch.metadata.sparse_rows[:batch_size].all():
    raise ValueError("the offloaded rows are not the step's tiered rows")
  cold = runner.hot_state_arrays()
  return TieredBatch(runner, batch, cold, spec.latent_dim * spec.itemsize)

"""Round trips device -> pinned_host -> device come back bit for bit (issue #35), for every
cache kind: float32, bfloat16 (uint16 storage on CPU), int8 and fp8_e4m3 (8-bit values +
float32 scales, every array of the pool).

The blocks hold random BITS, not random numbers: NaN payloads (signalling ones included),
infinities, subnormals and negative zero are planted in every block, so a move that goes
through a float conversion, a canonicalizing copy or an unpinned bounce shows (SGLang-JAX
warns that bf16 KV moved through unpinned_host is silently corrupted). Every comparison is
of raw bytes, read by a program of its own (the whole pool crossing to the device kind,
bitcast to unsigned), never through the paths under test.

  swap          TransferEngine.swap_out then swap_in into other device blocks
  third tier    HostPoolIO.read -> KVTier + DiskBackend (files) -> load into other host
                blocks (HostPoolIO.write) -> swap_in
  HiSparse      resolver.load_blocks (host pages -> device pages in a jitted program, a
                layer's k, v (and scales) as the step passes them) and load_tokens (a DSA
                layer's latent rows)
  engine        HiSparse engines (float32, bfloat16, int8): every swap-out (write-through;
                a preemption's too, and every swap-in, though none happen at this size)
                checked as it runs, and after every step each hot-buffer slot against the
                host copy the step loaded into it (the model's own K/V: no NaN patterns
                there, so these catch wrong or altered blocks, the others canonicalization)

Paths: "platform" is what this machine's devices use (CPU: block-copy loops over one
memory; GPU: host gather + crossing); "host_gather" forces the GPU mechanism, which runs on
CPU too. `make gpu-check` runs this file on a GPU (hisparse_engine step), where pinned_host
is real pinned host memory.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import GIB, MAX_MODEL_LEN, random_prompts, tiny_model
from engine_fixtures import run as run_engine
from jax import lax
from jax.sharding import make_single_device_sharding

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.kv_cache import capacity
from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, KVCacheSpec, KVPool, MLACacheSpec
from hisparse_jax.kv_cache.tiers import payload
from hisparse_jax.kv_cache.tiers.disk import DiskBackend
from hisparse_jax.kv_cache.tiers.keys import Namespace, chain_keys
from hisparse_jax.kv_cache.tiers.pool_io import HostPoolIO
from hisparse_jax.kv_cache.tiers.testing import wait_finished
from hisparse_jax.kv_cache.tiers.tier import KVTier
from hisparse_jax.kv_cache.transfer import TransferEngine
from hisparse_jax.sparse import resolver
from models.llama import LlamaForCausalLM

NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS_POOL = 16, 24
# Cache kinds: the logical dtype and what is stored (8-bit: values + float32 scales).
KINDS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8": dict(dtype="float32", kv_cache_dtype="int8"),
    "fp8_e4m3": dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3"),
}
# How blocks cross: as this platform does (CPU: one memory, block-copy loops); the GPU's
# paths forced on CPU: XLA's host gather + crossing, and the zero-copy block-copy kernel
# (interpret mode here; transfer.host_copy_mode).
PATHS = pytest.mark.parametrize(("one_memory", "host_copy"),
                                [(None, "xla"), (False, "xla"), (False, "kernel")],
                                ids=["platform", "host_gather", "zero_copy_kernel"])
# Bit patterns planted in every token of every array, by item size: NaNs
# (signalling, quiet with a payload, negative), +-inf, subnormals, -0 (bf16: the float32
# patterns' top halves; 1 byte: int8 extremes and fp8_e4m3fn's NaNs 0x7f / 0xff).
SPECIALS = {
    4: [0x7F800001, 0x7FC12345, 0xFFC00000, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF,
        0x80000000],
    2: [0x7F81, 0x7FC1, 0xFFC0, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x8000],
    1: [0x7F, 0xFF, 0x80, 0x01, 0x00],
}


def _spec(kind: str) -> KVCacheSpec:
  return KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, **KINDS[kind])


def _random_bits(rng, shape, dtype) -> np.ndarray:
  """Random bytes as `dtype` [num_blocks, block_size, ...], with SPECIALS planted in the
  first half of every token's values (rotated from token to token, so all of them occur)."""
  dtype = np.dtype(dtype)
  size = dtype.itemsize
  bits = rng.integers(0, 2**(8 * size), size=shape, dtype=np.uint64).astype(f"uint{8 * size}")
  rows = bits.reshape(shape[0] * shape[1], -1)  # a view: one row per token
  specials = np.asarray(SPECIALS[size], np.uint64).astype(bits.dtype)
  n = min(len(specials), max(1, rows.shape[1] // 2))
  for r in range(rows.shape[0]):
    rows[r, :n] = np.roll(specials, -r)[:n]
  return bits.view(dtype)


@functools.cache
def _raw_program(device: jax.Device):
  """(arrays of any memory kind) -> each array bitcast to unsigned ints on the device: the
  whole array crosses (a copy of its own, no gather / scatter of the paths under test)."""
  sharding = make_single_device_sharding(device, memory_kind=DEVICE)

  def raw(arrays):
    return tuple(lax.bitcast_convert_type(jax.device_put(a, sharding),
                                          jnp.dtype(f"uint{8 * a.dtype.itemsize}"))
                 for a in arrays)

  return jax.jit(raw)


def _raw_arrays(pool: KVPool) -> list[np.ndarray]:
  """Each array of `pool` as bytes, uint8 [num_blocks, bytes of one block]."""
  arrays = jax.device_get(_raw_program(pool.device)(pool.arrays()))
  return [np.ascontiguousarray(a).view(np.uint8).reshape(pool.num_blocks, -1)
          for a in arrays]


def _raw(pool: KVPool) -> np.ndarray:
  """uint8 [num_blocks, block bytes]: every block's bytes over all arrays, in `arrays()`
  order (the third tier's payload layout, HostPoolIO)."""
  return np.concatenate(_raw_arrays(pool), axis=1)


@functools.cache
def _fill_program(sharding):
  def fill(arrays, ids, blocks):
    return tuple(a.at[ids].set(b) for a, b in zip(arrays, blocks))

  return jax.jit(fill, donate_argnums=(0,), out_shardings=sharding)


def _fill(pool: KVPool, ids, rng) -> np.ndarray:
  """Random bits into device blocks `ids` (a jitted donated update); returns their bytes
  as `_raw` lays them out, after checking the pool holds exactly them."""
  ids = np.asarray(ids, np.int32)
  blocks = [_random_bits(rng, (len(ids), *a.shape[1:]), a.dtype) for a in pool.arrays()]
  arrays = pool.arrays()
  pool.set_arrays(_fill_program(tuple(a.sharding for a in arrays))(arrays, ids, tuple(blocks)))
  want = np.concatenate([b.view(np.uint8).reshape(len(ids), -1) for b in blocks], axis=1)
  np.testing.assert_array_equal(_raw(pool)[ids], want)  # the fill itself is bit exact
  return want


def _assert_specials_present(raw_arrays, pool):
  """The data holds what must survive: per float array, NaN, inf and subnormal patterns."""
  for raw, a in zip(raw_arrays, pool.arrays()):
    if np.dtype(a.dtype).itemsize == 1:
      continue
    values = raw.view(np.float32 if a.dtype.itemsize == 4 else jnp.bfloat16).astype(np.float32)
    assert np.isnan(values).any() and np.isinf(values).any()
    tiny = np.finfo(np.float32).tiny
    assert ((values != 0) & (np.abs(values) < tiny)).any()


def _pools(spec, num_device=NUM_DEVICE_BLOCKS, num_host=NUM_HOST_BLOCKS_POOL):
  return KVPool(spec, num_device, DEVICE), KVPool(spec, num_host, PINNED_HOST)


# --- swap ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
@PATHS
def test_swap_out_then_in_is_bit_exact(kind, one_memory, host_copy, rng):
  device_pool, host_pool = _pools(_spec(kind))
  engine = TransferEngine(device_pool, host_pool, one_memory=one_memory, host_copy=host_copy)
  usable = np.arange(1, NUM_DEVICE_BLOCKS)
  _fill(device_pool, usable, rng)
  before = _raw(device_pool)
  _assert_specials_present(_raw_arrays(device_pool), device_pool)

  src = rng.choice(usable, size=6, replace=False).astype(np.int32)
  host_ids = rng.choice(np.arange(1, NUM_HOST_BLOCKS_POOL), size=6, replace=False)
  engine.swap_out(src, host_ids)
  engine.wait()
  host = _raw(host_pool)
  np.testing.assert_array_equal(host[host_ids], before[src])
  others = np.setdiff1d(np.arange(NUM_HOST_BLOCKS_POOL), host_ids)
  assert not host[others].any()  # untouched (the null block included)

  perm = rng.permutation(6)
  dst = rng.choice(np.setdiff1d(usable, src), size=6, replace=False).astype(np.int32)
  engine.swap_in(host_ids[perm], dst)
  engine.wait()
  after = _raw(device_pool)
  np.testing.assert_array_equal(after[dst], before[src[perm]])
  others = np.setdiff1d(np.arange(NUM_DEVICE_BLOCKS), dst)
  np.testing.assert_array_equal(after[others], before[others])
  np.testing.assert_array_equal(_raw(host_pool), host)  # a swap-in reads only


# --- the third tier ------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(KINDS))
@PATHS
def test_third_tier_store_load_then_swap_in_is_bit_exact(kind, one_memory, host_copy, rng,
                                                          tmp_path):
  spec = _spec(kind)
  device_pool, host_pool = _pools(spec)
  engine = TransferEngine(device_pool, host_pool, one_memory=one_memory, host_copy=host_copy)
  usable = np.arange(1, NUM_DEVICE_BLOCKS)
  _fill(device_pool, usable, rng)
  before = _raw(device_pool)
  src = np.array([7, 2, 13, 4, 11], np.int32)
  stored_ids = np.array([3, 9, 1, 20, 15], np.int32)
  engine.swap_out(src, stored_ids)
  engine.wait()

  io = HostPoolIO(host_pool, one_memory=one_memory)
  assert io.block_nbytes == spec.bytes_per_block == before.shape[1]
  np.testing.assert_array_equal(io.read(stored_ids), before[src])  # the tier's payloads
  namespace = Namespace("round-trips", kind, spec.block_size, io.layout(), "tp0of1",
                        io.block_nbytes)
  backend = DiskBackend(tmp_path, 64 * payload.stored_nbytes(io.block_nbytes), namespace,
                        min_free_bytes=0)
  keys = chain_keys(range(spec.block_size * len(src)), spec.block_size, namespace)
  with KVTier(backend, io) as tier:
    tier.submit_store(keys, stored_ids)
    (job,) = wait_finished(tier, 1)
    assert job.kind == "store" and job.ok
    loaded_ids = np.array([22, 5, 17, 8, 12], np.int32)
    host_before = _raw(host_pool)
    tier.submit_load(keys, loaded_ids)
    (job,) = wait_finished(tier, 1)  # finished() wrote the rows (HostPoolIO.write)
    assert job.kind == "load" and job.ok
  host = _raw(host_pool)
  np.testing.assert_array_equal(host[loaded_ids], before[src])
  others = np.setdiff1d(np.arange(NUM_HOST_BLOCKS_POOL), loaded_ids)
  np.testing.assert_array_equal(host[others], host_before[others])

  dst = np.array([1, 3, 5, 6, 8], np.int32)
  engine.swap_in(loaded_ids, dst)
  engine.wait()
  after = _raw(device_pool)
  np.testing.assert_array_equal(after[dst], before[src])
  others = np.setdiff1d(np.arange(NUM_DEVICE_BLOCKS), dst)
  np.testing.assert_array_equal(after[others], before[others])


# --- HiSparse loads ------------------------------------------------------------------


def _filled_host_pool(spec, rng, num_host=NUM_HOST_BLOCKS_POOL):
  """Pools whose every usable host block holds random bits (filled on the device and
  swapped out, checked), the device blocks refilled with other bits. Returns the pools and
  the host and device pools' bytes (as `_raw_arrays`: one entry per array)."""
  device_pool, host_pool = _pools(spec, num_host=num_host)
  engine = TransferEngine(device_pool, host_pool)
  want = np.zeros((num_host, spec.bytes_per_block), np.uint8)
  chunk = NUM_DEVICE_BLOCKS - 1
  for start in range(1, num_host, chunk):
    ids = np.arange(start, min(start + chunk, num_host))
    want[ids] = _fill(device_pool, ids - start + 1, rng)
    engine.swap_out(ids - start + 1, ids)
  engine.wait()
  _fill(device_pool, np.arange(1, NUM_DEVICE_BLOCKS), rng)
  host = _raw_arrays(host_pool)
  np.testing.assert_array_equal(np.concatenate(host, axis=1), want)
  return device_pool, host_pool, host, _raw_arrays(device_pool)


@functools.cache
def _load_program(device_sharding, host_sharding, one_memory, host_copy):
  return jax.jit(functools.partial(resolver.load_blocks, device_sharding=device_sharding,
                                   host_sharding=host_sharding, one_memory=one_memory,
                                   host_copy=host_copy),
                 donate_argnums=(1,))


@pytest.mark.parametrize("kind", sorted(KINDS))
@PATHS
def test_hisparse_load_blocks_is_bit_exact(kind, one_memory, host_copy, rng):
  spec = _spec(kind)
  device_pool, host_pool, host, before = _filled_host_pool(spec, rng)
  load = _load_program(device_pool.sharding, host_pool.sharding, one_memory, host_copy)
  # As the step passes them: one layer's k, v (and scales), per layer.
  num_kinds = len(device_pool.arrays()) // spec.num_layers
  host_ids = np.array([23, 5, 17, 9, 0, 0], np.int32)
  device_ids = np.array([3, 9, 14, 2, NUM_DEVICE_BLOCKS, 99], np.int32)  # last 2: padding
  for layer in range(spec.num_layers):
    which = [j * spec.num_layers + layer for j in range(num_kinds)]
    arrays = list(device_pool.arrays())
    new, moved = load(tuple(host_pool.arrays()[j] for j in which),
                      tuple(arrays[j] for j in which), jnp.asarray(host_ids),
                      jnp.asarray(device_ids))
    assert int(moved) >= 4
    for j, a in zip(which, new):
      arrays[j] = a
    device_pool.set_arrays(tuple(arrays))
  after = _raw_arrays(device_pool)
  untouched = np.setdiff1d(np.arange(NUM_DEVICE_BLOCKS), device_ids[:4])
  for j in range(len(after)):  # every array: k, v and an 8-bit cache's scales
    np.testing.assert_array_equal(after[j][device_ids[:4]], host[j][host_ids[:4]])
    np.testing.assert_array_equal(after[j][untouched], before[j][untouched])
  np.testing.assert_array_equal(np.concatenate(_raw_arrays(host_pool), axis=1),
                                np.concatenate(host, axis=1))


@functools.cache
def _token_load_program(device_sharding, host_sharding, one_memory, host_copy):
  return jax.jit(functools.partial(resolver.load_tokens, device_sharding=device_sharding,
                                   host_sharding=host_sharding, one_memory=one_memory,
                                   host_copy=host_copy),
                 donate_argnums=(1,))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # (DSA caches: no 8-bit)
@PATHS
def test_hisparse_load_tokens_of_dsa_pages_is_bit_exact(dtype, one_memory, host_copy, rng):
  spec = MLACacheSpec(num_layers=1, kv_lora_rank=16, rope_dim=8, index_head_dim=8,
                      index_layers=(0,), dtype=dtype, block_size=4)
  device_pool, host_pool, host, before = _filled_host_pool(spec, rng, num_host=20)
  load = _token_load_program(device_pool.sharding, host_pool.sharding, one_memory,
                             host_copy)
  bs = spec.block_size
  host_tokens = np.array([79, 4, 41, 42, 7, 60, 0, 0], np.int32)
  device_tokens = np.array([5, 63, 20, 33, 34, 4, 64, 1000], np.int32)  # last 2: padding
  pages, moved = load(host_pool.latent[0], device_pool.latent[0], jnp.asarray(host_tokens),
                      jnp.asarray(device_tokens))
  assert int(moved) >= 6
  device_pool.set_arrays((pages, *device_pool.index_k))
  rows = lambda raw: raw.reshape(raw.shape[0] * bs, -1)  # noqa: E731 (token rows)
  after = rows(_raw_arrays(device_pool)[0])
  np.testing.assert_array_equal(after[device_tokens[:6]], rows(host[0])[host_tokens[:6]])
  untouched = np.setdiff1d(np.arange(NUM_DEVICE_BLOCKS * bs), device_tokens[:6])
  np.testing.assert_array_equal(after[untouched], rows(before[0])[untouched])


# --- the engine ----------------------------------------------------------------------

# HiSparse engines on blocks of 4 tokens: six prompts of 17-20 tokens decoding 12 more
# (every table 8 blocks wide: on CPU each engine compiles one step program) on a pool of
# 11 usable blocks, which offloads sparse decoders (write-through, then their device copies
# dropped) and loads their selected blocks back into 4-block hot buffers.
ENGINE_BLOCK_SIZE, ENGINE_DEVICE_BLOCKS, ENGINE_HOST_BLOCKS = 4, 12, 64
SMALL = HiSparseConfig(top_k_tokens=16, hot_buffer_tokens=16, sink_tokens=8, local_tokens=8,
                       sparse_threshold_tokens=16, resident_sparse_min_tokens=0)
ENGINE_PROMPTS = random_prompts((20, 18, 19, 17, 20, 18), seed=1)
ENGINE_KINDS = {"float32": ("float32", "auto"), "bfloat16": ("bfloat16", "auto"),
                "int8": ("float32", "int8")}


def _hisparse_engine(kind: str) -> Engine:
  dtype, kv_cache_dtype = ENGINE_KINDS[kind]
  model = tiny_model()
  if dtype == "bfloat16":
    model = LlamaForCausalLM(model.config, dtype=jnp.bfloat16, seed=0)
  spec = KVCacheSpec.from_model_config(model.config, dtype, ENGINE_BLOCK_SIZE, kv_cache_dtype)
  fields = dict(max_num_seqs=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16)
  # The device budget of ENGINE_DEVICE_BLOCKS blocks beside HiSparse's reservation (the
  # key bounds of every device and host block, the hot-buffer state), whatever the kind.
  reserved = capacity.hisparse_capacity(spec, SMALL, num_device_blocks=ENGINE_DEVICE_BLOCKS,
                                        num_host_blocks=ENGINE_HOST_BLOCKS, **fields)
  device_bytes = (ENGINE_DEVICE_BLOCKS + 0.5) * spec.bytes_per_block + reserved.reserved_bytes
  # (The reference kernels: one step program per engine, the cheapest to compile; the
  # host loads inside it are resolver.load_blocks, whatever the kernels.)
  config = EngineConfig(block_size=ENGINE_BLOCK_SIZE, dtype=dtype,
                        kv_cache_dtype=kv_cache_dtype, device_kv_gib=device_bytes / GIB,
                        host_pool_gib=(ENGINE_HOST_BLOCKS + 0.5) * spec.bytes_per_block / GIB,
                        hisparse=SMALL, kernel_backend="reference", **fields)
  engine = Engine(config, model=model, model_config=model.config)
  assert engine.device_pool.num_blocks == ENGINE_DEVICE_BLOCKS
  assert engine.host_pool.num_blocks == ENGINE_HOST_BLOCKS
  return engine


class _Checks:
  """Wraps an engine's transfers so that each swap is checked bit for bit as it runs
  (sources read before the dispatch, destinations after it finished), and checks every
  hot-buffer slot against its host copy after each step. Counts what it checked; a bad
  swap is recorded in `mismatches` (an exception inside the engine's block moves would
  only fail that step's requests)."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self.blocks = {"d2h": 0, "h2d": 0}
    self.hot_slots = 0
    self.mismatches: list[str] = []
    transfer = engine.transfer
    swap_out, swap_in = transfer.swap_out, transfer.swap_in
    device_pool, host_pool = engine.device_pool, engine.host_pool

    def checked(direction, move, src_pool, dst_pool, src_ids, dst_ids):
      src_ids, dst_ids = np.asarray(src_ids), np.asarray(dst_ids)
      want = _raw(src_pool)[src_ids]
      dst_before = _raw(dst_pool)
      move(src_ids, dst_ids)
      transfer.wait()
      got = _raw(dst_pool)
      bad = np.flatnonzero((got[dst_ids] != want).any(axis=1))
      if bad.size:
        self.mismatches.append(f"{direction}: {src_pool.memory_kind} blocks "
                               f"{src_ids[bad].tolist()} -> {dst_pool.memory_kind} blocks "
                               f"{dst_ids[bad].tolist()} differ")
      others = np.setdiff1d(np.arange(dst_pool.num_blocks), dst_ids)
      changed = others[(got[others] != dst_before[others]).any(axis=1)]
      if changed.size:
        self.mismatches.append(f"{direction}: untouched {dst_pool.memory_kind} blocks "
                               f"{changed.tolist()} changed")
      self.blocks[direction] += len(dst_ids)

    transfer.swap_out = lambda d, h: checked("d2h", swap_out, device_pool, host_pool, d, h)
    transfer.swap_in = lambda h, d: checked("h2d", swap_in, host_pool, device_pool, h, d)
    step = engine.step

    def checking_step():
      outputs = step()
      self.check_hot_slots()  # (outside the engine: a mismatch raises here)
      return outputs

    engine.step = checking_step

  def check_hot_slots(self):
    """Slot s of an offloaded sequence's row holds logical block j (hot-buffer state of
    layer l): its device block equals the host copy of block j in layer l, every array."""
    engine, bm = self.engine, self.engine.block_manager
    seqs = [(s, row) for s, row in engine.hot_rows.rows.items()
            if s in bm and not bm.is_swapped(s) and bm.is_offloaded(s)]
    if not seqs:
      return
    engine.transfer.wait()
    slot_block = engine.runner.hot_state_arrays()[0]  # [layers, rows, slots]
    device, host = _raw_arrays(engine.device_pool), _raw_arrays(engine.host_pool)
    num_layers = engine.device_pool.spec.num_layers
    width = engine.runner.max_blocks_per_seq
    for seq_id, row in seqs:
      slots = bm.hot_slots(seq_id)
      host_table = bm.host_tables([seq_id], width)[0]
      for layer in range(num_layers):
        for s, device_id in enumerate(slots):
          logical = slot_block[layer, row, s]
          if logical < 0:
            continue
          host_id = host_table[logical]
          assert host_id != 0, (seq_id, layer, s, logical)
          for j in range(layer, len(device), num_layers):  # this layer's k, v (scales)
            np.testing.assert_array_equal(device[j][device_id], host[j][host_id],
                                          err_msg=f"{seq_id} layer {layer} slot {s}")
          self.hot_slots += 1


@pytest.mark.parametrize("kind", sorted(ENGINE_KINDS))
def test_engine_write_through_and_hot_buffer_loads_are_bit_exact(kind):
  engine = _hisparse_engine(kind)
  checks = _Checks(engine)
  params = SamplingParams(temperature=0.0, max_tokens=12)
  for i, prompt in enumerate(ENGINE_PROMPTS):
    engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling_params=params)
  outputs = run_engine(engine)
  assert checks.mismatches == []
  assert {o.outputs[0].finish_reason for o in outputs.values()} == {"length"}
  assert len(outputs) == len(ENGINE_PROMPTS)
  m = engine.metrics()
  # Not vacuous: blocks were written through, offloaded requests loaded blocks into their
  # hot buffers, and the slots holding them were checked.
  assert m["hisparse_offloads_total"] > 0 and m["hisparse_hot_buffer_loads_total"] > 0
  assert checks.blocks["d2h"] > 20 and checks.hot_slots > 50, (checks.blocks, checks.hot_slots)

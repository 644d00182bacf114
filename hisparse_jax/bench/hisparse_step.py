"""Rough CPU indicator: select + resolve + load (+ attend) in one jit vs dense attention.

Batch 8, 64k-token contexts (4096 blocks of 16), top_k 1024 tokens, synthetic data, one
layer. Prints a table and writes JSON (path: argv[1], default results/hisparse_step_cpu.json).
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernels_pallas  # noqa: E402
from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, KVCacheSpec, KVPool  # noqa: E402
from hisparse_jax.sparse import (
  indexer,
  resolver,  # noqa: E402
)
from hisparse_jax.sparse.config import HiSparseConfig  # noqa: E402

BATCH, CONTEXT, BS, TOP_K = 8, 65536, 16, 1024
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 64
REPEATS = int(os.environ.get("REPEATS", "5"))


def timed(fn, *args):
  out = fn(*args)
  jax.block_until_ready(out)  # compile + warm-up
  times = []
  for _ in range(REPEATS):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3, out


def main():
  config = HiSparseConfig(top_k_tokens=TOP_K, sink_tokens=BS, local_tokens=BS)
  blocks = config.blocks(BS)
  max_blocks = CONTEXT // BS
  spec = KVCacheSpec(num_layers=1, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                     dtype="float32", block_size=BS)
  rng = np.random.default_rng(0)
  num_pool_blocks = 1 + BATCH * max_blocks
  shape = (num_pool_blocks, BS, NUM_KV_HEADS, HEAD_DIM)
  # Dense: every block of every sequence on the device.
  dense_k = jnp.asarray(rng.standard_normal(shape, np.float32))
  dense_v = jnp.asarray(rng.standard_normal(shape, np.float32))
  tables = (1 + np.arange(BATCH)[:, None] * max_blocks + np.arange(max_blocks)).astype(np.int32)
  kv_lens = np.full(BATCH, CONTEXT - 5, np.int32)  # newest block partly filled
  q = jnp.asarray(rng.standard_normal((BATCH, NUM_Q_HEADS, HEAD_DIM), np.float32))
  dense = jax.jit(kernels_pallas.paged_attention_reference)
  dense_ms, _ = timed(dense, q, dense_k, dense_v, jnp.asarray(tables), jnp.asarray(kv_lens))

  # Sparse: full KV in the host pool; device: sink + newest block resident, hot slots.
  host_pool = KVPool(spec, num_pool_blocks, PINNED_HOST)
  to_host = jax.jit(lambda x: jax.device_put(x, host_pool.sharding))
  host_arrays = (to_host(dense_k), to_host(dense_v))
  num_slots = blocks.hot_buffer_blocks
  num_device_blocks = 1 + 2 * BATCH + BATCH * num_slots
  device_pool = KVPool(spec, num_device_blocks, DEVICE)
  resident = np.zeros((BATCH, max_blocks), np.int32)
  resident[:, 0] = 1 + np.arange(BATCH)
  resident[:, -1] = 1 + BATCH + np.arange(BATCH)
  slot_device = (1 + 2 * BATCH + np.arange(BATCH * num_slots)).reshape(BATCH, num_slots)
  k_np = np.asarray(dense_k)
  bounds = jnp.asarray(np.stack([k_np[tables].min(2), k_np[tables].max(2)], axis=2))
  del k_np

  def sparse_step(q, state, host_arrays, device_arrays, stage):
    sel = indexer.select(q, bounds, jnp.asarray(kv_lens), blocks, config.selection)
    if stage == "select":
      return sel.logical_ids, state, device_arrays, sel.num_selected * 0
    res = resolver.resolve(sel.logical_ids, sel.valid, state, jnp.asarray(resident),
                           jnp.asarray(slot_device, jnp.int32), jnp.asarray(tables), 1,
                           num_device_blocks=num_device_blocks, thrash_window_steps=8)
    if stage == "resolve":
      return res.block_tables, res.state, device_arrays, res.counts.misses
    device_arrays, _ = resolver.load_blocks(
        host_arrays, device_arrays, res.load_host_ids, res.load_device_ids,
        device_sharding=device_pool.sharding, host_sharding=host_pool.sharding)
    if stage == "load":
      return res.block_tables, res.state, device_arrays, res.counts.misses
    out = kernels_pallas.paged_attention_reference(q, *device_arrays, res.block_tables,
                                                   sel.kv_lens)
    return out, res.state, device_arrays, res.counts.misses

  step = jax.jit(sparse_step, static_argnums=(4,))
  cold = resolver.HotBufferState.create(BATCH, num_slots, max_blocks)
  rows = []
  names = {"select": "select", "resolve": "select+resolve", "load": "select+resolve+load",
           "attend": "select+resolve+load+attend"}
  for stage, what in names.items():
    # Cold: fresh hot buffers, every non-resident selected block is a host load.
    ms_cold, out = timed(step, q, cold, host_arrays, device_pool.arrays(), stage)
    misses_cold = int(out[3].sum())
    # Warm: the state after one step with the same query: all hot hits, no load.
    warm = out[1]
    ms_warm, out = timed(step, q, warm, host_arrays, out[2], stage)
    rows.append({"what": what, "hot_buffer": "cold", "ms": ms_cold, "loads": misses_cold})
    rows.append({"what": what, "hot_buffer": "warm", "ms": ms_warm, "loads": int(out[3].sum())})
  rows.append({"what": "dense paged_attention_reference, all blocks", "hot_buffer": "-",
               "ms": dense_ms, "loads": 0})
  print(f"batch {BATCH}, context {CONTEXT} tokens ({max_blocks} blocks of {BS}), top_k "
        f"{TOP_K} tokens ({blocks.top_k_blocks} blocks), {NUM_Q_HEADS}q/{NUM_KV_HEADS}kv "
        f"heads x {HEAD_DIM}, float32, 1 layer, {jax.devices()[0].platform}, jax "
        f"{jax.__version__}, median of {REPEATS}")
  print(f"{'step':48s} {'hot buffer':>10s} {'ms':>9s} {'host loads':>10s}")
  for r in rows:
    print(f"{r['what']:48s} {r['hot_buffer']:>10s} {r['ms']:9.2f} {r['loads']:10d}")
  path = sys.argv[1] if len(sys.argv) > 1 else "results/hisparse_step_cpu.json"
  with open(path, "w") as f:
    json.dump({"batch": BATCH, "context_tokens": CONTEXT, "block_size": BS,
               "top_k_tokens": TOP_K, "num_q_heads": NUM_Q_HEADS,
               "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "jax": jax.__version__,
               "platform": jax.devices()[0].platform, "load_avg": os.getloadavg(),
               "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()

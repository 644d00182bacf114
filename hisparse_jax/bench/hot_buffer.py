"""Suite `hisparse_hot_buffer`: the HiSparse decode step at hot-buffer hit rates 0-100%.

The engine's own jitted step (`ModelRunner.build_batch` + `dispatch`/`collect`) with the
KV truly tiered, as the engine leaves an offloaded request:

    pinned_host pool  every block of every sequence (64k tokens each)
    device pool       per sequence: its sink and local blocks (resident, the newest
                      included) and a hot buffer of `hot_buffer_blocks` slots
    step              select top-k over every block's key bounds -> resolve (resident /
                      hot-buffer hit / miss) -> load the misses from the host pool into
                      hot-buffer slots -> attend the selected blocks

The hit rate is set through the hot-buffer state: one step from an empty hot buffer
leaves every selected block in it (the same batch selects the same blocks again); each
rate then starts its step from that warm state with a fraction 1 - rate of each row's
filled slots emptied, chosen at random. At rate 0 every selected block that is not
resident is a miss, at rate 1 none is.

Per rate (JSON `rates`): `step_ms` (median, rates interleaved), `missed_blocks_per_step`
(missed block-layers: the step's own counts), `h2d_bytes_per_step` (what its host loads
moved, from the blocks it reports moved, x `block_bytes`: the K and V bytes of one block
of one layer), `h2d_over_missed` (1.0: exactly the misses cross). The goal: h2d bytes =
missed blocks x block bytes at every rate (within the load bucket on GPU), 0 at 100%,
and `step_ms` at 100% <= 0.6x `step_ms` at 0%.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from hisparse_jax.bench import common
from hisparse_jax.bench import tiered as tiered_setup
from hisparse_jax.bench.decode import Size as ModelSize
from hisparse_jax.bench.decode import model_config
from hisparse_jax.engine.runner import COUNT_FIELDS, bounds_bytes_per_block
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec
from hisparse_jax.kv_cache.transfer import hop_free
from hisparse_jax.sparse import resolver
from hisparse_jax.sparse.config import HiSparseConfig
from models.llama import LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class Size:
  batch: int
  context: int  # tokens in each sequence's cache after the step
  top_k_tokens: int
  hot_buffer_tokens: int
  sink_tokens: int
  local_tokens: int
  rates: tuple[float, ...]
  reps: int
  model: ModelSize  # the synthetic model of decode_sparse_vs_dense


SIZES = {
    "full": Size(batch=8, context=65536, top_k_tokens=2048, hot_buffer_tokens=4096,
                 sink_tokens=64, local_tokens=256, rates=(0.0, 0.5, 0.9, 1.0), reps=7,
                 model=ModelSize((65536,), batch=8, top_k_tokens=2048, sink_tokens=64,
                                 local_tokens=256, reps=7, num_layers=4, hidden_size=256,
                                 intermediate_size=768, num_q_heads=8, num_kv_heads=2,
                                 head_dim=64, vocab_size=2048)),
    "smoke": Size(batch=2, context=1024, top_k_tokens=128, hot_buffer_tokens=256,
                  sink_tokens=16, local_tokens=32, rates=(0.0, 0.5, 1.0), reps=1,
                  model=ModelSize((1024,), batch=2, top_k_tokens=128, sink_tokens=16,
                                  local_tokens=32, reps=1, num_layers=2, hidden_size=64,
                                  intermediate_size=128, num_q_heads=4, num_kv_heads=2,
                                  head_dim=16, vocab_size=256)),
}


def state_at_rate(warm: tuple[np.ndarray, ...], rate: float, rng: np.random.Generator
                  ) -> tuple[np.ndarray, ...]:
  """The warm hot-buffer state with a fraction 1 - `rate` of each row's filled slots
  (every layer) emptied."""
  slot_block, last_used, evicted_at = (a.copy() for a in warm)
  for layer in range(slot_block.shape[0]):
    for row in range(slot_block.shape[1]):
      filled = np.flatnonzero(slot_block[layer, row] >= 0)
      drop = rng.choice(filled, round(len(filled) * (1 - rate)), replace=False)
      slot_block[layer, row, drop] = -1
      last_used[layer, row, drop] = resolver.NEVER
  return slot_block, last_used, evicted_at


def _step(tiered: tiered_setup.TieredBatch, state: tuple[np.ndarray, ...]):
  """One step from hot-buffer state `state`: (seconds, StepResult)."""
  runner = tiered.runner
  runner.set_hot_state(state)
  jax.block_until_ready(runner.hot_state)
  start = time.perf_counter()
  result = runner.collect(runner.dispatch(tiered.batch))
  return time.perf_counter() - start, result


def run(size_name: str = "full", block_size: int = 16, seed: int = 0) -> dict:
  size = SIZES[size_name]
  config = model_config(size.model)
  model = LlamaForCausalLM(config, seed=seed)
  spec = KVCacheSpec.from_model_config(config, size.model.dtype, block_size)
  hisparse = HiSparseConfig(top_k_tokens=size.top_k_tokens,
                            hot_buffer_tokens=size.hot_buffer_tokens,
                            sink_tokens=size.sink_tokens, local_tokens=size.local_tokens)
  tiered = tiered_setup.tiered_decode(model, spec, hisparse, size.batch, size.context, seed)
  # Warm: one step from empty hot buffers leaves every selected block in them.
  _, first = _step(tiered, tiered.cold_state)
  _step(tiered, tiered.cold_state)  # compiled and warm caches before timing
  warm = tiered.runner.hot_state_arrays()
  rng = np.random.default_rng(seed)
  states = {rate: state_at_rate(warm, rate, rng) for rate in size.rates}
  seconds = {rate: [] for rate in size.rates}
  results = {}
  for rep in range(size.reps):  # rates interleaved, the order rotating
    order = list(size.rates[rep % len(size.rates):] + size.rates[:rep % len(size.rates)])
    for rate in order:
      s, results[rate] = _step(tiered, states[rate])
      seconds[rate].append(s)
  host = COUNT_FIELDS.index("host")
  hot = COUNT_FIELDS.index("hot")
  rows = []
  for rate in size.rates:
    result = results[rate]
    missed = int(result.counts[:, :, host].sum())
    hits = int(result.counts[:, :, hot].sum())
    moved = result.loaded_block_layers
    rows.append({
        "hit_rate": rate, "step_ms": common.median(seconds[rate]) * 1e3,
        "missed_blocks_per_step": missed, "hot_hits_per_step": hits,
        "measured_hit_rate": hits / max(1, hits + missed),
        "loaded_blocks_per_step": moved, "block_bytes": tiered.block_bytes,
        "h2d_bytes_per_step": moved * tiered.block_bytes,
        "h2d_over_missed": moved / missed if missed else (0.0 if moved == 0 else math.inf)})
  by_rate = {r["hit_rate"]: r for r in rows}
  blocks = hisparse.blocks(block_size)
  # What a purely memory-bound step moves (all layers): the indexer reads every block's
  # key bounds, attention reads the selected blocks, each loaded block is read from the
  # host pool and written into the hot buffer. On one memory (CPU) a miss costs about
  # what a hit costs to read; over PCIe it costs ~HBM/PCIe bandwidth times more.
  num_blocks = math.ceil(size.context / block_size)
  fixed = size.batch * spec.num_layers * (
      num_blocks * bounds_bytes_per_block(spec, hisparse.bounds_dtype) // spec.num_layers
      + blocks.top_k_blocks * tiered.block_bytes)
  model = {r["hit_rate"]: fixed + 2 * r["h2d_bytes_per_step"] for r in rows}
  return {
      "batch": size.batch, "context": size.context, "block_size": block_size,
      "top_k_tokens": size.top_k_tokens, "top_k_blocks": blocks.top_k_blocks,
      "hot_buffer_blocks": blocks.hot_buffer_blocks,
      "resident_blocks_per_seq": blocks.sink_blocks + blocks.local_blocks,
      "num_layers": spec.num_layers, "kv_bytes_per_token": spec.bytes_per_token,
      "host_pool_bytes": tiered.runner.host_pool.nbytes,
      "device_pool_bytes": tiered.runner.pool.nbytes,
      "loads": "block copies (one memory)" if hop_free(tiered.runner.pool.sharding)
               else "host gather in load buckets",
      "cold_step_misses": int(first.counts[:, :, host].sum()),
      "kernel_backend": tiered.runner.ops.backend, "reps": size.reps, "rates": rows,
      "step_100_over_0": by_rate[1.0]["step_ms"] / by_rate[0.0]["step_ms"],
      "bytes_model_100_over_0": model[1.0] / model[0.0],
      "bytes_model": "indexer bounds + selected blocks + 2 x h2d bytes, all layers: the "
                     "ratio a memory-bound step on one memory could reach",
      "goal": "h2d bytes = missed blocks x block bytes at every rate (0 at 100%); "
              "step_ms at 100% hits <= 0.6x step_ms at 0%",
      "goal_met": (by_rate[1.0]["h2d_bytes_per_step"] == 0
                   and all(r["missed_blocks_per_step"] <= r["loaded_blocks_per_step"]
                           <= max(2 * r["missed_blocks_per_step"], 8 * spec.num_layers)
                           for r in rows)
                   and by_rate[1.0]["step_ms"] <= 0.6 * by_rate[0.0]["step_ms"]),
  }


def format_table(result: dict) -> str:
  rows = [(f"{100 * r['hit_rate']:.0f}%", f"{100 * r['measured_hit_rate']:.1f}%",
           r["step_ms"], r["missed_blocks_per_step"], r["loaded_blocks_per_step"],
           f"{r['h2d_bytes_per_step'] / 2**20:.2f}", r["h2d_over_missed"])
          for r in result["rates"]]
  table = common.format_table(["hit rate", "measured", "step ms", "missed blk-layers",
                               "loaded blk-layers", "h2d MiB", "loaded/missed"], rows)
  return (f"batch {result['batch']} x {result['context']:,} tokens, top-k "
          f"{result['top_k_blocks']} blocks, hot buffer {result['hot_buffer_blocks']} "
          f"blocks, {result['rates'][0]['block_bytes']:,} bytes per block and layer; loads: "
          f"{result['loads']}\n{table}\nstep at 100% hits / 0% hits: "
          f"{result['step_100_over_0']:.2f} (goal <= 0.6; a memory-bound step on one "
          f"memory: {result['bytes_model_100_over_0']:.2f})")

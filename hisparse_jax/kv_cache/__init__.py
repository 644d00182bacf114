"""The KV cache over memory tiers: pools by memory kind, capacity, transfers, block
bookkeeping.

  kv_pool.py             KVCacheSpec (bytes per block); KVPool: per-layer K/V block arrays
                         of one memory kind ("device", "pinned_host"); NULL_BLOCK_ID
  capacity.py            plan_capacity (block counts of both tiers from the budgets, bad
                         budgets refused naming the flag), CapacityReport (measured on the
                         allocated arrays) and its log lines
  transfer.py            TransferEngine: one batched jitted call per direction (h2d, d2h)
  block_pool.py          one tier's block ids: ref counts, LRU free queue, prefix hashes
  kv_hash.py             chained hashes of full blocks
  seq_state.py           SeqState: one sequence's blocks (+ the numpy mirror of its table)
  block_manager.py       BlockManager: every sequence's block tables over both tiers; owns
    prefix_cache.py        PrefixCache: lookups in both tiers, caching full blocks
    tier_mover.py          TierMover: swap-out / swap-in plans, host pins, the step contract
    hisparse_placement.py  HiSparsePlacement: write-through, offload, hot-buffer slots
  block_invariants.py    the BlockManager's invariants, checked (tests)
  block_plans.py         the plans the BlockManager returns (SwapOutPlan, SwapInPlan, ...)
  tiers/                 the third tier: blocks on disk or a Redis-protocol server (KVTier)

May import: distributed, observability, kernels_pallas. Never sparse, engine,
entrypoints or bench (tests/test_layering.py): a serving stack can embed it alone.

Public surface for embedding (examples/embed_decode_loop.py drives a decode loop with it):

  KVCacheSpec, KVPool, NULL_BLOCK_ID      the pools of each memory kind
  plan_capacity, CapacityPlan, CapacityReport   budgets -> pools -> the capacity lines
  BlockManager, SwapOutPlan, SwapInPlan   block tables, prefix cache, swap plans
  TransferEngine                          the batched moves that carry out the plans
"""

from hisparse_jax._lazy import lazy_exports

_EXPORTS = {
    "KVCacheSpec": "hisparse_jax.kv_cache.kv_pool",
    "KVPool": "hisparse_jax.kv_cache.kv_pool",
    "NULL_BLOCK_ID": "hisparse_jax.kv_cache.kv_pool",
    "plan_capacity": "hisparse_jax.kv_cache.capacity",
    "CapacityPlan": "hisparse_jax.kv_cache.capacity",
    "CapacityReport": "hisparse_jax.kv_cache.capacity",
    "BlockManager": "hisparse_jax.kv_cache.block_manager",
    "SwapOutPlan": "hisparse_jax.kv_cache.block_plans",
    "SwapInPlan": "hisparse_jax.kv_cache.block_plans",
    "TransferEngine": "hisparse_jax.kv_cache.transfer",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

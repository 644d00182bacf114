"""The third KV tier: blocks kept beyond the host pool, on disk or on a Redis-protocol
server, keyed by prefix, shared across restarts (disk) and engines (remote).

  keys.py      Namespace (what makes stored blocks one engine's), chain_keys (SHA-256
               chained over full blocks' token ids, seeded by a request's cache_salt)
  payload.py   the stored form of a block: header, payload, CRC-32; verified on every read
  base.py      BlockIO (the engine's host pool), Backend, LookupResult, TierJob, TierError
  tier.py      KVTier: a backend behind a worker thread; lookup, exists, submit_store,
               submit_load, finished, stats, close
  disk.py      DiskBackend: a file per block, byte cap with LRU eviction, free-space floor
  remote.py    RemoteBackend: a Redis/Valkey server (the `redis` client, imported lazily)
  testing.py   ArrayBlockIO (a numpy host pool), ThrottledBackend (a tier of known speed)

Public names: Namespace, chain_keys, KVTier, LookupResult, TierJob, TierError, BlockIO,
Backend, DiskBackend, RemoteBackend.

Usage:

  tier = KVTier(DiskBackend("/cache", 64 << 30, namespace), block_io)  # TierError: log, skip
  keys = chain_keys(token_ids, namespace.block_size, namespace)
  num_stored = tier.exists(keys)                  # longest stored prefix
  tier.submit_load(keys[:num_stored], host_ids)   # ... later, each step:
  for job in tier.finished(): ...                 # loaded rows are in the pool now
"""

from hisparse_jax._lazy import lazy_exports

_EXPORTS = {
  "Namespace": "hisparse_jax.kv_cache.tiers.keys",
  "chain_keys": "hisparse_jax.kv_cache.tiers.keys",
  "KVTier": "hisparse_jax.kv_cache.tiers.tier",
  "LookupResult": "hisparse_jax.kv_cache.tiers.base",
  "TierJob": "hisparse_jax.kv_cache.tiers.base",
  "TierError": "hisparse_jax.kv_cache.tiers.base",
  "BlockIO": "hisparse_jax.kv_cache.tiers.base",
  "Backend": "hisparse_jax.kv_cache.tiers.base",
  "DiskBackend": "hisparse_jax.kv_cache.tiers.disk",
  "RemoteBackend": "hisparse_jax.kv_cache.tiers.remote",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

"""The HiSparse sparse path: top-k block selection over the tiered cache, inside the step.

  config.py      HiSparseConfig (top-k, hot buffer, sink / local, threshold, bounds dtype)
                 and HiSparseBlocks (the same in whole blocks)
  indexer.py     block scores from per-block key bounds (an upper bound of q.k), top-k
  resolver.py    each selected block -> a device block: resident / hot-buffer hit / host
                 miss loaded into an LRU hot slot (pure jnp, inside the jitted step)
  attention.py   attention of one layer in the step: write K/V (+ key bounds), dense rows
                 through the ragged kernel, sparse rows select -> resolve -> load -> attend
                 (`attend`, an AttnFn once its static arguments are bound); StepMetadata

May import: kv_cache, distributed, observability, kernels_pallas (and models' config
types). Never engine, entrypoints or bench: the engine drives this path, not the reverse.

Public surface for embedding (a serving stack's own loop calls these inside its jitted
step; examples/embed_decode_loop.py):

  attend, write_pages, page_views, StepMetadata, SparseStatic   (attention.py)
  select, Selection                                             (indexer.py)
  resolve, load_blocks, HotBufferState                          (resolver.py)
  HiSparseConfig                                                (config.py)
"""

from hisparse_jax._lazy import lazy_exports

_EXPORTS = {
    "attend": "hisparse_jax.sparse.attention",
    "write_pages": "hisparse_jax.sparse.attention",
    "page_views": "hisparse_jax.sparse.attention",
    "StepMetadata": "hisparse_jax.sparse.attention",
    "SparseStatic": "hisparse_jax.sparse.attention",
    "select": "hisparse_jax.sparse.indexer",
    "Selection": "hisparse_jax.sparse.indexer",
    "resolve": "hisparse_jax.sparse.resolver",
    "load_blocks": "hisparse_jax.sparse.resolver",
    "HotBufferState": "hisparse_jax.sparse.resolver",
    "HiSparseConfig": "hisparse_jax.sparse.config",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

"""hisparse_jax: LLM decoding in JAX with a KV cache tiered over device and pinned host memory.

Public API (imported on first use, so `import hisparse_jax` and the CLI's `--help` stay
fast; everything but `__version__` imports jax):

  LLM                    batch generation: LLM(...).generate(prompts, SamplingParams(...))
  Engine, EngineConfig   the lower-level engine: add_request / step / abort_request
  HiSparseConfig         top-k sparse decoding settings: LLM(hisparse=HiSparseConfig(...))
  SamplingParams         vLLM's: temperature (1.0), top_p, top_k, max_tokens, seed, stop,
                         stop_token_ids, output_kind (RequestOutputKind)
  RequestOutput          vLLM's: prompt, prompt_token_ids, outputs (CompletionOutput: text,
                         token_ids, finish_reason, stop_reason), finished, metrics
                         (RequestMetrics: timings, blocks per tier, preemptions)
  CapacityReport, plan_capacity, KVCacheSpec, KVPool   the KV memory tiers
  TransferEngine         batched block moves between the device and host pools
  MetricsRegistry        counters, gauges, histograms; JSON and Prometheus read-outs

The package is in rooms, each a subpackage whose `__init__` says what lives there and
what it may import (tests/test_layering.py holds them to it); from the bottom up:

  observability/   metrics registry, the engine's series, status line, library logging
  distributed/     the jax Mesh of tensor parallelism, shardings, multi-host start
  kv_cache/        KV pools by memory kind, capacity, transfers, the block manager
  sparse/          the HiSparse sparse path: config, indexer, resolver, attention
  engine/          the engine loop: requests, scheduler, model runner, the jitted step
  entrypoints/     LLM, AsyncEngine, the OpenAI server, the `hisparse-jax` CLI
  bench/           benchmark suites and the GPU check (measures all of the above)

Embedding the pieces in another JAX serving stack (no Engine): `hisparse_jax.kv_cache`
and `hisparse_jax.sparse` list their public surface; examples/embed_decode_loop.py is a
hand-written decode loop over them.
"""

from hisparse_jax._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "hisparse_jax.entrypoints.llm",
    "Engine": "hisparse_jax.engine.engine",
    "EngineConfig": "hisparse_jax.engine.config",
    "HiSparseConfig": "hisparse_jax.sparse.config",
    "SamplingParams": "hisparse_jax.engine.sampling",
    "RequestOutputKind": "hisparse_jax.engine.sampling",
    "RequestOutput": "hisparse_jax.engine.request",
    "CompletionOutput": "hisparse_jax.engine.request",
    "Logprob": "hisparse_jax.engine.request",
    "RequestMetrics": "hisparse_jax.engine.request",
    "CapacityReport": "hisparse_jax.kv_cache.capacity",
    "plan_capacity": "hisparse_jax.kv_cache.capacity",
    "KVCacheSpec": "hisparse_jax.kv_cache.kv_pool",
    "KVPool": "hisparse_jax.kv_cache.kv_pool",
    "TransferEngine": "hisparse_jax.kv_cache.transfer",
    "MetricsRegistry": "hisparse_jax.observability.metrics",
}
__all__ = [*_EXPORTS, "__version__"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

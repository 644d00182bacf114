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
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "hisparse_jax.entrypoints.llm",
    "Engine": "hisparse_jax.engine.engine",
    "EngineConfig": "hisparse_jax.engine.engine",
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


def __getattr__(name: str):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'hisparse_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # later lookups skip this function
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))

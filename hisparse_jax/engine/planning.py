"""How an engine of a config is planned before anything is allocated: the options a model
kind runs with (check_model_kind), what it must fit (check_model_fits), the settings left
to the engine (resolve_config: the prefill chunk), and the capacity plan of both KV pools
(plan_engine_capacity). `Engine` at load and `aot.AotBuild` (a GPU target's engine,
nothing allocated) plan through these same functions."""

from __future__ import annotations

import dataclasses

from hisparse_jax.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from hisparse_jax.kv_cache.capacity import (
  HiSparseCapacity,
  hisparse_capacity,
  plan_capacity,
  plan_capacity_reserving,
  streamed_device_blocks,
)
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec, num_usable_blocks

# Below this prefill chunk a hot buffer left to its default gives way (resolve_config):
# a 7.5k-token prompt in chunks of fewer tokens takes over 15 streamed steps.
MIN_AUTO_CHUNK_TOKENS = 512


def check_model_kind(config: EngineConfig, model_config, is_dsa: bool) -> EngineConfig:
  """The config a model of this kind runs with; ValueError naming the field for an option
  it does not support. DSA models (models.deepseek_v32): HiSparse only with their learned
  indexer (`HiSparseConfig.for_index_topk`), no tensor parallelism or 8-bit cache yet;
  llama-family models have no learned indexer."""
  hisparse = config.hisparse
  if not is_dsa and config.index_cache_dtype != "auto":
    raise ValueError(f"--index_cache_dtype={config.index_cache_dtype}: only DSA models "
                     f"(deepseek_v32, glm_moe_dsa) have an indexer-key cache; "
                     f"{model_config.model_type} has none: use auto")
  if not is_dsa:
    if hisparse is not None and hisparse.indexer == "lightning":
      raise ValueError(
          f"hisparse: indexer='lightning' needs a model with a learned (lightning) indexer "
          f"(DSA models: deepseek_v32, glm_moe_dsa); {model_config.model_type} has none: use "
          "indexer='block_bounds'")
    return config
  kind = model_config.model_type
  if config.tensor_parallel_size > 1:
    raise ValueError(f"--tensor_parallel_size={config.tensor_parallel_size}: DSA models "
                     f"({kind}) run on one device so far; use 1")
  if config.kv_cache_dtype != "auto":
    raise ValueError(f"--kv_cache_dtype={config.kv_cache_dtype}: 8-bit caches of DSA models "
                     f"({kind}: MLA latent + indexer keys) are not supported; use auto")
  if config.kernel_backend == "pallas_mgpu":  # the Mosaic GPU sparse MLA decode's limits
    rank, rope = model_config.kv_lora_rank, model_config.qk_rope_head_dim
    # (dtype "auto" is the checkpoint's: the kernel itself refuses a float32 one)
    if config.dtype == "float32" or rank % 64 or rope != 64:
      raise ValueError(
          f"kernel_backend=pallas_mgpu: the Mosaic GPU sparse MLA decode of DSA models "
          f"({kind}) needs dtype bfloat16, kv_lora_rank a multiple of 64 and "
          f"qk_rope_head_dim 64, got dtype {config.dtype}, kv_lora_rank {rank}, "
          f"qk_rope_head_dim {rope}; use auto or pallas (Triton)")
  if hisparse is not None:
    try:
      hisparse = hisparse.for_index_topk(model_config.index_topk, config.max_model_len)
    except ValueError as e:
      raise ValueError(f"--hisparse: {str(e).replace('HiSparseConfig.', '--')}") from None
    config = dataclasses.replace(config, hisparse=hisparse)
  return config


def check_model_fits(config: EngineConfig, model_config) -> None:
  """ValueError naming the field when `config` asks more of the model than it has: a
  max_model_len past its positions, HiSparse over sliding-window attention."""
  max_positions = getattr(model_config, "max_position_embeddings", None)
  if max_positions is not None and config.max_model_len > max_positions:
    raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                     f"max_position_embeddings={max_positions}")
  if config.hisparse is not None and getattr(model_config, "sliding_window", None):
    raise ValueError("hisparse: models with sliding-window attention are not supported by "
                     "the sparse path; run without hisparse")


def hisparse_capacity_for(config: EngineConfig, spec: KVCacheSpec, num_device_blocks: int,
                          num_host_blocks: int, num_devices: int = 1) -> HiSparseCapacity:
  """The device bytes HiSparse holds beside pools of these block counts, for `config`
  (max_num_batched_tokens left to the engine: DEFAULT_MAX_NUM_BATCHED_TOKENS; the engine
  passes its resolved config)."""
  c = config
  chunk = c.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
  return hisparse_capacity(spec, c.hisparse, num_device_blocks=num_device_blocks,
                           num_host_blocks=num_host_blocks, max_num_seqs=c.max_num_seqs,
                           max_model_len=c.max_model_len, num_devices=num_devices,
                           max_num_batched_tokens=chunk if c.enable_chunked_prefill else None)


def plan_engine_capacity(config: EngineConfig, spec: KVCacheSpec, *, is_dsa: bool,
                         num_devices: int = 1, device=None, check_host_ram: bool = True,
                         chunk_is_smallest: bool = False):
  """The capacity plan an engine of `config` allocates (`Engine` at load; `aot` for a GPU
  target, with `device` a stand-in answering memory_stats()). With HiSparse the indexer's
  key bounds and the hot-buffer state come out of the device budget, beside the blocks
  they serve, and a prompt longer than the device pool streams through it (llama models;
  a DSA model's prompt must fit the device pool: its streamed prefill is not built)."""
  if config.max_num_batched_tokens is None:  # (left to the engine: decided as it does)
    config = resolve_config(config, spec, is_dsa=is_dsa, num_devices=num_devices,
                            device=device, check_host_ram=check_host_ram)
  plan_args = dict(max_model_len=config.max_model_len, host_pool_gib=config.host_pool_gib,
                   device_kv_gib=config.device_kv_gib, num_devices=num_devices, device=device,
                   check_host_ram=check_host_ram)
  if config.hisparse is None:
    return plan_capacity(spec, **plan_args)
  if config.enable_chunked_prefill and not is_dsa:
    plan_args["streamed_device_blocks"] = streamed_device_blocks(
        config.hisparse, spec.block_size, config.max_num_batched_tokens)
    plan_args["chunk_is_smallest"] = chunk_is_smallest
  if not is_dsa:  # (a refusal names --bounds_dtype=int8 where the bounds are wider)
    plan_args["bounds_dtype"] = config.hisparse.bounds_dtype
  return plan_capacity_reserving(
      spec, lambda d, h: hisparse_capacity_for(config, spec, d, h, num_devices).reserved_bytes,
      **plan_args)


def resolve_config(config: EngineConfig, spec: KVCacheSpec, *, is_dsa: bool,
                   num_devices: int = 1, device=None,
                   check_host_ram: bool = True) -> EngineConfig:
  """`config` with what it leaves to the engine decided: max_num_batched_tokens None is
  DEFAULT_MAX_NUM_BATCHED_TOKENS (max_model_len where larger, without chunked prefill).
  With HiSparse (llama models), where the device budget cannot stream a prompt longer
  than the device pool through chunks of that size (hot buffer + chunk + 2 blocks), the
  chunk is the largest the budget streams, in whole blocks: a prompt as long as the host
  pool takes then runs at the flags' device budget instead of being refused. Where that
  chunk would be below MIN_AUTO_CHUNK_TOKENS (or none), a hot buffer left to its default
  (2 x top-k) is lowered to the top-k (a default sparse threshold with it) when that
  gives a larger chunk; where not even one block's chunk streams, the plan refuses,
  naming the flags."""
  if config.max_num_batched_tokens is not None:
    return config
  if not config.enable_chunked_prefill:
    return dataclasses.replace(config, max_num_batched_tokens=max(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, config.max_model_len))
  chosen = dataclasses.replace(config, max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS)
  if config.hisparse is None or is_dsa:
    return chosen
  args = dict(is_dsa=is_dsa, num_devices=num_devices, device=device,
              check_host_ram=check_host_ram)
  try:
    plan_engine_capacity(chosen, spec, **args)
    return chosen
  except ValueError:
    pass
  chunk = _streamed_chunk(config, spec, args)
  hs = config.hisparse
  if ((chunk is None or chunk < MIN_AUTO_CHUNK_TOKENS) and "hot_buffer_tokens" in hs.defaulted
      and hs.hot_buffer_tokens > hs.top_k_tokens):
    # A hot buffer left to its default (2 x top-k) gives way to the prefill chunk, down to
    # the top-k it must hold; a sparse threshold left to its default follows it.
    lowered = dataclasses.replace(hs, hot_buffer_tokens=hs.top_k_tokens)
    if "sparse_threshold_tokens" in hs.defaulted:
      lowered = dataclasses.replace(lowered, sparse_threshold_tokens=hs.top_k_tokens)
    lowered_config = dataclasses.replace(config, hisparse=lowered)
    lowered_chunk = _streamed_chunk(lowered_config, spec, args)
    if lowered_chunk is not None and (chunk is None or lowered_chunk > chunk):
      config, chunk = lowered_config, lowered_chunk
  if chunk is None:  # refused, naming the flags: not even a one-block chunk streams
    plan_engine_capacity(dataclasses.replace(config, max_num_batched_tokens=spec.block_size),
                         spec, **args, chunk_is_smallest=True)
  return dataclasses.replace(config, max_num_batched_tokens=min(
      DEFAULT_MAX_NUM_BATCHED_TOKENS, chunk))


def _streamed_chunk(config: EngineConfig, spec: KVCacheSpec, args: dict) -> int | None:
  """The largest prefill chunk (tokens, whole blocks) the device budget streams a prompt
  longer than the device pool through beside the hot buffer (None: not even one block)."""
  smallest = dataclasses.replace(config, max_num_batched_tokens=spec.block_size)
  try:
    plan = plan_engine_capacity(smallest, spec, **args, chunk_is_smallest=True)
  except ValueError:
    return None
  hot = config.hisparse.blocks(spec.block_size).hot_buffer_blocks
  return (num_usable_blocks(plan.num_device_blocks) - hot - 2) * spec.block_size

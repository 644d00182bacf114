"""`hisparse-jax capacity`: load a model, allocate the KV pools, log their capacity.

Usage::

  hisparse-jax capacity [--model=DIR] [--dtype=float32] [--block_size=N]
      [--device_kv_gib=G] [--host_pool_gib=G] [--max_model_len=N]
      [--hisparse [--top_k_tokens=N --hot_buffer_tokens=N ...] --max_num_seqs=N]

Prints on stdout (the command's output) one capacity line per memory kind and the total,
the lines `hisparse_jax.kv_cache.capacity.CapacityReport.log` writes at model load, then
exits 0. With --hisparse, the device line details the indexer and hot-buffer bytes and the
total line says how many long requests HiSparse runs at once. Bad flag values (a budget
too small for one request of `--max_model_len`, a host pool above 95% of the available
RAM) exit 2 with one line naming the flag. A DSA model's lines name its two caches (MLA
latent, indexer keys) per memory kind. With --disk_cache_dir / --remote_cache_url the
engine is built and each third tier it opened gets a line (`[tier=disk path=...]`,
`[tier=remote url=...]`: its cap, bytes per stored block, and what it holds now).
"""

from __future__ import annotations

from absl import flags

from hisparse_jax.entrypoints.cli.generate import block_size_from_flags, hisparse_from_flags
from hisparse_jax.kv_cache.capacity import CapacityReport, plan_capacity
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec, MLACacheSpec, check_kv_cache_dtype

FLAGS = flags.FLAGS


def main(argv: list[str]) -> int:
  del argv  # all input comes from the shared flags of hisparse_jax.entrypoints.cli.flag_defs
  try:  # before the model loads
    check_kv_cache_dtype(FLAGS.kv_cache_dtype)
  except ValueError as e:
    raise ValueError(f"--{e}") from None
  from hisparse_jax.entrypoints.cli.generate import tier_kwargs_from_flags  # noqa: PLC0415
  from models.loader import (  # noqa: PLC0415 (heavy)
    checkpoint_dtype,
    is_dsa_config,
    load_pretrained,
  )

  tier_kwargs_from_flags()  # (its flags' values checked even when no tier is configured)
  if (FLAGS.tensor_parallel_size != 1 or FLAGS.disk_cache_dir is not None
      or FLAGS.remote_cache_url is not None):
    # Over a mesh, or with a third tier: the engine's own pools, tiers and lines.
    return _tensor_parallel()
  dtype = checkpoint_dtype(FLAGS.model) if FLAGS.dtype == "auto" else FLAGS.dtype
  _, config, _ = load_pretrained(FLAGS.model, dtype=dtype)
  max_positions = getattr(config, "max_position_embeddings", None)
  if max_positions is not None and FLAGS.max_model_len > max_positions:
    raise ValueError(f"--max_model_len={FLAGS.max_model_len} exceeds the model's "
                     f"max_position_embeddings={max_positions}")
  is_dsa = is_dsa_config(config)
  if is_dsa and FLAGS.kv_cache_dtype != "auto":
    raise ValueError(f"--kv_cache_dtype={FLAGS.kv_cache_dtype}: 8-bit caches of DSA models "
                     f"({config.model_type}: MLA latent + indexer keys) are not supported; "
                     "use auto")
  if not is_dsa and FLAGS.index_cache_dtype != "auto":
    raise ValueError(f"--index_cache_dtype={FLAGS.index_cache_dtype}: only DSA models "
                     f"(deepseek_v32, glm_moe_dsa) have an indexer-key cache; "
                     f"{config.model_type} has none: use auto")
  spec = (MLACacheSpec if is_dsa else KVCacheSpec).from_model_config(
      config, dtype, block_size_from_flags(), FLAGS.kv_cache_dtype,
      **({"index_cache_dtype": FLAGS.index_cache_dtype} if is_dsa else {}))
  plan_args = dict(max_model_len=FLAGS.max_model_len, host_pool_gib=FLAGS.host_pool_gib,
                   device_kv_gib=FLAGS.device_kv_gib)
  hisparse = hisparse_from_flags()
  if hisparse is None:
    plan = plan_capacity(spec, **plan_args)
    pools = plan.allocate()
    _print(CapacityReport.from_pools(pools, plan.device_reserved_bytes))
    return 0
  # As the engine plans (engine/planning.py): the model's HiSparse settings, the prefill
  # chunk the device budget streams, the indexer and hot-buffer bytes out of the budget.
  from hisparse_jax.engine.config import EngineConfig  # noqa: PLC0415
  from hisparse_jax.engine.planning import (  # noqa: PLC0415
    check_model_kind,
    hisparse_capacity_for,
    plan_engine_capacity,
    resolve_config,
  )

  engine_config = EngineConfig(
      model=FLAGS.model, dtype=dtype, block_size=spec.block_size,
      kv_cache_dtype=FLAGS.kv_cache_dtype, index_cache_dtype=FLAGS.index_cache_dtype,
      device_kv_gib=FLAGS.device_kv_gib, host_pool_gib=FLAGS.host_pool_gib,
      max_model_len=FLAGS.max_model_len, max_num_seqs=FLAGS.max_num_seqs,
      max_num_batched_tokens=FLAGS.max_num_batched_tokens, hisparse=hisparse)
  engine_config = check_model_kind(engine_config, config, is_dsa)
  engine_config = resolve_config(engine_config, spec, is_dsa=is_dsa)
  pools = plan_engine_capacity(engine_config, spec, is_dsa=is_dsa).allocate()
  detail = hisparse_capacity_for(engine_config, spec, pools[0].num_blocks, pools[1].num_blocks)
  _print(CapacityReport.from_pools(pools, detail.reserved_bytes, detail))
  return 0


def _tensor_parallel() -> int:
  """The capacity lines of an engine: over --tensor_parallel_size devices (weights loaded
  into their shards; the lines per device come from the live shards), and with the third
  KV tier's flags (a line per tier, from the opened tier: its cap and what it holds)."""
  from hisparse_jax.engine.engine import Engine, EngineConfig  # noqa: PLC0415 (heavy)
  from hisparse_jax.entrypoints.cli.generate import tier_kwargs_from_flags  # noqa: PLC0415

  # Only the flags this command reads (its --help groups).
  kwargs = dict(model=FLAGS.model, dtype=FLAGS.dtype, block_size=FLAGS.block_size,
                kv_cache_dtype=FLAGS.kv_cache_dtype, index_cache_dtype=FLAGS.index_cache_dtype,
                device_kv_gib=FLAGS.device_kv_gib, host_pool_gib=FLAGS.host_pool_gib,
                max_model_len=FLAGS.max_model_len, max_num_seqs=FLAGS.max_num_seqs,
                hisparse=hisparse_from_flags(),
                tensor_parallel_size=FLAGS.tensor_parallel_size, **tier_kwargs_from_flags())
  try:
    config = EngineConfig(**kwargs)
  except ValueError as e:
    raise ValueError(f"--{e}") from None
  engine = Engine(config)
  try:
    _print(engine.capacity)
  finally:
    engine.close()
  return 0


def _print(report: CapacityReport) -> None:
  for line in report.log_lines(FLAGS.max_model_len):
    print(line, flush=True)

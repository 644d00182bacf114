"""Suite `dsa_decode`: one decode step of a DSA model (MLA + lightning indexer), with the
host tier in, against dense MLA over the full cache.

Three contenders, each the engine's own jitted step (`DsaModelRunner.build_batch` +
`dispatch`) over the same weights and one decode row per sequence:

    dense      the model with index_topk >= the context: every query attends every key,
               read in place by the dense kernel (MLA as MQA over the latent pages), every
               block on the device
    resident   DSA as the model is: the learned indexer scores every key of the row (the
               indexer-key cache), the top index_topk tokens are attended
               (kernels' sparse_mla_decode), every block on the device
    offloaded  DSA with HiSparse (`indexer="lightning"`) as the engine leaves an offloaded
               request (bench/tiered.py: dsa_tiered_decode): every block in the pinned_host
               pool, only the newest resident, the indexer keys of host blocks on the
               device, a token-granular hot buffer of 2 x index_topk; the step selects ->
               resolves against the hot buffer -> loads the missed tokens' latent entries
               from the host -> attends. "warm": the hot buffer holds the previous step's
               selection (a decode step selects mostly what the last one did); "cold": it
               starts empty every step (every selected token loaded from the host)

and `resident_8bit`: the resident step over 8-bit indexer keys (`--index_cache_dtype`,
int8 on CPU: the indexer reads 132 bytes a key and layer instead of float32's 512 here,
bf16's 256 on a GPU), its own device pool (the same latent entries).

Contexts 4k to 64k tokens; the contenders alternate (medians of one run). Per context the
JSON gives the step times, `dense_over_offloaded` (warm) and `dense_over_offloaded_cold`,
the tokens the cold step loaded, and `bytes_bound` = the cache bytes a dense step reads /
(indexer-key bytes of every key + latent bytes of the index_topk selected + 2 x the bytes
the warm step's loads moved): what a memory-bound step could reach. The synthetic model's
attention has DeepSeek-V3.2's cache geometry (kv_lora_rank 512 + rope 64, indexer keys of
128, index_topk 2,048) and its 2:1 ratio of attention to indexer heads at 16 and 8 heads,
2 layers, every MLP dense so the weights stay small; its weights are random (time does
not depend on them). float32 caches (the CPU's C++ dense kernel reads float32 pages).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from flax import nnx

from hisparse_jax.bench import common, tiered
from hisparse_jax.engine.dsa_runner import DsaModelRunner
from hisparse_jax.kv_cache.kv_pool import DEVICE, KVPool, MLACacheSpec
from hisparse_jax.sparse.config import HiSparseConfig
from models import deepseek_v32 as ds


@dataclasses.dataclass(frozen=True)
class Size:
  contexts: tuple[int, ...]
  batch: int
  index_topk: int
  block_size: int
  reps: int
  num_layers: int
  hidden_size: int
  num_heads: int
  kv_lora_rank: int
  rope_dim: int
  index_heads: int
  index_dim: int
  vocab_size: int
  dtype: str = "float32"


SIZES = {
    # DeepSeek-V3.2's cache geometry (latent 512 + rope 64, indexer keys of 128, top-k
    # 2,048) and its 2:1 ratio of attention to indexer heads, at 16 and 8 heads.
    "full": Size((4096, 16384, 65536), batch=2, index_topk=2048, block_size=16, reps=5,
                 num_layers=2, hidden_size=512, num_heads=16, kv_lora_rank=512, rope_dim=64,
                 index_heads=8, index_dim=128, vocab_size=2048),
    "smoke": Size((256,), batch=1, index_topk=32, block_size=4, reps=1, num_layers=2,
                  hidden_size=64, num_heads=4, kv_lora_rank=32, rope_dim=16, index_heads=4,
                  index_dim=16, vocab_size=128),
}


def model_config(size: Size, index_topk: int) -> ds.DeepseekV32Config:
  return ds.DeepseekV32Config(
      vocab_size=size.vocab_size, hidden_size=size.hidden_size,
      intermediate_size=2 * size.hidden_size, moe_intermediate_size=size.hidden_size,
      num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads,
      n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.0,
      kv_lora_rank=size.kv_lora_rank, q_lora_rank=2 * size.kv_lora_rank,
      qk_rope_head_dim=size.rope_dim, v_head_dim=size.rope_dim, qk_nope_head_dim=size.rope_dim,
      n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True,
      index_topk=index_topk, index_head_dim=size.index_dim, index_n_heads=size.index_heads,
      mlp_layer_types=("dense",) * size.num_layers,
      max_position_embeddings=2 * max(size.contexts))


def kv_bytes(spec: MLACacheSpec, context: int, batch: int, index_topk: int,
             h2d_bytes: int = 0) -> dict:
  """Cache bytes one decode step reads (all layers): dense, every key's latent entry;
  DSA, every key's indexer key, the selected tokens' latent entries, 2 x its loads."""
  dense = batch * context * spec.latent_bytes_per_token
  index = batch * context * spec.index_bytes_per_token
  selected = batch * min(index_topk, context) * spec.latent_bytes_per_token
  return {"dense_kv_bytes": dense, "indexer_bytes": index, "sparse_kv_bytes": selected,
          "bytes_bound": dense / (index + selected + 2 * h2d_bytes)}


def run(size_name: str = "full", seed: int = 0, index_cache_dtype: str = "int8") -> dict:
  size = SIZES[size_name]
  config = model_config(size, size.index_topk)
  model = ds.DeepseekV32ForCausalLM(config, seed=seed)
  # The same weights, every key attended (dense MLA).
  dense_model = nnx.merge(*nnx.split(model))
  dense_model.config = dataclasses.replace(config, index_topk=config.max_position_embeddings)
  spec = MLACacheSpec.from_model_config(config, size.dtype, size.block_size)
  max_context = max(size.contexts)
  max_blocks = math.ceil(max_context / size.block_size)
  pool = KVPool(spec, 1 + size.batch * max_blocks, DEVICE)
  tiered.fill_kinds(pool, seed)
  runner_args = dict(max_model_len=max_context, max_num_seqs=size.batch,
                     max_num_batched_tokens=size.batch)
  # The dense and resident runners share the device pool (their steps alternate).
  dense = DsaModelRunner(dense_model, pool, **runner_args)
  resident = DsaModelRunner(model, pool, **runner_args)
  spec8 = MLACacheSpec.from_model_config(config, size.dtype, size.block_size,
                                         index_cache_dtype=index_cache_dtype)
  pool8 = KVPool(spec8, pool.num_blocks, DEVICE)
  tiered.fill_kinds(pool8, seed)
  resident8 = DsaModelRunner(model, pool8, **runner_args)
  all_tables = 1 + np.arange(size.batch)[:, None] * max_blocks + np.arange(max_blocks)
  rng = np.random.default_rng(seed)
  rows = []
  for context in size.contexts:
    tables = all_tables[:, :math.ceil(context / size.block_size)].astype(np.int32)
    chunks = tiered.decode_chunks(context, tables, size.block_size, size.vocab_size, rng)
    batch_dense = dense.build_batch(chunks, tables)
    batch_resident = resident.build_batch(chunks, tables)
    batch_resident8 = resident8.build_batch(chunks, tables)
    hisparse = HiSparseConfig(indexer="lightning", hot_buffer_tokens=2 * size.index_topk,
                              sparse_threshold_tokens=size.index_topk).for_index_topk(
                                  size.index_topk, context)
    setup = tiered.dsa_tiered_decode(model, spec, hisparse, size.batch, context, seed)
    offloaded, batch_offloaded = setup.runner, setup.batch
    cold = offloaded.collect(offloaded.dispatch(batch_offloaded))  # fills the hot buffer
    loaded = {"warm": [], "cold": []}

    def offloaded_step(warm: bool, runner=offloaded, batch=batch_offloaded, setup=setup,
                       loaded=loaded):
      if not warm:
        runner.set_hot_state(setup.cold_state)
      result = runner.collect(runner.dispatch(batch))
      loaded["warm" if warm else "cold"].append(result.loaded_block_layers)
      return result.tokens

    times = common.interleaved({
        "dense": functools.partial(dense.execute, batch_dense),
        "resident": functools.partial(resident.execute, batch_resident),
        "resident_8bit": functools.partial(resident8.execute, batch_resident8),
        "offloaded": functools.partial(offloaded_step, True),
        "offloaded_cold": functools.partial(offloaded_step, False)}, size.reps)
    ms = {name: common.median(t) * 1e3 for name, t in times.items()}
    h2d = int(np.median(loaded["warm"])) * setup.block_bytes
    row = {"context": context, "dense_ms": ms["dense"], "resident_ms": ms["resident"],
           "offloaded_ms": ms["offloaded"], "offloaded_cold_ms": ms["offloaded_cold"],
           "resident_8bit_ms": ms["resident_8bit"],
           "dense_over_resident": ms["dense"] / ms["resident"],
           "resident_over_resident_8bit": ms["resident"] / ms["resident_8bit"],
           "indexer_bytes_8bit": size.batch * context * spec8.index_bytes_per_token,
           "dense_over_offloaded": ms["dense"] / ms["offloaded"],
           "dense_over_offloaded_cold": ms["dense"] / ms["offloaded_cold"],
           "cold_step_tokens_loaded": int(cold.loaded_block_layers),
           "cold_step_h2d_bytes": int(cold.loaded_block_layers) * setup.block_bytes,
           "h2d_bytes_per_step": h2d,
           **kv_bytes(spec, context, size.batch, size.index_topk, h2d)}
    row["fraction_of_bound"] = row["dense_over_offloaded"] / row["bytes_bound"]
    rows.append(row)
    del offloaded, setup, offloaded_step
  return {"batch": size.batch, "block_size": size.block_size, "index_topk": size.index_topk,
          "hot_buffer_tokens": 2 * size.index_topk, "kernel_backend": dense.ops.backend,
          "model": dataclasses.asdict(config), "kv_dtype": size.dtype,
          "latent_bytes_per_token": spec.latent_bytes_per_token,
          "index_bytes_per_token": spec.index_bytes_per_token,
          "index_cache_dtype_8bit": index_cache_dtype,
          "index_bytes_per_token_8bit": spec8.index_bytes_per_token, "reps": size.reps,
          "rows": rows}


def format_table(result: dict) -> str:
  rows = [(r["context"], r["dense_ms"], r["resident_ms"], r.get("resident_8bit_ms"),
           r["offloaded_ms"], r["offloaded_cold_ms"], r["dense_over_offloaded"],
           r["dense_over_offloaded_cold"], r["bytes_bound"], r["cold_step_tokens_loaded"])
          for r in result["rows"]]
  eight = result.get("index_cache_dtype_8bit", "8-bit")
  lines = [common.format_table(
      ["context", "dense ms", "DSA resident ms", f"resident, {eight} indexer keys ms",
       "DSA offloaded ms (warm)", "cold ms", "dense/offloaded", "dense/cold", "bytes_bound",
       "cold tokens loaded"], rows)]
  lines.append(f"batch {result['batch']}, {result['model']['num_hidden_layers']} layers, "
               f"index_topk {result['index_topk']}, hot buffer {result['hot_buffer_tokens']} "
               f"tokens, block {result['block_size']}, backend {result['kernel_backend']}; "
               "offloaded: every block in the pinned_host pool, only the newest on the device")
  return "\n".join(lines)

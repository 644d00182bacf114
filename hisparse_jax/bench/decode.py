"""Suite `decode_sparse_vs_dense`: one decode step, HiSparse top-k against dense attention.

Both sides are the engine's own jitted step (`ModelRunner.build_batch` + `dispatch`)
over the same weights and the same batch: one decode row per sequence.

    dense   ModelRunner(..., hisparse=None): every block on the device, random K/V,
            attends every block
    sparse  ModelRunner(..., hisparse=HiSparseConfig(top_k_tokens=1024)) with the
            sequences offloaded as the engine leaves them (bench/tiered.py): every block
            in the pinned_host pool, the sink and local blocks resident, a warm hot
            buffer; select (key bounds of every block) -> resolve -> load the misses
            from the host pool -> attend the top-k blocks

Contexts of 4k, 16k and 64k tokens; dense and sparse steps alternate (medians of one
run). Per context the JSON gives `dense_over_sparse` (measured step-time ratio) and
`bytes_bound` = KV bytes a dense step reads / (KV bytes a sparse step reads + key-bound
bytes its indexer reads + 2 x the bytes its host loads moved, read and written, as the
step reports them: `h2d_bytes_per_step`): the speed-up a purely memory-bound step could
reach. The goal at the longest context is `dense_over_sparse >= bytes_bound / 2`.
`bytes_bound` depends on the block size (the indexer reads one bound pair per block, the
top-k rounds to whole blocks); `bytes_bound_by_block_size` gives it for several block
sizes (with the longest context's measured loads).

`profile` times the pieces of one layer at the longest context on their own (the
kernels the step calls, with the step's shapes), so a missed goal names what dominates.
The model is synthetic, sized like the attention of a small real model (8 query / 2 KV
heads of 64, 4 layers); its weights are random (time does not depend on them).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_pallas
from hisparse_jax.bench import common, tiered
from hisparse_jax.engine.runner import ModelRunner, bounds_bytes_per_block
from hisparse_jax.kv_cache.kv_pool import DEVICE, KVCacheSpec, KVPool
from hisparse_jax.sparse import indexer
from hisparse_jax.sparse.config import HiSparseConfig
from models.config import ModelConfig
from models.llama import LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class Size:
  contexts: tuple[int, ...]  # tokens in the cache after the decode step
  batch: int
  top_k_tokens: int
  sink_tokens: int
  local_tokens: int
  reps: int
  num_layers: int
  hidden_size: int
  intermediate_size: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  dtype: str = "float32"


SIZES = {
    # Attention like a small real model; hidden, MLP and vocabulary kept small so that the
    # weights (17 MB) do not hide the KV bytes the comparison is about (`weight_bytes`).
    "full": Size((4096, 16384, 65536), batch=2, top_k_tokens=1024, sink_tokens=64,
                 local_tokens=256, reps=5, num_layers=4, hidden_size=256,
                 intermediate_size=768, num_q_heads=8, num_kv_heads=2, head_dim=64,
                 vocab_size=2048),
    "smoke": Size((512,), batch=1, top_k_tokens=64, sink_tokens=16, local_tokens=16,
                  reps=1, num_layers=2, hidden_size=64, intermediate_size=128, num_q_heads=4,
                  num_kv_heads=2, head_dim=16, vocab_size=256),
}
BOUND_BLOCK_SIZES = (8, 16, 32, 64, 128)


def model_config(size: Size) -> ModelConfig:
  return ModelConfig(model_type="llama", vocab_size=size.vocab_size,
                     hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
                     num_hidden_layers=size.num_layers, num_attention_heads=size.num_q_heads,
                     num_key_value_heads=size.num_kv_heads, head_dim=size.head_dim,
                     max_position_embeddings=max(size.contexts), eos_token_id=None)


def kv_bytes(spec: KVCacheSpec, context: int, batch: int, top_k_tokens: int,
             h2d_bytes: int = 0, bounds_dtype: str = "float32") -> dict:
  """Bytes one decode step moves through memory for its KV, dense and sparse (all layers).

  Dense: every token. Sparse: the selected blocks (top-k in whole blocks), the key
  bounds of every block (which the indexer scores) and twice the bytes its host loads
  moved (`h2d_bytes`: read from the host pool, written into the hot buffer).
  """
  num_blocks = math.ceil(context / spec.block_size)
  selected = min(math.ceil(top_k_tokens / spec.block_size), num_blocks)
  dense = batch * context * spec.bytes_per_token
  sparse = batch * selected * spec.bytes_per_block
  index = batch * num_blocks * bounds_bytes_per_block(spec, bounds_dtype)
  return {"dense_kv_bytes": dense, "sparse_kv_bytes": sparse, "indexer_bytes": index,
          "bytes_bound": dense / (sparse + index + 2 * h2d_bytes)}


def _profile(dense: ModelRunner, sparse: ModelRunner, batch_dense, batch_sparse, reps: int,
             sparse_ms: float) -> list[dict]:
  """The attention pieces of one layer at the step's shapes, timed alone (layer 0's pages),
  and what the sparse step spends besides them (`sparse_ms` - pieces x layers): the
  weights (projections, MLP, logits), writing the new K/V and its block's bounds, the
  resolver. The select is the step's own: `indexer.select_rows` over the bounds array as
  stored, each logical block's row its device copy's or, once dropped, its host copy's
  (on CPU the C++ kernel scores them in place)."""
  ops = dense.ops
  pool = dense.pool
  spec = pool.spec
  meta = batch_dense.metadata
  tables, kv_lens, cu = (jnp.asarray(meta.block_tables), jnp.asarray(meta.kv_lens),
                         jnp.asarray(meta.cu_q_lens))
  num_seqs = tables.shape[0]
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((num_seqs, dense.config.num_attention_heads,
                                       spec.head_dim)), jnp.float32)
  k, v = pool.k[0], pool.v[0]
  blocks = sparse.hisparse_blocks
  ragged = jax.jit(ops.ragged_paged_attention)
  paged = jax.jit(ops.paged_attention)
  meta_s = batch_sparse.metadata
  s_tables, s_lens = jnp.asarray(meta_s.block_tables), jnp.asarray(meta_s.kv_lens)
  bounds_rows = jnp.where(s_tables != 0, s_tables,
                          sparse.pool.k[0].shape[0] + jnp.asarray(meta_s.host_tables))
  cpu_kernel = (sparse.ops.backend == "xla"
                and kernels_pallas.backend.target_platform() == "cpu")

  @jax.jit
  def select(q, bounds, bounds_rows, kv_lens):
    sel = indexer.select_rows(q, bounds, bounds_rows, kv_lens, blocks,
                              sparse.hisparse.selection, cpu_kernel=cpu_kernel)
    return sel.logical_ids, sel.kv_lens

  bounds = sparse.bounds[0]  # as stored (bfloat16 as its uint16 bits on CPU)
  # The paged attention piece reads the dense pool at the selection's logical blocks.
  ids, sel_lens = select(q, bounds, bounds_rows, s_lens)
  sel_table = jnp.where(ids >= 0, jnp.take_along_axis(tables, jnp.maximum(ids, 0), axis=1), 0)
  pieces = {
      "dense: ragged attention over every block": lambda: ragged(q, k, v, tables, kv_lens, cu),
      "sparse: indexer select over every block's key bounds":
          lambda: select(q, bounds, bounds_rows, s_lens),
      "sparse: paged attention over the selected blocks":
          lambda: paged(q, k, v, sel_table, sel_lens),
  }
  times = common.interleaved(pieces, reps)
  rows = [{"piece": name, "ms_per_layer": common.median(t) * 1e3,
           "ms_all_layers": common.median(t) * 1e3 * spec.num_layers}
          for name, t in times.items()]
  rest = sparse_ms - sum(r["ms_all_layers"] for r in rows if r["piece"].startswith("sparse"))
  rows.append({"piece": "sparse: rest of the step (weights, write_kv, bounds, resolver)",
               "ms_per_layer": rest / spec.num_layers, "ms_all_layers": rest})
  return rows


def _weight_bytes_per_step(model: LlamaForCausalLM) -> int:
  """Weight bytes a decode step reads: every parameter but the embedding table, of which
  it reads only the batch's rows."""
  total = sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return total - int(model.embed_tokens[...].nbytes)


def run(size_name: str = "full", block_size: int = 16, seed: int = 0) -> dict:
  size = SIZES[size_name]
  config = model_config(size)
  model = LlamaForCausalLM(config, seed=seed)
  spec = KVCacheSpec.from_model_config(config, size.dtype, block_size)
  hisparse = HiSparseConfig(top_k_tokens=size.top_k_tokens, sink_tokens=size.sink_tokens,
                            local_tokens=size.local_tokens)
  max_context = max(size.contexts)
  max_blocks = math.ceil(max_context / block_size)
  pool = KVPool(spec, 1 + size.batch * max_blocks, DEVICE)
  tiered.fill(pool, seed)
  runner_args = dict(max_model_len=max_context, max_num_seqs=size.batch,
                     max_num_batched_tokens=size.batch)
  dense = ModelRunner(model, pool, **runner_args)
  all_tables = 1 + np.arange(size.batch)[:, None] * max_blocks + np.arange(max_blocks)
  rng = np.random.default_rng(seed)
  rows, profile = [], None
  for context in size.contexts:
    tables = all_tables[:, :math.ceil(context / block_size)].astype(np.int32)
    batch_dense = dense.build_batch(
        tiered.decode_chunks(context, tables, block_size, size.vocab_size, rng), tables)
    # Sparse: the sequences offloaded (every block in the pinned_host pool, sink + local
    # blocks resident, a hot buffer), the hot buffer warm: one step from empty loads the
    # selection, later steps of this batch select the same blocks.
    sparse_setup = tiered.tiered_decode(model, spec, hisparse, size.batch, context, seed)
    sparse, batch_sparse = sparse_setup.runner, sparse_setup.batch
    cold = sparse.collect(sparse.dispatch(batch_sparse))
    loaded = []

    def sparse_step(sparse=sparse, batch_sparse=batch_sparse, loaded=loaded):
      result = sparse.collect(sparse.dispatch(batch_sparse))
      loaded.append(result.loaded_block_layers)
      return result.tokens

    steps = {"dense": functools.partial(dense.execute, batch_dense), "sparse": sparse_step}
    if context == max_context:  # the same sparse step over int8 key bounds beside it
      int8_hisparse = dataclasses.replace(hisparse, bounds_dtype="int8")
      int8_setup = tiered.tiered_decode(model, spec, int8_hisparse, size.batch, context, seed)
      int8_setup.runner.collect(int8_setup.runner.dispatch(int8_setup.batch))
      steps["sparse_int8_bounds"] = functools.partial(
          lambda setup: setup.runner.collect(setup.runner.dispatch(setup.batch)).tokens,
          int8_setup)
    times = common.interleaved(steps, size.reps)
    dense_s, sparse_s = common.median(times["dense"]), common.median(times["sparse"])
    h2d = int(np.median(loaded)) * sparse_setup.block_bytes
    row = {"context": context, "dense_ms": dense_s * 1e3, "sparse_ms": sparse_s * 1e3,
           "dense_over_sparse": dense_s / sparse_s,
           "blocks_attended_sparse": int(batch_sparse.blocks_attended[0]),
           "blocks_attended_dense": int(batch_dense.blocks_attended[0]),
           "cold_step_h2d_bytes": cold.loaded_block_layers * sparse_setup.block_bytes,
           "h2d_bytes_per_step": h2d,
           **kv_bytes(spec, context, size.batch, size.top_k_tokens, h2d,
                      hisparse.bounds_dtype)}
    row["fraction_of_bound"] = row["dense_over_sparse"] / row["bytes_bound"]
    if "sparse_int8_bounds" in times:
      int8_s = common.median(times["sparse_int8_bounds"])
      row["int8_bounds"] = {
          "sparse_ms": int8_s * 1e3, "dense_over_sparse": dense_s / int8_s,
          "sparse_over_bfloat16_bounds": int8_s / sparse_s,
          **kv_bytes(spec, context, size.batch, size.top_k_tokens, h2d, "int8")}
      del int8_setup
    rows.append(row)
    if context == max_context:
      profile = _profile(dense, sparse, batch_dense, batch_sparse, size.reps,
                         row["sparse_ms"])
    del sparse, sparse_setup, sparse_step
  by_block_size = {
      str(bs): {str(r["context"]): kv_bytes(dataclasses.replace(spec, block_size=bs),
                                            r["context"], size.batch, size.top_k_tokens,
                                            r["h2d_bytes_per_step"],
                                            hisparse.bounds_dtype)["bytes_bound"]
                for r in rows}
      for bs in BOUND_BLOCK_SIZES}
  longest = rows[-1]
  weight_bytes = _weight_bytes_per_step(model)
  for row in rows:  # what a memory-bound step could reach with the weights read too
    row["bytes_bound_with_weights"] = (
        (row["dense_kv_bytes"] + weight_bytes)
        / (row["sparse_kv_bytes"] + row["indexer_bytes"] + 2 * row["h2d_bytes_per_step"]
           + weight_bytes))
  return {
      "block_size": block_size, "batch": size.batch, "top_k_tokens": size.top_k_tokens,
      "hisparse": dataclasses.asdict(hisparse), "kernel_backend": dense.ops.backend,
      "model": dataclasses.asdict(config), "kv_dtype": size.dtype,
      "kv_bytes_per_token": spec.bytes_per_token, "weight_bytes_per_step": weight_bytes,
      "reps": size.reps, "rows": rows,
      "bytes_bound_by_block_size": by_block_size,
      "goal": "dense_over_sparse >= bytes_bound / 2 at the longest context",
      "goal_met": longest["dense_over_sparse"] >= longest["bytes_bound"] / 2,
      "profile_context": max_context, "profile": profile}


def format_table(result: dict) -> str:
  rows = [(r["context"], r["dense_ms"], r["sparse_ms"], r["dense_over_sparse"],
           r["bytes_bound"], r["blocks_attended_dense"], r["blocks_attended_sparse"],
           f"{r['h2d_bytes_per_step'] / 2**20:.2f}")
          for r in result["rows"]]
  lines = [common.format_table(["context", "dense ms", "sparse ms", "dense/sparse",
                                "bytes_bound", "blocks dense", "blocks sparse",
                                "h2d MiB/step"], rows)]
  lines.append("sparse: sequences offloaded (every block in the pinned_host pool), hot "
               "buffer warm; a cold step moved " + ", ".join(
                   f"{r['cold_step_h2d_bytes'] / 2**20:.2f}" for r in result["rows"])
               + " MiB host -> device")
  lines.append("with the weights read too (" + f"{result['weight_bytes_per_step'] / 1e6:.1f} "
               "MB a step), a memory-bound step could reach: " + ", ".join(
                   f"{r['bytes_bound_with_weights']:.1f}" for r in result["rows"]))
  int8 = result["rows"][-1].get("int8_bounds")
  if int8:
    lines.append(f"int8 key bounds at {result['rows'][-1]['context']} tokens: sparse "
                 f"{int8['sparse_ms']:.2f} ms ({int8['sparse_over_bfloat16_bounds']:.2f}x "
                 f"the bfloat16 bounds' step), dense/sparse {int8['dense_over_sparse']:.2f}, "
                 f"bytes_bound {int8['bytes_bound']:.1f}")
  lines.append(f"block_size {result['block_size']}, batch {result['batch']}, top_k_tokens "
               f"{result['top_k_tokens']}, backend {result['kernel_backend']}; goal met: "
               f"{result['goal_met']}")
  bound = result["bytes_bound_by_block_size"]
  longest = str(result["rows"][-1]["context"])
  lines.append(f"bytes_bound at {longest} tokens by block size: " + ", ".join(
      f"{bs}: {by_ctx[longest]:.1f}" for bs, by_ctx in bound.items()))
  lines.append(f"profile, one layer at {result['profile_context']} tokens:")
  lines.append(common.format_table(["piece", "ms/layer", "ms all layers"], [
      (p["piece"], p["ms_per_layer"], p["ms_all_layers"]) for p in result["profile"]]))
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  """PNG: decode step time against context, dense and sparse (context on a log axis)."""
  import matplotlib  # optional dependency (the test extra): imported on use

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  contexts = [r["context"] for r in result["rows"]]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(contexts, [r["dense_ms"] for r in result["rows"]], "o-", label="dense")
  ax.plot(contexts, [r["sparse_ms"] for r in result["rows"]], "s-",
          label=f"HiSparse top-k {result['top_k_tokens']} tokens")
  ax.set_xscale("log", base=2)
  ax.set_ylim(bottom=0)
  ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
  ax.minorticks_off()
  ax.set_xlabel("context (tokens)")
  ax.set_ylabel("decode step (ms, median)")
  ax.set_title(f"decode step, batch {result['batch']}, {result['model']['num_hidden_layers']} "
               f"layers, block {result['block_size']}")
  ax.grid(True, alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)

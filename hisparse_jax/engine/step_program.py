"""The step program: ONE jitted call per step (forward + sampling), and the small
jitted programs that change the runner's device state between steps.

    step_program(...)   input ids (in-flight tokens from the previous step's output)
                        -> embed -> per layer: qkv -> sparse.attention.attend (write_kv,
                        key bounds, dense / sparse attention) -> mlp
                        -> logits of each sequence's last token -> (SamplerExtras:
                        min_tokens mask, penalties) -> sample -> (logprobs)
    refresh_program     key bounds of blocks swapped in from the host pool
    copy_program        copy-on-write block copies (pages and key bounds)

Each is cached per model structure / kernel backend / dtype (`functools.cache`), so
engines of a process share compiled programs; the pages, key bounds and hot-buffer
state are donated (updated in place).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import kernels_pallas
from hisparse_jax.distributed.parallel import KV_HEADS, kv_sharding
from hisparse_jax.engine.sampling import (
  apply_penalties,
  greedy,
  mask_tokens,
  sample,
  token_logprobs,
)
from hisparse_jax.engine.step_batch import SamplerExtras, StepMetadata
from hisparse_jax.kv_cache.kv_pool import from_storage
from hisparse_jax.kv_cache.transfer import hop_free
from hisparse_jax.sparse import indexer
from hisparse_jax.sparse.attention import SparseStatic, attend
from hisparse_jax.sparse.config import HiSparseBlocks
from hisparse_jax.sparse.dsa_attention import DsaStatic
from hisparse_jax.sparse.dsa_attention import attend as dsa_attend
from kernels_pallas.quant import QuantizedPages


@functools.cache  # one jitted program per model structure, shared by engines of a process
def step_program(graphdef, ops: kernels_pallas.KernelOps, kv_dtype: str, storage_dtype,
                 blocks: HiSparseBlocks | None = None, selection: str | None = None,
                 thrash_window_steps: int = 0, device_sharding=None, host_sharding=None,
                 one_memory: bool | None = None, bounds_dtype: str = "float32", *,
                 mesh=None, kv_head_repeat: int = 1, params_def=None,
                 streamed_prefill: str = "exact", host_copy: str = "xla",
                 overlap_loads: bool = False):
  sparse = None
  if blocks is not None:
    sparse = SparseStatic(blocks, selection, thrash_window_steps, device_sharding,
                          host_sharding, one_memory, host_copy, bounds_dtype=bounds_dtype,
                          streamed_prefill=streamed_prefill, overlap_loads=overlap_loads)
    if mesh is not None:  # tensor parallel: under shard_map, see sharded_attend
      if not (hop_free(device_sharding) if one_memory is None else one_memory):
        raise ValueError(
            "--tensor_parallel_size > 1 with --hisparse: the in-step host loads under "
            "tensor parallelism are built only where device and host memory are one (CPU) "
            "so far")
      sparse = dataclasses.replace(sparse, device_sharding=None, one_memory=True,
                                   axis_name=KV_HEADS[2], kv_head_repeat=kv_head_repeat)
  attn_fn = functools.partial(attend, ops, jnp.dtype(kv_dtype), jnp.dtype(storage_dtype),
                              sparse)
  if mesh is not None:
    attn_fn = functools.partial(sharded_attend, attn_fn, mesh, sparse is not None)
  layout = KVLayout(hisparse=blocks is not None)
  forward = functools.partial(_forward, graphdef, params_def, attn_fn, layout)
  # Overlapped loads: XLA's latency-hiding scheduler places the staged host -> device
  # copies around the attention over the on-device blocks (resolver.staged_gather); XLA's
  # GPU compiler leaves it off unless asked (jax 0.11.2), and its default schedule puts
  # each copy-done right after its copy-start (seen compiling for the H200 deviceless).
  options = OVERLAP_COMPILER_OPTIONS if sparse is not None and sparse.overlap_loads else None
  return jax.jit(forward, donate_argnums=(2, 3, 4),
                 static_argnames=("greedy_only", "num_token_rows"), compiler_options=options)


# XLA options of a step with HISPARSE_JAX_OVERLAP_LOADS=1 (a GPU flag: XLA:CPU ignores it).
OVERLAP_COMPILER_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}


@functools.cache  # one jitted program per model structure, shared by engines of a process
def dsa_step_program(graphdef, ops: kernels_pallas.KernelOps, kv_dtype: str,
                     static: DsaStatic, index_layers: tuple[int, ...], *, params_def=None):
  """The step program of a DSA model (models/deepseek_v32.py): the same forward and
  sampling, each layer's attention `sparse.dsa_attention.attend` over its latent and
  indexer-key pages (and, tiered, the host pool's latent pages, the indexer keys of host
  blocks and the hot-buffer state)."""
  attn_fn = functools.partial(dsa_attend, ops, jnp.dtype(kv_dtype), static)
  layout = DsaLayout(index_layers=index_layers, tiered=static.tiered,
                     record_topk=static.record_topk)
  forward = functools.partial(_forward, graphdef, params_def, attn_fn, layout)
  return jax.jit(forward, donate_argnums=(2, 3, 4),
                 static_argnames=("greedy_only", "num_token_rows"))


def _layer_arrays(arrays, num_layers: int, i: int) -> tuple:
  """Layer i's array of each kind (arrays grouped by kind, num_layers each)."""
  kinds = len(arrays) // num_layers
  return tuple(arrays[j * num_layers + i] for j in range(kinds))


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """How a llama-family step hands each layer its cache (`attend`'s kv_cache) and
  gathers the layers' new caches back into the runner's flat arrays.

  The pool's arrays are grouped by kind (k..., v..., and an int8 cache's k_scale...,
  v_scale...); a layer's pages are its array of each kind (KVPool.arrays). HiSparse: each
  layer's cache is a dict of its pages, key bounds, host pages and hot-buffer state."""

  hisparse: bool

  def layer_caches(self, num_layers, kv_arrays, bounds, hot_state, host_arrays):
    if self.hisparse:
      return [dict(pages=_layer_arrays(kv_arrays, num_layers, i), bounds=bounds[i],
                   host=_layer_arrays(host_arrays, num_layers, i),
                   state=_layer_arrays(hot_state, num_layers, i))
              for i in range(num_layers)]
    return [_layer_arrays(kv_arrays, num_layers, i) for i in range(num_layers)]

  def outputs(self, kv_caches, bounds, hot_state):
    """(new pool arrays, new bounds, new hot state, (counts, loaded))."""
    num_layers = len(kv_caches)
    if self.hisparse:
      num_kinds = len(kv_caches[0]["pages"])
      new_arrays = tuple(c["pages"][j] for j in range(num_kinds) for c in kv_caches)
      # (A step without sparse rows is called without the state and hands none back.)
      new_state = tuple(c["state"][j] for j in range(len(hot_state) // num_layers)
                        for c in kv_caches)
      counts = jnp.stack([c["counts"] for c in kv_caches])  # [layers, num_seqs, 5]
      loaded = jnp.stack([c["loaded"] for c in kv_caches])  # [layers]: blocks moved h2d
      return new_arrays, tuple(c["bounds"] for c in kv_caches), new_state, (counts, loaded)
    num_kinds = len(kv_caches[0])
    new_arrays = tuple(c[j] for j in range(num_kinds) for c in kv_caches)
    return new_arrays, (), hot_state, (jnp.zeros((0,), jnp.int32),
                                       jnp.zeros((0,), jnp.int32))


@dataclasses.dataclass(frozen=True)
class DsaLayout:
  """`KVLayout` of a DSA model: pool arrays latent[0..L-1], then index_k of each layer
  with an indexer (`index_layers`, in order), then with 8-bit indexer keys their
  index_scale arrays; tiered (HiSparse), `bounds` holds those layers' indexer keys of
  host blocks (`host_index`: an array, or a (values, scales) pair), the host arrays are
  the host pool's
  (only the latent pages are read: loads move latent entries), the hot state is one
  (slot, last used, evicted at) triple per layer. record_topk: the step also returns each
  layer's selection (int32 [layers, tokens, k])."""

  index_layers: tuple[int, ...]
  tiered: bool
  record_topk: bool = False

  def layer_caches(self, num_layers, kv_arrays, bounds, hot_state, host_arrays):
    caches = []
    num_index = len(self.index_layers)
    kinds = (len(kv_arrays) - num_layers) // num_index  # 1, or 2 with 8-bit indexer keys
    for i in range(num_layers):
      slot = self.index_layers.index(i) if i in self.index_layers else None
      pages = (kv_arrays[i],) if slot is None else (kv_arrays[i], *(
          kv_arrays[num_layers + j * num_index + slot] for j in range(kinds)))
      if not self.tiered:
        caches.append(pages)
        continue
      cache = dict(pages=pages, host=host_arrays[i:i + 1],
                   state=_layer_arrays(hot_state, num_layers, i))
      if slot is not None:
        cache["host_index"] = bounds[slot]
      caches.append(cache)
    return caches

  def outputs(self, kv_caches, bounds, hot_state):
    num_layers = len(kv_caches)
    pages = [c["pages"] if isinstance(c, dict) else c for c in kv_caches]
    kinds = max(len(p) for p in pages)  # latent, index_k (, index_scale)
    new_arrays = tuple(p[j] for j in range(kinds) for p in pages if len(p) > j)
    topk = ()
    if self.record_topk:
      topk = (jnp.stack([c["topk"] for c in kv_caches]),)
    if not self.tiered:
      zeros = jnp.zeros((0,), jnp.int32)
      return new_arrays, bounds, hot_state, (zeros, zeros, *topk)
    new_state = tuple(c["state"][j] for j in range(len(hot_state) // num_layers)
                      for c in kv_caches)
    counts = jnp.stack([c["counts"] for c in kv_caches])
    loaded = jnp.stack([c["loaded"] for c in kv_caches])
    return new_arrays, bounds, new_state, (counts, loaded, *topk)


@functools.cache
def refresh_program(ops: kernels_pallas.KernelOps, kv_dtype: str, block_size: int,
                    bounds_dtype: str = "float32"):
  del block_size  # part of the cache key only (slots encode it)

  def refresh(bounds, k_arrays, k_scales, slots):
    # k_scales: an int8 cache's key scales per layer (empty otherwise).
    keys = (tuple(QuantizedPages(k, s, kv_dtype) for k, s in zip(k_arrays, k_scales))
            if k_scales else tuple(from_storage(k, jnp.dtype(kv_dtype)) for k in k_arrays))
    return tuple(
        indexer.bounds_storage(
            ops.block_key_bounds(indexer.bounds_view(b, bounds_dtype), k, slots),
            bounds_dtype, b)
        for b, k in zip(bounds, keys))

  return jax.jit(refresh, donate_argnums=(0,))


@functools.cache
def copy_program():
  return jax.jit(_copy_blocks, donate_argnums=(0,))


def sharded_attend(attn_fn, mesh, sparse: bool, q, k, v, *, layer_idx, kv_cache,
                   metadata: StepMetadata, config):
  """`attn_fn` under `shard_map` over the mesh's KV-head axis (tensor parallelism): each
  device attends with its own query / KV heads over its shard of the pages (and key
  bounds, host pages); block tables and every other step input are the same on all.
  Nothing crosses devices here except HiSparse's shared selection (one all-gather of
  the block scores per layer, in indexer.select), so the rows' selection, resolution,
  hot-buffer state and counts come out equal on every device (replicated outputs).
  q [1, tokens, heads, head_dim], k / v [1, tokens, kv_heads, head_dim]."""
  heads = P(None, None, KV_HEADS[2], None)  # pages, int8 scales and key bounds alike
  if sparse:
    cache = dict(kv_cache)
    n = len(cache["pages"])  # (k, v) or (k, v, k scales, v scales)
    if metadata.num_sparse_rows:
      # One memory (CPU): the host loads read the host pages as device-kind arrays (a
      # memory-kind move needs a sharding, which shard_map's body has not).
      device = kv_sharding(mesh, "device")
      cache["host"] = tuple(jax.device_put(a, device) for a in cache["host"])
    in_cache = dict(pages=(heads,) * n, bounds=heads, host=(heads,) * len(cache["host"]),
                    state=P())
    out_cache = dict(pages=(heads,) * n, bounds=heads, state=P(), counts=P(), loaded=P())
  else:
    cache = tuple(kv_cache)
    in_cache = out_cache = (heads,) * len(cache)

  def body(q, k, v, cache, metadata):
    return attn_fn(q, k, v, layer_idx=layer_idx, kv_cache=cache, metadata=metadata,
                   config=config)

  return jax.shard_map(body, mesh=mesh, in_specs=(heads, heads, heads, in_cache, P()),
                       out_specs=(heads, out_cache), check_vma=False)(
                           q, k, v, cache, metadata)


def _copy_blocks(arrays, src, dst):
  # (int8 key bounds are QuantizedBounds: both arrays' rows move.)
  return jax.tree.map(lambda a: a.at[dst].set(a[src], mode="drop"), tuple(arrays))


def _forward(graphdef, params_def, attn_fn, layout, params, head, kv_arrays, bounds,
             hot_state, host_arrays,
             input_ids, token_src, prev_tokens, positions, metadata: StepMetadata,
             logits_indices, temperature, top_p, top_k, seeds, counters,
             extras: SamplerExtras | None, *, greedy_only: bool, num_token_rows: int):
  # head: the output projection packed for the CPU matmul (PackedWeight), or None: the
  # model's own (`ModelRunner.packed_step_weights`). params: the model's state, or its
  # leaves when params_def (its tree structure) is given: a flat tuple of arrays is
  # what the call passes fastest (the state's variables flatten in Python each call).
  # layout: how the layers' caches come out of and go back into the flat arrays
  # (KVLayout, DsaLayout).
  if params_def is not None:
    params = jax.tree.unflatten(params_def, params)
  model = nnx.merge(graphdef, params)
  # Tokens still in flight on the host come from the previous step's output.
  input_ids = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], input_ids)
  kv_caches = layout.layer_caches(model.config.num_hidden_layers, kv_arrays, bounds,
                                  hot_state, host_arrays)
  hidden, kv_caches = model.hidden_states(input_ids[None], positions[None], attn_fn=attn_fn,
                                          kv_caches=kv_caches, attn_metadata=metadata)
  logits = model.compute_logits(hidden[0, logits_indices], head)  # [num_seqs, vocab]
  raw_logits = logits
  if extras is not None:
    logits = _process_logits(logits.astype(jnp.float32), extras, input_ids[logits_indices],
                             token_src[logits_indices] >= 0)
  if greedy_only:
    tokens = greedy(logits)
  else:
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    tokens = sample(logits, temperature, top_p, top_k, keys,
                    extras.min_p if extras is not None and extras.use_min_p else None)
  logprobs = ()
  if extras is not None and extras.num_logprobs:
    logprobs = token_logprobs(raw_logits, tokens, extras.num_logprobs)
  prompt_logprobs = ()
  if extras is not None and extras.num_prompt_logprobs >= 0:
    prompt_logprobs = token_logprobs(model.compute_logits(hidden[0, extras.prompt_rows], head),
                                     extras.prompt_targets, extras.num_prompt_logprobs)
  logprobs = (logprobs, prompt_logprobs)
  # One shape for every step (the next step reads it as prev_tokens).
  tokens = jnp.zeros((num_token_rows,), jnp.int32).at[:tokens.shape[0]].set(tokens)
  new_arrays, new_bounds, new_state, sparse_out = layout.outputs(kv_caches, bounds,
                                                                 hot_state)
  return tokens, new_arrays, new_bounds, new_state, sparse_out, logprobs


def _process_logits(logits, extras: SamplerExtras, last_input, inflight):
  """min_tokens' stop-token mask, then the penalties (vLLM's order). A row's last input
  token is its newest output token when that token was still in flight on the host
  (`inflight`): the host's output_ids lack it, the step adds it."""
  if extras.min_tokens:
    logits = mask_tokens(logits, extras.stop_ids, extras.below_min)
  if extras.penalties:
    vocab = logits.shape[-1]
    newest = jnp.where(inflight, last_input, vocab)[:, None]
    output_ids = jnp.concatenate([extras.output_ids, newest], axis=1)
    logits = apply_penalties(logits, extras.prompt_ids, output_ids, extras.presence,
                             extras.frequency, extras.repetition)
  return logits

"""The jitted step: one forward pass over a ragged batch, KV written into the device pool.

    chunks (host)  --build_batch-->  StepBatch (numpy, padded to buckets)
        |                                  |
        |        execute: ONE jitted call  v
        |   embed -> per layer: qkv -> write_kv(slots) -> attend(block tables) -> mlp
        |   -> logits of each sequence's last token -> sample
        v
    sampled token ids (the step's only device -> host sync)

Every scheduled token of every sequence is one row of a flat token axis (batch 1 for
the model, `seq` = all tokens); `cu_q_lens` cuts it into sequences. Shapes are padded
to power-of-two buckets (tokens, sequences, block-table width) so a run compiles a
bounded number of programs (each in two variants: with the random draws, and argmax
only for all-greedy batches), shared by every engine over the same model structure and
pool dtype (`_step_program`); padded tokens have slot -1 (never written) and belong to
no sequence, padded sequences have length 0.

Attention is `_attend`: the one place where the HiSparse path swaps the dense block
table for a table of selected blocks. With a HiSparseConfig the runner also keeps, per
layer, the key bounds of every device block (`bounds`, [num_blocks, 2, num_kv_heads,
head_dim] float32, donated like the pages), and each layer of the step runs:

    write_kv -> block_key_bounds(touched blocks)
      dense rows (prefill chunks, short sequences):  ragged_paged_attention(block tables)
      sparse rows (one query token, kv_len > sparse_threshold_tokens):
        select   indexer.select(q, bounds[block_tables], kv_lens)  -> logical ids [B, k]
        resolve  logical ids -> device ids through the block table (all blocks are
                 device-resident in this build; the resolver's hot buffer and host loads
                 plug in here)
        attend   paged_attention(q, pages, selected table, selection lengths)

`sparse_rows` (a per-row flag in StepMetadata) decides; shapes stay static (the
selected table is [num_seqs, top_k_blocks]), so the step is still one program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_pallas
from hisparse_jax import indexer
from hisparse_jax.hisparse_config import HiSparseBlocks, HiSparseConfig
from hisparse_jax.kv_pool import KVCacheSpec, KVPool
from hisparse_jax.sampling import sample
from hisparse_jax.scheduler import ScheduledChunk


def bucket(n: int, minimum: int, maximum: int | None = None) -> int:
  """Next power of two >= n (at least `minimum`, at most `maximum` when n fits)."""
  b = max(minimum, 1 << max(0, n - 1).bit_length())
  return max(n, min(b, maximum)) if maximum is not None else b


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """Per-step attention inputs (all int32)."""

  slot_ids: jax.Array  # [num_tokens]; -1 = padding, not written
  block_tables: jax.Array  # [num_seqs, max_blocks]; padded with the null block 0
  kv_lens: jax.Array  # [num_seqs]: tokens in the cache after this step
  cu_q_lens: jax.Array  # [num_seqs + 1]
  sparse_rows: jax.Array  # bool [num_seqs]: decode rows that attend over selected blocks


@dataclasses.dataclass(frozen=True)
class StepBatch:
  """Host-side arrays of one step, already padded."""

  input_ids: np.ndarray  # int32 [num_tokens]
  positions: np.ndarray  # int32 [num_tokens]
  metadata: StepMetadata  # numpy leaves
  logits_indices: np.ndarray  # int32 [num_seqs]: row of each sequence's last token
  temperature: np.ndarray  # float32 [num_seqs]
  top_p: np.ndarray  # float32 [num_seqs]
  top_k: np.ndarray  # int32 [num_seqs]
  seeds: np.ndarray  # uint32 [num_seqs]
  counters: np.ndarray  # int32 [num_seqs]: draws the request made before
  num_seqs: int  # real sequences (rows past it are padding)
  # int32 [num_seqs] (real rows only): blocks each row's attention reads, the selected
  # ones for sparse rows (min(top_k_blocks, valid blocks), the indexer's invariant).
  blocks_attended: np.ndarray | None = None


def bounds_bytes_per_block(spec: KVCacheSpec) -> int:
  """Device bytes of the key bounds of one block id over all layers (float32 min, max)."""
  return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4


class ModelRunner:
  """Owns the jitted step and the device pool's arrays between steps.

  Invariants: the device pool's arrays (and the key bounds, with HiSparse) are only
  replaced by arrays the jitted step, `copy_blocks` or `refresh_bounds` returned
  (donated, updated in place); after every step, the bounds of each block a running
  sequence holds equal `block_key_bounds_reference` over its valid tokens.
  """

  def __init__(self, model: nnx.Module, device_pool: KVPool, *, max_model_len: int,
               max_num_seqs: int, max_num_batched_tokens: int,
               kernel_backend: str | None = None, hisparse: HiSparseConfig | None = None):
    self.config = model.config
    self.pool = device_pool
    self.block_size = device_pool.spec.block_size
    self.max_blocks_per_seq = -(-max_model_len // self.block_size)
    self.max_num_seqs = max_num_seqs
    self.max_num_batched_tokens = max_num_batched_tokens
    self.ops = kernels_pallas.ops(kernel_backend)
    self.hisparse = hisparse
    self.hisparse_blocks = hisparse.blocks(self.block_size) if hisparse is not None else None
    # Per-layer key bounds of every device block: [num_blocks, 2, num_kv_heads, head_dim].
    self.bounds: tuple[jax.Array, ...] = ()
    if hisparse is not None:
      spec = device_pool.spec
      shape = (device_pool.num_blocks, 2, spec.num_kv_heads, spec.head_dim)
      zeros = jax.jit(functools.partial(jnp.zeros, shape, jnp.float32),
                      out_shardings=device_pool.sharding)
      self.bounds = tuple(zeros() for _ in range(spec.num_layers))
    graphdef, self.params = nnx.split(model)
    self._step = _step_program(graphdef, self.ops, device_pool.spec.dtype,
                               device_pool.storage_dtype, self.hisparse_blocks,
                               hisparse.selection if hisparse is not None else None)
    self._copy = _copy_program()
    self._refresh = _refresh_program(self.ops, device_pool.spec.dtype, self.block_size)
    # (tokens, sequences, block-table width, greedy only) of every step run so far.
    self.shapes_compiled: set[tuple[int, int, int, bool]] = set()

  @property
  def reserved_bytes(self) -> int:
    """Device bytes the runner holds besides the pool (the key bounds)."""
    return sum(int(b.nbytes) for b in self.bounds)

  # --- Host side -----------------------------------------------------------------

  def build_batch(self, chunks: Sequence[ScheduledChunk],
                  block_tables: np.ndarray) -> StepBatch:
    """Flattens the scheduled chunks into padded step arrays.

    `block_tables` [len(chunks), width] are the device tables of the chunks' requests.
    """
    num_tokens = sum(c.num_tokens for c in chunks)
    t_pad = bucket(num_tokens, 16, self.max_num_batched_tokens)
    b_pad = bucket(len(chunks), 4, self.max_num_seqs)
    w_pad = bucket(block_tables.shape[1], 4, self.max_blocks_per_seq)
    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_ids = np.full(t_pad, -1, np.int32)
    tables = np.zeros((b_pad, w_pad), np.int32)
    tables[:len(chunks), :block_tables.shape[1]] = block_tables
    kv_lens = np.zeros(b_pad, np.int32)
    cu_q_lens = np.full(b_pad + 1, num_tokens, np.int32)
    logits_indices = np.zeros(b_pad, np.int32)
    temperature = np.zeros(b_pad, np.float32)
    top_p = np.ones(b_pad, np.float32)
    top_k = np.zeros(b_pad, np.int32)
    seeds = np.zeros(b_pad, np.uint32)
    counters = np.zeros(b_pad, np.int32)
    sparse_rows = np.zeros(b_pad, bool)
    blocks_attended = np.zeros(len(chunks), np.int32)
    offset = 0
    for i, chunk in enumerate(chunks):
      request, n = chunk.request, chunk.num_tokens
      tokens = request.all_token_ids[chunk.start:chunk.start + n]
      input_ids[offset:offset + n] = tokens
      positions[offset:offset + n] = np.arange(chunk.start, chunk.start + n)
      slot_ids[offset:offset + n] = chunk.slot_ids
      cu_q_lens[i] = offset
      kv_lens[i] = chunk.start + n
      logits_indices[i] = offset + n - 1
      sp = request.sampling_params
      temperature[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, max(sp.top_k, 0)
      seeds[i] = request.seed
      counters[i] = len(request.output_token_ids)
      num_blocks = -(-kv_lens[i] // self.block_size)
      # A sparse row has one query token (a decode); chunks of several tokens stay dense.
      sparse_rows[i] = (self.hisparse is not None and n == 1
                        and self.hisparse.is_sparse(int(kv_lens[i])))
      blocks_attended[i] = (min(num_blocks, self.hisparse_blocks.top_k_blocks)
                            if sparse_rows[i] else num_blocks)
      offset += n
    cu_q_lens[len(chunks)] = offset
    meta = StepMetadata(slot_ids, tables, kv_lens, cu_q_lens, sparse_rows)
    return StepBatch(input_ids, positions, meta, logits_indices, temperature, top_p, top_k,
                     seeds, counters, len(chunks), blocks_attended)

  # --- Device side ---------------------------------------------------------------

  def execute(self, batch: StepBatch) -> np.ndarray:
    """Runs the step; returns int32 [batch.num_seqs] sampled tokens (one host sync).

    A batch of greedy requests only runs a program without the random draws (argmax):
    the threefry draws cost as much compile time as the whole tiny forward.
    """
    greedy_only = not np.any(batch.temperature > 0)
    self.shapes_compiled.add((batch.input_ids.shape[0], batch.logits_indices.shape[0],
                              batch.metadata.block_tables.shape[1], greedy_only))
    tokens, arrays, self.bounds = self._step(
        self.params, self.pool.arrays(), self.bounds, batch.input_ids, batch.positions,
        batch.metadata, batch.logits_indices, batch.temperature, batch.top_p, batch.top_k,
        batch.seeds, batch.counters, greedy_only=greedy_only)
    self.pool.set_arrays(arrays)
    return np.asarray(tokens)[:batch.num_seqs]

  def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write: device block src -> dst, every layer, one jitted call."""
    if not copies:
      return
    n = bucket(len(copies), 4)
    src = np.zeros(n, np.int32)
    dst = np.full(n, self.pool.num_blocks, np.int32)  # padding: out of range, dropped
    src[:len(copies)], dst[:len(copies)] = zip(*copies)
    num_pool_arrays = 2 * self.pool.num_layers
    arrays = self._copy((*self.pool.arrays(), *self.bounds), src, dst)
    self.pool.set_arrays(arrays[:num_pool_arrays])
    self.bounds = arrays[num_pool_arrays:]

  def refresh_bounds(self, device_ids: np.ndarray) -> None:
    """Recomputes the key bounds of whole blocks whose pages changed outside the step
    (swapped in from the host pool). A partly filled block gets the bound of all its
    slots here; the step that writes its next token (the one right after a swap-in)
    recomputes it over its valid tokens."""
    if not self.bounds or len(device_ids) == 0:
      return
    slots = np.full(bucket(len(device_ids), 4), -1, np.int32)
    slots[:len(device_ids)] = np.asarray(device_ids) * self.block_size + self.block_size - 1
    self.bounds = self._refresh(self.bounds, self.pool.arrays()[:self.pool.num_layers], slots)


@functools.cache  # one jitted program per model structure, shared by engines of a process
def _step_program(graphdef, ops: kernels_pallas.KernelOps, kv_dtype: str, storage_dtype,
                  blocks: HiSparseBlocks | None = None, selection: str | None = None):
  attn_fn = functools.partial(_attend, ops, jnp.dtype(kv_dtype), jnp.dtype(storage_dtype),
                              blocks, selection)
  forward = functools.partial(_forward, graphdef, attn_fn)
  return jax.jit(forward, donate_argnums=(1, 2), static_argnames=("greedy_only",))


@functools.cache
def _refresh_program(ops: kernels_pallas.KernelOps, kv_dtype: str, block_size: int):
  del block_size  # part of the cache key only (slots encode it)

  def refresh(bounds, k_arrays, slots):
    return tuple(ops.block_key_bounds(b, _from_storage(k, jnp.dtype(kv_dtype)), slots)
                 for b, k in zip(bounds, k_arrays))

  return jax.jit(refresh, donate_argnums=(0,))


@functools.cache
def _copy_program():
  return jax.jit(_copy_blocks, donate_argnums=(0,))


def _copy_blocks(arrays, src, dst):
  return tuple(a.at[dst].set(a[src], mode="drop") for a in arrays)


def _forward(graphdef, attn_fn, params, kv_arrays, bounds, input_ids, positions,
             metadata: StepMetadata, logits_indices, temperature, top_p, top_k, seeds,
             counters, *, greedy_only: bool):
  model = nnx.merge(graphdef, params)
  num_layers = len(kv_arrays) // 2
  kv_caches = [(kv_arrays[i], kv_arrays[num_layers + i], *bounds[i:i + 1])
               for i in range(num_layers)]
  hidden, kv_caches = model.hidden_states(input_ids[None], positions[None], attn_fn=attn_fn,
                                          kv_caches=kv_caches, attn_metadata=metadata)
  logits = model.compute_logits(hidden[0, logits_indices])  # [num_seqs, vocab]
  if greedy_only:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    tokens = sample(logits, temperature, top_p, top_k, keys)
  new_arrays = tuple(c[0] for c in kv_caches) + tuple(c[1] for c in kv_caches)
  return tokens, new_arrays, tuple(c[2] for c in kv_caches if len(c) > 2)


def _to_storage(x, kv_dtype, storage_dtype):
  """Logical -> storage dtype (a bitcast for bfloat16 stored as uint16 on CPU; KVPool)."""
  if x.dtype == storage_dtype:
    return x
  return jax.lax.bitcast_convert_type(x.astype(kv_dtype), storage_dtype)


def _from_storage(x, kv_dtype):
  return x if x.dtype == kv_dtype else jax.lax.bitcast_convert_type(x, kv_dtype)


def _attend(ops: kernels_pallas.KernelOps, kv_dtype, storage_dtype,
            blocks: HiSparseBlocks | None, selection: str | None, q, k, v, *, layer_idx,
            kv_cache, metadata: StepMetadata, config):
  """Writes this step's K/V into the pages (and their blocks' key bounds, with HiSparse),
  then attends: each sequence over its blocks, or sparse rows over their selected ones."""
  del layer_idx
  k_pages, v_pages, *bounds = kv_cache
  k_pages, v_pages = ops.write_kv(k_pages, v_pages, _to_storage(k[0], kv_dtype, storage_dtype),
                                  _to_storage(v[0], kv_dtype, storage_dtype), metadata.slot_ids)
  k_view, v_view = _from_storage(k_pages, kv_dtype), _from_storage(v_pages, kv_dtype)
  if blocks is None:
    out = ops.ragged_paged_attention(
        q[0], k_view, v_view, metadata.block_tables, metadata.kv_lens, metadata.cu_q_lens,
        sliding_window=config.sliding_window)
    return out[None], (k_pages, v_pages)
  bounds = ops.block_key_bounds(bounds[0], k_view, metadata.slot_ids)
  out = _hisparse_attention(ops, blocks, selection, q[0], k_view, v_view, bounds, metadata,
                            config)
  return out[None], (k_pages, v_pages, bounds)


def _hisparse_attention(ops: kernels_pallas.KernelOps, blocks: HiSparseBlocks, selection: str,
                        q, k_view, v_view, bounds, metadata: StepMetadata, config):
  """Dense rows through ragged attention, sparse rows through select -> resolve -> attend.

  q [num_tokens, num_q_heads, head_dim]; returns the same shape.
  """
  sparse = metadata.sparse_rows  # bool [num_seqs]
  num_tokens = q.shape[0]
  # Sparse rows are cut to one key in the dense call (their output is replaced below),
  # so the ragged kernel does no work for them.
  dense_lens = jnp.where(sparse, 1, metadata.kv_lens)
  out = ops.ragged_paged_attention(q, k_view, v_view, metadata.block_tables, dense_lens,
                                   metadata.cu_q_lens, sliding_window=config.sliding_window)
  rows = jnp.minimum(metadata.cu_q_lens[:-1], num_tokens - 1)  # the query token of each row
  q_rows = q[rows]  # [num_seqs, num_q_heads, head_dim]
  # select: bounds of each row's blocks, in logical order.
  sel = indexer.select(q_rows, bounds[metadata.block_tables], metadata.kv_lens, blocks,
                       selection)
  # resolve: logical -> device block ids. Every block is device-resident in this build;
  # the resolver (hot-buffer hits, host loads into LRU slots) replaces this gather.
  logical = jnp.where(sel.valid, sel.logical_ids, 0)
  table = jnp.where(sel.valid, jnp.take_along_axis(metadata.block_tables, logical, axis=1), 0)
  # attend: the newest, partly filled block is last (indexer order).
  lengths = jnp.where(sparse, sel.lengths, 0)
  sparse_out = ops.paged_attention(q_rows, k_view, v_view, table, lengths)
  dst = jnp.where(sparse, rows, num_tokens)  # dense rows dropped
  return out.at[dst].set(sparse_out.astype(out.dtype), mode="drop")

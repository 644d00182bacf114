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
layer, the key bounds of every device block AND every host block in one array
(`bounds`, [num_device_blocks + num_host_blocks, 2, num_kv_heads, head_dim] float32:
device block i at row i, host block j at row num_device_blocks + j; donated like the
pages), and each layer of the step runs:

    write_kv -> block_key_bounds(touched blocks)
      dense rows (prefill chunks, short sequences):  ragged_paged_attention(block tables)
      sparse rows (one query token, kv_len > sparse_threshold_tokens):
        select   indexer.select(q, key bounds of each logical block, kv_lens)
                 -> logical ids [B, k]; one gather of `bounds` reads a resident block's
                 row (by device id) or a dropped block's (by host id)
        resolve  resolver.resolve: resident device block / hot-buffer slot / host miss
                 (LRU slot of that sequence's hot buffer), hot-buffer state per layer
        load     resolver.load_blocks: the misses, host pool -> hot-buffer slots, inside
                 this program (GPU: one host gather under compute_on("device_host") sized
                 to the misses; CPU, one memory: a loop of exactly the misses' block
                 copies); no miss moves nothing
        attend   paged_attention(q, pages, resolved table, selection kv_lens)

`sparse_rows` (a per-row flag in StepMetadata) decides; shapes stay static (the
selected table is [num_seqs, top_k_blocks]), so the step is still one program.

Tier inputs of a step (`SparseTiers`, from the block manager): each row's host copies
per logical block (`host_tables`), its hot-buffer device blocks (`hot_slots`), and its
row of the hot-buffer state (`hot_rows`; `hot_reset` starts it empty). The runner owns
that state on the device: per layer [rows, slots] slot contents and last use, and
[rows, max_blocks] eviction steps, donated through the step like the pages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import kernels_pallas
from hisparse_jax import indexer, resolver
from hisparse_jax.capacity import bounds_bytes_per_block  # noqa: F401 (re-exported)
from hisparse_jax.hisparse_config import HiSparseBlocks, HiSparseConfig
from hisparse_jax.kv_pool import KVPool, from_storage, to_storage
from hisparse_jax.sampling import (
    apply_penalties,
    greedy,
    mask_tokens,
    sample,
    token_logprobs,
)
from hisparse_jax.scheduler import ScheduledChunk
from hisparse_jax.transfer import bucket_size
from kernels_pallas.xla_attention import decode_rows_bucket


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """Per-step attention inputs (all int32)."""

  slot_ids: jax.Array  # [num_tokens]; -1 = padding, not written
  block_tables: jax.Array  # [num_seqs, max_blocks]; padded with the null block 0
  kv_lens: jax.Array  # [num_seqs]: tokens in the cache after this step
  cu_q_lens: jax.Array  # [num_seqs + 1]
  sparse_rows: jax.Array  # bool [num_seqs]: decode rows that attend over selected blocks
  # HiSparse tiers (None without HiSparse):
  host_tables: jax.Array | None = None  # [num_seqs, max_blocks] host copy ids, 0 = none
  hot_slots: jax.Array | None = None  # [num_seqs, num_slots] hot-buffer device blocks
  hot_rows: jax.Array | None = None  # [num_seqs] hot-state row; >= rows: none
  hot_reset: jax.Array | None = None  # bool [num_seqs]: start the row empty
  step: jax.Array | None = None  # int32 scalar: decode-step clock of the hot buffers
  # Static sizes of the dense attention call (KernelOps.ragged_hints of the rows' query
  # lengths), as sorted (name, value) pairs: part of the compiled program's key.
  ragged_hints: tuple[tuple[str, int], ...] = dataclasses.field(
      default=(), metadata={"static": True})
  # HiSparse: rows the sparse path computes (a multiple of 8 holding the sparse rows; 0:
  # no sparse path in the program).
  num_sparse_rows: int = dataclasses.field(default=0, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerExtras:
  """Per-row sampling inputs beyond temperature / top-p / top-k, built only for a batch
  where some request asks for them (otherwise the step takes None and compiles none of
  it). Token-id arrays are padded with ids >= vocab (ignored)."""

  min_p: jax.Array  # float32 [num_seqs] (0: off)
  presence: jax.Array  # float32 [num_seqs] (0: off)
  frequency: jax.Array  # float32 [num_seqs] (0: off)
  repetition: jax.Array  # float32 [num_seqs] (1: off)
  prompt_ids: jax.Array  # int32 [num_seqs, P]: prompt tokens (repetition penalty; P may be 0)
  output_ids: jax.Array  # int32 [num_seqs, L]: output tokens known on the host
  stop_ids: jax.Array  # int32 [num_seqs, S]: EOS + stop_token_ids (min_tokens)
  below_min: jax.Array  # bool [num_seqs]: rows that may not sample a stop token yet
  penalties: bool = dataclasses.field(default=False, metadata={"static": True})
  use_min_p: bool = dataclasses.field(default=False, metadata={"static": True})
  min_tokens: bool = dataclasses.field(default=False, metadata={"static": True})
  num_logprobs: int = dataclasses.field(default=0, metadata={"static": True})  # 0: none
  # SamplingParams.prompt_logprobs: the logprob of `prompt_targets[j]` (the next prompt
  # token) after the token at step row `prompt_rows[j]`, and the top
  # `num_prompt_logprobs` there (-1: none computed; rows past the real ones: padding).
  prompt_rows: jax.Array | None = None  # int32 [R]
  prompt_targets: jax.Array | None = None  # int32 [R]
  num_prompt_logprobs: int = dataclasses.field(default=-1, metadata={"static": True})


def needs_extras(sp) -> bool:
  """Whether a request's SamplingParams need `SamplerExtras` in its steps."""
  return (sp.has_penalties or sp.min_p > 0 or sp.min_tokens > 0
          or sp.logprobs is not None or sp.prompt_logprobs is not None)


@dataclasses.dataclass(frozen=True)
class SparseTiers:
  """Where each chunk's blocks live (host numpy arrays, one row per chunk)."""

  host_tables: np.ndarray  # int32 [n, width]: host copy of each logical block, 0 = none
  hot_slots: np.ndarray  # int32 [n, num_slots]: hot-buffer device blocks, 0 = none
  hot_rows: np.ndarray  # int32 [n]: row of the runner's hot-buffer state; -1 = none
  hot_reset: np.ndarray  # bool [n]: the row's state starts empty this step


@dataclasses.dataclass(frozen=True)
class StepBatch:
  """Host-side arrays of one step, already padded."""

  input_ids: np.ndarray  # int32 [num_tokens]
  # int32 [num_tokens]: row of the previous step's sampled tokens that is this token (a
  # decode of a token still in flight), -1 = input_ids holds it.
  token_src: np.ndarray
  positions: np.ndarray  # int32 [num_tokens]
  metadata: StepMetadata  # numpy leaves
  logits_indices: np.ndarray  # int32 [num_seqs]: row of each sequence's last token
  temperature: np.ndarray  # float32 [num_seqs]
  top_p: np.ndarray  # float32 [num_seqs]
  top_k: np.ndarray  # int32 [num_seqs]
  seeds: np.ndarray  # uint32 [num_seqs]
  counters: np.ndarray  # int32 [num_seqs]: draws the request made before
  num_seqs: int  # real sequences (rows past it are padding)
  extras: SamplerExtras | None = None  # numpy leaves; None: no request needs them
  # int32 [num_seqs] (real rows only): blocks each row's attention reads, the selected
  # ones for sparse rows (min(top_k_blocks, valid blocks), the indexer's invariant).
  blocks_attended: np.ndarray | None = None
  # SamplingParams.prompt_logprobs: (chunk index, first row in the step's prompt-logprob
  # arrays, rows) of each chunk whose prompt positions get them.
  prompt_spans: tuple[tuple[int, int, int], ...] = ()


# Per row and layer of a HiSparse step: [device, hot, host, evictions, thrash] blocks.
COUNT_FIELDS = ("device", "hot", "host", "evictions", "thrash")


@dataclasses.dataclass(frozen=True)
class StepHandle:
  """A dispatched step: its results stay on the device until `ModelRunner.collect`."""

  tokens: jax.Array  # int32 [max_num_seqs]: sampled token of each row (rows past num_seqs: 0)
  counts: jax.Array  # int32 [layers, rows, 5] (HiSparse), else [0]
  loaded: jax.Array  # int32 [layers]: blocks the in-step host loads moved (HiSparse)
  num_seqs: int
  sparse: bool  # whether `counts` and `loaded` are read back
  # (sampled logprob [rows], its rank, top ids [rows, N], top logprobs), or () if none.
  logprobs: tuple = ()
  prompt_logprobs: tuple = ()  # the same four per prompt-logprob row, or () if none


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What a step hands back to the host (`ModelRunner.collect`)."""

  tokens: np.ndarray  # int32 [num_seqs] sampled tokens
  counts: np.ndarray | None  # int32 [layers, num_seqs, 5] (COUNT_FIELDS), HiSparse only
  loaded: np.ndarray | None  # int32 [layers]: blocks the step's host loads moved, HiSparse
  # (sampled logprob [num_seqs], rank, top ids [num_seqs, N], top logprobs) or None.
  logprobs: tuple[np.ndarray, ...] | None = None
  prompt_logprobs: tuple[np.ndarray, ...] | None = None  # per StepBatch.prompt_spans row

  @property
  def loaded_block_layers(self) -> int:
    """Blocks x layers the step's host loads moved (0 without HiSparse)."""
    return 0 if self.loaded is None else int(self.loaded.sum())


class ModelRunner:
  """Owns the jitted step and the device pool's arrays between steps.

  Invariants: the device pool's arrays (and the key bounds, with HiSparse) are only
  replaced by arrays the jitted step, `copy_blocks` or `refresh_bounds` returned
  (donated, updated in place); after every step, the bounds of each block a running
  sequence holds equal `block_key_bounds_reference` over its valid tokens.
  """

  def __init__(self, model: nnx.Module, device_pool: KVPool, *, max_model_len: int,
               max_num_seqs: int, max_num_batched_tokens: int,
               kernel_backend: str | None = None, hisparse: HiSparseConfig | None = None,
               host_pool: KVPool | None = None, eos_token_ids: Sequence[int] = ()):
    self.config = model.config
    self.vocab_size = model.config.vocab_size
    self.eos_token_ids = tuple(eos_token_ids)  # stop tokens min_tokens holds back
    self.pool = device_pool
    self.block_size = device_pool.spec.block_size
    self.max_blocks_per_seq = -(-max_model_len // self.block_size)
    self.max_num_seqs = max_num_seqs
    self.max_num_batched_tokens = max_num_batched_tokens
    self.ops = kernels_pallas.ops(kernel_backend)
    self.hisparse = hisparse
    self.hisparse_blocks = hisparse.blocks(self.block_size) if hisparse is not None else None
    # Per-layer key bounds of every device block: [num_blocks, 2, num_kv_heads, head_dim].
    # Per-layer key bounds of every device block (rows [0, num_blocks)) and, with
    # HiSparse, of every host block (rows num_blocks + host id): [rows, 2, heads, dim].
    self.bounds: tuple[jax.Array, ...] = ()
    # HiSparse: key bounds by host block id (for blocks whose device copy was dropped),
    # and the hot-buffer state, one row per offloaded sequence (rows = max_num_seqs).
    self.host_pool = host_pool
    self.hot_state: tuple[jax.Array, jax.Array, jax.Array] | None = None
    self.num_hot_rows = max_num_seqs
    self.step_clock = 0
    self.last_counts: np.ndarray | None = None  # int32 [layers, num_seqs, 5] (COUNT_FIELDS)
    if hisparse is not None:
      if host_pool is None:
        raise ValueError("hisparse needs the host pool (host_pool=...)")
      spec = device_pool.spec
      # Blocks written to the host pool keep their key bounds on the device, so a
      # dropped block can still be scored.
      self.bounds = tuple(
          _zeros((device_pool.num_blocks + host_pool.num_blocks, 2, spec.num_kv_heads,
                  spec.head_dim), jnp.float32, 0, device_pool.sharding)
          for _ in range(spec.num_layers))
      rows, slots = (spec.num_layers, self.num_hot_rows), self.hisparse_blocks.hot_buffer_blocks
      self.hot_state = (
          _zeros((*rows, slots), jnp.int32, -1, device_pool.sharding),
          _zeros((*rows, slots), jnp.int32, resolver.NEVER, device_pool.sharding),
          _zeros((*rows, self.max_blocks_per_seq), jnp.int32, resolver.NEVER,
                 device_pool.sharding))
    graphdef, self.params = nnx.split(model)
    self._step = _step_program(
        graphdef, self.ops, device_pool.spec.dtype, device_pool.storage_dtype,
        self.hisparse_blocks, hisparse.selection if hisparse is not None else None,
        hisparse.thrash_window_steps if hisparse is not None else 0,
        device_pool.sharding, host_pool.sharding if host_pool is not None else None)
    self._copy = _copy_program()
    self._refresh = _refresh_program(self.ops, device_pool.spec.dtype, self.block_size)
    # (tokens, sequences, block-table width, greedy only) of every step run so far.
    self.shapes_compiled: set[tuple[int, int, int, bool]] = set()
    # The previous-step tokens of a step that reads none (its token_src is all -1).
    self._no_tokens = jax.device_put(np.zeros(max_num_seqs, np.int32), device_pool.sharding)

  @property
  def reserved_bytes(self) -> int:
    """Device bytes the runner holds besides the pool (key bounds by device and by host
    block, hot-buffer state)."""
    return self.indexer_bytes + sum(int(a.nbytes) for a in self.hot_state or ())

  @property
  def indexer_bytes(self) -> int:
    """Device bytes of the indexer's key bounds (by device block and by host block)."""
    return sum(int(b.nbytes) for b in self.bounds)

  # --- Host side -----------------------------------------------------------------

  def build_batch(self, chunks: Sequence[ScheduledChunk], block_tables: np.ndarray,
                  tiers: SparseTiers | None = None) -> StepBatch:
    """Flattens the scheduled chunks into padded step arrays.

    `block_tables` [len(chunks), width] are the device tables of the chunks' requests
    (0 for blocks an offloaded sequence dropped); `tiers` says where HiSparse blocks
    live (None: every block device-resident, no hot buffer).
    """
    num_tokens = sum(c.num_tokens for c in chunks)
    t_pad = bucket_size(num_tokens, 16, self.max_num_batched_tokens)
    b_pad = bucket_size(len(chunks), 4, self.max_num_seqs)
    w_pad = bucket_size(block_tables.shape[1], 4, self.max_blocks_per_seq)
    input_ids = np.zeros(t_pad, np.int32)
    token_src = np.full(t_pad, -1, np.int32)
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
      if n == 0:  # samples from the logits of the chunk before it (n > 1), attends nothing
        if chunk.logits_of is None or i == 0 or chunk.logits_of not in (
            chunks[i - 1].request, chunks[i - 1].logits_of):
          raise ValueError("a chunk without tokens must follow the chunk it samples from")
        cu_q_lens[i] = offset
        logits_indices[i] = logits_indices[i - 1]
        sp = request.sampling_params
        temperature[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, max(sp.top_k, 0)
        seeds[i] = request.seed
        counters[i] = len(request.output_token_ids) + request.num_inflight
        continue
      if request.num_inflight and chunk.start + n == request.num_tokens:
        # A decode of the token the previous step is still sampling: read it there.
        token_src[offset] = request.inflight_row
      else:
        input_ids[offset:offset + n] = request.token_slice(chunk.start, chunk.start + n)
      positions[offset:offset + n] = np.arange(chunk.start, chunk.start + n)
      slot_ids[offset:offset + n] = chunk.slot_ids
      cu_q_lens[i] = offset
      kv_lens[i] = chunk.start + n
      logits_indices[i] = offset + n - 1
      sp = request.sampling_params
      temperature[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, max(sp.top_k, 0)
      seeds[i] = request.seed
      counters[i] = len(request.output_token_ids) + request.num_inflight
      num_blocks = -(-kv_lens[i] // self.block_size)
      # A sparse row decodes one token past the prefill (an output token); prefill
      # chunks, even of one token (after a prefix-cache hit), stay dense, so a prompt's
      # KV does not depend on how much of it the prefix cache held.
      sparse_rows[i] = (self.hisparse is not None and n == 1
                        and chunk.start >= request.prefill_len
                        and self.hisparse.is_sparse(int(kv_lens[i])))
      blocks_attended[i] = (min(num_blocks, self.hisparse_blocks.top_k_blocks)
                            if sparse_rows[i] else num_blocks)
      offset += n
    cu_q_lens[len(chunks)] = offset
    hisparse_meta = {}
    if self.hisparse is not None:
      n, slots = len(chunks), self.hisparse_blocks.hot_buffer_blocks
      host_tables = np.zeros((b_pad, w_pad), np.int32)
      hot_slots = np.zeros((b_pad, slots), np.int32)
      hot_rows = np.full(b_pad, self.num_hot_rows, np.int32)
      hot_reset = np.zeros(b_pad, bool)
      if tiers is not None:
        host_tables[:n, :tiers.host_tables.shape[1]] = tiers.host_tables
        hot_slots[:n, :tiers.hot_slots.shape[1]] = tiers.hot_slots
        hot_rows[:n] = np.where(tiers.hot_rows >= 0, tiers.hot_rows, self.num_hot_rows)
        hot_reset[:n] = tiers.hot_reset
      hisparse_meta = dict(host_tables=host_tables, hot_slots=hot_slots, hot_rows=hot_rows,
                           hot_reset=hot_reset, step=np.int32(self.step_clock))
    # Sparse rows are not in the dense call (kv_len 0 there), so their query counts not.
    dense_q_lens = [c.num_tokens for c, sparse in zip(chunks, sparse_rows) if not sparse]
    hints = tuple(sorted(self.ops.ragged_hints(dense_q_lens).items()))
    meta = StepMetadata(slot_ids, tables, kv_lens, cu_q_lens, sparse_rows, **hisparse_meta,
                        ragged_hints=hints,
                        num_sparse_rows=decode_rows_bucket(int(sparse_rows.sum())))
    extras, spans = None, ()
    if any(needs_extras(c.request.sampling_params) for c in chunks):
      extras, spans = self._sampler_extras(chunks, b_pad, cu_q_lens)
    return StepBatch(input_ids, token_src, positions, meta, logits_indices, temperature, top_p,
                     top_k, seeds, counters, len(chunks), extras, blocks_attended, spans)

  def _sampler_extras(self, chunks: Sequence[ScheduledChunk], b_pad: int,
                      cu_q_lens: np.ndarray) -> tuple[SamplerExtras, tuple]:
    """The batch's `SamplerExtras` and prompt-logprob spans (host work O(prompt +
    output) of the rows that use penalties or prompt logprobs; O(batch) otherwise)."""
    vocab = self.vocab_size
    params = [c.request.sampling_params for c in chunks]
    min_p = np.zeros(b_pad, np.float32)
    presence = np.zeros(b_pad, np.float32)
    frequency = np.zeros(b_pad, np.float32)
    repetition = np.ones(b_pad, np.float32)
    below_min = np.zeros(b_pad, bool)
    penalized = [i for i, sp in enumerate(params) if sp.has_penalties]
    repeated = [i for i in penalized if params[i].repetition_penalty != 1.0]
    limited = [i for i, sp in enumerate(params) if sp.min_tokens > 0]
    p_len = bucket_size(max(len(chunks[i].request.prompt_token_ids) for i in repeated), 16) \
        if repeated else 0
    o_len = bucket_size(max(len(chunks[i].request.output_token_ids) for i in penalized), 8) \
        if penalized else 0
    stops = {i: sorted(set(params[i].stop_token_ids)
                       | (set() if params[i].ignore_eos else set(self.eos_token_ids)))
             for i in limited}
    s_len = bucket_size(max(len(v) for v in stops.values()), 4) if limited else 0
    prompt_ids = np.full((b_pad, p_len), vocab, np.int32)
    output_ids = np.full((b_pad, o_len), vocab, np.int32)
    stop_ids = np.full((b_pad, s_len), vocab, np.int32)
    for i, (chunk, sp) in enumerate(zip(chunks, params)):
      request = chunk.request
      min_p[i] = sp.min_p
      presence[i], frequency[i] = sp.presence_penalty, sp.frequency_penalty
      repetition[i] = sp.repetition_penalty
      below_min[i] = len(request.output_token_ids) + request.num_inflight < sp.min_tokens
    for i in repeated:
      prompt = chunks[i].request.prompt_token_ids
      prompt_ids[i, :len(prompt)] = prompt
    for i in penalized:
      output = chunks[i].request.output_token_ids
      output_ids[i, :len(output)] = output
    for i, ids in stops.items():
      stop_ids[i, :len(ids)] = ids
    num_logprobs = max((sp.logprobs for sp in params if sp.logprobs is not None), default=-1)
    # Prompt logprobs: after each prompt token of this step but the prompt's last, the
    # next prompt token (once per request: not again when it is recomputed).
    spans, rows, targets, num_top = [], [], [], -1
    for i, (chunk, sp) in enumerate(zip(chunks, params)):
      request = chunk.request
      if sp.prompt_logprobs is None or len(request.prompt_logprobs) >= len(
          request.prompt_token_ids):
        continue
      end = min(chunk.start + chunk.num_tokens, len(request.prompt_token_ids) - 1)
      if end <= chunk.start:
        continue
      spans.append((i, len(rows), end - chunk.start))
      rows.extend(range(cu_q_lens[i], cu_q_lens[i] + end - chunk.start))
      targets.extend(request.prompt_token_ids[chunk.start + 1:end + 1])
      num_top = max(num_top, sp.prompt_logprobs)
    prompt_rows = prompt_targets = None
    if spans:
      prompt_rows = np.zeros(bucket_size(len(rows), 16), np.int32)
      prompt_targets = np.zeros_like(prompt_rows)
      prompt_rows[:len(rows)], prompt_targets[:len(rows)] = rows, targets
      num_top = min(bucket_size(max(num_top, 1), 1), vocab)
    extras = SamplerExtras(
        min_p, presence, frequency, repetition, prompt_ids, output_ids, stop_ids, below_min,
        penalties=bool(penalized), use_min_p=any(sp.min_p > 0 for sp in params),
        min_tokens=bool(limited),
        num_logprobs=0 if num_logprobs < 0 else min(bucket_size(max(num_logprobs, 1), 1), vocab),
        prompt_rows=prompt_rows, prompt_targets=prompt_targets,
        num_prompt_logprobs=num_top if spans else -1)
    return extras, tuple(spans)

  # --- Device side ---------------------------------------------------------------

  def dispatch(self, batch: StepBatch, prev_tokens: jax.Array | None = None) -> StepHandle:
    """Starts the step on the device and returns at once (JAX dispatches asynchronously).

    `prev_tokens`: the previous step's `StepHandle.tokens`, where the batch's `token_src`
    rows read their input token (None: no such row). A batch of greedy requests only
    runs a program without the random draws (argmax): the threefry draws cost as much
    compile time as the whole tiny forward.
    """
    greedy_only = not np.any(batch.temperature > 0)
    self.shapes_compiled.add((batch.input_ids.shape[0], batch.logits_indices.shape[0],
                              batch.metadata.block_tables.shape[1], greedy_only))
    if prev_tokens is None:
      if np.any(batch.token_src >= 0):
        raise ValueError("the batch reads tokens of a previous step; pass prev_tokens")
      prev_tokens = self._no_tokens
    host_arrays = self.host_pool.arrays() if self.hisparse is not None else ()
    (tokens, arrays, self.bounds, self.hot_state, (counts, loaded),
     (logprobs, prompt)) = self._step(
        self.params, self.pool.arrays(), self.bounds, self.hot_state, host_arrays,
        batch.input_ids, batch.token_src, prev_tokens, batch.positions,
        batch.metadata, batch.logits_indices, batch.temperature, batch.top_p, batch.top_k,
        batch.seeds, batch.counters, batch.extras, greedy_only=greedy_only,
        num_token_rows=self.max_num_seqs)
    self.pool.set_arrays(arrays)
    if self.hisparse is not None:
      self.step_clock += 1
    return StepHandle(tokens, counts, loaded, batch.num_seqs, self.hisparse is not None,
                      logprobs, prompt)

  def collect(self, handle: StepHandle) -> StepResult:
    """Waits for a dispatched step and reads back what the host needs of it (the step's
    only device-to-host reads)."""
    tokens = np.asarray(handle.tokens)[:handle.num_seqs]
    counts, loaded = None, None
    if handle.sparse:
      counts = np.asarray(handle.counts)[:, :handle.num_seqs]
      loaded = np.asarray(handle.loaded)
    self.last_counts = counts
    logprobs = None
    if handle.logprobs:
      logprobs = tuple(np.asarray(a)[:handle.num_seqs] for a in handle.logprobs)
    prompt = tuple(np.asarray(a) for a in handle.prompt_logprobs) or None
    return StepResult(tokens, counts, loaded, logprobs, prompt)

  def execute(self, batch: StepBatch) -> np.ndarray:
    """Runs the step to the end; returns int32 [batch.num_seqs] sampled tokens."""
    return self.collect(self.dispatch(batch)).tokens

  def copy_bounds_to_host_index(self, device_ids: np.ndarray, host_ids: np.ndarray) -> None:
    """The bounds rows of `host_ids` := those of `device_ids`, every layer (blocks
    written to the host pool keep their key bounds on the device for the indexer)."""
    if not self.bounds or len(device_ids) == 0:
      return
    n = bucket_size(len(device_ids), 4)
    src = np.zeros(n, np.int32)
    dst = np.full(n, self.bounds[0].shape[0], np.int32)  # padding: out of range, dropped
    src[:len(device_ids)] = device_ids
    dst[:len(device_ids)] = self.pool.num_blocks + np.asarray(host_ids)
    self.bounds = self._copy(self.bounds, src, dst)

  def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write: device block src -> dst, every layer, one jitted call."""
    if not copies:
      return
    n = bucket_size(len(copies), 4)
    src = np.zeros(n, np.int32)
    # Padding: out of range of every array (the bounds have the host blocks' rows too).
    dst = np.full(n, max([self.pool.num_blocks] + [b.shape[0] for b in self.bounds]),
                  np.int32)
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
    slots = np.full(bucket_size(len(device_ids), 4), -1, np.int32)
    slots[:len(device_ids)] = np.asarray(device_ids) * self.block_size + self.block_size - 1
    self.bounds = self._refresh(self.bounds, self.pool.arrays()[:self.pool.num_layers], slots)


def _zeros(shape, dtype, value, sharding):
  return jax.jit(functools.partial(jnp.full, shape, value, dtype), out_shardings=sharding)()


@functools.cache  # one jitted program per model structure, shared by engines of a process
def _step_program(graphdef, ops: kernels_pallas.KernelOps, kv_dtype: str, storage_dtype,
                  blocks: HiSparseBlocks | None = None, selection: str | None = None,
                  thrash_window_steps: int = 0, device_sharding=None, host_sharding=None):
  sparse = None
  if blocks is not None:
    sparse = _SparseStatic(blocks, selection, thrash_window_steps, device_sharding,
                           host_sharding)
  attn_fn = functools.partial(_attend, ops, jnp.dtype(kv_dtype), jnp.dtype(storage_dtype),
                              sparse)
  forward = functools.partial(_forward, graphdef, attn_fn)
  return jax.jit(forward, donate_argnums=(1, 2, 3),
                 static_argnames=("greedy_only", "num_token_rows"))


@dataclasses.dataclass(frozen=True)
class _SparseStatic:
  """The static settings of the sparse path of a step program."""

  blocks: HiSparseBlocks
  selection: str
  thrash_window_steps: int
  device_sharding: jax.sharding.Sharding
  host_sharding: jax.sharding.Sharding


@functools.cache
def _refresh_program(ops: kernels_pallas.KernelOps, kv_dtype: str, block_size: int):
  del block_size  # part of the cache key only (slots encode it)

  def refresh(bounds, k_arrays, slots):
    return tuple(ops.block_key_bounds(b, from_storage(k, jnp.dtype(kv_dtype)), slots)
                 for b, k in zip(bounds, k_arrays))

  return jax.jit(refresh, donate_argnums=(0,))


@functools.cache
def _copy_program():
  return jax.jit(_copy_blocks, donate_argnums=(0,))


def _copy_blocks(arrays, src, dst):
  return tuple(a.at[dst].set(a[src], mode="drop") for a in arrays)


def _forward(graphdef, attn_fn, params, kv_arrays, bounds, hot_state, host_arrays,
             input_ids, token_src, prev_tokens, positions, metadata: StepMetadata,
             logits_indices, temperature, top_p, top_k, seeds, counters,
             extras: SamplerExtras | None, *, greedy_only: bool, num_token_rows: int):
  model = nnx.merge(graphdef, params)
  # Tokens still in flight on the host come from the previous step's output.
  input_ids = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], input_ids)
  num_layers = len(kv_arrays) // 2
  if bounds:  # HiSparse: each layer's cache is a dict (see _attend)
    kv_caches = [dict(k=kv_arrays[i], v=kv_arrays[num_layers + i], bounds=bounds[i],
                      host_k=host_arrays[i], host_v=host_arrays[num_layers + i],
                      state=tuple(a[i] for a in hot_state))
                 for i in range(num_layers)]
  else:
    kv_caches = [(kv_arrays[i], kv_arrays[num_layers + i]) for i in range(num_layers)]
  hidden, kv_caches = model.hidden_states(input_ids[None], positions[None], attn_fn=attn_fn,
                                          kv_caches=kv_caches, attn_metadata=metadata)
  logits = model.compute_logits(hidden[0, logits_indices])  # [num_seqs, vocab]
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
    prompt_logprobs = token_logprobs(model.compute_logits(hidden[0, extras.prompt_rows]),
                                     extras.prompt_targets, extras.num_prompt_logprobs)
  logprobs = (logprobs, prompt_logprobs)
  # One shape for every step (the next step reads it as prev_tokens).
  tokens = jnp.zeros((num_token_rows,), jnp.int32).at[:tokens.shape[0]].set(tokens)
  if bounds:
    new_arrays = (tuple(c["k"] for c in kv_caches) + tuple(c["v"] for c in kv_caches))
    new_state = tuple(jnp.stack([c["state"][j] for c in kv_caches]) for j in range(3))
    counts = jnp.stack([c["counts"] for c in kv_caches])  # [layers, num_seqs, 5]
    loaded = jnp.stack([c["loaded"] for c in kv_caches])  # [layers]: blocks moved h2d
    return (tokens, new_arrays, tuple(c["bounds"] for c in kv_caches), new_state,
            (counts, loaded), logprobs)
  new_arrays = tuple(c[0] for c in kv_caches) + tuple(c[1] for c in kv_caches)
  return tokens, new_arrays, (), hot_state, (jnp.zeros((0,), jnp.int32),
                                             jnp.zeros((0,), jnp.int32)), logprobs


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


def _attend(ops: kernels_pallas.KernelOps, kv_dtype, storage_dtype,
            sparse: _SparseStatic | None, q, k, v, *, layer_idx, kv_cache,
            metadata: StepMetadata, config):
  """Writes this step's K/V into the pages (and their blocks' key bounds, with HiSparse),
  then attends: each sequence over its blocks, or sparse rows over their selected ones."""
  del layer_idx
  if sparse is None:
    k_pages, v_pages = kv_cache
    k_pages, v_pages = ops.write_kv(
        k_pages, v_pages, to_storage(k[0], kv_dtype, storage_dtype),
        to_storage(v[0], kv_dtype, storage_dtype), metadata.slot_ids)
    out = ops.ragged_paged_attention(
        q[0], from_storage(k_pages, kv_dtype), from_storage(v_pages, kv_dtype),
        metadata.block_tables, metadata.kv_lens, metadata.cu_q_lens,
        sliding_window=config.sliding_window, **dict(metadata.ragged_hints))
    return out[None], (k_pages, v_pages)
  cache = dict(kv_cache)
  k_pages, v_pages = ops.write_kv(
      cache["k"], cache["v"], to_storage(k[0], kv_dtype, storage_dtype),
      to_storage(v[0], kv_dtype, storage_dtype), metadata.slot_ids)
  bounds = ops.block_key_bounds(cache["bounds"], from_storage(k_pages, kv_dtype),
                                metadata.slot_ids)
  out, k_pages, v_pages, state, (counts, loaded) = _hisparse_attention(
      ops, sparse, kv_dtype, q[0], k_pages, v_pages, bounds, cache, metadata, config)
  return out[None], dict(k=k_pages, v=v_pages, bounds=bounds, state=state, counts=counts,
                         loaded=loaded)


def _hisparse_attention(ops: kernels_pallas.KernelOps, sparse: _SparseStatic, kv_dtype, q,
                        k_pages, v_pages, bounds, cache, metadata: StepMetadata, config):
  """Dense rows through ragged attention over their own tables; sparse rows, gathered
  into `metadata.num_sparse_rows` rows, through select -> resolve -> load -> attend (no
  sparse row's full table is read; with no sparse row none of it runs). q [num_tokens,
  num_q_heads, head_dim]; returns (out like q, new pages, new hot-buffer state of this
  layer, (counts [num_seqs, 5], blocks the host loads moved))."""
  is_sparse = metadata.sparse_rows  # bool [num_seqs]
  num_tokens, batch = q.shape[0], is_sparse.shape[0]
  tables = metadata.block_tables  # device ids; 0 = dropped (or padding)
  counts = jnp.zeros((batch, len(COUNT_FIELDS)), jnp.int32)
  loaded = jnp.int32(0)
  new_state = cache["state"]
  sparse_out = None
  num_sparse = min(metadata.num_sparse_rows, batch)
  if num_sparse:
    (rows,) = jnp.nonzero(is_sparse, size=num_sparse, fill_value=batch)
    live = rows < batch
    rows = jnp.minimum(rows, batch - 1)
    out_rows = jnp.where(live, rows, batch)  # for scatters back to the batch (padding dropped)
    token = jnp.minimum(metadata.cu_q_lens[rows], num_tokens - 1)  # each row's query token
    (k_pages, v_pages), new_state, row_counts, loaded, sparse_out = _sparse_rows(
        sparse, kv_dtype, ops, q[token], k_pages, v_pages, bounds, cache, metadata, rows,
        live)
    counts = counts.at[out_rows].set(row_counts, mode="drop")
  k_view, v_view = from_storage(k_pages, kv_dtype), from_storage(v_pages, kv_dtype)
  # Dense rows (prefill chunks, short decodes) through the ragged kernel; sparse rows get
  # no key there (their output is replaced below). A step with no dense row (a batch of
  # long decodes) skips the call: the reference's and the Pallas kernel's cost follows
  # the block-table width, not the lengths (measured: 408 of 463 ms per layer at 64k
  # tokens for length-1 rows).
  dense_lens = jnp.where(is_sparse, 0, metadata.kv_lens)
  any_dense = jnp.any(~is_sparse & (metadata.kv_lens > 0))
  out = lax.cond(
      any_dense,
      lambda: ops.ragged_paged_attention(q, k_view, v_view, tables, dense_lens,
                                         metadata.cu_q_lens,
                                         sliding_window=config.sliding_window,
                                         **dict(metadata.ragged_hints)).astype(q.dtype),
      lambda: jnp.zeros_like(q))
  if sparse_out is not None:
    out = out.at[jnp.where(live, token, num_tokens)].set(sparse_out.astype(out.dtype),
                                                         mode="drop")
  return out, k_pages, v_pages, new_state, (counts, loaded)


def _sparse_rows(sparse: _SparseStatic, kv_dtype, ops: kernels_pallas.KernelOps, q_rows,
                 k_pages, v_pages, bounds, cache, metadata: StepMetadata, rows, live):
  """select -> resolve -> load -> attend for the batch rows `rows` (`live` False:
  padding). q_rows [n, num_q_heads, head_dim]. Returns (new pages, new hot-buffer state,
  counts [n, 5], blocks loaded, attention output [n, num_q_heads, head_dim])."""
  tables = metadata.block_tables[rows]
  host_tables = metadata.host_tables[rows]
  kv_lens = jnp.where(live, metadata.kv_lens[rows], 0)
  # select: key bounds of each logical block, from its device copy's row or, once it was
  # dropped, its host copy's row (one gather).
  num_device_blocks = k_pages.shape[0]
  bounds_rows = jnp.where(tables != 0, tables, num_device_blocks + host_tables)
  sel = indexer.select(q_rows, bounds[bounds_rows], kv_lens, sparse.blocks, sparse.selection)
  # resolve: resident / hot-buffer hit / host miss, against this layer's hot-buffer rows.
  slot_block, last_used, evicted_at = cache["state"]
  num_state_rows, width = slot_block.shape[0], tables.shape[1]
  hot_rows = metadata.hot_rows[rows]
  own_row = live & (hot_rows < num_state_rows)
  state_row = jnp.minimum(hot_rows, num_state_rows - 1)
  fresh = (~own_row | metadata.hot_reset[rows])[:, None]
  state = resolver.HotBufferState(
      slot_block=jnp.where(fresh, -1, slot_block[state_row]),
      slot_last_used=jnp.where(fresh, resolver.NEVER, last_used[state_row]),
      evicted_at=jnp.where(fresh, resolver.NEVER, evicted_at[state_row, :width]))
  valid = sel.valid & live[:, None]
  res = resolver.resolve(jnp.where(valid, sel.logical_ids, 0), valid, state, tables,
                         metadata.hot_slots[rows], host_tables, metadata.step,
                         num_device_blocks=num_device_blocks,
                         thrash_window_steps=sparse.thrash_window_steps)
  # load: this layer's misses, host pool -> their slots; the bytes follow the misses
  # (none: nothing moves).
  (k_pages, v_pages), loaded = resolver.load_blocks(
      (cache["host_k"], cache["host_v"]), (k_pages, v_pages), res.load_host_ids,
      res.load_device_ids, device_sharding=sparse.device_sharding,
      host_sharding=sparse.host_sharding)
  # attend: the newest, partly filled block is last (indexer order).
  out = ops.paged_attention(q_rows, from_storage(k_pages, kv_dtype),
                            from_storage(v_pages, kv_dtype), res.block_tables,
                            jnp.where(live, sel.kv_lens, 0))
  # The rows' new state goes back to their state rows (rows without one are dropped).
  dst = jnp.where(own_row, hot_rows, num_state_rows)
  new_state = (slot_block.at[dst].set(res.state.slot_block, mode="drop"),
               last_used.at[dst].set(res.state.slot_last_used, mode="drop"),
               evicted_at.at[dst, :width].set(res.state.evicted_at, mode="drop"))
  c = res.counts
  counts = jnp.stack([c.resident_hits, c.hot_hits, c.misses, c.evictions, c.thrash], axis=-1)
  counts = jnp.where(live[:, None], counts, 0).astype(jnp.int32)
  return (k_pages, v_pages), new_state, counts, loaded, out

"""Batch building: the scheduled chunks of a step as padded host arrays (StepBatch).

Every scheduled token of every sequence is one row of a flat token axis (batch 1 for
the model, `seq` = all tokens); `cu_q_lens` cuts it into sequences. Shapes are padded
to power-of-two buckets (tokens, sequences, block-table width) so a run compiles a
bounded number of programs (each in two variants: with the random draws, and argmax
only for all-greedy batches), shared by every engine over the same model structure and
pool dtype (`step_program.step_program`); padded tokens have slot -1 (never written) and belong to
no sequence, padded sequences have length 0.

`BatchBuilder.build` (what `ModelRunner.build_batch` calls) is the step's host work: one
loop over the chunks filling numpy arrays, O(batch) (a chunk's tokens are copied as
slices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from hisparse_jax.engine.scheduler import ScheduledChunk
from hisparse_jax.kv_cache.transfer import bucket_size
from hisparse_jax.sparse.attention import (
  CHUNK_QUERIES,
  StepMetadata,  # noqa: F401 (re-exported)
)
from kernels_pallas.xla_attention import decode_rows_bucket

# Fewest sequence rows a step is padded to. The decode rows of the attention and HiSparse's
# sparse rows are computed in multiples of 8 whatever the batch (decode_rows_bucket), and
# the output projection streams its weights once for any few rows, so smaller buckets
# only add programs to compile (4 rows and 8 were two programs of each kind).
MIN_SEQ_ROWS = 8


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
  # Query lengths of the rows in the dense attention call (None: every row not sparse,
  # plus sparse rows of more than one query; step_shapes.dense_q_lens).
  dense_q_lens: tuple[int, ...] | None = None


class BatchBuilder:
  """Builds each step's `StepBatch` from the scheduled chunks.

  State: static sizes and settings only (set at construction, never changed): the
  padding limits, the kernels' `ragged_hints`, the HiSparse settings and hot-buffer rows,
  the vocabulary and EOS ids. What changes per step (the chunks, their tables, where
  their blocks live, the hot buffers' step clock) comes with each `build` call.
  """

  def __init__(self, *, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
               max_blocks_per_seq: int, ops, hisparse, num_hot_rows: int, vocab_size: int,
               eos_token_ids: Sequence[int], index_topk: int | None = None):
    """index_topk: a DSA model's (dsa_runner), the tokens each query attends at most. Its
    learned indexer runs the same in every row, so the only rows of the tiered path
    (`sparse_rows`) are those of offloaded sequences; a resident row attends its
    selected tokens in place."""
    self.block_size = block_size
    self.max_num_batched_tokens = max_num_batched_tokens
    self.max_num_seqs = max_num_seqs
    self.max_blocks_per_seq = max_blocks_per_seq
    self.ops = ops  # kernels_pallas.KernelOps: ragged_hints of the dense call
    self.hisparse = hisparse  # HiSparseConfig or None
    self.hisparse_blocks = hisparse.blocks(block_size) if hisparse is not None else None
    self.num_hot_rows = num_hot_rows
    self.vocab_size = vocab_size
    self.eos_token_ids = tuple(eos_token_ids)
    self.index_topk = index_topk
    self.tiered_rows_only = index_topk is not None

  def build(self, chunks: Sequence[ScheduledChunk], block_tables: np.ndarray,
            tiers: SparseTiers | None = None, step_clock: int = 0) -> StepBatch:
    """Flattens the scheduled chunks into padded step arrays.

    `block_tables` [len(chunks), width] are the device tables of the chunks' requests
    (0 for blocks an offloaded sequence dropped); `tiers` says where HiSparse blocks
    live (None: every block device-resident, no hot buffer); `step_clock`: the decode
    step of the hot buffers' LRU (HiSparse).
    """
    num_tokens = sum(c.num_tokens for c in chunks)
    t_pad = bucket_size(num_tokens, 16, self.max_num_batched_tokens)
    b_pad = bucket_size(len(chunks), MIN_SEQ_ROWS, self.max_num_seqs)
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
    offloaded_rows = np.zeros(b_pad, bool)
    blocks_attended = np.zeros(len(chunks), np.int32)
    offset = 0
    for i, chunk in enumerate(chunks):
      request, n = chunk.request, chunk.num_tokens
      sp = request.sampling_params
      # (a top_k past int32 keeps every token, as one of the vocabulary's size does)
      temperature[i], top_p[i] = sp.temperature, sp.top_p
      top_k[i] = min(max(sp.top_k, 0), np.iinfo(np.int32).max)
      seeds[i] = request.seed
      counters[i] = len(request.output_token_ids) + request.num_inflight
      if n == 0:  # samples from the logits of the chunk before it (n > 1), attends nothing
        if chunk.logits_of is None or i == 0 or chunk.logits_of not in (
            chunks[i - 1].request, chunks[i - 1].logits_of):
          raise ValueError("a chunk without tokens must follow the chunk it samples from")
        cu_q_lens[i] = offset
        logits_indices[i] = logits_indices[i - 1]
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
      num_blocks = -(-kv_lens[i] // self.block_size)
      # A sparse row decodes one token past the prefill (an output token); prefill
      # chunks, even of one token (after a prefix-cache hit), stay dense, so a prompt's
      # KV does not depend on how much of it the prefix cache held. Except the rows of an
      # offloaded sequence (some earlier blocks only on the host), whatever its length: a
      # streamed prompt's chunk attends over the top-k of its earlier blocks and densely
      # over its own (sparse/attention.py), and its decode rows are sparse even under
      # sparse_threshold_tokens (a dense row would read the dropped blocks' null entries).
      offloaded = offloaded_rows[i] = tiers is not None and tiers.hot_rows[i] >= 0
      prefill_row = chunk.start < request.prefill_len
      sparse_rows[i] = self.hisparse is not None and (
          offloaded or (n == 1 and not prefill_row and not self.tiered_rows_only
                        and self.hisparse.is_sparse(int(kv_lens[i]))))
      if self.tiered_rows_only:  # (DSA) a query's top-k tokens, in blocks' worth
        blocks_attended[i] = -(-min(int(kv_lens[i]), self.index_topk) // self.block_size)
      elif sparse_rows[i] and n > 1:  # a streamed prompt's chunk: its earlier full blocks
        # (exact: all; sparse: their top-k) + its own
        earlier = chunk.start // self.block_size
        blocks_attended[i] = num_blocks - earlier + (
            earlier if self.hisparse.streamed_prefill == "exact"
            else min(earlier, self.hisparse_blocks.top_k_blocks))
      else:
        blocks_attended[i] = (min(num_blocks, self.hisparse_blocks.top_k_blocks)
                              if sparse_rows[i] else num_blocks)
      offset += n
    cu_q_lens[len(chunks)] = offset
    if self.hisparse is not None and not self.tiered_rows_only:
      self._dense_resident_rows(sparse_rows, offloaded_rows, kv_lens, blocks_attended)
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
                           hot_reset=hot_reset, step=np.int32(step_clock))
    # Sparse decode rows are not in the dense call (kv_len 0 there), so their query
    # counts not; sparse prefill chunks are (over their rewritten tables), exact ones not.
    sparse_chunks = (self.hisparse is not None and not self.tiered_rows_only
                     and self.hisparse.streamed_prefill == "sparse")
    dense_q_lens = [c.num_tokens for c, sparse in zip(chunks, sparse_rows)
                    if not sparse or (sparse_chunks and c.num_tokens > 1)]
    hints = tuple(sorted(self.ops.ragged_hints(dense_q_lens).items()))
    # A step with a sparse prefill chunk selects by CHUNK_QUERIES queries per row (per
    # query head selections attend per selecting head: one query, theirs).
    chunk_queries = 1
    if (sparse_chunks and self.hisparse.selection != "per_query_head"
        and any(s and c.num_tokens > 1 for c, s in zip(chunks, sparse_rows))):
      chunk_queries = CHUNK_QUERIES
    num_sparse_rows = decode_rows_bucket(int(sparse_rows.sum()))
    if self.hisparse is not None and not self.tiered_rows_only and any(
        c.num_tokens > 1 and self.hisparse.is_sparse(c.request.prefill_len + 1)
        for c in chunks):
      # A step prefilling a prompt that will decode sparse carries the sparse path even
      # with no sparse row yet (a long prompt's first chunks): the same program as the
      # later prefill steps whose batch holds its decode rows, one program fewer per
      # token bucket. Its 8 empty rows cost nothing next to a prefill chunk; steps of
      # short prompts only, and decode-only steps, keep the choice.
      num_sparse_rows = max(num_sparse_rows, decode_rows_bucket(1))
    meta = StepMetadata(slot_ids, tables, kv_lens, cu_q_lens, sparse_rows, **hisparse_meta,
                        ragged_hints=hints, num_sparse_rows=num_sparse_rows,
                        chunk_queries=chunk_queries,
                        sparse_chunks=self.hisparse is not None and not self.tiered_rows_only
                        and any(
                            s and c.num_tokens > 1 for c, s in zip(chunks, sparse_rows)))
    extras, spans = None, ()
    if any(needs_extras(c.request.sampling_params) for c in chunks):
      extras, spans = self._sampler_extras(chunks, b_pad, cu_q_lens)
    return StepBatch(input_ids, token_src, positions, meta, logits_indices, temperature, top_p,
                     top_k, seeds, counters, len(chunks), extras, blocks_attended, spans,
                     tuple(dense_q_lens))

  def _dense_resident_rows(self, sparse_rows: np.ndarray, offloaded_rows: np.ndarray,
                           kv_lens: np.ndarray, blocks_attended: np.ndarray) -> None:
    """A step whose sparse rows all have every block on the device (none offloaded)
    attends them densely, in place, unless together they skip at least
    `resident_sparse_min_tokens` tokens of attention (HiSparseConfig): below that, the
    sparse path costs more than it skips. Exact either way for those rows (dense is the
    reference); their blocks are still written through, so they may be offloaded later."""
    if (offloaded_rows & sparse_rows).any() or not sparse_rows.any():
      return
    top_k = self.hisparse_blocks.top_k_blocks * self.block_size
    skipped = int(np.maximum(kv_lens[sparse_rows] - top_k, 0).sum())
    if skipped >= self.hisparse.resident_sparse_min_tokens:
      return
    n = len(blocks_attended)
    rows = np.flatnonzero(sparse_rows[:n])
    blocks_attended[rows] = -(-kv_lens[rows] // self.block_size)
    sparse_rows[:] = False

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

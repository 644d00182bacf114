"""Continuous batching over the tiered KV cache: who runs in the next step, and on which blocks.

Each `schedule()` call makes one step's plan, in this order (FCFS throughout):

  1. RUNNING requests, oldest first: a prefilling request gets its next prompt chunk
     (chunked prefill, within the `max_num_batched_tokens` budget); a decoding request
     gets one token. When the device pool has no block for it, the NEWEST running
     request is preempted by swap-out to the host pool (its blocks are copied there,
     never recomputed), until the block is found or the request itself is the newest.
  2. SWAPPED requests, oldest first, when no request was preempted in this step: they
     come back (swap-in plan) if the device has their blocks plus the block their next
     token may need, and run in this step.
  3. WAITING requests, oldest first, while nobody is left swapped: admitted when the
     device pool holds their prompt blocks plus one spare block per running request
     (so admission does not force an immediate preemption). A prompt whose leading full
     blocks are in the prefix cache starts after them (device hits shared, host hits
     swapped in). With HiSparse (admission "offload", the default) running sparse
     decoders are offloaded to make that room, and a prompt that will decode sparse but
     does not fit even then is admitted STREAMED (below) when its first chunk and its
     hot buffer do: more requests decode at once than the device holds whole.

Admission counts both tiers: a request occupies device blocks only while it runs;
when the device is short, running requests move to the host pool and come back later,
so the engine holds as many requests as device plus host blocks allow. Only when the
host pool cannot take a victim's blocks does preemption fall back to recomputation.

With HiSparse, a decoding request longer than `sparse_threshold_tokens` is a sparse
decoder: each time it decodes, its newly filled blocks are written through to the host
pool (d2h plans with the swap-outs). When the device is short (a decode without a block,
a swapped request or a waiting one without room), sparse decoders are OFFLOADED before
anyone is preempted: the device copies of their written-through blocks are dropped (no
write) and they keep only a hot buffer plus their newest blocks on the device, so the
running set is bounded by the host-backed capacity rather than the device's. A swapped
sparse decoder comes back offloaded (its newest block and hot buffer only).

A prompt of more blocks than the device pool has is STREAMED (HiSparse with chunked
prefill; `Request.streamed`): admitted with the blocks of its first chunk only, it gets
each next chunk's blocks as it is scheduled (`BlockManager.extend`), making room the way
decodes do, by offloading sparse decoders and streamed prompts (itself included: its
computed blocks are written through and dropped). An offloaded prompt's next chunk is a
sparse prefill row (step_batch.py): it attends over the top-k of its earlier blocks,
loaded into its hot buffer, and densely over its own (sparse/attention.py). The device
then holds a hot buffer plus a chunk per streamed prompt, so one request may be as long as
the host pool (the planner asks the device for `streamed_device_blocks` only).

A request with n > 1 sequences is admitted as its first sequence, with seats for all n
reserved; when its final prefill chunk is scheduled the others fork its blocks (shared,
copied on write) and join the running set with a row that samples from the same logits.

The scheduler owns host bookkeeping only (STYLE point 9); the engine executes the
plans (transfers, copy-on-write copies, the jitted step) in the order the
`BlockManager` contract gives.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from hisparse_jax.engine.request import Request, RequestStatus
from hisparse_jax.kv_cache import kv_hash
from hisparse_jax.kv_cache.block_manager import PENDING_TOKEN, BlockManager, SwapInPlan, SwapOutPlan
from hisparse_jax.sparse.config import HiSparseConfig


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
  """Tokens [start, start + num_tokens) of `request` are computed in this step."""

  request: Request
  start: int
  num_tokens: int
  slot_ids: np.ndarray  # int32 [num_tokens]
  # A row that computes no token (num_tokens 0) and samples from the logits of this
  # request's last token, whose chunk comes just before it (n > 1: the prompt's logits).
  logits_of: Request | None = None
  # Whether the chunk ends at the request's last token, so its logits are sampled. Fixed
  # when scheduled: appending the sampled token must not change what this step did.
  samples: bool = dataclasses.field(init=False)

  def __post_init__(self):
    object.__setattr__(self, "samples",
                       self.start + self.num_tokens == self.request.num_tokens)


@dataclasses.dataclass
class SchedulerOutput:
  chunks: list[ScheduledChunk] = dataclasses.field(default_factory=list)
  swap_out: list[SwapOutPlan] = dataclasses.field(default_factory=list)
  swap_in: list[SwapInPlan] = dataclasses.field(default_factory=list)
  copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  preempted: list[Request] = dataclasses.field(default_factory=list)  # swapped out
  swapped_in: list[Request] = dataclasses.field(default_factory=list)  # incl. host prefix hits
  recomputed: list[Request] = dataclasses.field(default_factory=list)
  offloaded: list[Request] = dataclasses.field(default_factory=list)  # HiSparse drops

  @property
  def num_tokens(self) -> int:
    return sum(c.num_tokens for c in self.chunks)

  @property
  def is_empty(self) -> bool:
    return not self.chunks


class Scheduler:
  """FCFS continuous batching with chunked prefill and swap-based preemption.

  Invariants: a request is in exactly one of `waiting`, `running`, `swapped` until it
  finishes; a running request is resident in the block manager, a swapped one is
  swapped out there; len(running) <= max_num_seqs; one step schedules at most
  `max_num_batched_tokens` tokens.
  """

  def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
               max_num_batched_tokens: int, enable_chunked_prefill: bool = True,
               hisparse: HiSparseConfig | None = None, max_model_len: int | None = None):
    if max_num_seqs < 1:
      raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_num_batched_tokens < 1:
      raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    self.bm = block_manager
    self.max_num_seqs = max_num_seqs
    self.max_num_batched_tokens = max_num_batched_tokens
    self.enable_chunked_prefill = enable_chunked_prefill
    self.hisparse = hisparse
    self.max_model_len = max_model_len if max_model_len is not None else float("inf")
    self.hot_buffer_blocks = (hisparse.blocks(block_manager.block_size).hot_buffer_blocks
                              if hisparse is not None else 0)
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.swapped: collections.deque[Request] = collections.deque()
    # The third KV tier (engine/tier_connector.py; None: none configured): waiting requests
    # whose prompt blocks it is loading into the host pool wait in `loading` meanwhile,
    # and others are admitted past them.
    self.tier = None
    self.loading: list[Request] = []
    # Seats of the sequences not forked yet of admitted (running or swapped) requests.
    self.num_reserved_seats = 0

  # --- Queues --------------------------------------------------------------------

  def add(self, request: Request) -> None:
    request.status = RequestStatus.WAITING
    self.waiting.append(request)

  @property
  def num_unfinished(self) -> int:
    return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.loading)

  def requeue_loaded(self, request: Request) -> None:
    """A request whose third-tier load finished: back to the waiting queue, in arrival
    order (its loaded blocks are host prefix hits now)."""
    if request in self.loading:
      self.loading.remove(request)
      _insert_by_arrival(self.waiting, request)

  def remove(self, request: Request) -> None:
    """Takes a request out of whichever queue holds it and frees its blocks."""
    if request.pending_children and request.status in (RequestStatus.RUNNING,
                                                       RequestStatus.SWAPPED):
      self.num_reserved_seats -= len(request.pending_children)
    if request in self.running:
      self.running.remove(request)
    elif request in self.swapped:
      self.swapped.remove(request)
    elif request in self.waiting:
      self.waiting.remove(request)
    elif request in self.loading:  # (its load finishes in the tier; the blocks are kept)
      self.loading.remove(request)
    if request.request_id in self.bm:
      self.bm.free(request.request_id)

  # --- One step ------------------------------------------------------------------

  def schedule(self) -> SchedulerOutput:
    out = SchedulerOutput()
    budget = self.max_num_batched_tokens
    budget = self._schedule_running(out, budget)
    if not out.preempted and not out.recomputed:
      budget = self._schedule_swapped(out, budget)
    if not self.swapped:
      self._schedule_waiting(out, budget)
    # The step will compute these tokens: the next schedule() plans past them, whether or
    # not this step's results are back (steps overlap).
    for chunk in out.chunks:
      chunk.request.num_computed_tokens = chunk.start + chunk.num_tokens
    return out

  def _chunk(self, request: Request, budget: int,
             out: SchedulerOutput) -> ScheduledChunk | None:
    """The next prefill chunk of a resident request within `budget` tokens (a streamed
    prompt's: within the device blocks it can get, `_extend_streamed`)."""
    start = request.num_computed_tokens
    remaining = request.prefill_len - start
    if not self.enable_chunked_prefill and remaining > budget:
      return None
    n = min(remaining, budget)
    if n > 0 and request.streamed:
      n = self._extend_streamed(request, start + n, out) - start
    if n <= 0:
      return None
    # Full blocks of this chunk become prefix-cache hits now: the forward writes their
    # KV (every layer writes before it attends) before any later step can read them.
    self.bm.cache_blocks(request.request_id, start + n)
    return ScheduledChunk(request, start, n, self.bm.slot_ids(request.request_id, start,
                                                              start + n))

  def _extend_streamed(self, request: Request, end: int, out: SchedulerOutput) -> int:
    """Device blocks for a streamed prompt up to token `end`, or as far as the device
    gives (offloading sparse decoders and streamed prompts, itself included, first).
    Returns the end its blocks reach now."""
    rid, bs = request.request_id, self.bm.block_size
    have = self.bm.num_tokens(rid)
    if end <= have:
      return end
    need = self.bm.blocks_to_extend(rid, end - have)
    if not self._make_room(need, out):
      self._make_room(1, out)  # what it can: a shorter chunk
    room = (self.bm.num_table_blocks(rid) + self.bm.device_pool.num_free_blocks) * bs
    end = min(end, room)
    if end > have:  # (room >= have: the table's blocks hold them)
      self.bm.extend(rid, request.all_token_ids[have:end])
    return end

  def _streams(self, request: Request, num_blocks: int) -> bool:
    """Whether a waiting request is admitted with its prompt streamed: with HiSparse and
    chunked prefill, a prompt of more blocks than the device pool has (its earlier chunks
    move to the host pool as it prefills; `Request.streamed`). A request with n > 1
    forks its blocks after the prefill, so it must fit (Engine.add_request refuses it)."""
    return (self.hisparse is not None and self.enable_chunked_prefill
            and not request.pending_children
            and num_blocks > self.bm.device_pool.num_usable_blocks)

  def _may_stream(self, request: Request) -> bool:
    """Whether a waiting request that fits the device pool may still be admitted streamed
    (HiSparse's admission by offload, when the device is short): it decodes sparse from
    its first token on (so its computed blocks may leave the device) and forks nothing."""
    return (self.hisparse is not None and self.hisparse.admission == "offload"
            and self.hisparse.indexer != "lightning"  # (a DSA prompt: no streamed prefill)
            and self.enable_chunked_prefill and not request.pending_children
            and self.hisparse.is_sparse(len(request.all_token_ids)))

  def _fork(self, chunk: ScheduledChunk, out: SchedulerOutput) -> list[Request]:
    """Adds `chunk` to the step; when it is the final prefill chunk of a request with
    sequences not forked yet, they fork its blocks now and sample in this step from its
    logits (rows right after its chunk). Returns them (running from now on)."""
    out.chunks.append(chunk)
    request = chunk.request
    if not (chunk.samples and request.pending_children):
      return []
    children, request.pending_children = request.pending_children, []
    self.num_reserved_seats -= len(children)
    for child in children:
      self.bm.fork(request.request_id, child.request_id)
      child.prefill_len = request.prefill_len
      child.num_cached_tokens = request.num_cached_tokens
      child.status = RequestStatus.RUNNING
      out.chunks.append(ScheduledChunk(child, request.prefill_len, 0,
                                       np.zeros(0, np.int32), logits_of=request))
    return children

  def _has_seats(self, request: Request | None = None) -> bool:
    """Whether the running set has a seat (for `request` and its sequences to fork)."""
    need = 1 if request is None else 1 + len(request.pending_children)
    return len(self.running) + self.num_reserved_seats + need <= self.max_num_seqs

  def is_sparse_decoder(self, request: Request) -> bool:
    """Whether the request's next step is a sparse decode (HiSparse)."""
    return (self.hisparse is not None and request.prefill_len > 0
            and not request.is_prefilling and self.hisparse.is_sparse(request.num_tokens))

  def _offloadable(self, request: Request) -> bool:
    """Whether `_make_room` may offload the request: a sparse decoder, or a streamed
    prompt (its computed blocks)."""
    return self.is_sparse_decoder(request) or (request.streamed and request.is_prefilling)

  def _write_through(self, request: Request, out: SchedulerOutput) -> None:
    plan = self.bm.write_through(request.request_id, request.num_computed_tokens)
    if plan.num_blocks:
      out.swap_out.append(plan)

  def _make_room(self, num_blocks: int, out: SchedulerOutput) -> bool:
    """Offloads running sparse decoders and streamed prompts (largest gain first) until
    `num_blocks` device blocks are free; returns whether they are. Offloads nobody when all
    of them together could not free enough (an offload costs host loads later)."""
    free = self.bm.device_pool.num_free_blocks
    if free >= num_blocks:
      return True
    gains = {}
    for request in self.running:  # (requests preempted in this step are not RUNNING)
      if request.status == RequestStatus.RUNNING and self._offloadable(request):
        self._write_through(request, out)
        gain = self.bm.offload_gain(request.request_id, self.hot_buffer_blocks)
        if gain > 0:
          gains[request.request_id] = (gain, request)
    if free + sum(g for g, _ in gains.values()) < num_blocks:
      return False
    for _gain, request in sorted(gains.values(), key=lambda x: -x[0]):
      if self.bm.device_pool.num_free_blocks >= num_blocks:
        break
      self.bm.offload(request.request_id, self.hot_buffer_blocks)
      out.offloaded.append(request)
    return self.bm.device_pool.num_free_blocks >= num_blocks

  def _decode(self, request: Request, out: SchedulerOutput) -> ScheduledChunk:
    if self.is_sparse_decoder(request):
      self._write_through(request, out)
    # The token whose K/V this step computes: the last sampled one, unless it is still in
    # flight (then the step reads it from the previous step's output on the device).
    token = PENDING_TOKEN if request.num_inflight else request.output_token_ids[-1]
    result = self.bm.append_slot(request.request_id, token)
    request.pending_in_blocks = token == PENDING_TOKEN
    if result.copy is not None:
      out.copies.append(result.copy)
    return ScheduledChunk(request, request.num_tokens - 1, 1,
                          np.array([result.slot_id], np.int32))

  def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
    victim.num_preemptions += 1
    if self.bm.can_swap_out(victim.request_id):
      out.swap_out.append(self.bm.swap_out(victim.request_id))
      victim.status = RequestStatus.SWAPPED
      self._insert_swapped(victim)
      out.preempted.append(victim)
    else:  # The host pool is full too: drop the blocks and compute them again later.
      self.num_reserved_seats -= len(victim.pending_children)  # (again at admission)
      self.bm.free(victim.request_id)
      victim.num_computed_tokens = 0
      victim.status = RequestStatus.WAITING
      self.waiting.appendleft(victim)
      out.recomputed.append(victim)

  def _insert_swapped(self, request: Request) -> None:
    """Keeps `swapped` in arrival order, so the oldest preempted request returns first."""
    _insert_by_arrival(self.swapped, request)

  def _insert_running(self, request: Request) -> None:
    """Keeps `running` in arrival order, so the newest running request is preempted first
    (a request that comes back from the host pool is older than those admitted since)."""
    _insert_by_arrival(self.running, request)

  def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
    queue = list(self.running)
    kept: list[Request] = []
    while queue:
      request = queue.pop(0)
      if budget <= 0:
        kept.append(request)
        continue
      if request.is_prefilling:
        chunk = self._chunk(request, budget, out)
        kept.append(request)
        if chunk is not None:
          kept.extend(self._fork(chunk, out))
          budget -= chunk.num_tokens
        continue
      if request.reaches_length(self.max_model_len):  # its token in flight is its last
        kept.append(request)
        continue
      while (not self.bm.can_append(request.request_id)
             and not (self.hisparse is not None and self._make_room(1, out))):
        victim = queue.pop() if queue else None
        if victim is None:  # Nobody newer left: this request gives its blocks up.
          self._preempt(request, out)
          break
        self._preempt(victim, out)
      else:
        out.chunks.append(self._decode(request, out))
        kept.append(request)
        budget -= 1
    self.running = kept
    return budget

  def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
    while self.swapped and budget > 0 and self._has_seats():
      request = self.swapped[0]
      if request.num_inflight:  # preempted while its token was in flight: next step
        break
      # Only when it can also run now: the device must hold its blocks AND the block its
      # next token may open (counted without device prefix hits, conservatively). A
      # request swapped in without room to decode would swap itself out again at once,
      # a round trip per step with no progress.
      # Blocks of all its tokens, the next one's included (its last sampled token).
      num_blocks = -(-request.num_tokens // self.bm.block_size)
      if request.streamed and request.is_prefilling:  # the blocks allocated so far
        num_blocks = -(-self.bm.num_tokens(request.request_id) // self.bm.block_size)
      hot, kept = 0, 0
      if self._offloadable(request):  # comes back offloaded: newest blocks + hot buffer
        hot = self.hot_buffer_blocks
        kept = request.num_computed_tokens // self.bm.block_size
      needed = num_blocks - kept + (hot if kept else 0)
      if self.hisparse is not None:
        self._make_room(needed, out)
      if (not self.bm.can_swap_in(request.request_id, hot, request.num_computed_tokens)
          or self.bm.device_pool.num_free_blocks < needed):
        break
      self.swapped.popleft()
      plan = self.bm.swap_in(request.request_id, hot, request.num_computed_tokens)
      out.swap_in.append(plan)
      out.swapped_in.append(request)
      request.num_swapped_in_blocks += plan.num_blocks
      request.status = RequestStatus.RUNNING
      self._insert_running(request)
      if request.is_prefilling:
        chunk = self._chunk(request, budget, out)
      elif self.bm.can_append(request.request_id):
        chunk = self._decode(request, out)
      else:
        chunk = None
      if chunk is not None:
        for child in self._fork(chunk, out):
          self._insert_running(child)
        budget -= chunk.num_tokens
    return budget

  def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
    while self.waiting and budget > 0 and self._has_seats(self.waiting[0]):
      request = self.waiting[0]
      if request.num_inflight:  # recomputed while its token was in flight: next step
        break
      tokens = request.all_token_ids  # a recomputed request re-reads its outputs too
      # A spare block per running sequence, and per sequence of this request that will
      # fork its blocks (each copies the shared last block on write).
      spare = len(self.running) + self.num_reserved_seats + len(request.pending_children)
      needed = -(-len(tokens) // self.bm.block_size)
      request.streamed = self._streams(request, needed)
      allocated = tokens
      if request.streamed:  # its first chunk's blocks now, the next ones as it runs
        allocated = tokens[:budget]
        needed = -(-len(allocated) // self.bm.block_size)
      if self.hisparse is not None and (request.streamed
                                        or self.hisparse.admission == "offload"):
        # Admission by host-backed capacity: offload first. A prompt that will decode
        # sparse and does not fit beside the others even then streams in (its first
        # chunk now, beside room for its hot buffer), rather than waiting for them.
        room = needed + spare if self.running else needed
        if (not self._make_room(room, out) and not request.streamed
            and self._may_stream(request)):
          first = tokens[:budget]
          first_blocks = -(-len(first) // self.bm.block_size)
          if self._make_room(first_blocks + self.hot_buffer_blocks + spare, out):
            request.streamed, allocated, needed = True, first, first_blocks
      if request.streamed:  # what the device gives now (at least one block)
        free = self.bm.device_pool.num_free_blocks - (spare if self.running else 0)
        allocated = tokens[:max(0, min(len(allocated), free * self.bm.block_size))]
        needed = -(-len(allocated) // self.bm.block_size)
        if not allocated:
          break
      read_cache = request.sampling_params.prompt_logprobs is None
      hashes = self._prefix_hashes(request, len(allocated))
      if (self.tier is not None and read_cache and not request.tier_checked
          and not request.streamed and self.bm.prefix_cache.enabled):
        # Prefix misses in both pools that a third tier holds: loaded into the host pool
        # while others run; the request comes back through requeue_loaded.
        request.tier_checked = True
        if self.tier.start_load(request, allocated, hashes):
          self.waiting.popleft()
          self.loading.append(request)
          continue
      if not self.bm.can_allocate(allocated, read_cache=read_cache, hashes=hashes):
        break
      if self.running and self.bm.device_pool.num_free_blocks < needed + spare:
        break
      if not self.enable_chunked_prefill and len(tokens) > budget:
        break
      self.waiting.popleft()
      result = self.bm.allocate(request.request_id, allocated, num_new_tokens=0,
                                read_cache=read_cache, hashes=hashes,
                                cache_salt=request.cache_salt)
      request.prefill_len = len(tokens)
      if result.swap_in.num_blocks:
        out.swap_in.append(result.swap_in)
        out.swapped_in.append(request)
        request.num_swapped_in_blocks += result.swap_in.num_blocks
      request.num_computed_tokens = result.num_cached_tokens
      if not request.output_token_ids and not request.num_preemptions:  # first admission
        request.num_cached_tokens = min(result.num_cached_tokens, request.num_prompt_tokens)
      request.status = RequestStatus.RUNNING
      self.num_reserved_seats += len(request.pending_children)
      self._insert_running(request)
      chunk = self._chunk(request, budget, out)
      if chunk is not None:
        for child in self._fork(chunk, out):
          self._insert_running(child)
        budget -= chunk.num_tokens

  def _prefix_hashes(self, request: Request, num_tokens: int) -> list:
    """The prefix cache's chained hashes of the full blocks of the request's first
    `num_tokens` tokens (`PrefixCache.hashes` of them), from `request.block_hashes`,
    extended only by the blocks not hashed before."""
    cache = self.bm.prefix_cache
    if not cache.enabled:
      return []
    size = self.bm.block_size
    have = request.block_hashes
    full = num_tokens // size
    if len(have) < full:
      start = len(have)
      have.extend(kv_hash.hash_full_blocks(request.token_slice(start * size, full * size),
                                           size, None, have[-1] if have else None,
                                           cache_salt=request.cache_salt))
    return have[:full]


def _insert_by_arrival(queue, request: Request) -> None:
  for i, other in enumerate(queue):
    if request.arrival_time < other.arrival_time:
      queue.insert(i, request)
      return
  queue.append(request)

"""The engine: requests in, tokens out, one `step()` at a time over the tiered KV cache.

    step():  schedule -> move blocks (d2h swap-outs, copy-on-write, h2d swap-ins)
             -> build batch -> run (one jitted forward + sample, dispatched)
             -> postprocess the step before it (append, stop, free; OutputProcessor)

`Engine` is the lower-level API for serving stacks (`add_request`, `step`,
`abort_request`, `has_unfinished_requests`); `hisparse_jax.LLM` wraps it for batch
generation. Constructing an engine loads the model, plans and allocates both KV pools
and logs their capacity per memory kind.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging

from hisparse_jax.distributed import parallel
from hisparse_jax.engine.config import EngineConfig, default_block_size
from hisparse_jax.engine.dsa_runner import DsaModelRunner
from hisparse_jax.engine.hot_rows import HotRows
from hisparse_jax.engine.invariants import check_engine
from hisparse_jax.engine.output_processor import OutputProcessor
from hisparse_jax.engine.planning import (
  check_model_fits,
  check_model_kind,
  hisparse_capacity_for,
  plan_engine_capacity,
  resolve_config,
)
from hisparse_jax.engine.request import (
  Request,
  RequestOutput,
  RequestStatus,
  SequenceGroup,
  check_prompt,
  check_sampling,
)
from hisparse_jax.engine.runner import ModelRunner, SparseTiers, StepBatch, StepHandle
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.engine.scheduler import Scheduler, SchedulerOutput
from hisparse_jax.engine.tier_connector import TierConnector, hashes_of, open_engine_tiers
from hisparse_jax.kv_cache.block_manager import BlockManager
from hisparse_jax.kv_cache.capacity import CapacityReport, HiSparseCapacity
from hisparse_jax.kv_cache.kv_pool import (
  KVCacheSpec,
  MLACacheSpec,
  check_kv_cache_dtype_devices,
)
from hisparse_jax.kv_cache.transfer import TransferEngine
from hisparse_jax.observability import engine_metrics
from hisparse_jax.observability.library_logging import configure_library_logging
from hisparse_jax.observability.metrics import MetricsRegistry

__all__ = ["Engine", "EngineConfig", "configure_library_logging", "default_block_size"]


@dataclasses.dataclass(frozen=True)
class _InflightStep:
  """A dispatched step whose tokens are not read back yet."""

  out: SchedulerOutput
  batch: StepBatch
  handle: StepHandle
  start: float  # perf_counter at dispatch


class Engine:
  """Continuous-batching engine over a device KV pool and a pinned-host KV pool.

  Invariants: every request added is finished exactly once (stop, length, abort or
  error) and then holds no block; between steps the block manager's invariants hold.
  """

  def __init__(self, config: EngineConfig | None = None, *, model=None, model_config=None,
               tokenizer=None):
    from models.loader import (  # heavy import, on use
      checkpoint_dtype,
      is_dsa_config,
      load_config,
      load_pretrained,
      shard_model,
    )
    from models.sharding import check_tensor_parallel, kv_head_repeat

    config = config if config is not None else EngineConfig()
    if config.dtype == "auto":  # the checkpoint's torch_dtype (float32 for a given model)
      dtype = (checkpoint_dtype(config.model) if model is None
               else str(model.embed_tokens[...].dtype))
      config = dataclasses.replace(config, dtype=dtype)
    if config.block_size is None:
      config = dataclasses.replace(config, block_size=default_block_size())
    # DSA models (MLA + lightning indexer): refused options and the HiSparse settings
    # they run with, decided from config.json before any weight is read.
    unloaded = load_config(config.model) if model is None else model.config
    self.is_dsa = is_dsa_config(unloaded)
    config = check_model_kind(config, unloaded, self.is_dsa)
    self.config = config
    # Tensor parallel: one mesh; the weights go straight into their shards.
    self.mesh = parallel.make_mesh(config.tensor_parallel_size)
    self.kv_head_repeat = 1  # copies of each KV head over the mesh (models.sharding)
    if self.mesh is not None:  # refused before any weight is read
      check_tensor_parallel(unloaded, config.tensor_parallel_size)
      self.kv_head_repeat = kv_head_repeat(unloaded, config.tensor_parallel_size)
    devices = jax.devices()[:1] if self.mesh is None else self.mesh.devices.flat
    check_kv_cache_dtype_devices(config.kv_cache_dtype, devices)
    check_kv_cache_dtype_devices(config.index_cache_dtype, devices, "index_cache_dtype")
    loaded_here = model is None
    if model is None:
      model, model_config, tokenizer = load_pretrained(config.model, dtype=config.dtype,
                                                       mesh=self.mesh)
    elif self.mesh is not None:  # a model built in memory (tests): into its shards
      model = shard_model(model, self.mesh)
      model_config = dataclasses.replace(
          model_config, num_key_value_heads=model.config.num_key_value_heads)
    self.model, self.model_config, self.tokenizer = model, model_config, tokenizer
    # Ends of generation: the model config's eos ids and the tokenizer's, which come from
    # generation_config.json (what transformers' generate stops at; instruction-tuned
    # checkpoints often list more ids there than in config.json).
    eos = model_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    if tokenizer is not None:
      eos_ids |= set(tokenizer.eos_token_ids)
    self.eos_token_ids = frozenset(int(t) for t in eos_ids)
    self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, config.max_model_len)
    check_model_fits(config, model_config)
    spec_cls = MLACacheSpec if self.is_dsa else KVCacheSpec
    spec = spec_cls.from_model_config(model_config, config.dtype, config.block_size,
                                      config.kv_cache_dtype,
                                      **({"index_cache_dtype": config.index_cache_dtype}
                                         if self.is_dsa else {}))
    config = self.config = resolve_config(config, spec, is_dsa=self.is_dsa,
                                          num_devices=parallel.tp_size(self.mesh))
    plan = plan_engine_capacity(config, spec, is_dsa=self.is_dsa,
                                num_devices=parallel.tp_size(self.mesh))
    self.device_pool, self.host_pool = plan.allocate(mesh=self.mesh)
    runner_cls = DsaModelRunner if self.is_dsa else ModelRunner
    self.runner = runner_cls(model, self.device_pool, max_model_len=config.max_model_len,
                              max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              kernel_backend=config.kernel_backend, hisparse=config.hisparse,
                              host_pool=self.host_pool, eos_token_ids=self.eos_token_ids,
                              compile_in_background=config.compile_in_background,
                              max_step_programs=config.max_step_programs,
                              kv_head_repeat=self.kv_head_repeat)
    if loaded_here:  # the model the step runs (its weights packed on CPU); the loaded
      self.model = self.runner.model  # arrays it replaced are not kept
    # (GPU, TPU: the largest steps' temporaries must fit what weights and pools left)
    from hisparse_jax.engine import aot  # noqa: PLC0415 (it imports this module)

    aot.check_step_footprint(self.runner, config, self.is_dsa, self.device_pool.device)
    # Reserved bytes as allocated (the runner's arrays), not as planned.
    hisparse = None
    if config.hisparse is not None:
      hisparse = self._hisparse_capacity(spec, self.device_pool.num_blocks,
                                         self.host_pool.num_blocks)
      # (multi-host: this process holds its devices' share of the mesh's bytes)
      planned = (hisparse.reserved_bytes * len(self.device_pool.local_devices)
                 // len(self.device_pool.devices))
      if planned != self.runner.reserved_bytes:
        raise AssertionError(f"HiSparse device bytes: planned {planned:,}, "
                             f"allocated {self.runner.reserved_bytes:,}")
    self.capacity = CapacityReport.from_pools((self.device_pool, self.host_pool),
                                              self.runner.reserved_bytes, hisparse,
                                              reserved_arrays=self.runner.reserved_arrays())
    configure_library_logging()
    # The third KV tier(s): opened before the capacity lines, which name them.
    self._tier_parts = None
    self.tier_namespace = None  # the third tier's Namespace (tier_connector.namespace_for)
    if config.disk_cache_dir or config.remote_cache_url:
      self._tier_parts = open_engine_tiers(config, self.mesh, self.host_pool,
                                           self.model_config, self.model)
      self.tier_namespace = self._tier_parts[2]
      self.capacity = dataclasses.replace(self.capacity,
                                          third_tiers=tuple(self._tier_parts[3]))
    self.capacity.log(config.max_model_len)
    self.metrics_registry = MetricsRegistry()
    self.capacity.export(self.metrics_registry)
    self.stats = engine_metrics.EngineMetrics(self.metrics_registry)
    self.transfer = TransferEngine(self.device_pool, self.host_pool, self.metrics_registry)
    self.stats.zero_transfer_series()
    self.block_manager = BlockManager(self.device_pool.num_blocks, self.host_pool.num_blocks,
                                      config.block_size,
                                      enable_prefix_caching=config.enable_prefix_caching)
    self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                               max_num_batched_tokens=config.max_num_batched_tokens,
                               enable_chunked_prefill=config.enable_chunked_prefill,
                               hisparse=config.hisparse, max_model_len=config.max_model_len)
    self.tier: TierConnector | None = None
    if self._tier_parts is not None:
      tiers, failed, namespace, _ = self._tier_parts
      self.tier = TierConnector(tiers, self.block_manager, self.transfer, self.runner,
                                namespace, write_policy=config.kv_tier_write_policy,
                                failed_at_open=failed, registry=self.metrics_registry,
                                max_num_batched_tokens=config.max_num_batched_tokens)
      self.scheduler.tier = self.tier if tiers else None
    self.hot_rows = HotRows(self.runner.num_hot_rows)  # (HiSparse)
    self.requests: dict[str, Request] = {}  # unfinished requests only: a server runs long
    self._inflight: _InflightStep | None = None  # dispatched, tokens not read back yet
    self._finished: list[Request] = []  # finished since the last step() returned
    self._groups: dict[str, SequenceGroup] = {}  # unfinished requests with n > 1
    self._seed_rng = np.random.default_rng(config.seed)
    self._ids = itertools.count()
    self.num_steps = 0
    self.last_step_num_tokens = 0  # tokens the last step() scheduled
    self.last_step_prefill_tokens = 0  # of those, prompt (or recomputed) tokens

  def close(self) -> None:
    """Finishes the third tier's pending stores (write_back: stores the host blocks it
    lacks first) and releases its files and connections. Idempotent; the engine may not
    be stepped after it."""
    if self.tier is not None:
      self.tier.close()
      self.tier = None
      self.scheduler.tier = None

  def _hisparse_capacity(self, spec: KVCacheSpec, num_device_blocks: int,
                         num_host_blocks: int) -> HiSparseCapacity:
    return hisparse_capacity_for(self.config, spec, num_device_blocks, num_host_blocks,
                                 parallel.tp_size(self.mesh))

  # --- Requests ------------------------------------------------------------------

  def add_request(self, request_id: str | None = None, prompt: str | None = None,
                  sampling_params: SamplingParams | None = None, *,
                  prompt_token_ids: Sequence[int] | None = None,
                  cache_salt: str | None = None) -> str:
    """Queues a request; returns its id. Bad input raises ValueError naming the field.
    `cache_salt` (vLLM's): a non-empty string mixed into the prompt's block hashes and
    tier keys, so the request shares cached KV (prefix cache, host, disk and remote tiers)
    only with requests of the same salt; None shares with every unsalted request."""
    sampling_params = sampling_params if sampling_params is not None else SamplingParams()
    if not isinstance(sampling_params, SamplingParams):
      raise ValueError(f"sampling_params must be a SamplingParams, got "
                       f"{type(sampling_params).__name__}")
    if request_id is None:
      request_id = f"req-{next(self._ids)}"
    request_id = str(request_id)
    if request_id in self.requests or request_id in self._groups:
      raise ValueError(f"request_id {request_id!r} is already in use")
    if prompt is None and prompt_token_ids is None:
      raise ValueError("give prompt or prompt_token_ids")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
      raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r:.80}")
    if prompt_token_ids is None:  # (with both, the ids are the prompt; the text is kept)
      if self.tokenizer is None:
        raise ValueError("prompt: this engine has no tokenizer; pass prompt_token_ids")
      token_ids = self.tokenizer.encode(prompt)
    else:
      token_ids = prompt_token_ids
    token_ids = check_prompt(token_ids, vocab_size=self.model_config.vocab_size,
                             max_model_len=self.config.max_model_len,
                             text=prompt if prompt_token_ids is None else None)
    check_sampling(sampling_params, vocab_size=self.model_config.vocab_size,
                   has_tokenizer=self.tokenizer is not None,
                   max_num_seqs=self.config.max_num_seqs, prompt_len=len(token_ids),
                   device_tokens=(self.block_manager.device_pool.num_usable_blocks
                                  * self.config.block_size))
    n = sampling_params.n
    # Sequence i > 0 of a request with n > 1 runs as f"{i}_{request_id}" (vLLM's).
    seq_ids = [request_id] + [f"{i}_{request_id}" for i in range(1, n)]
    if taken := [i for i in seq_ids[1:] if i in self.requests]:
      raise ValueError(f"request_id {request_id!r}: its sequence id {taken[0]!r} is in use")
    seqs = []
    arrival = time.perf_counter()
    for i, seq_id in enumerate(seq_ids):
      seed = sampling_params.seed
      seed = (int(self._seed_rng.integers(0, 2**31 - 1)) if seed is None
              else (seed + i) % 2**32)
      seqs.append(Request(seq_id, token_ids, sampling_params, seed=seed, prompt=prompt,
                          arrival_time=arrival, index=i, cache_salt=cache_salt,
                          detokenizer=self.tokenizer.decode_stream(
                              prompt_token_ids=token_ids,
                              skip_special_tokens=sampling_params.skip_special_tokens)
                          if self.tokenizer and sampling_params.detokenize else None))
    request = seqs[0]
    if sampling_params.prompt_logprobs is not None:
      request.prompt_logprobs = [None]  # (the first prompt token has none)
    if n > 1:
      group = self._groups[request_id] = SequenceGroup(request_id, seqs)
      for seq in seqs:
        seq.group = group
      request.pending_children = seqs[1:]
    for seq in seqs:
      self.requests[seq.request_id] = seq
    self.scheduler.add(request)
    self.stats.on_add(request)
    return request_id

  def abort_request(self, request_id: str) -> bool:
    """Ends a request (all n of its sequences) now, finish_reason "abort", and frees its
    blocks."""
    group = self._groups.get(str(request_id))
    request = self.requests.get(str(request_id))
    if group is None and (request is None or request.is_finished):
      return False
    for seq in group.seqs if group is not None else [request]:
      if not seq.is_finished:
        self._finish(seq, "abort")
    return True

  def has_unfinished_requests(self) -> bool:
    return self.scheduler.num_unfinished > 0

  @property
  def num_pending_outputs(self) -> int:
    """Outputs of requests finished between steps (aborted), which the next `step()`
    hands out."""
    return len(self._finished)

  # --- One step ------------------------------------------------------------------

  def step(self) -> list[RequestOutput]:
    """Runs one engine step; returns the outputs of requests that got a token or finished.

    Steps overlap (vLLM V1's async scheduling): this call plans and dispatches step t,
    then reads back step t - 1's tokens and postprocesses them while step t runs on the
    device. A decode in step t whose token step t - 1 is still sampling reads it there, on
    the device; the host learns each token one call later. A request that stops on a
    token of step t - 1 may have a row in step t: that row is dropped.
    """
    self.transfer.poll()
    if self.tier is not None:
      for request in self.tier.poll():
        self.scheduler.requeue_loaded(request)
    out = self.scheduler.schedule()
    self.last_step_num_tokens = out.num_tokens
    self.last_step_prefill_tokens = sum(
        c.num_tokens for c in out.chunks
        if c.num_tokens > 1 or c.start < c.request.num_prompt_tokens)
    if (out.is_empty and self._inflight is None and self.tier is not None
        and self.tier.num_loading):
      # Nothing to run but third-tier loads in flight: wait for one (a few ms at most)
      # rather than spin, which would starve the tier's worker thread of the GIL.
      self.tier.wait(0.05)
    dispatched = self._run(out)
    outputs: dict[str, Request] = {}
    previous, self._inflight = self._inflight, dispatched
    if previous is not None:
      self._postprocess(previous, outputs)
    if self._inflight is not None and (self.scheduler.num_unfinished == 0
                                       or not self.config.async_scheduling):
      # Without async scheduling, or with nothing left to run (the step in flight holds
      # rows of finished requests only), the step completes now.
      last, self._inflight = self._inflight, None
      self._postprocess(last, outputs)
    self.num_steps += 1
    result = self.output_processor.outputs(
        [r for r in outputs.values() if not r.is_finished] + self._finished)
    self._finished = []
    self.stats.on_usage(self.block_manager, self.scheduler)
    if self.tier is not None:  # (its series current for a reader of the registry alone)
      self.tier.export()
    return result

  def _run(self, out: SchedulerOutput) -> _InflightStep | None:
    """Moves the step's blocks, builds its batch and dispatches it (None: nothing to run,
    or it failed: a failed step ends only the requests it held)."""
    dispatched, moved = None, False
    try:
      self._move_blocks(out)
      moved = True
      if not out.is_empty:
        seq_ids = [c.request.request_id for c in out.chunks]
        width = max(self.block_manager.num_table_blocks(s) for s in seq_ids)
        batch = self.runner.build_batch(out.chunks,
                                        self.block_manager.block_tables(seq_ids, width),
                                        self._sparse_tiers(seq_ids, width))
        prev = self._inflight.handle.tokens if self._inflight is not None else None
        dispatched = _InflightStep(out, batch, self.runner.dispatch(batch, prev),
                                   time.perf_counter())
    except Exception as e:
      self.block_manager.finish_step()  # (its transfers, if any, are dispatched)
      self._fail_step(out, moved, e)
      return None
    self.block_manager.finish_step()
    if dispatched is not None:
      for i, chunk in enumerate(out.chunks):
        if chunk.samples:
          chunk.request.num_inflight += 1
          chunk.request.inflight_row = i
    return dispatched

  def _postprocess(self, step: _InflightStep, outputs: dict[str, Request]) -> None:
    """Reads back a dispatched step's tokens (waits for it) and hands each row's token
    to its request; `outputs` gets the requests that advanced."""
    try:
      result = self.runner.collect(step.handle)
    except Exception as e:  # the step failed on the device: its requests end
      self._fail_step(step.out, True, e)
      return
    tokens, counts = result.tokens, result.counts
    now = time.perf_counter()  # every row's token arrives now
    self.stats.on_step(step.out, now - step.start, self.block_manager)
    # The per-token prefill time the tier's load gate weighs (not from a step that may have
    # compiled its program: seconds of compile would make recomputing look dear).
    if self.tier is not None and not step.handle.compiled:
      self.tier.observe_prefill(
          sum(c.num_tokens for c in step.out.chunks if c.start < c.request.num_prompt_tokens),
          now - step.start)
    sparse_rows = step.batch.metadata.sparse_rows
    if result.prompt_logprobs is not None:
      for i, first, num in step.batch.prompt_spans:
        chunk = step.out.chunks[i]
        if not chunk.request.is_finished:
          self.output_processor.add_prompt_logprobs(
              chunk.request, chunk.start + 1,
              tuple(a[first:first + num] for a in result.prompt_logprobs))
    tally = engine_metrics.StepTally()
    for i, (chunk, token, num_blocks) in enumerate(zip(
        step.out.chunks, tokens.tolist(), step.batch.blocks_attended.tolist())):
      request = chunk.request
      if chunk.samples:
        request.num_inflight -= 1
      if request.is_finished:  # stopped (or aborted) before this row came back
        continue
      row_logprobs = None
      if result.logprobs is not None and request.sampling_params.logprobs is not None:
        row_logprobs = tuple(a[i] for a in result.logprobs)
      own = 0
      if sparse_rows[i] and chunk.num_tokens > 1:  # a streamed prompt's prefill chunk
        earlier = chunk.start // self.config.block_size  # (exact: all of them attended)
        if self.runner.hisparse.streamed_prefill == "sparse":
          earlier = min(earlier, self.runner.hisparse_blocks.top_k_blocks)
        own = num_blocks - earlier
      engine_metrics.tally_blocks(request, num_blocks, tally,
                         counts[:, i] if counts is not None and sparse_rows[i] else None,
                         own, self.config.block_size if self.is_dsa else 1)
      if chunk.samples:  # (a prompt chunk before the last has nothing to report)
        self._append_token(request, token, now, tally, row_logprobs)
        outputs[request.request_id] = request
    tally.loaded_block_layers = result.loaded_block_layers
    self.stats.on_tally(tally, self.runner.load_unit_bytes)

  def _fail_step(self, out: SchedulerOutput, moved: bool, error: Exception) -> None:
    """Finishes (reason "error") the requests whose KV the failed step may have spoiled.

    Always the scheduled ones; when the block moves themselves failed, also the requests
    swapped out or in by this step. Others go on. When the jitted step failed after
    consuming the donated device pool, no resident KV survives: that is fatal.
    """
    requests = [c.request for c in out.chunks]
    if not moved:
      requests += out.preempted + out.swapped_in
    logging.exception("step failed (%s: %s); finishing its %d requests",
                      type(error).__name__, error, len(requests))
    message = f"{type(error).__name__}: {error}"
    for request in requests:
      if not request.is_finished:  # (also skips a request listed twice)
        self._finish(request, "error", error=message)
    if any(a.is_deleted() for a in self.device_pool.arrays()):
      raise RuntimeError("the device KV pool was consumed by a failed step; this engine "
                         "cannot continue") from error

  def _sparse_tiers(self, seq_ids: list[str], width: int) -> SparseTiers | None:
    """Host copies, hot slots and hot-state rows of the step's requests (HiSparse)."""
    if self.config.hisparse is None:
      return None
    bm = self.block_manager
    rows, reset = self.hot_rows.assign(bm, seq_ids)
    slots = self.runner.hisparse_blocks.hot_buffer_blocks
    return SparseTiers(host_tables=bm.host_tables(seq_ids, width),
                       hot_slots=bm.hot_slot_tables(seq_ids, slots), hot_rows=rows,
                       hot_reset=reset)

  def _move_blocks(self, out: SchedulerOutput) -> None:
    """Executes the step's block moves in the BlockManager contract's order."""
    self.stats.on_preempt(len(out.preempted) + len(out.recomputed))
    self.stats.on_offload(len(out.offloaded))
    if self.tier is not None:  # write_back: evicted host blocks stored before reuse
      self.tier.store_evicted()
    if out.swap_out:
      device_ids = np.concatenate([p.device_ids for p in out.swap_out])
      host_ids = np.concatenate([p.host_ids for p in out.swap_out])
      self.transfer.swap_out(device_ids, host_ids)
      self.runner.copy_bounds_to_host_index(device_ids, host_ids)  # the indexer's view
    self.runner.copy_blocks(out.copies)
    if out.swap_in:
      device_ids = np.concatenate([p.device_ids for p in out.swap_in])
      host_ids = np.concatenate([p.host_ids for p in out.swap_in])
      self.transfer.swap_in(host_ids, device_ids)
      self.runner.refresh_bounds(device_ids)  # the key bounds follow the pages
      if self.tier is not None:  # a block loaded from the third tier has no host bounds
        self.runner.copy_bounds_to_host_index(device_ids, host_ids)

  def _append_token(self, request: Request, token: int, now: float,
                    tally: engine_metrics.StepTally, logprobs) -> None:
    """A sampled token reaches its request: its timings, the pending slot it fills in the
    block manager, its output and text (OutputProcessor); finishes it when it stops."""
    if request.first_token_time is None:
      request.first_token_time = now
      tally.ttft.append(now - request.arrival_time)
      if self.tier is not None and self.config.enable_prefix_caching:
        # Its prompt's KV is computed: host copies of its full blocks, stored behind.
        self.tier.on_prefilled(request, hashes_of(request.prompt_token_ids,
                                                  self.config.block_size,
                                                  request.block_hashes,
                                                  request.cache_salt))
    else:
      tally.token_gaps.append(now - request.last_token_time)
    request.last_token_time = now
    tally.generated += 1
    if request.pending_in_blocks:  # a decode was planned with this token pending
      request.pending_in_blocks = False
      position = len(request.prompt_token_ids) + len(request.output_token_ids)
      self.block_manager.set_token(request.request_id, position, token)
    reason = self.output_processor.append_token(request, token, logprobs)
    if reason is not None:
      self._finish(request, reason)

  def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
    children = request.pending_children
    self.scheduler.remove(request)
    request.pending_children = []
    del self.requests[request.request_id]  # its id may be used again from now on
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    request.error = error
    self.stats.on_finish(request)
    self._finished.append(request)
    for child in children:  # sequences that never forked its blocks end with it
      self._finish(child, reason, error)
    if request.group is not None and request.group.finished:
      self._groups.pop(request.group.request_id, None)

  # --- Figures -------------------------------------------------------------------

  def metrics(self) -> dict[str, float]:
    """All metrics as a flat dict (labelled series keyed like `name{label="x"}`)."""
    self.transfer.poll()
    self.stats.on_usage(self.block_manager, self.scheduler)
    self.stats.on_shapes(len(self.runner.shapes_compiled), self.runner.compiler)
    if self.tier is not None:
      self.tier.export()
    return self.metrics_registry.to_dict()

  def check_invariants(self) -> None:
    """Block-manager invariants plus the engine's own (invariants.check_engine)."""
    check_engine(self)

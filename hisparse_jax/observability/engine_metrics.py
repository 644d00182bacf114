"""The engine's runtime metrics: names, help texts, and the hooks the engine calls.

Every series lives in the engine's `MetricsRegistry` (flat dict via `to_dict()`,
Prometheus via `serve(port)`). Series, with the labels they carry:

  hisparse_kv_capacity_tokens{memory_kind}      gauge   (set at load, CapacityReport)
  hisparse_kv_capacity_bytes{memory_kind,device} gauge  (tensor parallel only: each
                                                        device's live shard bytes)
  hisparse_kv_usage_ratio{memory_kind}          gauge   owned blocks / usable blocks
  hisparse_blocks_selected_total{source}        counter blocks attention read (all of a
                                                        dense row's blocks, the selected
                                                        ones of a HiSparse row): device,
                                                        hot (HiSparse), host (came back
                                                        from the host pool)
  hisparse_transfer_*{direction}                        (TransferEngine: calls, blocks,
                                                        bytes, seconds)
  hisparse_prefix_cache_queries_total           counter full-block lookups
  hisparse_prefix_cache_hits_total{memory_kind} counter full-block hits per tier
  hisparse_preemptions_total                    counter requests preempted
  hisparse_thrash_total                         counter blocks loaded again soon after
                                                        leaving the hot buffer (HiSparse)
  hisparse_offloads_total                       counter sparse requests that dropped their
                                                        written-through device blocks
  hisparse_hot_buffer_{lookups,hits,evictions,loads}_total   counters, in block-layers
                                                        (a block of one layer): lookups of
                                                        non-resident selected blocks, hot
                                                        hits, slots overwritten, misses
                                                        loaded from the host pool inside the
                                                        step; transfer bytes h2d count what
                                                        those loads moved (the misses
                                                        rounded up to a load size)
  hisparse_hot_buffer_hit_rate                  gauge   hits / lookups so far
  hisparse_requests_total{finish_reason}        counter finished requests
  hisparse_prompt_tokens_total, hisparse_generation_tokens_total   counters
  hisparse_num_requests{state}                  gauge   running, waiting, swapped; offloaded
                                                        (running, KV offloaded: HiSparse),
                                                        loading (waiting on a third-tier
                                                        load)
  hisparse_step_shapes                          gauge   distinct padded step shapes run so
                                                        far (each compiled a step program
                                                        the first time: a rise while serving
                                                        is a compile stall, unless
                                                        compile_in_background)
  hisparse_step_compiles{where}                 gauge   step programs compiled so far:
                                                        foreground (the step waited: a
                                                        stall), background
                                                        (compile_in_background) or warmup
                                                        (before any request: serve's
                                                        warm-up, engine/warmup.py)
  hisparse_steps_on_covering_shape              gauge   steps run padded to a compiled
                                                        covering shape while their own
                                                        compiled (compile_in_background)
  hisparse_time_to_first_token_seconds, hisparse_inter_token_seconds,
  hisparse_step_seconds                         histograms (_count, _sum, _p50, _p99)
"""

from __future__ import annotations

import dataclasses

from hisparse_jax.observability import metrics as m
from hisparse_jax.observability.metrics import MetricsRegistry

KV_USAGE_RATIO = "hisparse_kv_usage_ratio"
BLOCKS_SELECTED_TOTAL = "hisparse_blocks_selected_total"
PREFIX_CACHE_QUERIES_TOTAL = "hisparse_prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL = "hisparse_prefix_cache_hits_total"
PREEMPTIONS_TOTAL = "hisparse_preemptions_total"
THRASH_TOTAL = "hisparse_thrash_total"
OFFLOADS_TOTAL = "hisparse_offloads_total"
HOT_LOOKUPS_TOTAL = "hisparse_hot_buffer_lookups_total"
HOT_HITS_TOTAL = "hisparse_hot_buffer_hits_total"
HOT_EVICTIONS_TOTAL = "hisparse_hot_buffer_evictions_total"
HOT_LOADS_TOTAL = "hisparse_hot_buffer_loads_total"
HOT_HIT_RATE = "hisparse_hot_buffer_hit_rate"
REQUESTS_TOTAL = "hisparse_requests_total"
PROMPT_TOKENS_TOTAL = "hisparse_prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "hisparse_generation_tokens_total"
NUM_REQUESTS = "hisparse_num_requests"
STEP_SHAPES = "hisparse_step_shapes"
STEP_COMPILES = "hisparse_step_compiles"
STEPS_ON_COVERING_SHAPE = "hisparse_steps_on_covering_shape"
TTFT_SECONDS = "hisparse_time_to_first_token_seconds"
INTER_TOKEN_SECONDS = "hisparse_inter_token_seconds"
STEP_SECONDS = "hisparse_step_seconds"


class EngineMetrics:
  """Hooks that keep the engine's series current; one per engine."""

  def __init__(self, registry: MetricsRegistry):
    r = self._registry = registry
    self.usage = r.gauge(KV_USAGE_RATIO, "Owned KV blocks / usable blocks.", ("memory_kind",))
    self.blocks_selected = r.counter(BLOCKS_SELECTED_TOTAL,
                                     "KV blocks attention read, by where they came from.",
                                     ("source",))
    self.prefix_queries = r.counter(PREFIX_CACHE_QUERIES_TOTAL,
                                    "Prefix-cache lookups of full blocks.")
    self.prefix_hits = r.counter(PREFIX_CACHE_HITS_TOTAL, "Prefix-cache hits (blocks).",
                                 ("memory_kind",))
    self.preemptions = r.counter(PREEMPTIONS_TOTAL, "Requests preempted.")
    self.step_shapes = r.gauge(STEP_SHAPES, "Distinct padded step shapes run so far (each "
                               "compiled a step program once).")
    self.step_compiles = r.gauge(STEP_COMPILES, "Step programs compiled so far, in the "
                                 "foreground (the step waited), the background or the "
                                 "warm-up before any request.",
                                 labelnames=("where",))
    self.steps_on_cover = r.gauge(STEPS_ON_COVERING_SHAPE, "Steps run padded to a compiled "
                                  "covering shape while their own program compiled.")
    self.thrash = r.counter(THRASH_TOTAL, "Blocks reloaded soon after eviction.")
    self.offloads = r.counter(OFFLOADS_TOTAL, "Sparse requests whose written-through device "
                              "blocks were dropped to make room (HiSparse).")
    self.hot_lookups = r.counter(HOT_LOOKUPS_TOTAL, "Selected non-resident block-layers "
                                 "looked up in the hot buffers (HiSparse).")
    self.hot_hits = r.counter(HOT_HITS_TOTAL, "Hot-buffer lookups that hit (HiSparse).")
    self.hot_evictions = r.counter(HOT_EVICTIONS_TOTAL,
                                   "Hot-buffer slots overwritten by a load (HiSparse).")
    self.hot_loads = r.counter(HOT_LOADS_TOTAL, "Block-layers loaded from the host pool "
                               "into hot buffers inside the step (HiSparse).")
    self.hot_hit_rate = r.gauge(HOT_HIT_RATE, "Hot-buffer hits / lookups so far (HiSparse).")
    self.requests = r.counter(REQUESTS_TOTAL, "Finished requests.", ("finish_reason",))
    self.prompt_tokens = r.counter(PROMPT_TOKENS_TOTAL, "Prompt tokens received.")
    self.generation_tokens = r.counter(GENERATION_TOKENS_TOTAL, "Tokens generated.")
    self.num_requests = r.gauge(NUM_REQUESTS, "Requests by scheduler state.", ("state",))
    self.ttft = r.histogram(TTFT_SECONDS, "Seconds from arrival to the first token.")
    self.inter_token = r.histogram(INTER_TOKEN_SECONDS, "Seconds between output tokens.")
    self.step_seconds = r.histogram(STEP_SECONDS, "Seconds of one jitted step.")
    for source in ("device", "hot", "host"):
      self.blocks_selected.inc(0, source=source)
    for kind in ("device", "pinned_host"):
      self.prefix_hits.inc(0, memory_kind=kind)
    for counter in (self.preemptions, self.thrash, self.offloads, self.hot_lookups,
                    self.hot_hits, self.hot_evictions, self.hot_loads):
      counter.inc(0)
    self.hot_hit_rate.set(0.0)
    self._seen_queries = 0
    self._seen_hits = {"device": 0, "pinned_host": 0}

  def zero_transfer_series(self) -> None:
    """Shows the transfer counters of both directions at 0 before any transfer (call
    after the TransferEngine registered them), so `metrics()` always has their keys."""
    for name in (m.TRANSFERS_TOTAL, m.TRANSFER_BLOCKS_TOTAL, m.TRANSFER_BYTES_TOTAL):
      for direction in (m.DIRECTION_H2D, m.DIRECTION_D2H):
        self._registry.get(name).inc(0, direction=direction)

  def on_add(self, request) -> None:
    self.prompt_tokens.inc(request.num_prompt_tokens)

  def on_preempt(self, n: int) -> None:
    if n:
      self.preemptions.inc(n)

  def on_step(self, out, seconds: float, block_manager) -> None:
    self.step_seconds.observe(seconds)
    queries = block_manager.device_pool.prefix_cache_queries
    self.prefix_queries.inc(queries - self._seen_queries)
    self._seen_queries = queries
    for kind, pool in block_manager.pools.items():
      self.prefix_hits.inc(pool.prefix_cache_hits - self._seen_hits[kind], memory_kind=kind)
      self._seen_hits[kind] = pool.prefix_cache_hits

  def on_tally(self, tally: StepTally, bytes_per_block_layer: int) -> None:
    """Records what one step's rows added (one update per series, not one per row)."""
    self.on_blocks(**tally.blocks)
    if tally.hot_buffer is not None:
      self.on_hot_buffer(**tally.hot_buffer)
    if tally.loaded_block_layers:  # what the step's host loads moved (misses, bucketed)
      self._registry.get(m.TRANSFER_BYTES_TOTAL).inc(
          bytes_per_block_layer * tally.loaded_block_layers, direction=m.DIRECTION_H2D)
    if tally.ttft:
      self.ttft.observe_many(tally.ttft)
    if tally.token_gaps:
      self.inter_token.observe_many(tally.token_gaps)
    if tally.generated:
      self.generation_tokens.inc(tally.generated)

  def on_blocks(self, *, device: int = 0, hot: int = 0, host: int = 0) -> None:
    for source, n in (("device", device), ("hot", hot), ("host", host)):
      if n:
        self.blocks_selected.inc(n, source=source)

  def on_offload(self, n: int) -> None:
    if n:
      self.offloads.inc(n)

  def on_hot_buffer(self, *, hits: int, misses: int, evictions: int, thrash: int) -> None:
    """Counts of one sparse row of a step, summed over layers (block-layers): hot-buffer
    hits, misses (= loads from the host pool inside the step), evictions, thrash."""
    self.hot_lookups.inc(hits + misses)
    self.hot_hits.inc(hits)
    self.hot_evictions.inc(evictions)
    if thrash:
      self.thrash.inc(thrash)
    if misses:
      self.hot_loads.inc(misses)
    lookups = self.hot_lookups.value()
    self.hot_hit_rate.set(self.hot_hits.value() / lookups if lookups else 0.0)

  def on_first_token(self, seconds: float) -> None:
    self.ttft.observe(seconds)

  def on_token_gap(self, seconds: float) -> None:
    self.inter_token.observe(seconds)

  def on_generated(self, n: int) -> None:
    self.generation_tokens.inc(n)

  def on_finish(self, request) -> None:
    self.requests.inc(finish_reason=request.finish_reason)

  def on_shapes(self, num_shapes: int, compiler=None) -> None:
    self.step_shapes.set(num_shapes)
    if compiler is not None:
      self.step_compiles.set(compiler.foreground, where="foreground")
      self.step_compiles.set(compiler.background, where="background")
      self.step_compiles.set(compiler.warmed, where="warmup")
      self.steps_on_cover.set(compiler.covered)

  def on_usage(self, block_manager, scheduler) -> None:
    for kind, pool in block_manager.pools.items():
      self.usage.set(pool.usage, memory_kind=kind)
    self.num_requests.set(len(scheduler.running), state="running")
    self.num_requests.set(len(scheduler.waiting), state="waiting")
    self.num_requests.set(len(scheduler.swapped), state="swapped")
    # (of the running: those whose KV is offloaded to the host pool, HiSparse; and the
    # waiting ones whose prompt blocks a third tier is loading)
    self.num_requests.set(sum(block_manager.is_offloaded(r.request_id)
                              for r in scheduler.running
                              if r.request_id in block_manager), state="offloaded")
    self.num_requests.set(len(scheduler.loading), state="loading")


@dataclasses.dataclass
class StepTally:
  """What the rows of one step add to the metrics, summed on the host as rows are
  postprocessed and recorded by `EngineMetrics.on_tally` once per step."""

  blocks: dict[str, float] = dataclasses.field(
      default_factory=lambda: {"device": 0, "hot": 0, "host": 0})
  hot_buffer: dict[str, int] | None = None  # hits, misses, evictions, thrash (HiSparse)
  ttft: list[float] = dataclasses.field(default_factory=list)
  token_gaps: list[float] = dataclasses.field(default_factory=list)
  generated: int = 0
  loaded_block_layers: int = 0  # blocks x layers the step's host loads moved

  def add_blocks(self, device: float, hot: float, host: float) -> None:
    blocks = self.blocks
    blocks["device"] += device
    blocks["hot"] += hot
    blocks["host"] += host

  def add_hot_buffer(self, **counts: int) -> None:
    if self.hot_buffer is None:
      self.hot_buffer = dict.fromkeys(counts, 0)
    for name, n in counts.items():
      self.hot_buffer[name] += n


def tally_blocks(request, num_blocks: int, tally: StepTally, sparse_counts,
                 own_blocks: int = 0, units_per_block: int = 1) -> None:
  """Where a row's blocks came from, into the step's `tally` and the request's metrics
  (an engine Request: its num_swapped_in_blocks and blocks_selected). `num_blocks`:
  blocks the row's attention read (all of them, or the selected); `sparse_counts`: None
  for a dense row, else [layers, 5] (runner.COUNT_FIELDS) of a sparse row, per
  layer (counted as the mean over layers); `own_blocks`: a sparse prefill chunk's own
  blocks, read besides the selected ones (device-resident); `units_per_block`: count units
  per block (1; a DSA model counts tokens: block_size)."""
  from_host = min(request.num_swapped_in_blocks, num_blocks)
  request.num_swapped_in_blocks = 0
  selected = request.blocks_selected
  if sparse_counts is None:
    tally.add_blocks(num_blocks - from_host, 0, from_host)
    selected["device"] += num_blocks - from_host
    selected["host"] += from_host
    return
  layers = sparse_counts.shape[0]
  device, hot, host, evictions, thrash = (int(x) for x in sparse_counts.sum(axis=0))
  device += own_blocks * layers  # a sparse prefill chunk's own blocks (on the device)
  # The hot buffer counts in its unit (block-layers; a DSA model's: token-layers); the
  # blocks read in blocks (a DSA model's selected tokens / block_size).
  tally.add_hot_buffer(hits=hot, misses=host, evictions=evictions, thrash=thrash)
  per_block = layers * units_per_block
  tally.add_blocks(device / per_block, hot / per_block, host / per_block)
  selected["device"] += device / per_block
  selected["hot"] += hot / per_block
  selected["host"] += host / per_block

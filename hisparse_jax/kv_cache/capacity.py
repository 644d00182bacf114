"""KV capacity: planning the pools of each memory kind, and reporting what was allocated.

Owns two steps of model loading:

1. `plan_capacity`: how many blocks each tier gets. Device budget: `--device_kv_gib`;
   else, where `device.memory_stats()` exists (GPU, TPU), `device_memory_fraction` of
   `bytes_limit - bytes_in_use` measured after the weights are loaded; else (CPU, where
   it is None) `DEFAULT_DEVICE_KV_GIB`. Device bytes reserved for the indexer and hot
   buffers (`device_reserved_bytes`, filled by HiSparse) come out of that budget first,
   except from the default: it is `DEFAULT_DEVICE_KV_GIB` of KV blocks, and the reserved
   bytes come on top (HiSparse's key bounds of a 1 GiB host pool of 4-token blocks take
   0.25 GiB: out of the default they would leave no room for one request).
   Host budget: `--host_pool_gib`, refused above 95% of the available RAM. Each tier
   must hold one request of `--max_model_len` tokens, or planning fails naming the flag.
2. `CapacityReport.from_pools`: the capacity of each memory kind measured on the
   allocated arrays (sum of `nbytes` of the arrays whose sharding has that memory kind),
   never from the formula used to plan them; `log()` writes the capacity lines.

The null block of each pool (block 0) is allocated (its bytes are in `kv_bytes` and in
the GiB figure) but never handed out, so it is not in `num_blocks` or `num_tokens`;
each line says so in its detail.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import psutil
from absl import logging

from hisparse_jax.distributed import parallel
from hisparse_jax.distributed.parallel import live_bytes
from hisparse_jax.kv_cache.kv_pool import (
  DEVICE,
  MEMORY_KINDS,
  PINNED_HOST,
  KVCacheSpec,
  KVPool,
  num_usable_blocks,
)
from hisparse_jax.kv_cache.sparse_capacity import (  # noqa: F401 (re-exported)
  HiSparseCapacity,
  bounds_bytes_per_block,
  hisparse_capacity,
  limited_by,
  num_hot_rows,
  streamed_device_blocks,
)
from hisparse_jax.observability import metrics as m

GIB = 2**30
# Device KV blocks when neither the flag nor memory_stats() decide (+ reserved bytes).
DEFAULT_DEVICE_KV_GIB = 0.25
DEFAULT_DEVICE_MEMORY_FRACTION = 0.9  # of the device memory left after loading the weights
MAX_HOST_RAM_FRACTION = 0.95  # of psutil.virtual_memory().available


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
  """Block counts of both tiers. Invariant: each tier holds one request of
  `max_model_len` tokens in usable blocks (the null block of each tier excluded); the
  device blocks plus `device_reserved_bytes` fit the device budget; the host blocks fit
  the host budget."""

  spec: KVCacheSpec
  num_device_blocks: int  # allocated, null block included
  num_host_blocks: int
  device_budget_bytes: int
  device_budget_source: str  # "--device_kv_gib", "memory_stats" or "default"
  device_reserved_bytes: int
  host_budget_bytes: int
  max_model_len: int

  def allocate(self, device: jax.Device | None = None, mesh: jax.sharding.Mesh | None = None
               ) -> tuple[KVPool, KVPool]:
    """The (device pool, host pool) of this plan (mesh: split by KV head over it)."""
    return (KVPool(self.spec, self.num_device_blocks, DEVICE, device, mesh=mesh),
            KVPool(self.spec, self.num_host_blocks, PINNED_HOST, device, mesh=mesh))


def _gib(num_bytes: float) -> str:
  """GiB with two decimals and thousands separators; under 0.01 GiB in MiB, so a small
  pool never reads "0.00 GiB"."""
  if num_bytes < 0.01 * GIB:
    return f"{num_bytes / 2**20:,.2f} MiB"
  return f"{num_bytes / GIB:,.2f} GiB"


def plan_capacity(spec: KVCacheSpec, *, max_model_len: int, host_pool_gib: float,
                  device_kv_gib: float | None = None, device: jax.Device | None = None,
                  device_reserved_bytes: int = 0,
                  device_memory_fraction: float = DEFAULT_DEVICE_MEMORY_FRACTION,
                  num_devices: int = 1,
                  streamed_device_blocks: int | None = None,  # noqa: F811 (the count)
                  check_host_ram: bool = True, chunk_is_smallest: bool = False,
                  bounds_dtype: str | None = None) -> CapacityPlan:
  """Plans the block counts of both tiers; `ValueError` naming the flag when refused.

  streamed_device_blocks: with HiSparse (and chunked prefill) one request's KV lives in
  the host pool and streams through the device (`streamed_device_blocks`); the device
  must then hold that many usable blocks, not the whole request.

  num_devices: tensor parallelism; each block is split over that many devices, the
  device budget (flag, memory_stats or default) is per device, and the plan's budget and
  `device_reserved_bytes` are over all of them. The host budget is the whole host's.

  check_host_ram: refuse a host pool above 95% of this machine's available RAM (False:
  planning for another machine, `hisparse-jax compile --target`).

  chunk_is_smallest: the streamed prefill chunk is already one block (the engine chose
  it, engine/planning.resolve_config): a refusal does not suggest a smaller one.

  bounds_dtype: HiSparse's key-bounds dtype (llama models): where wider than int8, a
  refusal over the reserved bytes also suggests --bounds_dtype=int8."""
  device = device if device is not None else jax.local_devices()[0]  # (this process's)
  if max_model_len <= 0:
    raise ValueError(f"--max_model_len must be positive, got {max_model_len}")
  if device_reserved_bytes < 0:
    raise ValueError(f"device_reserved_bytes must be >= 0, got {device_reserved_bytes}")
  blocks_per_request = math.ceil(max_model_len / spec.block_size)
  request_bytes = blocks_per_request * spec.bytes_per_block
  need = (f"one request of --max_model_len={max_model_len:,} tokens needs "
          f"{blocks_per_request:,} blocks of {spec.block_size} tokens "
          f"({request_bytes:,} bytes)")

  # Device tier.
  stats = device.memory_stats()
  free = None
  if stats and "bytes_limit" in stats:
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  if device_kv_gib is not None:
    if device_kv_gib <= 0:
      raise ValueError(f"--device_kv_gib must be positive, got {device_kv_gib}")
    budget, source = int(device_kv_gib * GIB), "--device_kv_gib"
    if free is not None and budget > free:
      raise ValueError(f"--device_kv_gib={device_kv_gib} asks for {_gib(budget)} but only "
                       f"{_gib(free)} of device memory is free after loading the weights")
    budget *= num_devices
  elif free is not None:
    budget, source = int(device_memory_fraction * free) * num_devices, "memory_stats"
  else:
    budget = int(DEFAULT_DEVICE_KV_GIB * GIB) * num_devices + device_reserved_bytes
    source = "default"
  if num_devices > 1:
    source += f", per device x {num_devices} devices"
  num_device_blocks = max(0, (budget - device_reserved_bytes) // spec.bytes_per_block)
  device_need = blocks_per_request
  if streamed_device_blocks is not None and streamed_device_blocks < blocks_per_request:
    device_need = streamed_device_blocks
    chunk = ("a prefill chunk of one block at the least" if chunk_is_smallest
             else "one prefill chunk of --max_num_batched_tokens")
    need = (f"HiSparse streams a request through {streamed_device_blocks:,} blocks of "
            f"{spec.block_size} tokens (its hot buffer, {chunk}, and 2 more)")
  if num_usable_blocks(num_device_blocks) < device_need:
    raise ValueError(
        f"--device_kv_gib: the device KV budget of {budget:,} bytes = {_gib(budget)} "
        f"({source}) holds "
        f"{max(0, num_usable_blocks(num_device_blocks)):,} usable blocks after the null block and "
        f"{device_reserved_bytes:,} bytes reserved for the indexer and hot buffers, but "
        f"{need}; raise --device_kv_gib or lower --max_model_len"
        + ((" or --hot_buffer_tokens" if chunk_is_smallest
            else ", --hot_buffer_tokens or --max_num_batched_tokens") if device_need
           < blocks_per_request else "")
        + (" (or lower --host_pool_gib"
           + (" or raise --block_size" if bounds_dtype in (None, "int8")
              else ", raise --block_size or set --bounds_dtype=int8")
           + ": the indexer keeps the "
           f"{'indexer keys' if spec.is_mla else 'key bounds'} of every host block on the "
           "device)" if device_reserved_bytes else ""))

  # Host tier.
  if host_pool_gib < 0:
    raise ValueError(f"--host_pool_gib must be >= 0, got {host_pool_gib}")
  host_bytes = int(host_pool_gib * GIB)
  available = int(psutil.virtual_memory().available)
  if check_host_ram and host_bytes > MAX_HOST_RAM_FRACTION * available:
    raise ValueError(
        f"--host_pool_gib={host_pool_gib} asks for {_gib(host_bytes)} of pinned host memory, "
        f"above 95% of the available RAM ({_gib(available)} available, at most "
        f"{_gib(MAX_HOST_RAM_FRACTION * available)})")
  if free is None and device.platform == "cpu" and device_kv_gib is not None:
    # On CPU the device pool is host RAM too: both pools must fit it.
    if budget + host_bytes > MAX_HOST_RAM_FRACTION * available:
      raise ValueError(
          f"--device_kv_gib={device_kv_gib} and --host_pool_gib={host_pool_gib} ask for "
          f"{_gib(budget + host_bytes)} in all; on CPU both pools are host RAM, and that is "
          f"above 95% of the available RAM ({_gib(available)} available, at most "
          f"{_gib(MAX_HOST_RAM_FRACTION * available)})")
  num_host_blocks = host_bytes // spec.bytes_per_block
  if num_usable_blocks(num_host_blocks) < blocks_per_request:
    raise ValueError(f"--host_pool_gib={host_pool_gib} ({host_bytes:,} bytes) holds "
                     f"{max(0, num_usable_blocks(num_host_blocks)):,} usable blocks after the "
                     f"null block, but {need}; raise --host_pool_gib or lower --max_model_len")
  return CapacityPlan(spec=spec, num_device_blocks=num_device_blocks,
                      num_host_blocks=num_host_blocks, device_budget_bytes=budget,
                      device_budget_source=source,
                      device_reserved_bytes=device_reserved_bytes,
                      host_budget_bytes=host_bytes, max_model_len=max_model_len)


def plan_capacity_reserving(spec: KVCacheSpec, reserved_bytes, **plan_args) -> CapacityPlan:
  """The plan with the most device blocks whose `reserved_bytes(num_device_blocks,
  num_host_blocks)` (device bytes that grow with the pools, e.g. HiSparse's key bounds)
  fit the device budget beside them. Bisection over the reservation: a plan reserving r
  bytes is feasible when r covers what its own blocks need; feasibility is monotone in r
  (more reserved, fewer blocks, less needed)."""
  plan = plan_capacity(spec, **plan_args)  # nothing reserved: the most blocks
  hi = reserved_bytes(plan.num_device_blocks, plan.num_host_blocks)  # feasible
  lo = 0
  while lo < hi:
    mid = (lo + hi) // 2
    try:
      p = plan_capacity(spec, **plan_args, device_reserved_bytes=mid)
      feasible = mid >= reserved_bytes(p.num_device_blocks, p.num_host_blocks)
    except ValueError:  # too little left for one request: more reservation cannot help
      feasible = True
    if feasible:
      hi = mid
    else:
      lo = mid + 1
  plan = plan_capacity(spec, **plan_args, device_reserved_bytes=hi)
  needed = reserved_bytes(plan.num_device_blocks, plan.num_host_blocks)
  if needed > hi:
    raise AssertionError(f"reservation {hi:,} < {needed:,} bytes needed")
  return dataclasses.replace(plan, device_reserved_bytes=needed)


@dataclasses.dataclass(frozen=True)
class TierCapacity:
  """What one memory kind holds. Invariants: `num_tokens == num_blocks * block_size`;
  `kv_bytes` is the allocated bytes of the pool arrays of this kind, reserved (null)
  blocks included; `num_blocks` counts only blocks that can be handed out."""

  memory_kind: str
  kv_bytes: int
  num_blocks: int
  block_size: int
  num_tokens: int
  num_null_blocks: int
  bytes_per_token: int
  reserved_bytes: int = 0  # device bytes for the indexer and hot buffers, not in kv_bytes
  # Tensor parallel: "cpu:0" for one device's shards (its KV heads of every block), None
  # for the memory kind over all devices of the mesh.
  device: str | None = None
  num_devices: int = 1  # devices whose shards the figures add up
  # Multi-host: the figures are this process's devices' (each process reports its own).
  process_index: int = 0
  num_processes: int = 1
  kv_dtype: str = ""  # what the pool stores (KVCacheSpec.describe()); "" = not named
  # A pool of several caches (a DSA model's MLA latent and indexer keys): (name, bytes per
  # token, allocated bytes) of each, measured on its arrays; () for K/V alone.
  caches: tuple[tuple[str, int, int], ...] = ()

  def log_line(self) -> str:
    where = f"memory_kind={self.memory_kind}"
    if self.device is not None:
      where += f", device={self.device}"
    line = (f"KV cache capacity [{where}]: {_gib(self.kv_bytes)} = "
            f"{self.num_blocks:,} blocks x {self.block_size} tokens = "
            f"{self.num_tokens:,} tokens; {self.bytes_per_token:,} bytes per token")
    if self.caches:
      line += " (" + "; ".join(f"{name} {per_token:,} bytes per token = {_gib(nbytes)}"
                               for name, per_token, nbytes in self.caches) + ")"
    if self.kv_dtype:
      line += f" (KV {self.kv_dtype})"
    if self.num_null_blocks:
      line += (f"; +{self.num_null_blocks} null block in the bytes, never handed out")
    if self.memory_kind == DEVICE:
      line += f"; {self.reserved_bytes:,} bytes reserved for the indexer and hot buffers"
    if self.device is None and self.num_devices > 1:
      line += f"; over {self.num_devices} devices"
      if self.num_processes > 1:
        line += f" of process {self.process_index} of {self.num_processes}"
    return line


@dataclasses.dataclass(frozen=True)
class CapacityReport:
  """KV capacity per memory kind, measured on the allocated pools.

  The total is the sum of the tiers: the tokens the engine can keep at once when every
  host block holds KV that is not also on the device. That is how swap works (a block
  swapped out frees its device copy, so device and host blocks hold different
  requests). Write-back tiering (HiSparse keeps a long sequence's full KV in the host
  pool and copies of hot blocks on the device) holds a block in both tiers, so for such
  sequences the distinct tokens are fewer than the sum; the sum stays the capacity of
  the two tiers together, and `max_concurrency(..., memory_kinds=("device",))` is the
  device-only figure.
  """

  tiers: tuple[TierCapacity, ...]
  hisparse: HiSparseCapacity | None = None
  # Tensor parallel: each device's shards, by memory kind (device order of the mesh);
  # their kv_bytes / reserved_bytes add up to the tiers'. Empty on one device.
  per_device: tuple[TierCapacity, ...] = ()
  # The third KV tier(s) (engine/tier_connector.ThirdTierCapacity: disk, remote), each
  # with its own line; their tokens are not in `total_tokens` (the pools' tokens), and
  # the total line names them apart.
  third_tiers: tuple = ()

  @classmethod
  def from_pools(cls, pools: Sequence[KVPool], device_reserved_bytes: int = 0,
                 hisparse: HiSparseCapacity | None = None,
                 reserved_arrays: Sequence[jax.Array] = ()) -> CapacityReport:
    """Capacity from the arrays of `pools`, grouped by each array's memory kind (and, over
    a mesh, by device: the bytes of each device's live shards; `reserved_arrays`: the
    arrays of `device_reserved_bytes`, split the same way)."""
    by_kind: dict[str, dict[str, int]] = {}
    for pool in pools:
      acc = by_kind.setdefault(pool.memory_kind, dict(kv_bytes=0, num_blocks=0,
                                                      num_null_blocks=0))
      for array in pool.arrays():
        kind = array.sharding.memory_kind
        if kind != pool.memory_kind:
          raise ValueError(f"a {pool.memory_kind} pool holds an array in {kind}")
        acc["kv_bytes"] += sum(live_bytes([array]).values())  # every shard, every copy
      acc["num_blocks"] += pool.num_usable_blocks
      acc["num_null_blocks"] += pool.num_blocks - pool.num_usable_blocks
      if len(pool.spec.caches) > 1:  # each cache apart, from its own arrays
        by_cache = acc.setdefault("cache_bytes", {})
        for name, nbytes in pool.cache_bytes().items():
          by_cache[name] = by_cache.get(name, 0) + nbytes
    specs = {pool.spec for pool in pools}
    if len(specs) != 1:
      raise ValueError(f"pools of one report must share one KVCacheSpec, got {specs}")
    spec = specs.pop()
    per_token = dict(spec.caches)

    def caches(acc: dict[str, int]) -> tuple[tuple[str, int, int], ...]:
      return tuple((name, per_token[name], nbytes)
                   for name, nbytes in acc.pop("cache_bytes", {}).items())

    tiers = tuple(
        TierCapacity(memory_kind=kind, block_size=spec.block_size,
                     num_tokens=acc["num_blocks"] * spec.block_size,
                     bytes_per_token=spec.bytes_per_token, kv_dtype=spec.describe(),
                     reserved_bytes=device_reserved_bytes if kind == DEVICE else 0,
                     caches=caches(acc), **acc)
        for kind in MEMORY_KINDS if (acc := by_kind.get(kind)) is not None)
    devices = {d for pool in pools for d in pool.devices}
    local = {d for pool in pools for d in pool.local_devices}  # multi-host: this process's
    per_device = []
    if len(devices) > 1:
      tiers = tuple(dataclasses.replace(
          t, num_devices=len(local), process_index=jax.process_index(),
          num_processes=jax.process_count(),
          bytes_per_token=t.bytes_per_token * len(local) // len(devices)) for t in tiers)
      reserved = live_bytes(reserved_arrays)
      for tier in tiers:
        kind_pools = [p for p in pools if p.memory_kind == tier.memory_kind]
        live = live_bytes(a for p in kind_pools for a in p.arrays())
        for device in kind_pools[0].local_devices:
          per_device.append(dataclasses.replace(
              tier, device=parallel.device_name(device), kv_bytes=live.get(device, 0),
              bytes_per_token=spec.bytes_per_token // len(kind_pools[0].devices),
              reserved_bytes=reserved.get(device, 0) if tier.memory_kind == DEVICE else 0,
              num_devices=1, num_processes=1))
    return cls(tiers=tiers, hisparse=hisparse, per_device=tuple(per_device))

  def __getitem__(self, memory_kind: str) -> TierCapacity:
    for tier in self.tiers:
      if tier.memory_kind == memory_kind:
        return tier
    raise KeyError(memory_kind)

  def __iter__(self):
    """The tiers (TierCapacity), device first: `list(report)` works as `report.tiers`."""
    return iter(self.tiers)

  def __len__(self) -> int:
    return len(self.tiers)

  @property
  def total_tokens(self) -> int:
    return sum(t.num_tokens for t in self.tiers)

  def max_concurrency(self, tokens_per_request: int,
                      memory_kinds: Sequence[str] | None = None) -> float:
    """How many requests of `tokens_per_request` tokens the tiers hold at once, counted
    in whole blocks per request (a request's last block may be partly empty)."""
    if tokens_per_request <= 0:
      raise ValueError(f"tokens_per_request must be positive, got {tokens_per_request}")
    tiers = [t for t in self.tiers if memory_kinds is None or t.memory_kind in memory_kinds]
    return sum(t.num_blocks / math.ceil(tokens_per_request / t.block_size) for t in tiers)

  def hisparse_concurrency(self, tokens_per_request: int) -> int | None:
    """Sparse requests of `tokens_per_request` tokens that RUN at once with HiSparse, as
    the scheduler admits them (None without HiSparse, for requests that stay dense, or
    with admission "wait"). Each running one holds its whole KV on the host and, once
    offloaded, a hot buffer plus its newest block on the device, and keeps a spare block
    there for its next one (admission's reserve); the last one admitted needs, beside
    them, its first prefill chunk and room for its hot buffer (streamed admission), or
    its whole prompt where prompts cannot stream. Also at most max_num_seqs."""
    hs = self.hisparse
    if (hs is None or tokens_per_request <= hs.sparse_threshold_tokens
        or hs.admission != "offload"):
      return None
    host, device = self[PINNED_HOST], self[DEVICE]
    request_blocks = math.ceil(tokens_per_request / host.block_size)
    last = request_blocks  # whole, or streamed when less: its first chunk + hot buffer
    if hs.streamed_device_blocks is not None:
      last = min(last, hs.streamed_device_blocks - 2)
    by_device = 0 if device.num_blocks < last else (
        1 + (device.num_blocks - last) // (hs.hot_buffer_blocks + 2))
    limits = [host.num_blocks // request_blocks, by_device]
    if hs.max_num_seqs is not None:
      limits.append(hs.max_num_seqs)
    return min(limits)

  def log_lines(self, tokens_per_request: int) -> list[str]:
    lines = [t.log_line() for t in self.per_device]  # tensor parallel: each device first
    lines += [t.log_line() for t in self.tiers]
    lines += [t.log_line() for t in self.third_tiers]
    if self.hisparse is not None:
      lines[len(self.per_device)] += "; " + self.hisparse.device_detail(
          self.tiers[0].block_size)
    line = (f"KV cache capacity [total]: {self.total_tokens:,} tokens; max concurrency for "
            f"{tokens_per_request:,} tokens per request: "
            f"{self.max_concurrency(tokens_per_request):,.2f}x (device only: "
            f"{self.max_concurrency(tokens_per_request, (DEVICE,)):,.2f}x)")
    if self.third_tiers:
      line += "; behind them " + ", ".join(
          f"tier={t.kind}: " + (f"{t.num_tokens:,} tokens" if t.num_tokens is not None
                                else "unavailable" if getattr(t, "error", None)
                                else "bounded by the server") for t in self.third_tiers)
    running = self.hisparse_concurrency(tokens_per_request)
    if running is not None:
      line += (f"; HiSparse runs {running:,} at once (full KV on {PINNED_HOST}, hot "
               f"buffer + newest block on {DEVICE}; "
               + limited_by(self, running, tokens_per_request) + ")")
      device_tokens = self[DEVICE].num_tokens
      if self.hisparse.streamed_device_blocks is not None and tokens_per_request > device_tokens:
        hs = self.hisparse
        chunk = (hs.streamed_device_blocks - hs.hot_buffer_blocks - 2) * self[DEVICE].block_size
        line += (f"; one request may be up to {tokens_per_request:,} tokens, beyond the "
                 f"{device_tokens:,} of {DEVICE}: its prefill streams through "
                 f"{hs.streamed_device_blocks:,} device blocks (chunks of {chunk:,} tokens), "
                 f"its KV to {PINNED_HOST}")
    elif (self.hisparse is not None and self.hisparse.admission != "offload"
          and tokens_per_request > self.hisparse.sparse_threshold_tokens):
      line += ("; HiSparse admission 'wait': a waiting request waits for free device "
               "blocks (running sparse decoders are offloaded only for their own decodes)")
    elif self.hisparse is not None:  # the threshold is at least the longest request
      default = ("the hot buffer: 2 x the model's index_topk, at most half of max_model_len"
                 if self.hisparse.lightning else "2 x top_k_tokens")
      line += (f"; HiSparse: requests up to {self.hisparse.sparse_threshold_tokens:,} tokens "
               f"decode dense, so none of up to {tokens_per_request:,} decodes sparse: lower "
               f"sparse_threshold_tokens (default: {default}) below max_model_len")
    lines.append(line)
    return lines

  def log(self, tokens_per_request: int) -> None:
    """Writes the capacity lines with absl logging at INFO."""
    for line in self.log_lines(tokens_per_request):
      logging.info("%s", line)

  def export(self, registry: m.MetricsRegistry) -> None:
    """Sets `hisparse_kv_capacity_tokens{memory_kind}` for every tier (and, over a mesh,
    `hisparse_kv_capacity_bytes{memory_kind, device}` for every device)."""
    gauge = registry.gauge(m.KV_CAPACITY_TOKENS, "KV tokens each memory kind holds.",
                           ("memory_kind",))
    for tier in self.tiers:
      gauge.set(tier.num_tokens, memory_kind=tier.memory_kind)
    if self.per_device:  # tensor parallel: the tokens are every device's; bytes differ
      by_device = registry.gauge(m.KV_CAPACITY_BYTES, "KV cache bytes of each device's "
                                 "shards, by memory kind.", ("memory_kind", "device"))
      for tier in self.per_device:
        by_device.set(tier.kv_bytes, memory_kind=tier.memory_kind, device=tier.device)

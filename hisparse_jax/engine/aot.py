"""Deviceless AOT: every program an engine of a config builds, compiled for a GPU target by
XLA's GPU compiler on a machine with no GPU (`hisparse-jax compile --target=h200`).

    AotBuild(config, target)
      plan       the capacity plan the target's memory gives (what Engine allocates there:
                 memory_stats() = the target's bytes_limit less the weights per device)
      runner     the engine's own ModelRunner / DsaModelRunner over the abstract model
                 (shapes only: nnx.eval_shape) and abstract pools of the plan's sizes on
                 the target's devices: nothing of the target's size is allocated here
      programs() (name, jitted function, abstract arguments) of each program:
                 step programs (dense prefill / decode / mixed; HiSparse prefill, tiered
                 decode with in-step host loads, streamed prefill chunk; DSA prefill,
                 decode, tiered decode), the swap programs (d2h, h2d), the copy-on-write
                 and key-bounds programs, the third tier's read / write programs
    aot_compile.compile_programs(build) -> AotReport: each compiled for the target by
                 XLA's GPU compiler; check_footprint(): ValueError when a program's device
                 bytes beyond its arguments do not fit what the plan leaves beside the
                 weights and the pools

Step batches are built by the engine's BatchBuilder from scheduled chunks made here at the
extremes the flags allow (a full prefill chunk, max_num_seqs decode rows at
max_model_len), so each program is the largest of its kind. The step is compiled with
the random draws (greedy_only=False): a superset of the argmax-only variant.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, make_single_device_sharding

import kernels_pallas
from hisparse_jax.distributed import parallel
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.dsa_runner import DsaModelRunner, host_index_arrays
from hisparse_jax.engine.gpu_target import GpuTarget
from hisparse_jax.engine.planning import (
  check_model_fits,
  check_model_kind,
  plan_engine_capacity,
  resolve_config,
)
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import ModelRunner, SparseTiers
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.engine.scheduler import ScheduledChunk
from hisparse_jax.engine.step_batch import StepBatch
from hisparse_jax.engine.step_shapes import dense_q_lens
from hisparse_jax.kv_cache import transfer
from hisparse_jax.kv_cache.capacity import GIB, CapacityPlan
from hisparse_jax.kv_cache.kv_pool import (
  DEVICE,
  PINNED_HOST,
  KVCacheSpec,
  KVPool,
  MLACacheSpec,
  check_kv_cache_dtype_devices,
  check_mesh,
  storage_dtype,
)
from hisparse_jax.kv_cache.tiers import pool_io
from kernels_pallas.block_key_bounds import bounds_arrays

ID_BUCKET = 16  # ids of one swap / tier / copy program (the engine pads to powers of two)


class TargetDevice:
  """What the capacity planner asks of a device, answered for a GPU target: its
  allocator's limit and the weights' bytes in use (Engine plans after loading them)."""

  platform = "gpu"

  def __init__(self, target: GpuTarget, weight_bytes: int):
    self.target, self.weight_bytes = target, weight_bytes
    self.device_kind = target.device_kind
    self.compute_capability = "{}.{}".format(*target.compute_capability)

  def memory_stats(self) -> dict[str, int]:
    return {"bytes_limit": self.target.bytes_limit(), "bytes_in_use": self.weight_bytes}


class AbstractPool(KVPool):
  """A KVPool of `num_blocks` whose arrays are `jax.ShapeDtypeStruct`s (nothing allocated):
  what a step program of the plan's sizes is traced over. Its shardings are this host's
  devices' (a CPU mesh with tensor parallelism): the program is lowered for "cuda" from
  them, memory kinds included, and compiled for the target's devices (compile_program)."""

  def __init__(self, spec, num_blocks: int, memory_kind: str, mesh):
    """mesh: tensor parallelism: a mesh of this host's CPU devices (programs that move
    blocks between memory kinds) or of the target's topology (step programs: their Pallas
    kernels lower for the mesh's GPU; memory kinds, which a topology's devices do not
    keep, play no part in a dense tensor-parallel step)."""
    self.spec, self.memory_kind, self.mesh = spec, memory_kind, mesh
    self.device = jax.local_devices(backend="cpu")[0]
    self.sharding = make_single_device_sharding(self.device, memory_kind=memory_kind)
    # `replicated`: where the runner builds its own small arrays (this host, at once);
    # `placed`: where a program's replicated inputs go (_place).
    self.replicated = self.placed = self.sharding
    if mesh is not None:
      check_mesh(spec, mesh)
      self.sharding = parallel.kv_sharding(mesh, memory_kind)
      self.placed = parallel.replicated(mesh, DEVICE)
    self.num_blocks = int(num_blocks)
    self.storage_dtype = (np.dtype(spec.cache_dtype) if spec.quantized
                          else storage_dtype(spec.dtype, "gpu"))
    self.kinds = spec.array_kinds()
    self._arrays = {kind.name: tuple(
        jax.ShapeDtypeStruct(self.kind_shape(kind), self.kind_dtype(kind),
                             sharding=self.sharding) for _ in range(kind.count))
        for kind in self.kinds}

  def set_arrays(self, arrays) -> None:
    raise TypeError("an AbstractPool is compiled over, never run")


class _AotRunnerMixin:
  """The runner's state beside the pools (key bounds / indexer keys of host blocks, the
  hot-buffer state) as abstract arrays of the target's sizes, and no packed CPU weights."""

  packs_weights = False

  def _hot_state(self, num_slots: int, num_logical: int):
    rows = self.num_hot_rows
    shapes = ((rows, num_slots), (rows, num_slots), (rows, num_logical))
    return tuple(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.pool.placed)
                 for shape in shapes for _ in range(self.pool.spec.num_layers))


class AotModelRunner(_AotRunnerMixin, ModelRunner):
  def _sparse_state(self):
    pool, spec = self.pool, self.pool.spec
    shape = (pool.num_blocks + self.host_pool.num_blocks, 2, spec.num_kv_heads, spec.head_dim)
    bounds = tuple(
        bounds_arrays(shape, self.hisparse.bounds_dtype,
                      lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                                sharding=pool.sharding))
        for _ in range(spec.num_layers))
    return bounds, self._hot_state(self.hisparse_blocks.hot_buffer_blocks,
                                   self.max_blocks_per_seq)


class AotDsaRunner(_AotRunnerMixin, DsaModelRunner):
  def _sparse_state(self):
    spec = self.spec
    host_index = host_index_arrays(
        spec, self.host_pool.num_blocks, self.pool.storage_dtype,
        lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=self.pool.sharding))
    blocks = self.hisparse_blocks
    return host_index, self._hot_state(blocks.hot_buffer_blocks * spec.block_size,
                                       self.max_blocks_per_seq * spec.block_size)


@dataclasses.dataclass(frozen=True)
class Program:
  """One program to compile: `fn` (a jitted function) over `args` (abstract arrays on the
  target's devices, static arguments as `kwargs`)."""

  name: str
  kind: str  # "step", "swap", "copy", "tier"
  fn: object
  args: tuple
  kwargs: dict = dataclasses.field(default_factory=dict)
  detail: str = ""  # what the program's batch is, in words


class AotBuild:
  """The engine of `config` as the target would build it, without its memory (see the
  module docstring). Bad configs raise ValueError naming the flag, as Engine does."""

  def __init__(self, config: EngineConfig, target: GpuTarget):
    from models.loader import checkpoint_dtype, is_dsa_config, load_config  # noqa: PLC0415
    from models.sharding import check_tensor_parallel, kv_head_repeat, tp_config  # noqa: PLC0415

    self.target = target
    if config.dtype == "auto":
      config = dataclasses.replace(config, dtype=checkpoint_dtype(config.model))
    if config.block_size is None:  # the engine's default on a GPU
      config = dataclasses.replace(config, block_size=16)
    source = load_config(config.model)
    self.is_dsa = is_dsa_config(source)
    config = check_model_kind(config, source, self.is_dsa)
    self.config = config
    tp = config.tensor_parallel_size
    device = TargetDevice(target, 0)
    check_kv_cache_dtype_devices(config.kv_cache_dtype, [device])
    check_kv_cache_dtype_devices(config.index_cache_dtype, [device], "index_cache_dtype")
    if tp > 1:
      check_tensor_parallel(source, tp)
    check_model_fits(config, source)
    self.backend = kernels_pallas.backend.resolve_backend(config.kernel_backend, "gpu")
    self.topology = target.topology(tp)
    self.target_devices = list(self.topology.devices)[:tp]
    self.mesh = None  # tensor parallel: the step programs' mesh, the topology's
    self.host_mesh = None  # ... and the block moves' (memory kinds kept), this host's
    if tp > 1:
      from jax.experimental import topologies  # noqa: PLC0415

      self.mesh = topologies.make_mesh(self.topology, (tp,), (parallel.KV_HEADS[2],))
      self.host_mesh = parallel.make_mesh(tp)
    model_config = tp_config(source, tp) if tp > 1 else source
    self.kv_head_repeat = kv_head_repeat(source, tp) if tp > 1 else 1
    self.model = _abstract_model(model_config, config.dtype, self.is_dsa)
    self.model_config = model_config
    self.weight_bytes = _bytes_per_device(self.model, tp)
    spec_cls = MLACacheSpec if self.is_dsa else KVCacheSpec
    self.spec = spec_cls.from_model_config(
        model_config, config.dtype, config.block_size, config.kv_cache_dtype,
        **({"index_cache_dtype": config.index_cache_dtype} if self.is_dsa else {}))
    device = TargetDevice(target, self.weight_bytes)
    config = self.config = resolve_config(config, self.spec, is_dsa=self.is_dsa,
                                          num_devices=tp, device=device, check_host_ram=False)
    self.plan: CapacityPlan = plan_engine_capacity(config, self.spec, is_dsa=self.is_dsa,
                                                   num_devices=tp, device=device,
                                                   check_host_ram=False)
    self.device_pool = AbstractPool(self.spec, self.plan.num_device_blocks, DEVICE, self.mesh)
    self.host_pool = AbstractPool(self.spec, self.plan.num_host_blocks, PINNED_HOST, self.mesh)
    if tp > 1:  # (the block moves' pools: memory kinds on this host's mesh)
      self.move_pools = (
          AbstractPool(self.spec, self.plan.num_device_blocks, DEVICE, self.host_mesh),
          AbstractPool(self.spec, self.plan.num_host_blocks, PINNED_HOST, self.host_mesh))
    else:
      self.move_pools = (self.device_pool, self.host_pool)
    runner_cls = AotDsaRunner if self.is_dsa else AotModelRunner
    # (the runner's own kernels are this host's, built by name: the Mosaic GPU ones exist
    # only for a GPU; the programs take the target's, self.ops)
    self.runner = runner_cls(
        self.model, self.device_pool, max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        kernel_backend="pallas" if self.backend == "pallas_mgpu" else self.backend,
        hisparse=config.hisparse, host_pool=self.host_pool,
        eos_token_ids=(), kv_head_repeat=self.kv_head_repeat)
    self.ops = kernels_pallas.ops(self.backend, platform="gpu",
                                  pages_dtype=self.runner._pages_dtype())
    self._param_shardings = _param_shardings(self.runner, self.mesh,
                                             self.device_pool.device)

  def describe(self) -> list[str]:
    """Two lines: what is compiled, for which GPU, and the memory plan per device."""
    c, t = self.config, self.target
    what = [c.model or "hisparse-tiny", c.dtype, f"block {c.block_size}",
            f"KV {c.kv_cache_dtype}", f"kernels {self.backend}"]
    if c.index_cache_dtype != "auto":
      what.insert(4, f"indexer keys {c.index_cache_dtype}")
    if c.hisparse is not None:
      what.append("HiSparse")
    if c.tensor_parallel_size > 1:
      what.append(f"tensor parallel {c.tensor_parallel_size}")
    return [f"compiling for {t.device_kind} ({t.sm}, {t.name}): {', '.join(what)}",
            f"per device: weights {gib_text(self.weight_bytes)}, KV budget "
            f"{gib_text(self.kv_bytes)} ({self.plan.num_device_blocks:,} device blocks; "
            f"{self.plan.num_host_blocks:,} pinned_host blocks), left for temporaries "
            f"{gib_text(self.reserve_bytes)} of {gib_text(t.bytes_limit())} usable"]

  # --- Memory ---------------------------------------------------------------------

  @property
  def free_bytes(self) -> int:
    """Device bytes per device the allocator has once the weights are loaded."""
    return self.target.bytes_limit() - self.weight_bytes

  @property
  def kv_bytes(self) -> int:
    """Device bytes per device of the plan: the pool and HiSparse's reserved arrays."""
    return self.plan.device_budget_bytes // self.config.tensor_parallel_size

  @property
  def reserve_bytes(self) -> int:
    """Device bytes per device left beside the weights and the KV budget: where a
    program's temporaries must fit."""
    return self.free_bytes - self.kv_bytes

  # --- Programs -------------------------------------------------------------------

  def programs(self) -> list[Program]:
    progs = [*self._step_programs(), *self._swap_programs(), *self._copy_programs()]
    if self.config.disk_cache_dir or self.config.remote_cache_url:
      progs += self._tier_programs()
    return progs

  def _place(self, x, sharding=None):
    """`x` (an array, numpy array or abstract array) as an abstract array on the target:
    its own target sharding if it has one, else `sharding`, else replicated."""
    if x is None:
      return None
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
      return x
    if sharding is None:
      sharding = self.device_pool.placed
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype")
                                else x.dtype, sharding=sharding)

  def _step_args(self, batch: StepBatch) -> tuple:
    runner = self.runner
    meta = batch.metadata
    hints = tuple(sorted(self.ops.ragged_hints(dense_q_lens(batch)).items()))
    batch = dataclasses.replace(batch, metadata=dataclasses.replace(meta, ragged_hints=hints))
    args = list(runner._step_args(batch, runner._no_tokens))
    args[0] = tuple(self._place(leaf, s) for leaf, s in zip(args[0], self._param_shardings))
    head = args[1]
    args[1] = None if head is None else self._place(head)
    return tuple(jax.tree.map(self._place, a) if i > 1 else a for i, a in enumerate(args))

  def _step(self, name: str, batch: StepBatch, detail: str) -> Program:
    step = self.runner._step_for(self.ops, one_memory=False)
    return Program(name, "step", step, self._step_args(batch),
                   dict(greedy_only=False, num_token_rows=self.runner.max_num_seqs),
                   detail)

  def _step_programs(self) -> list[Program]:
    return [self._step(name, batch, detail)
            for name, batch, detail in step_batches(self.runner, self.config, self.is_dsa)]

  def _swap_programs(self) -> list[Program]:
    device_pool, host_pool = self.move_pools
    n = len(device_pool.arrays())
    scalar = device_pool.placed
    ids = self._place(np.zeros(ID_BUCKET, np.int32), scalar)
    dev, host = device_pool.arrays(), host_pool.arrays()
    mode = transfer.host_copy_mode()  # (HISPARSE_JAX_HOST_COPY, as the engine's)
    out = transfer._swap_out_program(n, device_pool.sharding, host_pool.sharding, False,
                                     scalar, mode)
    into = transfer._swap_in_program(n, device_pool.sharding, host_pool.sharding, False,
                                     scalar, mode)
    return [Program("swap_out", "swap", out, (dev, host, ids, ids),
                    detail=f"{ID_BUCKET} blocks device -> pinned_host"),
            Program("swap_in", "swap", into, (host, dev, ids, ids),
                    detail=f"{ID_BUCKET} blocks pinned_host -> device")]

  def _copy_programs(self) -> list[Program]:
    runner = self.runner
    ids = self._place(np.zeros(ID_BUCKET, np.int32))
    arrays = self.device_pool.arrays()
    progs = [Program("copy_on_write", "copy", runner._copy,
                     ((*arrays, *runner.bounds) if not self.is_dsa else arrays, ids, ids),
                     detail=f"{ID_BUCKET} device blocks copied (prefix-cache fork)")]
    if self.config.hisparse is None:
      return progs
    if self.is_dsa:
      from hisparse_jax.engine.dsa_runner import _copy_index_keys  # noqa: PLC0415

      progs.append(Program("index_keys_to_host", "copy", _copy_index_keys,
                           (self.device_pool.index_keys(), runner.bounds, ids, ids),
                           detail="indexer keys of blocks written to pinned_host"))
      return progs
    from hisparse_jax.engine.step_program import refresh_program  # noqa: PLC0415

    refresh = refresh_program(self.ops, self.spec.dtype, self.config.block_size,
                              self.config.hisparse.bounds_dtype)
    progs.append(Program("bounds_to_host_index", "copy", runner._copy,
                         (runner.bounds, ids, ids),
                         detail="key bounds of blocks written to pinned_host"))
    progs.append(Program("refresh_bounds", "copy", refresh,
                         (runner.bounds, self.device_pool.k, self.device_pool.k_scale, ids),
                         detail="key bounds of swapped-in blocks"))
    return progs

  def _tier_programs(self) -> list[Program]:
    n = len(self.host_pool.arrays())
    device_sharding = make_single_device_sharding(self.device_pool.device, memory_kind=DEVICE)
    read = pool_io._read_program(n, device_sharding, self.host_pool.sharding, False)
    write = pool_io._write_program(n, device_sharding, self.host_pool.sharding, False)
    ids = self._place(np.zeros(ID_BUCKET, np.int32))
    host = self.host_pool.arrays()
    blocks = tuple(jax.ShapeDtypeStruct((ID_BUCKET, *a.shape[1:]), a.dtype,
                                        sharding=device_sharding) for a in host)
    return [Program("tier_read", "tier", read, (host, ids),
                    detail=f"{ID_BUCKET} host blocks read for the third tier's store"),
            Program("tier_write", "tier", write, (host, blocks, ids),
                    detail=f"{ID_BUCKET} blocks loaded from the third tier into pinned_host")]


def _abstract_model(model_config, dtype: str, is_dsa: bool):
  dtype = jnp.dtype(dtype)
  if is_dsa:
    from models.deepseek_v32 import DeepseekV32ForCausalLM  # noqa: PLC0415

    return nnx.eval_shape(lambda: DeepseekV32ForCausalLM(model_config, dtype=dtype,
                                                         seed=None))
  from models.llama import LlamaForCausalLM  # noqa: PLC0415

  return nnx.eval_shape(lambda: LlamaForCausalLM(model_config, dtype=dtype, seed=None))


def _param_specs(runner: ModelRunner) -> list:
  """The PartitionSpec of each of the runner's parameter leaves (its flattening order)."""
  from models.sharding import param_spec  # noqa: PLC0415

  paths = jax.tree_util.tree_flatten_with_path(runner.params)[0]
  return [param_spec(tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
                           for k in path)) for path, _ in paths]


def _param_shardings(runner: ModelRunner, mesh, device) -> list:
  if mesh is None:
    return [make_single_device_sharding(device, memory_kind=DEVICE)] * len(runner._param_leaves)
  return [NamedSharding(mesh, spec, memory_kind=DEVICE) for spec in _param_specs(runner)]


def _bytes_per_device(model, tp: int) -> int:
  """The weights' bytes on one device (split parameters: their share)."""
  leaves = jax.tree.leaves(nnx.state(model))
  if tp == 1:
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves))
  from models.sharding import param_spec  # noqa: PLC0415

  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
    keys = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    split = any(axis is not None for axis in param_spec(keys))
    total += math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // (tp if split else 1)
  return int(total)


def step_batches(runner: ModelRunner, config: EngineConfig, is_dsa: bool,
                 only: set[str] | None = None) -> list[tuple[str, StepBatch, str]]:
  """(name, batch, what it is) of the largest step of each kind an engine of `config`
  runs, built by `runner`'s BatchBuilder from chunks made here: a full prefill chunk (a
  long prompt's first: with HiSparse it carries the sparse path), max_num_seqs decode rows
  at max_model_len, a prefill chunk beside max_num_seqs - 1 decode rows; with HiSparse the
  same rows offloaded (in-step host loads) and a later chunk of a prompt streamed through
  the device. `only`: just these kinds."""
  c, bs = config, config.block_size
  n_seqs, chunk = c.max_num_seqs, min(c.max_num_batched_tokens, c.max_model_len - 1)
  ctx, long_prompt, hisparse = c.max_model_len, c.max_model_len - 1, c.hisparse
  rows = [_decode(ctx, bs) for _ in range(n_seqs)]
  kinds = {
      "prefill": lambda: ([_prefill(long_prompt if hisparse else chunk, 0, chunk, bs)], 0,
                          f"1 prompt chunk of {chunk:,} tokens"),
      "decode": lambda: (rows, 0, f"{n_seqs} decode rows at {ctx:,} tokens")}
  if n_seqs > 1 and chunk > 1:
    kinds["mixed"] = lambda: (
        [_prefill(chunk, 0, max(1, chunk - (n_seqs - 1)), bs), *rows[1:]], 0,
        f"1 prompt chunk + {n_seqs - 1} decode rows")
  if hisparse is not None:
    kinds["tiered_decode"] = lambda: (rows, len(rows), f"{n_seqs} offloaded decode rows at "
                                      f"{ctx:,} tokens, in-step host loads")
    if not is_dsa and c.enable_chunked_prefill and long_prompt > chunk:
      start = (long_prompt - chunk) // bs * bs  # a later chunk of a streamed prompt
      kinds["streamed_prefill"] = lambda: (
          [_prefill(long_prompt, start, chunk, bs)], 1,
          f"a {chunk:,}-token chunk of a {long_prompt:,}-token prompt streamed through the "
          f"device ({hisparse.streamed_prefill})")
  out = []
  for name, make in kinds.items():
    if only is None or name in only:
      chunks, offloaded, detail = make()
      out.append((name, _batch(runner, config, chunks, offloaded), detail))
  return out


def device_free_bytes(device) -> int | None:
  """Bytes the device's allocator has left (memory_stats: bytes_limit - bytes_in_use), or
  None where it reports no limit (CPU)."""
  stats = device.memory_stats()
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def check_step_footprint(runner: ModelRunner, config: EngineConfig, is_dsa: bool,
                         device) -> None:
  """At load, on a device with an allocator limit (GPU, TPU): the largest prefill and
  decode step programs are compiled, and the device bytes each needs beyond its
  arguments (temporaries, outputs not written in place) must fit what the weights and the
  KV pools left; ValueError naming the flags otherwise (a refusal now, not an
  out-of-memory error at the first step). Nothing on CPU (no limit to check)."""
  free = device_free_bytes(device)
  if free is None:
    return
  kinds = {"prefill", "tiered_decode" if config.hisparse is not None else "decode"}
  for name, batch, _ in step_batches(runner, config, is_dsa, kinds):
    args = runner._step_args(batch, runner._no_tokens)
    compiled = runner._step.trace(*args, greedy_only=False,
                                  num_token_rows=runner.max_num_seqs).lower().compile()
    ma = compiled.memory_analysis()
    need = int(ma.temp_size_in_bytes) + max(
        0, int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes))
    if need > free:
      raise ValueError(
          f"--device_kv_gib: the step program {name!r} needs {gib_text(need)} of device "
          f"memory beyond its arguments, but the weights and the KV pools leave "
          f"{gib_text(free)} free on {getattr(device, 'device_kind', device)}: lower "
          "--device_kv_gib (or --max_num_batched_tokens / --max_num_seqs)")


def _batch(runner: ModelRunner, config: EngineConfig, chunks: list[ScheduledChunk],
           offloaded: int = 0) -> StepBatch:
  """The step batch of `chunks` (the first `offloaded` of them offloaded: their blocks on
  the host, a hot-buffer row each)."""
  bs, n = config.block_size, len(chunks)
  width = max(math.ceil(c.request.num_tokens / bs) for c in chunks)
  tables = np.zeros((n, width), np.int32)
  for i, c in enumerate(chunks):
    used = math.ceil(c.request.num_tokens / bs)
    tables[i, :used] = np.arange(1, used + 1) % max(2, runner.pool.num_blocks - 1) + 1
  tiers = None
  if config.hisparse is not None:
    off = np.arange(n) < offloaded
    tiers = SparseTiers(host_tables=np.where(off[:, None], tables, 0),
                        hot_slots=np.ones((n, runner.hisparse_blocks.hot_buffer_blocks),
                                          np.int32),
                        hot_rows=np.where(off, np.arange(n), -1),
                        hot_reset=np.zeros(n, bool))
    tables = np.where(off[:, None], 0, tables)
  return runner.build_batch(chunks, tables, tiers)


def _request(num_prompt: int, num_output: int) -> Request:
  request = Request("aot", [1] * num_prompt, SamplingParams(temperature=1.0, top_p=0.9,
                                                            max_tokens=None), seed=0)
  request.output_token_ids = [1] * num_output
  request.prefill_len = num_prompt
  return request


def _slots(start: int, n: int, bs: int) -> np.ndarray:
  return (bs + np.arange(start, start + n) % bs).astype(np.int32)


def _prefill(prompt_len: int, start: int, n: int, bs: int) -> ScheduledChunk:
  """Tokens [start, start + n) of a prompt of `prompt_len` tokens."""
  return ScheduledChunk(_request(prompt_len, 0), start, n, _slots(start, n, bs))


def _decode(ctx: int, bs: int) -> ScheduledChunk:
  """The decode of token `ctx - 1` (a prompt of ctx - 2 tokens and one output token)."""
  request = _request(max(1, ctx - 2), 1)
  return ScheduledChunk(request, request.num_tokens - 1, 1, _slots(ctx - 1, 1, bs))


def gib_text(n: float) -> str:
  """Bytes as KiB / MiB / GiB, for the table and the refusals."""
  if abs(n) < 2**20:
    return f"{n / 2**10:,.1f} KiB"
  if abs(n) < GIB:
    return f"{n / 2**20:,.1f} MiB"
  return f"{n / GIB:,.2f} GiB"

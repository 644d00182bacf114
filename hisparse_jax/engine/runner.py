"""The jitted step: one forward pass over a ragged batch, KV written into the device pool.

    chunks (host)  --build_batch-->  StepBatch (numpy, padded to buckets)
        |                                  |
        |        execute: ONE jitted call  v
        |   embed -> per layer: qkv -> write_kv(slots) -> attend(block tables) -> mlp
        |   -> logits of each sequence's last token -> sample
        v
    sampled token ids (the step's only device -> host sync)

The runner's pieces, one module each:

    runner.py              ModelRunner: the device state between steps (pages, key bounds,
                           hot-buffer state), dispatch / collect of a step, block copies
    step_batch.py          BatchBuilder (the runner owns one): StepBatch, SamplerExtras,
                           SparseTiers, built on the host each step
    step_program.py        the jitted step (forward + sampling) and the copy / refresh
                           programs
    sparse/attention.py    attention inside the step: dense rows, and the HiSparse sparse
                           rows (select -> resolve -> load -> attend); StepMetadata
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels_pallas
from hisparse_jax.distributed import parallel
from hisparse_jax.engine.scheduler import ScheduledChunk
from hisparse_jax.engine.step_batch import (  # noqa: F401 (re-exported)
  BatchBuilder,
  SamplerExtras,
  SparseTiers,
  StepBatch,
  StepMetadata,
  needs_extras,
)
from hisparse_jax.engine.step_program import copy_program, refresh_program, step_program
from hisparse_jax.engine.step_shapes import StepCompiler, dense_q_lens
from hisparse_jax.kv_cache.capacity import (  # noqa: F401 (bounds_...: re-exported)
  bounds_bytes_per_block,
  num_hot_rows,
)
from hisparse_jax.kv_cache.kv_pool import KVPool, device_full_fn, storage_dtype
from hisparse_jax.kv_cache.transfer import bucket_size, host_copy_mode
from hisparse_jax.sparse import resolver
from hisparse_jax.sparse.attention import COUNT_FIELDS  # noqa: F401 (re-exported)
from hisparse_jax.sparse.config import HiSparseConfig
from kernels_pallas import cpu_kernels, packed
from kernels_pallas.block_key_bounds import bounds_arrays


def packed_step_weights(model: nnx.Module, ops: kernels_pallas.KernelOps, mesh=None
                        ) -> tuple[nnx.Module, packed.PackedWeight | None]:
  """(the model the step runs, its packed output projection or None).

  On CPU (the xla kernels, one device, float32 weights, the C++ kernels built): a copy of
  `model` whose every `Linear` kernel is a `kernels_pallas.packed.PackedWeight` (the
  matmul that streams a decode step's weights at the memory's bandwidth), and the output
  projection packed (the tied embedding transposed: 1 x the embedding's bytes more, the
  lookup still reads the embedding). `model` itself is left as it is. Elsewhere:
  (`model`, None)."""
  from models.llama import Linear  # noqa: PLC0415

  weights = model.embed_tokens[...]
  if (ops.backend != "xla" or mesh is not None or weights.dtype != jnp.float32
      or not all(d.platform == "cpu" for d in weights.devices())
      or not cpu_kernels.available()):
    return model, None
  graphdef, state = nnx.split(model)
  copy = nnx.merge(graphdef, state)  # new variables over the same arrays
  for _, node in nnx.iter_graph(copy):
    if isinstance(node, Linear) and isinstance(node.kernel[...], jax.Array):
      node.kernel.set_value(packed.pack_array(node.kernel[...]))  # (not packed already)
  head = (packed.pack_array(weights.T) if copy.lm_head is None
          else copy.lm_head.kernel[...])
  return copy, head


def _resident_only(batch: StepBatch) -> bool:
  """No row of the step attends sparsely (no host load, no hot-buffer slot read): a
  dense engine's steps, and a HiSparse engine's steps of resident rows only."""
  return batch.metadata.num_sparse_rows == 0


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
  # A DSA runner recording selections: int32 [layers, tokens, k] key positions per token.
  topk: jax.Array | None = None
  # The call compiled (or loaded from the persistent cache) its program: the step's time
  # includes that, so it says nothing of the step's own speed.
  compiled: bool = False


def _num_programs(jitted) -> int | None:
  """How many programs `jitted` (a jax.jit function) holds in this process (None where
  the object does not say): one more after a call means the call compiled one."""
  size = getattr(jitted, "_cache_size", None)
  return size() if size is not None else None


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What a step hands back to the host (`ModelRunner.collect`)."""

  tokens: np.ndarray  # int32 [num_seqs] sampled tokens
  counts: np.ndarray | None  # int32 [layers, num_seqs, 5] (COUNT_FIELDS), HiSparse only
  loaded: np.ndarray | None  # int32 [layers]: blocks the step's host loads moved, HiSparse
  # (sampled logprob [num_seqs], rank, top ids [num_seqs, N], top logprobs) or None.
  logprobs: tuple[np.ndarray, ...] | None = None
  prompt_logprobs: tuple[np.ndarray, ...] | None = None  # per StepBatch.prompt_spans row
  topk: np.ndarray | None = None  # StepHandle.topk read back (DSA, record_topk)

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
               host_pool: KVPool | None = None, eos_token_ids: Sequence[int] = (),
               compile_in_background: bool = False, max_step_programs: int | None = None,
               kv_head_repeat: int = 1):
    """kv_head_repeat: tensor parallel with fewer KV heads than devices, the copies of
    each KV head the (repeated) model holds (models.sharding.kv_head_repeat)."""
    self.config = model.config
    self.vocab_size = model.config.vocab_size
    self.eos_token_ids = tuple(eos_token_ids)  # stop tokens min_tokens holds back
    self.kv_head_repeat = kv_head_repeat
    self.pool = device_pool
    self.block_size = device_pool.spec.block_size
    self.max_blocks_per_seq = -(-max_model_len // self.block_size)
    self.max_num_seqs = max_num_seqs
    self.max_num_batched_tokens = max_num_batched_tokens
    self.kernel_backend = kernel_backend
    self.ops = kernels_pallas.ops(kernel_backend, pages_dtype=self._pages_dtype())
    self.hisparse = hisparse
    self.hisparse_blocks = hisparse.blocks(self.block_size) if hisparse is not None else None
    # Per-layer key bounds of every device block: [num_blocks, 2, num_kv_heads, head_dim].
    # Per-layer key bounds of every device block (rows [0, num_blocks)) and, with
    # HiSparse, of every host block (rows num_blocks + host id): [rows, 2, heads, dim].
    self.bounds: tuple[jax.Array, ...] = ()
    # HiSparse: key bounds by host block id (for blocks whose device copy was dropped),
    # and the hot-buffer state, one row per offloaded sequence (rows = max_num_seqs).
    self.host_pool = host_pool
    # (slot blocks, last used, evicted at) of every layer, grouped by kind as the pool's
    # arrays: [kind * num_layers + layer], each [rows, slots] (the block table width for
    # evicted-at). One array per layer, not a stacked one: a step program slicing a layer
    # out of a stacked array compiles one kernel per layer for it (fusions of identical
    # computations are compiled once; a layer's constant offset makes them differ).
    self.hot_state: tuple[jax.Array, ...] | None = None
    # One row per sequence offloaded at once: each holds a hot buffer of device blocks,
    # so at most the usable blocks' worth (capacity.num_hot_rows), not every seat.
    self.num_hot_rows = max_num_seqs if hisparse is None else num_hot_rows(
        max_num_seqs, device_pool.num_blocks, hisparse.blocks(self.block_size).hot_buffer_blocks)
    self.step_clock = 0
    self.last_counts: np.ndarray | None = None  # int32 [layers, num_seqs, 5] (COUNT_FIELDS)
    if hisparse is not None:
      if host_pool is None:
        raise ValueError("hisparse needs the host pool (host_pool=...)")
      self.bounds, self.hot_state = self._sparse_state()
    self.batch_builder = BatchBuilder(
        block_size=self.block_size, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, max_blocks_per_seq=self.max_blocks_per_seq, ops=self.ops,
        hisparse=hisparse, num_hot_rows=self.num_hot_rows, vocab_size=self.vocab_size,
        eos_token_ids=self.eos_token_ids, **self._builder_options())
    # The step's weights: on CPU the float32 matrices packed for the C++ matmul (and the
    # output projection as `head`); `model` is the model the step runs (packed or not).
    self.model, self.head = (packed_step_weights(model, self.ops, device_pool.mesh)
                             if self.packs_weights else (model, None))
    self._graphdef, self.params = nnx.split(self.model)
    # What each step passes: the state's leaves (flattened once here, not per call).
    self._param_leaves, self._params_def = jax.tree.flatten(self.params)
    self._param_leaves = tuple(self._param_leaves)
    if self.head is not None:  # (CPU): the weights and pages a step streams, on huge pages
      cpu_kernels.advise_huge_pages([*jax.tree.leaves(self.params), *jax.tree.leaves(self.head),
                                     *device_pool.arrays()])
    self._step = self._step_for(self.ops, one_memory=None)
    self._copy = copy_program()
    self._refresh = refresh_program(self.ops, device_pool.spec.dtype, self.block_size,
                                    hisparse.bounds_dtype if hisparse else "float32")
    # (tokens, sequences, block-table width, greedy only) of every step run so far.
    self.shapes_compiled: set[tuple[int, int, int, bool]] = set()
    # compile_in_background: new step shapes run padded to a compiled covering shape
    # while their own program compiles in a thread (step_shapes.py); None: jit's cache.
    self.compiler = (StepCompiler(self._step, {"num_token_rows": max_num_seqs},
                                  self.ops.hints_cover, self.num_hot_rows,
                                  max_programs=max_step_programs)
                     if compile_in_background else None)
    # The previous-step tokens of a step that reads none (its token_src is all -1).
    self._no_tokens = jax.device_put(np.zeros(max_num_seqs, np.int32),
                                     device_pool.replicated)

  # Whether the CPU step multiplies by packed copies of the weights (packed_step_weights).
  packs_weights = True

  def _sparse_state(self) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """HiSparse's device arrays besides the pool: (key bounds of every device and host
    block per layer, hot-buffer state: (slot blocks, last used, evicted at) per layer)."""
    device_pool, spec = self.pool, self.pool.spec
    # Blocks written to the host pool keep their key bounds on the device, so a dropped
    # block can still be scored.
    bounds_shape = (device_pool.num_blocks + self.host_pool.num_blocks, 2, spec.num_kv_heads,
                    spec.head_dim)
    # bfloat16 bounds are stored as uint16 on CPU, as the pools' bf16 (kv_pool).
    # int8: QuantizedBounds (int8 values and float32 scales) per layer.
    bounds_storage = storage_dtype(self.hisparse.bounds_dtype, device_pool.device.platform)
    bounds = tuple(
        bounds_arrays(bounds_shape, bounds_storage,
                      lambda shape, dtype: device_full_fn(shape, dtype, 0,
                                                          device_pool.sharding)())
        for _ in range(spec.num_layers))
    return bounds, self._hot_state(self.hisparse_blocks.hot_buffer_blocks,
                                   self.max_blocks_per_seq)

  def _hot_state(self, num_slots: int, num_logical: int) -> tuple[jax.Array, ...]:
    """The hot-buffer state of every layer (rows x `num_slots` slots, `num_logical`
    evicted-at entries: blocks, or tokens for a token-granular buffer)."""
    rows = self.num_hot_rows
    kinds = (((rows, num_slots), -1), ((rows, num_slots), resolver.NEVER),
             ((rows, num_logical), resolver.NEVER))
    return tuple(device_full_fn(shape, jnp.int32, value, self.pool.replicated)()
                 for shape, value in kinds for _ in range(self.pool.spec.num_layers))

  def _builder_options(self) -> dict:
    """Extra BatchBuilder settings of this runner's models (none for llama models)."""
    return {}

  def _pages_dtype(self) -> str | None:
    """The dtype the attention reads the pages in (None: quantized pages)."""
    spec = self.pool.spec
    return spec.dtype if spec.kv_cache_dtype == "auto" else None

  def _step_for(self, ops: kernels_pallas.KernelOps, one_memory: bool | None):
    """The jitted step program over `ops` (`one_memory`: how HiSparse loads cross, see
    resolver.load_blocks; None: as this process's devices do)."""
    hisparse = self.hisparse
    return step_program(
        self._graphdef, ops, self.pool.spec.dtype, self.pool.storage_dtype,
        self.hisparse_blocks, hisparse.selection if hisparse is not None else None,
        hisparse.thrash_window_steps if hisparse is not None else 0,
        self.pool.sharding, self.host_pool.sharding if self.host_pool is not None else None,
        one_memory, hisparse.bounds_dtype if hisparse is not None else "float32",
        mesh=self.pool.mesh, kv_head_repeat=self.kv_head_repeat, params_def=self._params_def,
        streamed_prefill=hisparse.streamed_prefill if hisparse is not None else "exact",
        host_copy=host_copy_mode(), overlap_loads=resolver.overlap_loads_mode())

  @property
  def reserved_bytes(self) -> int:
    """Device bytes the runner holds besides the pool (key bounds by device and by host
    block, hot-buffer state), over all devices (tensor parallel: the state is replicated,
    every copy counts)."""
    return sum(parallel.live_bytes(self.reserved_arrays()).values())

  def reserved_arrays(self) -> tuple[jax.Array, ...]:
    """The arrays of `reserved_bytes` (their shards: the capacity lines per device)."""
    return (*jax.tree.leaves(self.bounds), *(self.hot_state or ()))

  def hot_state_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The hot-buffer state read back, each kind stacked over the layers: (slot blocks,
    last used) [layers, rows, slots] and evicted-at [layers, rows, table width]."""
    n = self.config.num_hidden_layers
    state = [np.asarray(a) for a in self.hot_state]
    return tuple(np.stack(state[k * n:(k + 1) * n]) for k in range(3))

  def set_hot_state(self, state: Sequence[np.ndarray]) -> None:
    """Replaces the hot-buffer state with `state` (as `hot_state_arrays` gives it)."""
    sharding = self.hot_state[0].sharding
    self.hot_state = tuple(jax.device_put(np.asarray(a[layer]), sharding)
                           for a in state for layer in range(a.shape[0]))

  @property
  def indexer_bytes(self) -> int:
    """Device bytes of the indexer's key bounds (by device block and by host block)."""
    return sum(int(b.nbytes) for b in self.bounds)

  @property
  def load_unit_bytes(self) -> int:
    """Bytes one in-step host load moves per layer (StepResult.loaded's unit): a block."""
    spec = self.pool.spec
    return spec.bytes_per_block // spec.num_layers

  # --- Host side -----------------------------------------------------------------

  def build_batch(self, chunks: Sequence[ScheduledChunk], block_tables: np.ndarray,
                  tiers: SparseTiers | None = None) -> StepBatch:
    """The step's padded host arrays (`BatchBuilder.build` at this runner's step clock)."""
    return self.batch_builder.build(chunks, block_tables, tiers, self.step_clock)

  # --- Device side ---------------------------------------------------------------

  def dispatch(self, batch: StepBatch, prev_tokens: jax.Array | None = None) -> StepHandle:
    """Starts the step on the device and returns at once (JAX dispatches asynchronously).

    `prev_tokens`: the previous step's `StepHandle.tokens`, where the batch's `token_src`
    rows read their input token (None: no such row). A batch of greedy requests only
    runs a program without the random draws (argmax): the threefry draws cost as much
    compile time as the whole tiny forward.
    """
    greedy_only = not np.any(batch.temperature > 0)
    if prev_tokens is None:
      if np.any(batch.token_src >= 0):
        raise ValueError("the batch reads tokens of a previous step; pass prev_tokens")
      prev_tokens = self._no_tokens
    programs = None  # the jitted step's programs before the call (a new one: compiled)
    if self.compiler is None:
      step = functools.partial(self._step, greedy_only=greedy_only,
                               num_token_rows=self.max_num_seqs)
      programs = _num_programs(self._step)
    else:  # (a shape nothing compiled covers is compiled here, in the foreground)
      foreground = self.compiler.foreground
      step, batch = self.compiler.program(
          batch, greedy_only, lambda b: self._step_args(b, prev_tokens))
      compiled = self.compiler.foreground != foreground
    self.shapes_compiled.add((batch.input_ids.shape[0], batch.logits_indices.shape[0],
                              batch.metadata.block_tables.shape[1], greedy_only))
    (tokens, arrays, self.bounds, hot_state, (counts, loaded, *topk),
     (logprobs, prompt)) = step(*self._step_args(batch, prev_tokens))
    if not _resident_only(batch):  # (a resident-only step leaves the state as it was)
      self.hot_state = hot_state
    self.pool.set_arrays(arrays)
    if self.hisparse is not None:
      self.step_clock += 1
    if programs is not None:
      compiled = _num_programs(self._step) != programs
    return StepHandle(tokens, counts, loaded, batch.num_seqs, self.hisparse is not None,
                      logprobs, prompt, topk[0] if topk else None, compiled)

  def _step_args(self, batch: StepBatch, prev_tokens: jax.Array) -> tuple:
    # A HiSparse step with no sparse row reads neither the host pool nor the hot-buffer
    # state: it runs without them (each of their 5 arrays a layer costs the call ~10 us).
    full = self.hisparse is not None and not _resident_only(batch)
    host_arrays = self.host_pool.arrays() if full else ()
    hot_state = self.hot_state if full else ()
    return (self._param_leaves, self.head, self.pool.arrays(), self.bounds, hot_state,
            host_arrays,
            batch.input_ids, batch.token_src, prev_tokens, batch.positions, batch.metadata,
            batch.logits_indices, batch.temperature, batch.top_p, batch.top_k, batch.seeds,
            batch.counters, batch.extras)

  def lower(self, batch: StepBatch, *, platform: str = "cuda",
            kernel_backend: str | None = None) -> jax.stages.Lowered:
    """The step program of `batch`, lowered for `platform` ("cuda", "rocm", "cpu" or
    "tpu") from whatever machine this is, without running it: what a GPU would compile,
    checked from a CPU-only host (tests/hisparse_jax/engine/test_lowering_cuda.py). The
    kernels are those of `kernel_backend` (None: the runner's) resolved for that
    platform ("auto" gives the compiled Pallas kernels on a GPU), and HiSparse loads
    cross between separate device and host memories unless the platform is CPU."""
    target = kernels_pallas.backend.target_platform(platform)
    backend = self.kernel_backend if kernel_backend is None else kernel_backend
    ops = kernels_pallas.ops(backend, platform=target, pages_dtype=self._pages_dtype())
    step = self._step_for(ops, one_memory=target == "cpu")
    # The dense call's static sizes are the target kernels' own (build_batch gave this
    # runner's).
    meta = batch.metadata
    hints = tuple(sorted(ops.ragged_hints(dense_q_lens(batch)).items()))
    batch = dataclasses.replace(batch, metadata=dataclasses.replace(meta, ragged_hints=hints))
    greedy_only = not np.any(batch.temperature > 0)
    # A cuda target from a host without a GPU: the Pallas kernels lower for an abstract
    # H200 (jax >= 0.11 asks for the target GPU); the arrays stay on this host's devices.
    gpu = platform == "cuda" and kernels_pallas.backend.platform() != "gpu"
    with kernels_pallas.backend.abstract_gpu() if gpu else contextlib.nullcontext():
      return step.trace(*self._step_args(batch, self._no_tokens), greedy_only=greedy_only,
                        num_token_rows=self.max_num_seqs).lower(lowering_platforms=(platform,))

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
    topk = None if handle.topk is None else np.asarray(handle.topk)
    return StepResult(tokens, counts, loaded, logprobs, prompt, topk)

  def execute(self, batch: StepBatch) -> np.ndarray:
    """Runs the step to the end; returns int32 [batch.num_seqs] sampled tokens."""
    return self.collect(self.dispatch(batch)).tokens

  # --- Warm-up (engine/warmup.py): programs compiled, nothing run ---------------------

  def warm_step(self, batch: StepBatch) -> bool:
    """Compiles the step program of `batch`'s shape (loaded from the persistent
    compilation cache when it holds it) without running it, so that a later step of that
    shape runs at once. False when nothing was compiled: with compile_in_background, the
    shape is kept already or the kept programs are at their cap."""
    greedy_only = not np.any(batch.temperature > 0)
    if self.compiler is not None:
      return self.compiler.warm(batch, greedy_only,
                                lambda b: self._step_args(b, self._no_tokens))
    # jit's own cache: a later call with arguments of these types finds this program.
    self._step.lower(*self._step_args(batch, self._no_tokens), greedy_only=greedy_only,
                     num_token_rows=self.max_num_seqs).compile()
    return True

  def lowered_block_programs(self, buckets: Sequence[int]) -> list[jax.stages.Lowered]:
    """The runner's programs between steps at each padded id count of `buckets`, lowered
    from the arrays' types (to compile: engine/warmup.py): with key bounds, their refresh
    after a swap-in and their copy to the host index; the copy-on-write copy at the
    first bucket only (a step copies one partial block per forked sequence)."""
    out = []
    for i, n in enumerate(buckets):
      ids = np.zeros(n, np.int32)
      if i == 0:
        out.append(self._copy.lower((*self.pool.arrays(), *self.bounds), ids, ids))
      if self.bounds:
        out.append(self._copy.lower(self.bounds, ids, ids))
        out.append(self._refresh.lower(self.bounds, self.pool.k, self.pool.k_scale, ids))
    return out

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
    num_pool_arrays = len(self.pool.arrays())
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
    self.bounds = self._refresh(self.bounds, self.pool.k, self.pool.k_scale, slots)

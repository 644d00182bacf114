"""Step shapes: which compiled step program a batch runs on, and new programs compiled
in the background instead of stalling the engine.

A step program is compiled per padded shape: tokens, sequences, block-table width, the
dense attention call's static sizes (`ragged_hints`), the sparse rows, greedy or not,
and the sampler extras' shapes. While serving, a batch mix never seen before
(say 37 decode rows beside a 300-token prefill chunk) compiles a new program, and on
this CPU that stalls every request for a second or more.

`StepCompiler` (`EngineConfig.compile_in_background`) removes the stall the way vLLM's
CUDA graphs do for uncaptured batch sizes (they run eagerly, padded to no graph): a
batch whose own program is not compiled yet runs on the cheapest compiled program whose
shape COVERS it (`covers`: every size at least the batch's, the attention's static sizes
able to hold its rows), padded up to that shape (`pad_to`: padding tokens write nowhere,
padding rows attend nothing and their tokens are dropped), while its own program
compiles in a background thread and takes over once ready. Only a batch that no compiled
program covers compiles in the foreground.

What a request gets does not depend on the padding except in float rounding: a covering
program may split the attention's prefill tiles differently, so greedy tokens can differ
where two logits tie to float32 rounding. That is why it is an option (on for `serve`,
whose batches depend on arrival times anyway; off for offline runs, which stay
reproducible).

The compiled programs kept are bounded (`MAX_PROGRAMS`, the least recently run dropped
with the step's jit caches, which hold every program compiled through them): a
CPU program holds its code in ~240 memory maps of its own, a process may have 65,530
(Linux's vm.max_map_count), and past ~270 programs a compile cannot map its code
("LLVM compilation error: Cannot allocate memory") and the process dies of a SIGSEGV.
A served request mix reaches that many (shape x sampler signature: penalties, min_tokens,
logprobs), which fuzzing `serve` found in ~5 minutes (bench/fuzz_server.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from hisparse_jax.engine.step_batch import StepBatch

# Compiled step programs kept at most (see the module's docstring): ~31k memory maps on
# CPU, half of Linux's default vm.max_map_count.
MAX_PROGRAMS = 128


@dataclasses.dataclass(frozen=True)
class StepShape:
  """The static shape of a step program (what a compile is keyed by)."""

  num_tokens: int
  num_seqs: int
  table_width: int
  ragged_hints: tuple[tuple[str, int], ...]
  num_sparse_rows: int
  greedy_only: bool
  # Shapes and static fields of the sampler extras (None: no extras). Only an equal
  # signature covers: extras are rare and their shapes many.
  extras: Any = None
  chunk_queries: int = 1  # StepMetadata.chunk_queries (queries a sparse chunk selects by)
  sparse_chunks: bool = True  # StepMetadata.sparse_chunks (the streamed-chunk path in it)

  @property
  def cost(self) -> tuple:
    """Order of preference among covering shapes: the smallest step first."""
    return (self.num_tokens, self.num_seqs, self.table_width,
            sum(v for _, v in self.ragged_hints), self.num_sparse_rows,
            not self.greedy_only)


def shape_of(batch: StepBatch, greedy_only: bool) -> StepShape:
  extras = None
  if batch.extras is not None:
    leaves, treedef = jax.tree.flatten(batch.extras)
    extras = (treedef, tuple((np.shape(x), np.result_type(x).str) for x in leaves))
  meta = batch.metadata
  return StepShape(int(batch.input_ids.shape[0]), int(batch.logits_indices.shape[0]),
                   int(meta.block_tables.shape[1]), tuple(meta.ragged_hints),
                   int(meta.num_sparse_rows), bool(greedy_only), extras,
                   int(meta.chunk_queries), bool(meta.sparse_chunks))


def dense_q_lens(batch: StepBatch) -> list[int]:
  """Query lengths of the batch's rows in the dense attention call (sparse decode rows
  are not in it; a sparse prefill chunk is, over its rewritten table, unless exact): as
  the batch builder recorded them, else from the metadata."""
  if batch.dense_q_lens is not None:
    return list(batch.dense_q_lens)
  meta = batch.metadata
  q_lens = np.diff(np.asarray(meta.cu_q_lens)[:batch.num_seqs + 1])
  sparse = np.asarray(meta.sparse_rows)[:batch.num_seqs]
  return q_lens[~sparse | (q_lens > 1)].tolist()


def covers(big: StepShape, small: StepShape, q_lens: Sequence[int],
           hints_cover: Callable[[dict[str, int], Sequence[int]], bool]) -> bool:
  """Whether a program of shape `big` computes a batch of shape `small` padded up to it
  (`q_lens`: the batch's dense query lengths, `hints_cover`: KernelOps.hints_cover)."""
  if big == small:
    return True
  return (big.num_tokens >= small.num_tokens and big.num_seqs >= small.num_seqs
          and big.table_width >= small.table_width
          and big.num_sparse_rows >= small.num_sparse_rows
          and (big.num_sparse_rows > 0) == (small.num_sparse_rows > 0)
          # A sampling program samples greedy rows greedily; not the other way round.
          and (big.greedy_only <= small.greedy_only)
          and big.extras == small.extras
          and big.chunk_queries == small.chunk_queries
          # A program with the streamed-chunk path runs a batch without chunks too.
          and big.sparse_chunks >= small.sparse_chunks
          and hints_cover(dict(big.ragged_hints), q_lens))


def _pad(x: np.ndarray, size: int, value, axis: int = 0) -> np.ndarray:
  extra = size - x.shape[axis]
  if extra <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return np.pad(x, widths, constant_values=value)


def pad_to(batch: StepBatch, shape: StepShape, num_hot_rows: int) -> StepBatch:
  """`batch` padded up to `shape` (which covers it): padding tokens have slot -1 (written
  nowhere) and no row; padding rows have kv_len 0, no table and no hot-buffer row."""
  t, b, w = shape.num_tokens, shape.num_seqs, shape.table_width
  meta = batch.metadata
  cu = np.asarray(meta.cu_q_lens)
  hisparse = {}
  if meta.host_tables is not None:
    hisparse = dict(
        host_tables=_pad(_pad(np.asarray(meta.host_tables), b, 0), w, 0, axis=1),
        hot_slots=_pad(np.asarray(meta.hot_slots), b, 0),
        hot_rows=_pad(np.asarray(meta.hot_rows), b, num_hot_rows),
        hot_reset=_pad(np.asarray(meta.hot_reset), b, False))
  meta = dataclasses.replace(
      meta, slot_ids=_pad(np.asarray(meta.slot_ids), t, -1),
      block_tables=_pad(_pad(np.asarray(meta.block_tables), b, 0), w, 0, axis=1),
      kv_lens=_pad(np.asarray(meta.kv_lens), b, 0),
      cu_q_lens=_pad(cu, b + 1, cu[-1]),
      sparse_rows=_pad(np.asarray(meta.sparse_rows), b, False),
      ragged_hints=shape.ragged_hints, num_sparse_rows=shape.num_sparse_rows,
      chunk_queries=shape.chunk_queries, sparse_chunks=shape.sparse_chunks, **hisparse)
  return dataclasses.replace(
      batch, input_ids=_pad(batch.input_ids, t, 0), token_src=_pad(batch.token_src, t, -1),
      positions=_pad(batch.positions, t, 0), metadata=meta,
      logits_indices=_pad(batch.logits_indices, b, 0),
      temperature=_pad(batch.temperature, b, 0.0), top_p=_pad(batch.top_p, b, 1.0),
      top_k=_pad(batch.top_k, b, 0), seeds=_pad(batch.seeds, b, 0),
      counters=_pad(batch.counters, b, 0))


def abstract(args: Any) -> Any:
  """The avals (with shardings) of a step's arguments: what a compile needs, taken now,
  before the step donates the pool arrays."""

  def one(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return jax.ShapeDtypeStruct(np.shape(x), np.result_type(x))

  return jax.tree.map(one, args)


class StepCompiler:
  """Compiled step programs by shape; new shapes compiled in one background thread.

  `step`: the jitted step program; `static`: its static keyword arguments (the same for
  every shape); `hints_cover`: KernelOps.hints_cover. `program(batch, args_of)` returns
  (compiled program, the batch as it must be run). At most `max_programs` are kept: with
  that many (compiled or compiling), a batch a kept program covers runs padded to it and
  nothing compiles; one that none covers compiles, and past the cap the least recently
  run are dropped down to 3/4 of it (freed; compiled again if their shape returns). So a
  server's programs, and the memory they hold, stop growing at the cap.
  Counters: `foreground` compiles (stalls), `background` compiles, `covered` steps run
  padded to a covering shape (`capped` of them at the cap: no compile of their own),
  `evicted` programs dropped, `warmed` programs compiled by `warm` before any request.
  """

  def __init__(self, step, static: dict[str, Any], hints_cover, num_hot_rows: int,
               max_programs: int | None = None):
    max_programs = MAX_PROGRAMS if max_programs is None else max_programs
    if max_programs < 1:
      raise ValueError(f"max_programs must be >= 1, got {max_programs}")
    self._step = step
    self._static = static
    self._hints_cover = hints_cover
    self._num_hot_rows = num_hot_rows
    self._max_programs = max_programs
    # (least recently run first)
    self.ready: collections.OrderedDict[StepShape, Any] = collections.OrderedDict()
    self._pending: dict[StepShape, concurrent.futures.Future] = {}
    self._executor: concurrent.futures.ThreadPoolExecutor | None = None
    self.foreground = 0
    self.background = 0
    self.covered = 0
    self.capped = 0
    self.evicted = 0
    self.warmed = 0

  def _compile(self, shape: StepShape, avals, greedy_only: bool):
    return self._step.lower(*avals, greedy_only=greedy_only, **self._static).compile()

  def _keep(self, shape: StepShape, compiled) -> None:
    self.ready[shape] = compiled  # (the most recent: never one dropped)
    if len(self.ready) > self._max_programs:
      # Down to 3/4 of the cap at once, then the step's jit caches cleared: they hold
      # every program compiled through them (dropping ours alone frees no memory map);
      # the programs kept are held here.
      while len(self.ready) > max(1, self._max_programs * 3 // 4):
        self.ready.popitem(last=False)
        self.evicted += 1
      clear_cache = getattr(self._step, "clear_cache", None)
      if clear_cache is not None:
        clear_cache()

  def _collect_done(self) -> None:
    for shape, future in list(self._pending.items()):
      if future.done():
        del self._pending[shape]
        self._keep(shape, future.result())  # a failed compile raises here
        self.background += 1

  def program(self, batch: StepBatch, greedy_only: bool,
              args_of: Callable[[StepBatch], tuple]) -> tuple[Any, StepBatch]:
    self._collect_done()
    shape = shape_of(batch, greedy_only)
    compiled = self.ready.get(shape)
    if compiled is not None:
      self.ready.move_to_end(shape)
      return compiled, batch
    q_lens = dense_q_lens(batch)
    options = [s for s in self.ready
               if covers(s, shape, q_lens, self._hints_cover)]
    if not options:
      compiled = self._compile(shape, abstract(args_of(batch)), greedy_only)
      self._keep(shape, compiled)
      self.foreground += 1
      return compiled, batch
    at_cap = len(self.ready) + len(self._pending) >= self._max_programs
    if shape not in self._pending and at_cap:
      self.capped += 1  # (the cover serves this shape: no program of its own)
    elif shape not in self._pending:
      if self._executor is None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hisparse-compile")
      self._pending[shape] = self._executor.submit(
          self._compile, shape, abstract(args_of(batch)), greedy_only)
    cover = min(options, key=lambda s: s.cost)
    self.ready.move_to_end(cover)
    self.covered += 1
    return self.ready[cover], pad_to(batch, cover, self._num_hot_rows)

  def warm(self, batch: StepBatch, greedy_only: bool,
           args_of: Callable[[StepBatch], tuple]) -> bool:
    """Compiles `batch`'s own program now (loaded from the persistent compilation cache
    when it holds it) and keeps it, so a later batch of that shape runs on it at once
    (engine/warmup.py, before a server takes requests). False, compiling nothing, when
    the shape is kept already or the kept programs are at the cap (a warm-up never
    evicts). Counted in `warmed`, not `foreground`: no request waited for it."""
    self._collect_done()
    shape = shape_of(batch, greedy_only)
    if shape in self.ready or shape in self._pending:
      return False
    if len(self.ready) + len(self._pending) >= self._max_programs:
      return False
    self._keep(shape, self._compile(shape, abstract(args_of(batch)), greedy_only))
    self.warmed += 1
    return True

  def wait(self) -> None:
    """Blocks until every background compile is done (tests, warm-up)."""
    for future in list(self._pending.values()):
      future.result()
    self._collect_done()

  def close(self) -> None:
    if self._executor is not None:
      self._executor.shutdown(wait=True, cancel_futures=True)
      self._executor = None

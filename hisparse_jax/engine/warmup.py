"""Warm-up: the programs a server's first requests run, compiled before it takes any.

A fresh process pays for each program on the first step that needs it: a step program
of a new shape is traced and lowered in Python (~0.5-1 s for the real model's 30 layers
on the 2-core CPU), then loaded from the persistent compilation cache or compiled
(~1-2 s); the programs between steps (swap-in / swap-out, copy-on-write, the third
tier's host-pool read and write) compile in 0.1-0.3 s each and are not written to the
cache (they compile under its threshold). A `serve` restart's first request served from
the disk tier paid all of that: 2.3 s against 0.65 s on a warmed server.

`warm_up(engine)` compiles those programs before the engine takes a request:
`hisparse-jax serve` calls it before it logs "serving on" (--nowarmup skips it), and an
embedder may call it on a new `Engine`. Nothing runs: each program is lowered from the
types of its arguments and compiled (`jax.stages.Lowered.compile`), which fills the
caches a call looks in (jit's own, the `StepCompiler`'s kept programs) and goes through
JAX's persistent compilation cache when it is on (loaded when the cache holds the
program, written when it compiled long enough: the block programs never are). So no
token, block, prefix-cache entry, metric counter or tier entry changes
(tests/hisparse_jax/engine/test_warmup.py).

Which step shapes: those of a lone request, which a restarted server's first request is,
for greedy and for sampling requests (two programs each), at every block-table width
bucket up to max_model_len:

    decode    one token a step (a width's shortest and longest contexts: HiSparse may
              decode the one densely and the other sparsely)
    tail      a prompt's last chunk after a prefix-cache or third-tier hit of its full
              blocks: 1 to block_size tokens, each token bucket up to block_size
    prefill   the other chunk sizes of a prompt computed from scratch, every token bucket
              up to max_num_batched_tokens (not in DEFAULT_KINDS: a prompt computed from
              scratch pays its whole prefill anyway, and each kind of program costs
              start-up time and ~15-40 MB of memory on CPU)

The shapes come from the engine's own `BatchBuilder` over chunks of synthetic requests,
so they are exactly the shapes its steps will have. Batches of several requests (more
rows, decode rows beside a prefill chunk) and HiSparse's streamed prompts (longer than
the device pool) are left to the `StepCompiler`: they run padded on a covering program
while their own compiles in the background. With
compile_in_background the warm-up compiles at most half of --max_step_programs (the
rest is the server's), the kinds in the order above.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from hisparse_jax.engine.request import Request
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.engine.scheduler import ScheduledChunk
from hisparse_jax.engine.step_batch import StepBatch
from hisparse_jax.engine.step_shapes import shape_of
from hisparse_jax.kv_cache.tiers.pool_io import HostPoolIO
from hisparse_jax.kv_cache.transfer import bucket_size, warm_buckets

KINDS = ("decode", "tail", "prefill")
DEFAULT_KINDS = ("decode", "tail")
MIN_TOKEN_BUCKET = 16  # BatchBuilder's token padding: the power of two, at least 16
MIN_WIDTH_BUCKET = 4  # and of the block-table width


@dataclasses.dataclass(frozen=True)
class WarmupReport:
  """What a warm-up compiled (or loaded from the persistent compilation cache)."""

  step_programs: int
  block_programs: int  # swaps, copy-on-write and key-bounds copies, tier reads / writes
  skipped_shapes: int  # step shapes kept already, or past the warm-up's budget
  seconds: float

  @property
  def num_programs(self) -> int:
    return self.step_programs + self.block_programs

  def log_line(self) -> str:
    skipped = f", {self.skipped_shapes} step shapes left out" if self.skipped_shapes else ""
    return (f"warm-up: {self.num_programs} programs compiled or loaded from the compilation "
            f"cache in {self.seconds:.1f} s ({self.step_programs} step programs, "
            f"{self.block_programs} block programs{skipped}); --nowarmup skips it")


@dataclasses.dataclass(frozen=True)
class WarmChunk:
  """One chunk of a synthetic lone request: tokens [start, start + num_tokens) of a
  request whose prompt has `prompt_len` tokens (start >= prompt_len: a decode)."""

  kind: str
  prompt_len: int
  start: int
  num_tokens: int


def lone_request_chunks(block_size: int, max_model_len: int, max_num_batched_tokens: int,
                        kinds: Sequence[str] = DEFAULT_KINDS) -> list[WarmChunk]:
  """Chunks of `kinds` that together have every step shape a lone request's chunks of
  those kinds can have (some of them the same shape: `warm_up` compiles each once), in
  the order of KINDS: each width bucket's shortest and longest contexts (HiSparse's
  dense and sparse sides), each token bucket of the kind."""
  bad = [k for k in kinds if k not in KINDS]
  if bad:
    raise ValueError(f"warm-up kinds must be among {KINDS}, got {bad}")
  max_blocks = -(-max_model_len // block_size)
  # Each width bucket's shortest and longest contexts (tokens).
  contexts: dict[int, tuple[int, int]] = {}
  for num_blocks in range(1, max_blocks + 1):
    width = bucket_size(num_blocks, MIN_WIDTH_BUCKET, max_blocks)
    shortest = contexts.get(width, ((num_blocks - 1) * block_size + 1,))[0]
    contexts[width] = (shortest, min(num_blocks * block_size, max_model_len))
  token_buckets = warm_buckets(max_num_batched_tokens, MIN_TOKEN_BUCKET,
                               max_num_batched_tokens)
  # A tail is at most a block (after a hit on every full block; the last token is always
  # computed): the token buckets up to that of block_size tokens.
  max_tail = bucket_size(block_size, MIN_TOKEN_BUCKET, max_num_batched_tokens)
  out = []
  for kind in (k for k in KINDS if k in kinds):
    for width in sorted(contexts):
      for context in sorted(set(contexts[width])):
        if kind == "decode":  # (a decode follows a prompt of at least one token)
          context = max(context, 2)
          out.append(WarmChunk(kind, context - 1, context - 1, 1))
          continue
        # (a prompt leaves room for a token; a chunk of one token is a decode row to the
        # attention's static sizes, so a tail of one token has a shape of its own)
        prompt_len = max(1, min(max(context, 2), max_model_len - 1))
        sizes = {min(b, prompt_len) for b in token_buckets} | {1}
        for tokens in sorted(sizes):
          bucket = bucket_size(tokens, MIN_TOKEN_BUCKET, max_num_batched_tokens)
          if (bucket <= max_tail) == (kind == "tail"):
            out.append(WarmChunk(kind, prompt_len, prompt_len - tokens, tokens))
  return out


def chunk_batch(runner, chunk: WarmChunk, temperature: float) -> StepBatch:
  """The step batch `runner` builds for `chunk` of a synthetic request alone (its slots
  -1, its table the null block: it is compiled, never run)."""
  request = Request("warmup", [0] * chunk.prompt_len,
                    SamplingParams(temperature=temperature), seed=0,
                    prefill_len=chunk.prompt_len)
  end = chunk.start + chunk.num_tokens
  request.output_token_ids = [0] * max(0, end - chunk.prompt_len)
  scheduled = ScheduledChunk(request, chunk.start, chunk.num_tokens,
                             np.full(chunk.num_tokens, -1, np.int32))
  table = np.zeros((1, -(-end // runner.block_size)), np.int32)
  return runner.build_batch([scheduled], table)


def warm_up(engine, *, kinds: Sequence[str] = DEFAULT_KINDS,
            max_step_programs: int | None = None) -> WarmupReport:
  """Compiles (or loads from the persistent compilation cache) the programs a lone
  request of `engine` runs (see the module docstring), running none of them, one after
  the other (compiling on a second thread while the next is traced was slower on the
  2-core CPU: 85 s against 69-79 s for the real model's 67 programs).

  `max_step_programs`: step programs compiled at most (None: half the StepCompiler's
  cap with compile_in_background, else all). The engine must have no request yet
  (ValueError otherwise): its state is left as it was."""
  if engine.has_unfinished_requests():
    raise ValueError("warm_up: the engine has requests; warm it up before it takes any")
  start = time.perf_counter()
  config, runner = engine.config, engine.runner
  if max_step_programs is None and runner.compiler is not None:
    max_step_programs = max(1, config.max_step_programs // 2)
  shapes = set()
  step_programs = skipped = 0
  for chunk in lone_request_chunks(config.block_size, config.max_model_len,
                                   config.max_num_batched_tokens, kinds):
    for temperature in (0.0, 1.0):
      batch = chunk_batch(runner, chunk, temperature)
      shape = shape_of(batch, temperature == 0.0)
      if shape in shapes:
        continue
      shapes.add(shape)
      if ((max_step_programs is None or step_programs < max_step_programs)
          and runner.warm_step(batch)):
        step_programs += 1
      else:
        skipped += 1
  # The programs between steps: id lists up to one max_model_len request's blocks.
  max_blocks = -(-config.max_model_len // config.block_size)
  lowered = [*engine.transfer.lowered_programs(max_blocks),
             *runner.lowered_block_programs(warm_buckets(max_blocks, 4))]
  if engine.tier is not None and engine.tier.tiers:
    lowered += HostPoolIO(engine.host_pool).lowered_programs(max_blocks)
  for program in lowered:
    program.compile()
  return WarmupReport(step_programs, len(lowered), skipped, time.perf_counter() - start)


__all__ = ["DEFAULT_KINDS", "KINDS", "WarmChunk", "WarmupReport", "chunk_batch",
           "lone_request_chunks", "warm_up"]

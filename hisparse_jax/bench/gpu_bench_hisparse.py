"""`make gpu-bench`'s HiSparse part (#55): host <-> device moves, a decode step by miss
fraction, and an 8B-class random model served by the engine. Prints a table, writes JSON.

Usage::

  python -m hisparse_jax.bench.gpu_bench_hisparse [--size=smoke|full] --out FILE.json
      [--budget_s N] [--only transfer,miss_step,engine,transfer_kernel]

`--size` defaults to full on a GPU, smoke elsewhere; `--budget_s` to 150 s (full) or 600 s
(smoke). Parts, in order, each within its share of the budget (transfer 15%, miss_step
20%, engine 90%, transfer_kernel the rest); what does not fit is skipped and listed
(`skipped`: part, what, reason), never left half-recorded:

  transfer   TransferEngine swap_in / swap_out (bench/transfer.py's `case`, the engine
             alone) at the 8B-class layout (32 layers x 8 KV heads x 128, bfloat16, K and
             V: 128 KiB a token), blocks of 16 and 64 tokens, 16 and 256 blocks a call:
             GB/s and share of the PCIe peak (transfer.PCIE_PEAK_BYTES_PER_S); targets at
             16-token blocks: >= 32 GB/s at 256 blocks, >= 16 GB/s at 16, each direction
  miss_step  one HiSparse decode step (ModelRunner, bench/tiered.py's offloaded batch:
             every block in the pinned_host pool, sink and local blocks resident, a warm
             hot buffer) whose selection misses 0%, 10%, 30% of its blocks: that share of
             each row's selected blocks is emptied from the warm hot buffer (every layer),
             so exactly those are loaded from the host in the step (the step's own counts
             say how many); full size: 4 of the 8B's 32 layers with its head scaled to
             4/32 (vocabulary 16,032: the step's weight bytes in the 8B's proportions),
             batch 4 x 32k tokens, top-k 2,048; ratio to the 0% step, target <= 1.3 at 30%
  engine     gpu_bench_hisparse_engine.py: (b) batch 1 HiSparse / dense, (c) a request of
             twice the device pool against a dense engine's tokens, (a) 4N requests at N
             requests' device budget, HiSparse / device-only decode tokens/s
  transfer_kernel  the zero-copy block copy (HISPARSE_JAX_HOST_COPY=kernel: a Pallas
             kernel reading / writing the pinned_host pool in place, #55) beside XLA's
             host gather: first both paths against numpy bit for bit (random bytes, 16
             blocks each way; a differing block is a correctness failure), then the
             transfer part's 16-token-block rows through the kernel, each with its ratio
             to the XLA row (`vs_xla`). Last, so a kernel that faults on a GPU whose
             pinned_host is not device-mapped costs no other part.

Rows: part, name, config, figure, unit, target, met (None where there is no target, and
on a CPU, whose figures say nothing of a GPU's). JSON top level: machine, size, budget,
rows, skipped, errors, summary. Exit status 1 on a correctness failure (tokens differ
where they must be equal) or a part that raised; else 0. At full size JAX's persistent
compilation cache is on (compilation_cache.default_dir(); $HISPARSE_COMPILATION_CACHE_DIR=
"" turns it off), so a second run on the same machine loads the 32-layer programs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

PARTS = ("transfer", "miss_step", "engine", "transfer_kernel")
SHARES = {"transfer": 0.15, "miss_step": 0.2, "engine": 0.9,  # of the time left at its start
          "transfer_kernel": 1.0}
DEFAULT_BUDGET_S = {"full": 150.0, "smoke": 600.0}
TRANSFER_TARGETS = {256: 32.0, 16: 16.0}  # GB/s at 16-token blocks, by blocks per call
MISS_TARGET = 1.3  # the 30% step over the 0% step


@dataclasses.dataclass(frozen=True)
class TransferSize:
  num_layers: int
  num_kv_heads: int
  head_dim: int
  reps: int
  dtype: str = "bfloat16"
  block_sizes: tuple[int, ...] = (16, 64)
  num_blocks: tuple[int, ...] = (256, 16)  # the two targets first


@dataclasses.dataclass(frozen=True)
class MissSize:
  model: dict  # overrides of llama_8b_config, or "tiny": the engine part's toy config
  dtype: str
  batch: int
  context: int
  top_k_tokens: int
  hot_buffer_tokens: int
  sink_tokens: int
  local_tokens: int
  reps: int
  fractions: tuple[float, ...] = (0.0, 0.1, 0.3)
  block_size: int = 16


TRANSFER_SIZES = {"full": TransferSize(32, 8, 128, reps=5),
                  "smoke": TransferSize(2, 2, 16, reps=2)}
MISS_SIZES = {
    "full": MissSize(model={"num_hidden_layers": 4, "vocab_size": 128256 * 4 // 32},
                     dtype="bfloat16", batch=4, context=32768, top_k_tokens=2048,
                     hot_buffer_tokens=4096, sink_tokens=64, local_tokens=256, reps=7),
    "smoke": MissSize(model={"tiny": True}, dtype="float32", batch=2, context=1024,
                      top_k_tokens=128, hot_buffer_tokens=256, sink_tokens=16,
                      local_tokens=32, reps=2),
}


class Clock:
  """The run's deadline and the current part's."""

  def __init__(self, budget_s: float):
    self.start = time.monotonic()
    self.end = self.start + budget_s
    self.deadline = self.end

  def begin(self, share: float) -> None:
    now = time.monotonic()
    self.deadline = now + share * max(0.0, self.end - now)

  def left(self) -> float:
    return self.deadline - time.monotonic()


class Report:
  """Rows, skips and errors, written to the JSON after every part."""

  def __init__(self, size: str, budget_s: float, out: str | None, on_gpu: bool):
    self.size, self.budget_s, self.out, self.on_gpu = size, budget_s, out, on_gpu
    self.rows: list[dict] = []
    self.skipped: list[dict] = []
    self.errors: list[dict] = []
    self.correct = True
    self.machine = None

  def add_row(self, part, name, config, figure, unit, target, met, **details) -> None:
    self.rows.append({"part": part, "name": name, "config": config, "figure": figure,
                      "unit": unit, "target": target,
                      "met": met if self.on_gpu else None, **details})

  def skip(self, part: str, what: str, reason: str) -> None:
    self.skipped.append({"part": part, "what": what, "reason": reason})
    print(f"skipped {part}: {what}: {reason}", file=sys.stderr, flush=True)

  def result(self, started: float) -> dict:
    mets = [r["met"] for r in self.rows]
    return {"machine": self.machine, "size": self.size,
            "budget": {"budget_s": self.budget_s,
                       "spent_s": round(time.monotonic() - started, 1)},
            "rows": self.rows, "skipped": self.skipped, "errors": self.errors,
            "summary": {"rows": len(self.rows), "met": mets.count(True),
                        "not_met": mets.count(False), "no_target_or_cpu": mets.count(None),
                        "skipped": len(self.skipped), "errors": len(self.errors),
                        "tokens_equal_where_required": self.correct,
                        "parts": sorted({r["part"] for r in self.rows})}}

  def write(self, started: float) -> None:
    if self.out:
      os.makedirs(os.path.dirname(os.path.abspath(self.out)), exist_ok=True)
      with open(self.out, "w") as f:
        json.dump(self.result(started), f, indent=1, default=str)


def run_transfer(size_name: str, clock: Clock, report: Report) -> None:
  import numpy as np  # noqa: PLC0415

  from hisparse_jax.bench import transfer  # noqa: PLC0415
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec  # noqa: PLC0415

  size = TRANSFER_SIZES[size_name]
  rng = np.random.default_rng(0)
  peak = transfer.pcie_peak()
  if peak is None:
    report.skip("transfer", "share of the PCIe peak", "not a GPU with a known PCIe peak "
                "(transfer.PCIE_PEAK_BYTES_PER_S): GB/s only")
  largest = (0.0, 1)  # (seconds, pools' bytes) of the largest case so far: its rate
  for block_size in size.block_sizes:
    spec = KVCacheSpec(num_layers=size.num_layers, num_kv_heads=size.num_kv_heads,
                       head_dim=size.head_dim, dtype=size.dtype, block_size=block_size)
    for n in size.num_blocks:
      what = f"block {block_size} x {n} blocks"
      pool_bytes = (2 * n + 1) * spec.bytes_per_block  # transfer.case's pools, each
      need = largest[0] * pool_bytes / largest[1]
      if clock.left() < need or clock.left() <= 0:
        report.skip("transfer", what, f"budget: {clock.left():.0f} s left of the part, "
                    f"~{need:.0f} s estimated from the largest case before")
        continue
      start = time.monotonic()
      for r in transfer.case(spec, n, size.reps, rng, with_numpy=False):
        target = TRANSFER_TARGETS.get(n) if block_size == 16 else None
        gbs = r["engine_gb_per_s"]
        report.add_row("transfer", f"{r['direction']} block {block_size} x {n}",
                       {"block_size": block_size, "num_blocks": n, "layers": spec.num_layers,
                        "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                        "dtype": spec.dtype, "bytes": r["bytes"], "reps": size.reps},
                       gbs, "GB/s", None if target is None else f">= {target:g} GB/s",
                       None if target is None else gbs >= target,
                       ms=r["engine_ms"], pcie_share=r["pcie_fraction"],
                       pcie_peak_bytes_per_s=peak)
      if pool_bytes >= largest[1]:
        largest = (time.monotonic() - start, pool_bytes)


def run_transfer_kernel(size_name: str, clock: Clock, report: Report) -> None:
  import numpy as np  # noqa: PLC0415

  from hisparse_jax.bench import transfer  # noqa: PLC0415
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec  # noqa: PLC0415

  size = TRANSFER_SIZES[size_name]
  rng = np.random.default_rng(1)
  block_size = size.block_sizes[0]
  spec = KVCacheSpec(num_layers=size.num_layers, num_kv_heads=size.num_kv_heads,
                     head_dim=size.head_dim, dtype=size.dtype, block_size=block_size)
  checked = 16
  differing = transfer.kernel_check(spec, checked, rng)
  config = {"block_size": block_size, "num_blocks": checked, "layers": spec.num_layers,
            "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "dtype": spec.dtype}
  for host_copy, n in differing.items():
    if n:
      report.correct = False
    report.add_row("transfer_kernel", f"bit-exact vs numpy ({host_copy})", config, n,
                   "blocks differing", "0", n == 0)
  if differing["kernel"]:
    report.skip("transfer_kernel", "timing", "the kernel moved wrong bytes")
    return
  xla = {r["name"]: r["figure"] for r in report.rows if r["part"] == "transfer"}
  for n in size.num_blocks:
    what = f"block {block_size} x {n} blocks"
    if clock.left() <= 0:
      report.skip("transfer_kernel", what, "budget: no time left")
      continue
    # (one_memory False: the GPU's mechanism; on a CPU the kernel runs in interpret mode)
    for r in transfer.case(spec, n, size.reps, rng, with_numpy=False, one_memory=False,
                           host_copy="kernel"):
      name = f"{r['direction']} block {block_size} x {n}"
      target = TRANSFER_TARGETS.get(n)
      gbs = r["engine_gb_per_s"]
      report.add_row("transfer_kernel", f"{name} (kernel)",
                     {**config, "num_blocks": n, "bytes": r["bytes"], "reps": size.reps,
                      "host_copy": "kernel"},
                     gbs, "GB/s", None if target is None else f">= {target:g} GB/s",
                     None if target is None else gbs >= target,
                     ms=r["engine_ms"], pcie_share=r["pcie_fraction"],
                     vs_xla=gbs / xla[name] if xla.get(name) else None)


def state_with_misses(warm, fraction: float, top_k_blocks: int, rng):
  """The warm hot-buffer state with round(fraction x top_k_blocks) of each row's filled
  slots (every layer) emptied: those selected blocks miss in the next step."""
  from hisparse_jax.sparse import resolver  # noqa: PLC0415

  slot_block, last_used, evicted_at = (a.copy() for a in warm)
  for layer in range(slot_block.shape[0]):
    for row in range(slot_block.shape[1]):
      filled = (slot_block[layer, row] >= 0).nonzero()[0]
      drop = rng.choice(filled, min(len(filled), round(fraction * top_k_blocks)),
                        replace=False)
      slot_block[layer, row, drop] = -1
      last_used[layer, row, drop] = resolver.NEVER
  return slot_block, last_used, evicted_at


def run_miss_step(size_name: str, clock: Clock, report: Report) -> None:
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from hisparse_jax.bench import common, tiered  # noqa: PLC0415
  from hisparse_jax.bench.gpu_bench_hisparse_engine import tiny_config  # noqa: PLC0415
  from hisparse_jax.engine.runner import COUNT_FIELDS  # noqa: PLC0415
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec  # noqa: PLC0415
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415
  from models.random_weights import llama_8b_config, random_llama  # noqa: PLC0415

  size = MISS_SIZES[size_name]
  config = (dataclasses.replace(tiny_config(), max_position_embeddings=size.context)
            if "tiny" in size.model else llama_8b_config(**size.model))
  model = random_llama(config, jnp.dtype(size.dtype), seed=1)
  spec = KVCacheSpec.from_model_config(config, size.dtype, size.block_size)
  hisparse = HiSparseConfig(top_k_tokens=size.top_k_tokens,
                            hot_buffer_tokens=size.hot_buffer_tokens,
                            sink_tokens=size.sink_tokens, local_tokens=size.local_tokens)
  setup = tiered.tiered_decode(model, spec, hisparse, size.batch, size.context, seed=0)
  runner = setup.runner

  def step(state):
    runner.set_hot_state(state)
    jax.block_until_ready(runner.hot_state)
    start = time.perf_counter()
    result = runner.collect(runner.dispatch(setup.batch))
    return time.perf_counter() - start, result

  compile_start = time.monotonic()
  step(setup.cold_state)  # compiles; leaves the selection in the hot buffers
  compile_s = time.monotonic() - compile_start
  step(setup.cold_state)
  warm = runner.hot_state_arrays()
  top_k_blocks = hisparse.blocks(size.block_size).top_k_blocks
  rng = np.random.default_rng(0)
  states = {f: state_with_misses(warm, f, top_k_blocks, rng) for f in size.fractions}
  seconds = {f: [] for f in size.fractions}
  results = {}
  rep_s = 0.0
  for rep in range(size.reps):
    if rep >= 1 and clock.left() < 2 * rep_s:
      report.skip("miss_step", f"repetitions {rep + 1}-{size.reps}",
                  f"budget: {clock.left():.1f} s left of the part")
      break
    start = time.monotonic()
    k = rep % len(size.fractions)
    for f in size.fractions[k:] + size.fractions[:k]:
      s, results[f] = step(states[f])
      seconds[f].append(s)
    rep_s = time.monotonic() - start
  fields = {name: COUNT_FIELDS.index(name) for name in ("device", "hot", "host")}
  base_ms = common.median(seconds[size.fractions[0]]) * 1e3
  for f in size.fractions:
    counts = results[f].counts
    selected = int(sum(counts[:, :, i].sum() for i in fields.values()))
    missed = int(counts[:, :, fields["host"]].sum())
    ms = common.median(seconds[f]) * 1e3
    ratio = ms / base_ms
    target = MISS_TARGET if f == max(size.fractions) and f > 0 else None
    report.add_row(
        "miss_step", f"decode step, {100 * f:.0f}% of selected blocks missed: step / 0% step",
        {"layers": config.num_hidden_layers, "hidden": config.hidden_size,
         "heads": f"{config.num_attention_heads}:{config.num_key_value_heads}",
         "head_dim": config.head_dim, "vocab": config.vocab_size, "dtype": size.dtype,
         "batch": size.batch, "context": size.context, "top_k_tokens": size.top_k_tokens,
         "hot_buffer_tokens": size.hot_buffer_tokens, "block_size": size.block_size,
         "reps": len(seconds[f])},
        ratio, "x", None if target is None else f"<= {target}",
        None if target is None else ratio <= target, step_ms=ms,
        measured_miss_fraction=missed / max(1, selected), missed_block_layers=missed,
        selected_block_layers=selected, loaded_block_layers=results[f].loaded_block_layers,
        h2d_bytes=results[f].loaded_block_layers * setup.block_bytes,
        kernel_backend=runner.ops.backend)
  run_overlapped_miss_steps(runner, step, states, results, base_ms, size, clock, report,
                            need_s=compile_s + rep_s)


def run_overlapped_miss_steps(runner, step, states, results, base_ms, size, clock,
                              report: Report, need_s: float) -> None:
  """The same steps with HISPARSE_JAX_OVERLAP_LOADS=1 (the attention over the blocks
  already on the device while the misses load, then the misses', merged by log-sum-exp):
  extra rows, step time over the option-off 0% step, where the part's budget leaves time
  for one more compile and one repetition (`need_s`: the option-off ones' time). Each
  step's sampled tokens and counts must equal the option-off step's (a mismatch fails the
  run, as unequal tokens do)."""
  import numpy as np  # noqa: PLC0415

  from hisparse_jax.bench import common  # noqa: PLC0415
  from hisparse_jax.sparse import resolver  # noqa: PLC0415

  if clock.left() < need_s:
    report.skip("miss_step", "overlapped loads",
                f"budget: {clock.left():.1f} s left of the part, {need_s:.1f} s needed")
    return
  before, off_step = os.environ.get(resolver.OVERLAP_LOADS_ENV), runner._step
  os.environ[resolver.OVERLAP_LOADS_ENV] = "1"
  try:
    runner._step = runner._step_for(runner.ops, one_memory=None)
    step(states[size.fractions[0]])  # compiles
    seconds = {f: [] for f in size.fractions}
    equal = {f: True for f in size.fractions}
    last = {}
    rep_s = 0.0
    for rep in range(size.reps):
      if rep >= 1 and clock.left() < rep_s:
        report.skip("miss_step", f"overlapped loads, repetitions {rep + 1}-{size.reps}",
                    f"budget: {clock.left():.1f} s left of the part")
        break
      rep_start = time.monotonic()
      for f in size.fractions:
        s, last[f] = step(states[f])
        seconds[f].append(s)
        if not (np.array_equal(last[f].tokens, results[f].tokens)
                and np.array_equal(last[f].counts, results[f].counts)):
          equal[f] = report.correct = False
          report.errors.append({"part": "miss_step", "error": (
              f"overlapped loads at {100 * f:.0f}% misses: tokens or counts differ from the "
              "option-off step")})
      rep_s = time.monotonic() - rep_start
    for f in size.fractions:
      ms = common.median(seconds[f]) * 1e3
      counts = last[f].counts
      missed, selected = int(counts[:, :, 2].sum()), int(counts[:, :, :3].sum())
      report.add_row(
          "miss_step", f"decode step, {100 * f:.0f}% missed, overlapped loads: step / 0% "
          "step (option off)", {"overlap_loads": True, "reps": len(seconds[f])},
          ms / base_ms, "x", None, None, step_ms=ms,
          measured_miss_fraction=missed / max(1, selected), missed_block_layers=missed,
          loaded_block_layers=last[f].loaded_block_layers,
          tokens_and_counts_equal_option_off=equal[f], kernel_backend=runner.ops.backend)
  finally:
    runner._step = off_step
    if before is None:
      os.environ.pop(resolver.OVERLAP_LOADS_ENV, None)
    else:
      os.environ[resolver.OVERLAP_LOADS_ENV] = before


def format_table(result: dict) -> str:
  from hisparse_jax.bench import common  # noqa: PLC0415

  rows = []
  for r in result["rows"]:
    fig = r["figure"]
    extra = ""
    if r.get("pcie_share") is not None:
      extra = f"PCIe {100 * r['pcie_share']:.1f}%"
    elif "step_ms" in r:
      extra = f"{r['step_ms']:.2f} ms, misses {100 * r['measured_miss_fraction']:.1f}%"
    elif r["part"] == "engine" and "decode_steps" in r:
      extra = f"{r['decode_steps']} decode steps, {r['max_decoding']} at once"
    rows.append((r["part"], r["name"], fig if isinstance(fig, (int, float)) else str(fig),
                 r["unit"], r["target"] or "-", "-" if r["met"] is None else r["met"], extra))
  lines = [common.format_table(["part", "row", "figure", "unit", "target", "met", ""], rows)
           if rows else "no rows"]
  lines += [f"skipped {s['part']}: {s['what']}: {s['reason']}" for s in result["skipped"]]
  lines += [f"ERROR {e['part']}: {e['error']}" for e in result["errors"]]
  s = result["summary"]
  m = result["machine"] or {}
  lines.append(f"size {result['size']}, {result['budget']['spent_s']} s of "
               f"{result['budget']['budget_s']:g}; {m.get('platform')} / "
               f"{m.get('device_kind')}; met {s['met']}, not met {s['not_met']}, "
               f"tokens equal where required: {s['tokens_equal_where_required']}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=("smoke", "full"), default=None,
                      help="default: full on a GPU, smoke elsewhere")
  parser.add_argument("--out", default=None, help="write the JSON here")
  parser.add_argument("--budget_s", type=float, default=None,
                      help="seconds for the whole run (default: 150 full, 600 smoke)")
  parser.add_argument("--only", default=",".join(PARTS),
                      help=f"comma-separated parts of {','.join(PARTS)}")
  args = parser.parse_args(argv)
  only = [p for p in args.only.split(",") if p]
  if bad := [p for p in only if p not in PARTS]:
    parser.error(f"--only: unknown part(s) {bad}; choose from {','.join(PARTS)}")
  started = time.monotonic()
  import jax  # noqa: PLC0415 (after argument errors)

  from hisparse_jax.bench import common  # noqa: PLC0415
  from hisparse_jax.bench import gpu_bench_hisparse_engine as engine_part  # noqa: PLC0415

  on_gpu = jax.devices()[0].platform == "gpu"
  size = args.size or ("full" if on_gpu else "smoke")
  budget_s = args.budget_s if args.budget_s is not None else DEFAULT_BUDGET_S[size]
  if not math.isfinite(budget_s) or budget_s <= 0:
    parser.error(f"--budget_s must be a positive number, got {budget_s}")
  if size == "full":
    from hisparse_jax.engine import compilation_cache  # noqa: PLC0415

    compilation_cache.enable(compilation_cache.default_dir())
  clock = Clock(budget_s)
  report = Report(size, budget_s, args.out, on_gpu)
  report.machine = common.machine()
  if not on_gpu:
    report.skip("all", "targets (met)", f"not a GPU ({jax.devices()[0].platform}): "
                "figures recorded, met None")
  runners = {"transfer": run_transfer, "miss_step": run_miss_step,
             "transfer_kernel": run_transfer_kernel,
             "engine": lambda s, c, r: _engine(engine_part, s, c, r)}
  for part in PARTS:
    if part not in only:
      report.skip(part, "the whole part", "not in --only")
      continue
    clock.begin(SHARES[part])
    if clock.left() <= 0:
      report.skip(part, "the whole part", "budget: no time left")
      continue
    print(f"-- {part} ({clock.left():.0f} s)", file=sys.stderr, flush=True)
    try:
      runners[part](size, clock, report)
    except Exception as e:  # recorded; the other parts go on
      report.errors.append({"part": part, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-4000:]})
      traceback.print_exc()
    report.write(started)
  result = report.result(started)
  report.write(started)
  print(format_table(result))
  return 0 if report.correct and not report.errors else 1


def _engine(engine_part, size: str, clock: Clock, report: Report) -> None:
  if not engine_part.run(size, clock, report.add_row, report.skip):
    report.correct = False


if __name__ == "__main__":
  sys.exit(main())

"""Suite `scheduler_overhead`: host microseconds per decode step per sequence.

An engine on the default model with `num_seqs` (256) requests of short prompts, all
running and decoding, with `async_scheduling=False` and each dispatch waiting for its
step (`_DeviceWait`): each step's host work (schedule, block bookkeeping, build_batch,
dispatch, postprocess, metrics) then runs while the device is idle, so it is measured
alone: the step's wall time minus the time it waits for the device. (Beside a running
step, the same Python work is up to 2x slower: the device's threads take both cores
and the memory bandwidth.) With async scheduling (the default) the
same work overlaps the device's previous step and competes with it for the two cores
and memory bandwidth: `async_step_ms` and `async_host_us_per_seq_step` show that run.
The runner's `collect` and `build_batch` and the scheduler's `schedule` are wrapped on
the instance with a timer (the engine is not modified). JSON `host_us_per_seq_step` =
median host time of a decode step / running sequences, plus the split, and a cProfile
of a few more steps (`profile`: the functions with the most own time) naming what
dominates.

Second table (`by_context`): the same measurement for `context_seqs` sequences decoding
up to 256 and up to 4,096 tokens of context (prompts of that length less the tokens they
decode), and `host_ratio_long_vs_short`: the host work of a step must not grow with the
context (goal: within 1.2x). A long-context step streams its KV (134 MB per step at
4,096 tokens x 64 sequences) through the CPU caches and evicts the host's working set,
which by itself slows the postprocessing that follows (measured: 956 -> 1,315 us per
step at 256 tokens when a 64 MiB read is inserted after each step). So each row is
measured twice: as it runs (`host_us_per_step`), and with the caches flushed the same
way after every step in both rows (a 64 MiB read inside the device wait,
`host_us_per_step_cold`): the ratio of the cold rows compares the host's work alone.
The four engines (two contexts, flushed or not) are stepped in turn, one step each, so
the machine's slow and fast spells fall on every row alike; switching engines leaves
every step's caches cold, so these rows' absolute figures are above the first table's
and only their ratio is the figure.
The long prompts share a prefix (prefix caching), so only one of them is prefilled in
full.
"""

from __future__ import annotations

import cProfile
import dataclasses
import os
import pstats
import time

import jax
import numpy as np

from hisparse_jax.bench import common
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Size:
  num_seqs: int
  prompt_len: int
  warmup_steps: int  # decode steps not measured (compiles of growing block-table widths)
  measured_steps: int
  profiled_steps: int  # then this many steps under cProfile (its overhead kept apart)
  context_seqs: int  # sequences of the by-context rows
  contexts: tuple[int, ...]  # their prompt lengths


SIZES = {
    "full": Size(num_seqs=256, prompt_len=16, warmup_steps=20, measured_steps=40,
                 profiled_steps=5, context_seqs=64, contexts=(256, 4096)),
    "smoke": Size(num_seqs=8, prompt_len=8, warmup_steps=2, measured_steps=3,
                  profiled_steps=1, context_seqs=4, contexts=(48, 96)),
}


def _profile(engine: Engine, steps: int, num_seqs: int, top: int = 8) -> list[dict]:
  """cProfile over `steps` more decode steps: the functions with the most own time
  (microseconds per step per sequence, profiler overhead included)."""
  profiler = cProfile.Profile()
  profiler.enable()
  for _ in range(steps):
    engine.step()
  profiler.disable()
  stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, ..)
  rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
  per = steps * num_seqs
  return [{"function": f"{os.path.basename(file)}:{line}({name})", "calls_per_step":
           calls / steps, "own_us_per_seq_step": own / per * 1e6}
          for (file, line, name), (_, calls, own, _, _) in rows]


def _engine(num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
            seed: int, async_scheduling: bool = False) -> Engine:
  # 1 KiB per token (f32); room for every request's blocks plus the admission's spare
  # block per running request (blocks of up to 128 tokens).
  kv_gib = 1.1 * num_seqs * (max_model_len + 2 * 128) * 1024 / 2**30 + 0.01
  return Engine(EngineConfig(max_model_len=max_model_len, max_num_seqs=num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             device_kv_gib=kv_gib, host_pool_gib=0.01, seed=seed,
                             async_scheduling=async_scheduling))


FLUSH_BYTES = 64 * 2**20


def _flushing(collect):
  """`collect`, then a read of FLUSH_BYTES: the caches are cold for the postprocessing."""
  junk = np.ones(FLUSH_BYTES // 4, np.float32)

  def flushing_collect(handle):
    out = collect(handle)
    junk.sum()
    return out

  return flushing_collect


class _DeviceWait:
  """Wraps `ModelRunner.dispatch` so it returns only when the step is done: the host's
  work then never runs beside the device's (its time waiting is kept in `seconds`)."""

  def __init__(self, dispatch):
    self.dispatch = dispatch
    self.seconds: list[float] = []

  def __call__(self, *args, **kwargs):
    handle = self.dispatch(*args, **kwargs)
    start = time.perf_counter()
    jax.block_until_ready(handle.tokens)
    self.seconds.append(time.perf_counter() - start)
    return handle

  def take(self) -> float:
    total, self.seconds = sum(self.seconds), []
    return total


class _Stepper:
  """Steps one engine and keeps the timings of its decode steps once `num_seqs` requests
  decode together (after `warmup` of them). `flush`: the caches are flushed after every
  step (inside the wait); `isolate`: each dispatch waits for its step, so no host work
  overlaps the device's. Samples: (wall, wait, schedule, build_batch, host thread CPU)
  seconds of each measured step."""

  def __init__(self, engine: Engine, num_seqs: int, warmup: int, flush: bool = False,
               isolate: bool = False):
    self.engine, self.num_seqs, self.warmup = engine, num_seqs, warmup
    collect = engine.runner.collect
    if flush:
      collect = _flushing(collect)
    self.collect = engine.runner.collect = common.CallTimer(collect)
    self.device_wait = None
    if isolate:
      self.device_wait = engine.runner.dispatch = _DeviceWait(engine.runner.dispatch)
    self.build = engine.runner.build_batch = common.CallTimer(engine.runner.build_batch)
    self.schedule = engine.scheduler.schedule = common.CallTimer(engine.scheduler.schedule)
    self.samples: list[tuple[float, ...]] = []
    self.decode_steps = 0

  def step(self) -> None:
    engine = self.engine
    start, cpu_start = time.perf_counter(), time.thread_time()
    engine.step()
    wall = time.perf_counter() - start
    cpu = time.thread_time() - cpu_start
    running = engine.scheduler.running
    wait = self.collect.take() + (self.device_wait.take() if self.device_wait else 0.0)
    parts = (wait, self.schedule.take(), self.build.take(), cpu)
    if len(running) == self.num_seqs and all(not r.is_prefilling for r in running):
      self.decode_steps += 1
      if self.decode_steps > self.warmup:
        self.samples.append((wall, *parts))
    if not engine.has_unfinished_requests():
      raise ValueError(f"never {self.num_seqs} sequences decoding at once")

  def arrays(self) -> list[np.ndarray]:
    return [np.asarray(x) for x in zip(*self.samples)]


def _decode_steps(engine: Engine, num_seqs: int, warmup: int, measured: int,
                  isolate: bool = False) -> list[np.ndarray]:
  """Times `measured` decode steps of one engine (see _Stepper)."""
  stepper = _Stepper(engine, num_seqs, warmup, isolate=isolate)
  while len(stepper.samples) < measured:
    stepper.step()
  return stepper.arrays()


def _add(engine: Engine, prompts: list[list[int]], max_tokens: int) -> None:
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
  for prompt in prompts:
    engine.add_request(prompt_token_ids=prompt, sampling_params=params)


def _by_context(size: Size, seed: int) -> dict:
  """Host time per decode step of `context_seqs` sequences at each context length, as
  it runs and with the caches flushed alike: four engines stepped in turn (one step
  each), so the machine's slow and fast spells fall on every row alike."""
  rng = np.random.default_rng(seed)
  # More tokens than measured: the first request (prefilled alone) decodes while the
  # others prefill, and must still run when they all decode.
  steps = size.warmup_steps + size.measured_steps + 32
  steppers = {}
  for context in size.contexts:
    for flush in (False, True):
      # The context grows to `context` tokens (the default model's longest is 4,096).
      engine = _engine(size.context_seqs, context, 2048, seed)
      vocab = engine.model_config.vocab_size
      shared = rng.integers(3, vocab, context - steps - 1).tolist()
      prompts = [shared + [int(t)] for t in rng.integers(3, vocab, size.context_seqs)]
      _add(engine, prompts[:1], steps)
      while engine.requests[next(iter(engine.requests))].is_prefilling:
        engine.step()  # the first prompt fills the prefix cache; the others hit it
      _add(engine, prompts[1:], steps)
      steppers[context, flush] = _Stepper(engine, size.context_seqs, size.warmup_steps,
                                          flush=flush, isolate=True)
  while any(len(s.samples) < size.measured_steps for s in steppers.values()):
    for stepper in steppers.values():
      if len(stepper.samples) < size.measured_steps:
        stepper.step()
  rows = {}
  for context in size.contexts:
    wall, wait, _, _, cpu = steppers[context, False].arrays()
    cold_wall, cold_wait, *_ = steppers[context, True].arrays()
    host = float(np.median(wall - wait)) * 1e6
    rows[str(context)] = {
        "host_us_per_step": host, "host_us_per_seq_step": host / size.context_seqs,
        "host_cpu_us_per_step": float(np.median(cpu)) * 1e6,
        "host_us_per_step_cold": float(np.median(cold_wall - cold_wait)) * 1e6,
        "step_ms": float(np.median(wall)) * 1e3}
  short, long = (rows[str(c)] for c in (min(size.contexts), max(size.contexts)))
  return {"rows": rows, "num_seqs": size.context_seqs,
          "host_ratio_long_vs_short": long["host_us_per_step_cold"]
          / short["host_us_per_step_cold"],
          "host_ratio_long_vs_short_warm": long["host_us_per_step"] / short["host_us_per_step"],
          "goal_ratio": 1.2, "flush_bytes": FLUSH_BYTES}


def _short_prompts(size: Size, seed: int, async_scheduling: bool):
  max_tokens = size.warmup_steps + size.measured_steps + size.profiled_steps + 2
  engine = _engine(size.num_seqs, size.prompt_len + max_tokens,
                   size.num_seqs * size.prompt_len, seed, async_scheduling)
  rng = np.random.default_rng(seed)
  vocab = engine.model_config.vocab_size
  _add(engine, [rng.integers(3, vocab, size.prompt_len).tolist()
                for _ in range(size.num_seqs)], max_tokens)
  return engine, _decode_steps(engine, size.num_seqs, size.warmup_steps,
                               size.measured_steps, isolate=not async_scheduling)


def run(size_name: str = "full", seed: int = 0) -> dict:
  size = SIZES[size_name]
  _, (a_wall, a_wait, *_) = _short_prompts(size, seed, async_scheduling=True)
  engine, (wall, wait, sched, build_s, cpu) = _short_prompts(size, seed,
                                                            async_scheduling=False)
  profile = _profile(engine, size.profiled_steps, size.num_seqs)
  host = wall - wait
  n = size.num_seqs

  def us(seconds):  # median over the measured steps, per sequence, in microseconds
    return float(np.median(seconds)) / n * 1e6

  return {
      "host_us_per_seq_step": us(host), "goal_host_us_per_seq_step": 20.0,
      "split_us_per_seq_step": {"schedule": us(sched), "build_batch": us(build_s),
                                "rest (block moves, dispatch, postprocess, metrics)":
                                    us(host - sched - build_s)},
      "wait_us_per_seq_step": us(wait), "host_cpu_us_per_seq_step": us(cpu),
      "step_ms": float(np.median(wall)) * 1e3,
      "async_step_ms": float(np.median(a_wall)) * 1e3,
      "async_host_us_per_seq_step": us(a_wall - a_wait),
      "host_fraction_of_step": float(np.median(host / wall)), "running_seqs": n,
      "measured_steps": len(wall), "config": dataclasses.asdict(size),
      "profile": profile, "by_context": _by_context(size, seed),
      "model": "hisparse-tiny (default)", "block_size": engine.config.block_size}


def format_table(result: dict) -> str:
  rows = [(k, v) for k, v in result["split_us_per_seq_step"].items()]
  rows += [("host total", result["host_us_per_seq_step"]),
           ("(host thread CPU time)", result["host_cpu_us_per_seq_step"]),
           ("waiting for the device", result["wait_us_per_seq_step"])]
  profile = common.format_table(
      ["cProfile: most own time", "calls/step", "us/seq/step"],
      [(p["function"], p["calls_per_step"], p["own_us_per_seq_step"]) for p in result["profile"]])
  ctx = result["by_context"]
  by_context = common.format_table(
      [f"context ({ctx['num_seqs']} sequences)", "host us/step", "host us/seq/step",
       "host thread CPU us/step", "host us/step, cold caches", "step ms"],
      [(k, r["host_us_per_step"], r["host_us_per_seq_step"], r["host_cpu_us_per_step"],
        r["host_us_per_step_cold"], r["step_ms"]) for k, r in ctx["rows"].items()])
  return (common.format_table(["per decode step, per sequence", "us"], rows)
          + f"\n{result['running_seqs']} running sequences, step {result['step_ms']:.2f} ms "
          f"one at a time, host {100 * result['host_fraction_of_step']:.0f}% of it; with async "
          f"scheduling {result['async_step_ms']:.2f} ms, host "
          f"{result['async_host_us_per_seq_step']:.1f} us/seq overlapping the device\n"
          f"{profile}\n{by_context}\n"
          f"host time per step, longest vs shortest context: "
          f"{ctx['host_ratio_long_vs_short']:.2f}x with the caches flushed alike (goal <= "
          f"{ctx['goal_ratio']}), {ctx['host_ratio_long_vs_short_warm']:.2f}x as it runs")

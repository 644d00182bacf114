"""Suite `scheduler_overhead`: host microseconds per decode step per sequence.

An engine on the default model with `num_seqs` (256) requests of short prompts, all
running and decoding. Per engine step, wall time minus the time inside
`ModelRunner.execute` (the jitted step: dispatch, device work, the token sync) is the
host side: schedule, block bookkeeping, build_batch, postprocess, metrics. The runner's
`execute`, the scheduler's `schedule` and the runner's `build_batch` are wrapped on the
instance with a timer (the engine is not modified). JSON `host_us_per_seq_step` =
median host time of a decode step / running sequences, plus the split, and a cProfile of
a few more steps (`profile`: the functions with the most own time) naming what dominates.
"""

from __future__ import annotations

import cProfile
import dataclasses
import os
import pstats
import time

import numpy as np

from hisparse_jax.bench import common
from hisparse_jax.engine import Engine, EngineConfig
from hisparse_jax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Size:
  num_seqs: int
  prompt_len: int
  warmup_steps: int  # decode steps not measured (compiles of growing block-table widths)
  measured_steps: int
  profiled_steps: int  # then this many steps under cProfile (its overhead kept apart)


SIZES = {
    "full": Size(num_seqs=256, prompt_len=16, warmup_steps=20, measured_steps=40,
                 profiled_steps=5),
    "smoke": Size(num_seqs=8, prompt_len=8, warmup_steps=2, measured_steps=3,
                  profiled_steps=1),
}


def _profile(engine: Engine, size: Size, top: int = 8) -> list[dict]:
  """cProfile over `profiled_steps` more decode steps: the functions with the most own
  time (microseconds per step per sequence, profiler overhead included)."""
  profiler = cProfile.Profile()
  profiler.enable()
  for _ in range(size.profiled_steps):
    engine.step()
  profiler.disable()
  stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, ..)
  rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
  per = size.profiled_steps * size.num_seqs
  return [{"function": f"{os.path.basename(file)}:{line}({name})", "calls_per_step":
           calls / size.profiled_steps, "own_us_per_seq_step": own / per * 1e6}
          for (file, line, name), (_, calls, own, _, _) in rows]


def run(size_name: str = "full", seed: int = 0) -> dict:
  size = SIZES[size_name]
  max_tokens = size.warmup_steps + size.measured_steps + size.profiled_steps + 2
  max_model_len = size.prompt_len + max_tokens
  engine = Engine(EngineConfig(max_model_len=max_model_len, max_num_seqs=size.num_seqs,
                               max_num_batched_tokens=size.num_seqs * size.prompt_len,
                               device_kv_gib=0.125, host_pool_gib=0.01, seed=seed))
  execute = engine.runner.execute = common.CallTimer(engine.runner.execute)
  build = engine.runner.build_batch = common.CallTimer(engine.runner.build_batch)
  schedule = engine.scheduler.schedule = common.CallTimer(engine.scheduler.schedule)
  rng = np.random.default_rng(seed)
  params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  for _ in range(size.num_seqs):
    engine.add_request(prompt_token_ids=rng.integers(3, engine.model_config.vocab_size,
                                                     size.prompt_len).tolist(),
                       sampling_params=params)
  samples = []
  decode_steps = 0
  while decode_steps < size.warmup_steps + size.measured_steps:
    start = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - start
    running = len(engine.scheduler.running)
    in_decode = all(not r.is_prefilling for r in engine.scheduler.running)
    parts = (execute.take(), schedule.take(), build.take())
    if running == size.num_seqs and in_decode:
      decode_steps += 1
      if decode_steps > size.warmup_steps:
        samples.append((wall, *parts))
  if not samples:
    raise ValueError(f"never {size.num_seqs} sequences decoding at once")
  profile = _profile(engine, size)
  wall, exe, sched, build_s = (np.asarray(x) for x in zip(*samples))
  host = wall - exe
  n = size.num_seqs

  def us(seconds):  # median over the measured steps, per sequence, in microseconds
    return float(np.median(seconds)) / n * 1e6

  return {
      "host_us_per_seq_step": us(host),
      "split_us_per_seq_step": {"schedule": us(sched), "build_batch": us(build_s),
                                "rest (block moves, postprocess, metrics)":
                                    us(host - sched - build_s)},
      "execute_us_per_seq_step": us(exe), "step_ms": float(np.median(wall)) * 1e3,
      "host_fraction_of_step": float(np.median(host / wall)), "running_seqs": n,
      "measured_steps": len(samples), "config": dataclasses.asdict(size),
      "profile": profile,
      "model": "hisparse-tiny (default)"}


def format_table(result: dict) -> str:
  rows = [(k, v) for k, v in result["split_us_per_seq_step"].items()]
  rows += [("host total", result["host_us_per_seq_step"]),
           ("execute (jitted step)", result["execute_us_per_seq_step"])]
  profile = common.format_table(
      ["cProfile: most own time", "calls/step", "us/seq/step"],
      [(p["function"], p["calls_per_step"], p["own_us_per_seq_step"]) for p in result["profile"]])
  return (common.format_table(["per decode step, per sequence", "us"], rows)
          + f"\n{result['running_seqs']} running sequences, step {result['step_ms']:.2f} ms, "
          f"host {100 * result['host_fraction_of_step']:.0f}% of it\n{profile}")

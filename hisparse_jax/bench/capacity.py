"""Suite `capacity_concurrency`: at one device KV budget, how many long requests run at once.

Two engines over the default model, the same device budget (`device_requests` requests
of prompt + output tokens), the same host pool and the same workload of `num_requests`
requests of `prompt_len` random tokens:

    device-only   EngineConfig(hisparse=None)      every running request's KV on the device
    HiSparse      EngineConfig(hisparse=HiSparseConfig(top_k_tokens=...))
                  a long request keeps its KV in the host pool; the device holds its
                  hot buffer and newest blocks, so more requests can run at once

Each engine first runs a warm-up workload of the same shape (other random prompts, so
the prefix cache does not help the timed runs) to compile its step programs. Then
`reps` rounds, each on fresh random prompts that both engines run, in an order that
alternates between rounds (side by side, as every ratio of the benches); each engine's
figures are those of its median round. Per step of a run,
`len(engine.scheduler.running)` is the concurrency. JSON: `concurrency_ratio` =
HiSparse / device-only of the most requests running in one step, `throughput_ratio` =
HiSparse / device-only of generated tokens per second over the whole run,
`decode_throughput_ratio` = the same over decode-only steps (prefill excluded, as
hisparse_throughput's decode tokens/s), and `throughput_ratio_bound` = the whole-run
ratio if HiSparse's decode-only steps cost nothing (device-only's seconds over
HiSparse's `prefill_s`): the prompt tokens are the same work in both engines, so the
share of the run they take caps what more requests at once can buy.

Two workloads, each at its own device budget of `device_requests` whole requests: the
top level is the prefill-heavy one (`max_tokens` new tokens a request: 2,048 + 32 in
`full`, where the prompts take most of the run and `throughput_ratio_bound` caps the
ratio), and `decode_heavy` the same prompts with `decode_max_tokens` new tokens (2,048 +
256), the shape where KV capacity binds: decode steps, which more requests at once make
cheaper per token, take most of the run. The goal (`goal`, `goal_met`) is judged there.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from hisparse_jax.bench import common
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import RequestOutputKind, SamplingParams
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec
from hisparse_jax.sparse.config import HiSparseConfig

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Size:
  prompt_len: int
  max_tokens: int
  num_requests: int
  device_requests: int  # the device budget holds this many whole requests
  top_k_tokens: int
  sink_tokens: int
  local_tokens: int
  block_size: int
  max_num_batched_tokens: int
  warmup: bool = True  # run the workload once untimed first (compiles); off in smoke runs
  reps: int = 3  # timed rounds; each runs both engines on the same fresh prompts
  decode_max_tokens: int = 0  # new tokens a request in the `decode_heavy` workload


SIZES = {
    "full": Size(prompt_len=2048, max_tokens=32, num_requests=16, device_requests=4,
                 top_k_tokens=256, sink_tokens=16, local_tokens=64, block_size=16,
                 max_num_batched_tokens=2048, decode_max_tokens=256),
    "smoke": Size(prompt_len=48, max_tokens=2, num_requests=3, device_requests=2,
                  top_k_tokens=16, sink_tokens=8, local_tokens=8, block_size=8,
                  max_num_batched_tokens=64, warmup=False, reps=1, decode_max_tokens=6),
}


def _workload(engine: Engine, prompts: np.ndarray, max_tokens: int) -> dict:
  """Runs the prompts to completion; per-step concurrency, generated tokens/s, and the
  decode-only steps' share (peer_worker's rule: a `step()` call whose engine step and the
  one before it scheduled no prompt token) and their seconds in steps with prompt tokens
  (`prefill_s`: the part of the run neither engine's concurrency can shorten)."""
  params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)
  start = time.perf_counter()
  for prompt in prompts:
    engine.add_request(prompt_token_ids=prompt.tolist(), sampling_params=params)
  running, generated, previous = [], 0, None
  decode_s, decode_tokens = 0.0, 0
  while engine.has_unfinished_requests():
    before = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - before
    new = sum(len(o.outputs[0].token_ids) for o in outputs)
    running.append(len(engine.scheduler.running))
    generated += new
    prefill = engine.last_step_prefill_tokens
    if prefill == 0 and previous == 0:
      decode_s += seconds
      decode_tokens += new
    previous = prefill
  seconds = time.perf_counter() - start
  return {"steps": len(running), "max_running": max(running),
          "mean_running": float(np.mean(running)), "generated_tokens": generated,
          "seconds": seconds, "tokens_per_s": generated / seconds,
          "decode_s": decode_s, "decode_tokens": decode_tokens,
          "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
          "prefill_s": seconds - decode_s}


def _ordinary_tokens(engine: Engine) -> np.ndarray:
  """Token ids that are neither special nor padding (random prompts draw from these)."""
  config = engine.model_config
  special = {config.bos_token_id, config.pad_token_id, *engine.eos_token_ids} - {None}
  return np.asarray([t for t in range(config.vocab_size) if t not in special])


def _engine_runs(configs: dict[str, EngineConfig], size: Size, rng: np.random.Generator
                 ) -> dict[str, dict]:
  """Each engine's median round (by seconds) of `size.reps` alternated rounds."""
  engines = {name: Engine(config) for name, config in configs.items()}
  ordinary = _ordinary_tokens(next(iter(engines.values())))

  def prompts():
    return rng.choice(ordinary, (size.num_requests, size.prompt_len))

  if size.warmup:
    for engine in engines.values():
      _workload(engine, prompts(), size.max_tokens)  # compiles the step programs
  names = list(engines)
  rounds: dict[str, list[dict]] = {name: [] for name in names}
  for r in range(size.reps):
    round_prompts = prompts()
    for name in names[r % len(names):] + names[:r % len(names)]:
      rounds[name].append(_workload(engines[name], round_prompts, size.max_tokens))
  out = {}
  for name, engine in engines.items():
    by_time = sorted(rounds[name], key=lambda x: x["seconds"])
    result = dict(by_time[len(by_time) // 2])
    result["seconds_by_round"] = [x["seconds"] for x in rounds[name]]
    result["device_blocks"] = engine.device_pool.num_blocks
    result["host_blocks"] = engine.host_pool.num_blocks
    # The engine's own account of where the runs' blocks came from and went.
    result["metrics"] = {k: v for k, v in engine.metrics().items()
                         if any(w in k for w in ("preempt", "transfer_blocks", "selected"))}
    out[name] = result
  return out


GOAL_THROUGHPUT_RATIO = 1.3  # HiSparse / device-only whole-run tokens/s, decode-heavy


def run(size_name: str = "full", seed: int = 0) -> dict:
  """The prefill-heavy workload's figures, with the decode-heavy one's as `decode_heavy`."""
  size = SIZES[size_name]
  result = _measure(size, seed)
  heavy = _measure(dataclasses.replace(size, max_tokens=size.decode_max_tokens), seed + 1)
  result["decode_heavy"] = heavy
  result["goal"] = (f"decode_heavy throughput_ratio >= {GOAL_THROUGHPUT_RATIO} (HiSparse / "
                    "device-only tokens/s over the whole run)")
  result["goal_met"] = heavy["throughput_ratio"] >= GOAL_THROUGHPUT_RATIO
  return result


def _measure(size: Size, seed: int) -> dict:
  """Both engines on one workload (`size.max_tokens` new tokens a request)."""
  from models.loader import load_config  # heavy import, on use

  model_config = load_config(None)
  spec = KVCacheSpec.from_model_config(model_config, "float32", size.block_size)
  max_model_len = size.prompt_len + size.max_tokens
  blocks_per_request = -(-max_model_len // size.block_size)
  # +1: the null block; +0.5 block so the float budget never rounds a block away. With
  # HiSparse the indexer's key bounds and hot-buffer state come out of this same budget.
  device_kv_gib = (size.device_requests * blocks_per_request + 1.5) * spec.bytes_per_block / GIB
  # The host pool holds every request once, with a quarter to spare: its key bounds live
  # on the device, so a bigger pool would only take device budget away from HiSparse.
  host_pool_gib = 1.25 * size.num_requests * blocks_per_request * spec.bytes_per_block / GIB
  hisparse = HiSparseConfig(top_k_tokens=size.top_k_tokens, sink_tokens=size.sink_tokens,
                            local_tokens=size.local_tokens)
  base = dict(block_size=size.block_size, device_kv_gib=device_kv_gib,
              host_pool_gib=host_pool_gib, max_model_len=max_model_len,
              max_num_seqs=size.num_requests,
              max_num_batched_tokens=size.max_num_batched_tokens, seed=seed)
  rng = np.random.default_rng(seed)
  runs = _engine_runs({"device_only": EngineConfig(**base),
                       "hisparse_host_pool": EngineConfig(**base, hisparse=hisparse)},
                      size, rng)
  dense, sparse = runs["device_only"], runs["hisparse_host_pool"]
  return {
      "concurrency_ratio": sparse["max_running"] / dense["max_running"],
      "mean_concurrency_ratio": sparse["mean_running"] / dense["mean_running"],
      "throughput_ratio": sparse["tokens_per_s"] / dense["tokens_per_s"],
      # Prefill excluded (hisparse_throughput's figure): what the concurrency buys.
      "decode_throughput_ratio": (sparse["decode_tokens_per_s"] / dense["decode_tokens_per_s"]
                                  if dense["decode_tokens_per_s"] else 0.0),
      # Amdahl: the whole-run ratio HiSparse would reach if its decode-only steps took no
      # time at all (the device-only run's seconds over HiSparse's seconds outside them).
      "throughput_ratio_bound": dense["seconds"] / sparse["prefill_s"],
      "device_kv_gib": device_kv_gib, "host_pool_gib": host_pool_gib,
      "config": dataclasses.asdict(size),
      "hisparse": dataclasses.asdict(hisparse), "model": "hisparse-tiny (default)",
      "device_only": dense, "hisparse_host_pool": sparse}


def format_table(result: dict) -> str:
  text = _format_workload(result)
  if "decode_heavy" in result:  # (older JSONs lack it)
    text += ("\ndecode-heavy workload (the goal's):\n" + _format_workload(result["decode_heavy"])
             + f"\ngoal: {result['goal']}; met: {result['goal_met']}")
  return text


def _format_workload(result: dict) -> str:
  runs = (("device-only", result["device_only"]),
          ("HiSparse + host pool", result["hisparse_host_pool"]))
  decode = "decode_tokens_per_s" in result["device_only"]  # (older JSONs lack it)
  rows = [(name, r["max_running"], r["mean_running"], r["steps"], r["generated_tokens"],
           r["seconds"], r["tokens_per_s"],
           *((r["prefill_s"], r["decode_tokens_per_s"]) if decode else ()))
          for name, r in runs]
  c = result["config"]
  text = (common.format_table(["engine", "max running", "mean running", "steps", "tokens",
                               "s", "tokens/s",
                               *(("s with prefill", "decode tokens/s") if decode else ())],
                              rows)
          + f"\n{c['num_requests']} requests of {c['prompt_len']} + {c['max_tokens']} tokens, "
          f"device budget {result['device_kv_gib'] * 1024:.2f} MiB ({c['device_requests']} "
          f"requests); concurrency_ratio {result['concurrency_ratio']:.2f}, throughput_ratio "
          f"{result['throughput_ratio']:.2f}")
  if decode:
    text += (f", decode_throughput_ratio {result['decode_throughput_ratio']:.2f}, "
             f"throughput_ratio_bound {result['throughput_ratio_bound']:.2f} (HiSparse's "
             f"decode-only steps free)")
  return text

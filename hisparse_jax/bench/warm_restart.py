"""Suite `warm_restart` (#53): the first request after a `hisparse-jax serve` restart that
the disk KV tier serves, against the same request on the warmed server.

Real `serve` processes (bench/serve_load.ServerProcess), all on one --disk_cache_dir and
one --compilation_cache_dir:

    writer     serve --nowarmup: computes and stores `num_prompts` prompts of
               `prompt_tokens` random token ids (write-through), then SIGTERM
    restarts   a new serve on the same directories, each one of:
                 nowarmup_first  --nowarmup, the compilation cache holding only what the
                                 writer compiled (its first requests compile the rest)
                 warmup_first    the warm-up on (engine/warmup.py), its programs not all
                                 in the cache yet (the first start of the new server)
                 nowarmup        --nowarmup, every program in the cache (the server
                                 before the warm-up, restarted)
                 warmup          the warm-up, every program in the cache (what each
                                 later restart costs)
               in the order of Size.restarts (the last two alternate, 3 times each)

Each restart is timed to "serving on" (process start, model load, warm-up), then serves
prompt 0 (its FIRST request: the disk-tier hit a restart's first user meets), then the
prompts in rotation (1, 2, 0, 1, 2, 0, ...): the pools hold about one prompt and a
third, so each request evicts the prompt served two before it and every request is a
disk-tier hit again (checked: the tier's loaded blocks grow by the prompt's full blocks
each time; the block files are dropped from the page cache before each request, as
third_tier does). Last, two fresh prompts nobody stored: the second one's time is the
recompute time on the warmed server (the first may compile a prefill shape).

Each request streams `new_tokens` greedy tokens: TTFT and the whole request's seconds.
Per condition, over its restarts: ratio = the median first request / the median of
prompt 0's repeats on the same servers (goal <= 1.3 with the warm-up); the texts of
every hit are compared with the writer's. After the warm-up, before any request, the
server's /metrics must show no block owned, no request, no prefix-cache lookup, no
transfer and no tier load (the warm-up changes none).

`size`: full (smollm2-135m-instruct, ~4,000-token prompts, block 128), smoke
(hisparse-tiny, 200-token prompts, block 16, the writer and one warm-up restart; for
tests/hisparse_jax/entrypoints/test_serve_warmup.py).
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
RESTARTS = ("nowarmup_first", "warmup_first", *(("nowarmup", "warmup") * 3))


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
  rounds: int = 3  # rotations after the first request (prompt 0 repeated `rounds` times)

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
                  restarts=("warmup_first",), rounds=1),
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
             for _ in range(size.num_prompts + 2 * len(size.restarts))]
  stored, fresh = prompts[:size.num_prompts], prompts[size.num_prompts:]
  try:
    start = time.perf_counter()
    writer = ServerProcess(*flags, "--nowarmup", start_timeout_s=1800)
    writer_start_s = time.perf_counter() - start
    try:
      written = [_request(writer.url, p, size.new_tokens) for p in stored]
    finally:
      writer.stop()
    restarts = [_restart(size, flags, name, stored, fresh[2 * i:2 * i + 2], written, disk)
                for i, name in enumerate(size.restarts)]
  finally:
    shutil.rmtree(work, ignore_errors=True)
  return {"size": size_name, "model": size.label, "prompt_tokens": size.prompt_tokens,
          "block_size": size.block_size, "pool_blocks": size.pool_blocks,
          "new_tokens": size.new_tokens, "server_flags": size.engine_flags(),
          "writer_start_s": writer_start_s,
          "writer_ttft_s": [w["ttft_s"] for w in written],
          "summary": _summary(restarts), "restarts": restarts}


def _summary(restarts: list[dict]) -> dict:
  """Per condition, over its restarts: medians of the first request, of prompt 0's
  repeats, their ratios; time to serving on, the warm-up, the recompute."""
  out = {}
  for name in dict.fromkeys(r["name"] for r in restarts):
    rs = [r for r in restarts if r["name"] == name]
    s = {"restarts": len(rs)}
    for k in ("ttft_s", "total_s"):
      first = common.median([r[f"first_{k}"] for r in rs])
      repeat = common.median([x for r in rs for x in r[f"repeat_{k}"]])
      s.update({f"first_{k}": first, f"repeat_{k}": repeat,
                f"ratio_{k.split('_')[0]}": first / repeat})
    for k in ("start_to_serving_s", "warmup_seconds", "recompute_ttft_s"):
      values = [r[k] for r in rs if r[k] is not None]
      s[k] = common.median(values) if values else None
    s["all_disk_hits"] = all(r["all_disk_hits"] for r in rs)
    s["same_text"] = all(r["same_text"] for r in rs)
    out[name] = s
  return out


def _restart(size: Size, flags: list[str], name: str, stored, fresh, written, disk) -> dict:
  """One restart: time to "serving on", /metrics after the warm-up, the first hit, the
  rotation's hits, two recomputes."""
  extra = ["--nowarmup"] if name.startswith("nowarmup") else []
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
    recomputes = [_request(server.url, p, size.new_tokens) for p in fresh]
  finally:
    rc = server.stop()
  first, repeats = hits[0], [h for h in hits[1:] if h["prompt"] == 0]
  return {
      "name": name, "start_to_serving_s": start_s, "warmup_log": warm_line,
      "warmup_seconds": _warm_field(warm_line, r"in ([\d.]+) s"),
      "warmup_programs": _warm_field(warm_line, r"warm-up: (\d+) programs"),
      "metrics_after_warmup": before, "exit_code": rc,
      "first_ttft_s": first["ttft_s"], "first_total_s": first["total_s"],
      "repeat_ttft_s": [h["ttft_s"] for h in repeats],
      "repeat_total_s": [h["total_s"] for h in repeats],
      "recompute_ttft_s": recomputes[-1]["ttft_s"],
      "recompute_first_ttft_s": recomputes[0]["ttft_s"],
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
  for name, r in result["summary"].items():
    rows.append([name, r["restarts"], r["start_to_serving_s"], r["warmup_seconds"] or "-",
                 r["first_ttft_s"], r["repeat_ttft_s"], r["ratio_ttft"], r["first_total_s"],
                 r["repeat_total_s"], r["ratio_total"], r["recompute_ttft_s"],
                 "yes" if r["all_disk_hits"] and r["same_text"] else "NO"])
  return (f"{result['model']}, {result['prompt_tokens']}-token prompts from the disk tier "
          f"after a serve restart (block {result['block_size']}, {result['new_tokens']} new "
          "tokens; medians over the restarts):\n" + common.format_table(
              ["restart", "n", "to serving s", "warm-up s", "1st TTFT s", "warm TTFT s", "x",
               "1st total s", "warm total s", "x", "recompute s", "disk hits, same"],
              rows))

"""Suite `hisparse_throughput`: what HiSparse's host pool buys in tokens per second.

One device KV budget, three engines on the real model (SmolLM2-135M-Instruct, converted
to a float32 HF directory once per run, as `engine_vs_vllm` does), each in its own
process (`peer_worker.py`), greedy, `ignore_eos`, prefix caching off:

    device-only   this engine, device_kv_gib = KV_GIB, no HiSparse: requests that do not
                  fit wait (or are preempted)
    HiSparse      the same device budget + a host pool holding every request, top-k
                  TOP_K_TOKENS (other settings at their defaults): long requests decode
                  from their hot buffers while their KV lives in the pinned_host pool
    vLLM          vLLM's CPU build with the same KV bytes (VLLM_CPU_KVCACHE_SPACE = KV_GIB;
                  its own defaults otherwise)

KV_GIB = 1 holds 23,301 tokens of SmolLM2's KV (46,080 bytes per token in float32): about
7 requests of the workload's mean length. The workload has `num_requests` (24: ~3.4x
that) requests of 2,000-3,900 prompt tokens (seeded English prose,
engine_vs_vllm.make_text_prompts' sentences; lengths drawn uniformly).

Decode tokens/s excludes prefill by timing the steps that only decode: the tokens of the
`step()` calls whose engine step (and the step before it) scheduled no prompt token, over
those calls' wall time (`peer_worker.py`: each engine reports what it scheduled). Not by
differencing two output lengths: with requests queued for device KV, a longer output
changes how prefills and decodes share steps, and the difference then measured scheduling,
not decoding (the first run here gave HiSparse 858 "decode" tokens/s against 99 for
device-only). Every engine first runs the call once to compile and warm up (untimed).
Also per engine: end-to-end tokens/s (prompt + generated tokens over the call's wall time),
TTFT and ITL p50/p99, the share of the wall time in decode-only steps, and (this engine)
the most requests one step ran.

Concurrency sweep: c = 1, 2, 4, 8, 16, 32 requests of SWEEP_PROMPT_LEN tokens at once,
device-only against HiSparse (same budgets), decode tokens/s the same way (each level
warmed up by the same call: a shorter warm-up can leave the step shapes of the longer
contexts to compile inside the timed call). At c <= 8 the requests fit the device budget,
so HiSparse's cost over dense shows; past it, device-only queues. Side by side: both
engines' workers stay up through the sweep and take turns at each level, `sweep_rounds`
timed calls each at c <= SWEEP_ROUNDS_MAX_C (the order flips every round; a level's
figures are its median round, every round's decode tokens/s kept) and one above it, where
a call prefills 16-32 prompts and the ratio is far from 1. (One engine's whole sweep after
the other's left the ratio to the VM's drift between them: the same tree measured 0.66x
and 0.99x at c = 2 in two runs.)

Nothing is asserted on speed. The suite fails if device-only's greedy tokens differ from
vLLM's (as engine_vs_vllm checks); HiSparse's are not compared (sparse attention may
change a token: its accuracy is the passkey suite's).
Smoke size: a tiny random GGUF through the same conversion, our two engines only.

Long sizes (`--bench_size=long`, `long_6k`; throughput_long.py): HiSparse's admission by
offload against device-only and against admission "wait", 8 passkey prompts at ~2k, ~6k
and the model's longest context, one device budget of 3 requests (issue #53).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import numpy as np

from hisparse_jax.bench import common, throughput_long
from hisparse_jax.bench import engine_vs_vllm as evv

KV_GIB = 1
SWEEP_ROUNDS_MAX_C = 8  # sweep levels timed `sweep_rounds` times (the others once)


@dataclasses.dataclass(frozen=True)
class Size:
  model: str
  num_requests: int
  prompt_lens: tuple[int, int]  # uniform in [low, high]
  short_tokens: int
  long_tokens: int
  top_k_tokens: int
  host_pool_gib: float
  max_model_len: int
  sweep: tuple[int, ...]
  sweep_prompt_len: int
  with_vllm: bool
  kv_gib: float = KV_GIB
  sweep_rounds: int = 3  # timed calls per engine at c <= SWEEP_ROUNDS_MAX_C


SIZES = {
    "full": Size(model=evv.REAL_MODEL, num_requests=24, prompt_lens=(2000, 3900),
                 short_tokens=16, long_tokens=80, top_k_tokens=512, host_pool_gib=5.0,
                 max_model_len=4096, sweep=(1, 2, 4, 8, 16, 32), sweep_prompt_len=2000,
                 with_vllm=True),
    # The tiny GGUF's KV is 512 bytes per token: a 1/1024 GiB budget holds 2,048 tokens.
    # The concurrency sweep alone (device-only and HiSparse, no workload, no vLLM row).
    "sweep": Size(model=evv.REAL_MODEL, num_requests=0, prompt_lens=(2000, 3900),
                  short_tokens=16, long_tokens=80, top_k_tokens=512, host_pool_gib=5.0,
                  max_model_len=4096, sweep=(1, 2, 4, 8, 16, 32), sweep_prompt_len=2000,
                  with_vllm=False),
    # The workload rows only (device-only, HiSparse, vLLM; no sweep): full's first half.
    "workload": Size(model=evv.REAL_MODEL, num_requests=24, prompt_lens=(2000, 3900),
                     short_tokens=16, long_tokens=80, top_k_tokens=512, host_pool_gib=5.0,
                     max_model_len=4096, sweep=(), sweep_prompt_len=2000, with_vllm=True),
    "smoke": Size(model=evv.SMOKE_GGUF, num_requests=4, prompt_lens=(300, 500),
                  short_tokens=2, long_tokens=6, top_k_tokens=64, host_pool_gib=0.01,
                  max_model_len=512, sweep=(1, 2), sweep_prompt_len=300, with_vllm=False,
                  kv_gib=1 / 1024, sweep_rounds=2),
    # Admission by offload at long prompts (throughput_long.py): long, long_6k, long_smoke.
    **throughput_long.SIZES,
}


def _prompts(size: Size, seed: int, tokenizer, count: int, lens: tuple[int, int]
             ) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  out = []
  for i, n in enumerate(rng.integers(lens[0], lens[1] + 1, size=count)):
    w = evv.Workload(1, int(n), size.long_tokens, size.model)
    out.append(evv.make_text_prompts(w, seed * 1000 + i, tokenizer)[0])
  return out


def _pct(xs: list[float], q: float) -> float:
  return 1e3 * float(np.percentile(xs, q)) if xs else float("nan")


def _measure(worker, prompts: list[list[int]], size: Size, warm: str | None) -> dict:
  """Warm-up (`warm`: "long" or "short" output; None: none), then the timed call (long
  output)."""
  if warm is not None:
    worker.generate(prompts, size.long_tokens if warm == "long" else size.short_tokens)
  long = worker.generate(prompts, size.long_tokens)
  n = len(prompts)
  prompt_tokens = sum(len(p) for p in prompts)
  return {
      "decode_tokens_per_s": long["decode_tokens"] / long["decode_s"] if long["decode_s"]
      else float("nan"),
      "decode_steps": long["decode_steps"], "decode_tokens": long["decode_tokens"],
      "decode_share": long["decode_s"] / long["seconds"],
      "e2e_tokens_per_s": (prompt_tokens + n * size.long_tokens) / long["seconds"],
      "generated_tokens_per_s": n * size.long_tokens / long["seconds"],
      "seconds": long["seconds"],
      "ttft_p50_ms": _pct(long["ttft_s"], 50), "ttft_p99_ms": _pct(long["ttft_s"], 99),
      "itl_p50_ms": _pct(long["itl_s"], 50), "itl_p99_ms": _pct(long["itl_s"], 99),
      "max_running": long.get("max_running"), "cpu_s": long["cpu_s"],
      "token_ids": long["token_ids"]}


def _sweep(workers: dict, size: Size, tokenizer, seed: int) -> dict[str, dict[int, dict]]:
  """Each level's figures per engine: the engines take turns (warm-up, then the timed
  calls), the first one first where level index + round is even; a level's figures are those
  of its median timed call, with every call's decode tokens/s."""
  names = list(workers)
  out = {name: {} for name in names}
  for i, c in enumerate(size.sweep):
    p = _prompts(size, seed + 7, tokenizer, c, (size.sweep_prompt_len,) * 2)
    rounds = size.sweep_rounds if c <= SWEEP_ROUNDS_MAX_C else 1
    calls = {name: [] for name in names}
    for r in range(rounds):
      for name in (names if (i + r) % 2 == 0 else names[::-1]):
        calls[name].append(_measure(workers[name], p, size, "long" if r == 0 else None))
    for name in names:
      ranked = sorted(calls[name], key=lambda m: m["decode_tokens_per_s"])
      level = ranked[(len(ranked) - 1) // 2]
      level.pop("token_ids")
      level["rounds_decode_tokens_per_s"] = [m["decode_tokens_per_s"] for m in calls[name]]
      out[name][c] = level
      print(f"hisparse_throughput {name} sweep c={c}: decode "
            f"{level['decode_tokens_per_s']:.1f} tok/s (calls: "
            f"{', '.join(f'{x:.1f}' for x in level['rounds_decode_tokens_per_s'])})",
            file=sys.stderr, flush=True)
  return out


def run(size_name: str = "full", seed: int = 0) -> dict:
  from models import loader

  if size_name in throughput_long.SIZES:
    return throughput_long.run(size_name)
  size = SIZES[size_name]
  if size.with_vllm and not os.path.exists(evv.peer_python()):  # before an hour of rows
    raise ValueError(f"hisparse_throughput: no interpreter at {evv.peer_python()} for the "
                     "vLLM row; run `make peers` (or set HISPARSE_VLLM_PYTHON)")
  log_dir = tempfile.mkdtemp(prefix="hisparse_throughput_")
  checkpoint = evv.checkpoint_for(size.model, log_dir)
  tokenizer = loader.load_tokenizer(checkpoint)
  prompts = _prompts(size, seed, tokenizer, size.num_requests, size.prompt_lens)
  base = (f"--max_num_seqs={max(64, 2 * size.num_requests)}",)
  kv_gib = size.kv_gib
  specs = {"device-only": ("hisparse", base),
           "HiSparse": ("hisparse", (*base, f"--host_pool_gib={size.host_pool_gib}",
                                     f"--top_k_tokens={size.top_k_tokens}"))}
  if size.with_vllm:
    specs["vLLM"] = ("vllm", ())
  rows, infos = {}, {}

  def start(name):
    engine, extra = specs[name]
    python = evv.peer_python() if engine == "vllm" else sys.executable
    # The worker's --kv_cache_gib is whole GiB (vLLM's unit); a smaller budget (smoke)
    # goes to this engine as a float through the same flag's twin.
    kv_args = ((f"--kv_cache_gib={int(kv_gib)}",) if float(kv_gib).is_integer()
               else (f"--device_kv_gib={kv_gib}",))
    worker = evv.Worker(name, python, engine, checkpoint, log_dir, None, size.max_model_len,
                        (*kv_args, *extra))
    infos[name] = worker.info
    return worker

  def workload(name, worker):
    rows[name] = {}
    if size.num_requests:
      rows[name] = _measure(worker, prompts, size, "long")
      print(f"hisparse_throughput {name}: decode {rows[name]['decode_tokens_per_s']:.1f} "
            f"tok/s, e2e {rows[name]['e2e_tokens_per_s']:.0f} tok/s, at once "
            f"{rows[name]['max_running']} (load {os.getloadavg()[0]:.1f})",
            file=sys.stderr, flush=True)

  # Our two engines stay up together (the sweep alternates them), then vLLM's row alone.
  workers = {}
  try:
    for name in ("device-only", "HiSparse"):
      workers[name] = start(name)
      workload(name, workers[name])
    for name, sweep in _sweep(workers, size, tokenizer, seed).items():
      rows[name]["sweep"] = sweep
  finally:
    for worker in workers.values():
      worker.close()
  if size.with_vllm:
    worker = start("vLLM")
    try:
      workload("vLLM", worker)
    finally:
      worker.close()
  identical = None
  if "vLLM" in rows:
    identical = rows["device-only"]["token_ids"] == rows["vLLM"]["token_ids"]
    if not identical:
      diff = evv._first_difference(rows["device-only"]["token_ids"],
                                   rows["vLLM"]["token_ids"])
      raise AssertionError(f"hisparse_throughput: device-only and vLLM greedy tokens differ: "
                           f"{diff}")
  for r in rows.values():
    r.pop("token_ids", None)
  dense, sparse = rows["device-only"], rows["HiSparse"]
  ratios = {"sweep_decode_vs_device_only": {
      c: sparse["sweep"][c]["decode_tokens_per_s"]
      / dense["sweep"][c]["decode_tokens_per_s"] for c in size.sweep}}
  if size.num_requests:
    ratios["decode_vs_device_only"] = (sparse["decode_tokens_per_s"]
                                       / dense["decode_tokens_per_s"])
    ratios["e2e_vs_device_only"] = sparse["e2e_tokens_per_s"] / dense["e2e_tokens_per_s"]
  if "vLLM" in rows:
    ratios["decode_vs_vllm"] = sparse["decode_tokens_per_s"] / rows["vLLM"]["decode_tokens_per_s"]
    ratios["e2e_vs_vllm"] = sparse["e2e_tokens_per_s"] / rows["vLLM"]["e2e_tokens_per_s"]
  return {"size": dataclasses.asdict(size), "rows": rows, "ratios": ratios,
          "engines": infos, "device_only_tokens_identical_to_vllm": identical,
          "goals": {"decode_vs_device_only": 1.5, "decode_vs_vllm": 1.5,
                    "sweep_batch_1_2": 0.95, "sweep_from_8": 1.0},
          "prompt_tokens": [len(p) for p in prompts], "log_dir": log_dir,
          "machine": common.machine()}


def format_table(result: dict) -> str:
  if "lengths" in result:  # a long size's rows
    return throughput_long.format_table(result)
  rows = []
  for name, r in result["rows"].items():
    if "decode_tokens_per_s" not in r:  # --bench_size=sweep: the sweep only
      continue
    rows.append([name, f"{r['decode_tokens_per_s']:.1f}", f"{100 * r['decode_share']:.0f}%",
                 f"{r['e2e_tokens_per_s']:.0f}",
                 "-" if r["max_running"] is None else r["max_running"],
                 f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
                 f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f}"])
  ratios = result["ratios"]
  lines = []
  if rows:
    table = common.format_table(["engine", "decode tok/s", "time decoding", "e2e tok/s",
                                 "at once", "TTFT p50/p99 ms", "ITL p50/p99 ms"], rows)
    lines = [table, "HiSparse decode vs device-only: "
             f"{ratios['decode_vs_device_only']:.2f}x; e2e "
             f"{ratios['e2e_vs_device_only']:.2f}x"]
  if "decode_vs_vllm" in ratios:
    lines.append(f"HiSparse decode vs vLLM: {ratios['decode_vs_vllm']:.2f}x; e2e "
                 f"{ratios['e2e_vs_vllm']:.2f}x")
  sweep_rows = []
  dense = result["rows"]["device-only"].get("sweep", {})  # (--bench_size=workload: none)
  sparse = result["rows"]["HiSparse"].get("sweep", {})
  for c in dense:
    sweep_rows.append([c, f"{dense[c]['decode_tokens_per_s']:.1f}",
                       f"{sparse[c]['decode_tokens_per_s']:.1f}",
                       f"{ratios['sweep_decode_vs_device_only'][c]:.2f}x"])
  if sweep_rows:
    lines.append(common.format_table(["at once", "device-only decode tok/s",
                                      "HiSparse decode tok/s", "ratio"], sweep_rows))
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  """PNG: the concurrency sweep's decode tokens/s, device-only and HiSparse, and each
  engine's decode tokens/s on the workload as a point at the requests it ran at once
  (a long size: decode tokens/s against length)."""
  if "lengths" in result:
    throughput_long.plot(result, path)
    return
  import matplotlib  # optional dependency (the test extra): imported on use

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4.5))
  styles = {"device-only": ("k", "o"), "HiSparse": ("tab:red", "s"), "vLLM": ("tab:blue", "^")}
  for name, row in result["rows"].items():
    color, marker = styles.get(name, ("tab:gray", "x"))
    if "sweep" in row:
      levels = sorted(row["sweep"], key=int)
      ax.plot([int(c) for c in levels], [row["sweep"][c]["decode_tokens_per_s"] for c in levels],
              "-", marker=marker, color=color, label=f"{name}, sweep")
    if "decode_tokens_per_s" not in row:  # --bench_size=sweep: no workload point
      continue
    if row.get("max_running"):
      ax.plot([row["max_running"]], [row["decode_tokens_per_s"]], marker, color=color, ms=11,
              mfc="none", mew=2, label=f"{name}, workload ({row['max_running']} at once)")
    else:
      ax.axhline(row["decode_tokens_per_s"], color=color, ls=":", label=f"{name}, workload")
  size = result["size"]
  ax.set_xscale("log", base=2)
  ax.set_xlabel("requests decoding at once")
  ax.set_ylabel("decode tokens/s (steps without prefill)")
  ax.set_title(f"hisparse_throughput: {size['kv_gib']:g} GiB device KV, HiSparse top-k "
               f"{size['top_k_tokens']:,} (+ host pool)", fontsize=10)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)

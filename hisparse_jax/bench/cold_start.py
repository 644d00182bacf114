"""Suite `cold_start`: what a fresh `hisparse-jax generate` costs, dense against HiSparse.

A CLI user (or an `LLM` in a new process) pays model loading and every step program's
compilation on each start. This suite runs the command a user runs, in fresh processes:

    hisparse-jax generate --model=smollm2-135m-instruct --prompts_file=F
        --max_new_tokens=8 --device_kv_gib=1.5 --host_pool_gib=1.5
        [--hisparse --top_k_tokens=512]

over `num_prompts` passkey prompts of `prompt_tokens` tokens (models/passkey.py; a
prefill-heavy job: ~3.8k prompt tokens and 8 new per request). The device budget holds
every request, so the two differ only by HiSparse itself (the indexer's key bounds and
write-through at prefill, its extra step programs, sparse decode rows). Two conditions,
each command timed as wall seconds of the whole process, alternating dense / HiSparse:

    cold   --compilation_cache_dir= (off): everything compiles, as before the cache
    warm   a cache directory of the run's own, filled by one untimed run of each command
           first: what every later start costs

and a third in this process, the same job through the library (`LLM.generate`, the same
settings, prefix caching off so that a repeat recomputes every prompt):

    engine a warm engine of each kind (built, and the job run once, untimed): the job's
           wall time alone, what a long-lived server or embedding pays per job

`reps` rounds per condition, alternating dense / HiSparse; medians. JSON: per condition,
dense and HiSparse seconds and HiSparse / dense (goals: <= 1.3 cold, <= 1.05 engine).
Greedy answers are compared between the two and reported (a difference is a finding of
the run, printed, not an error: the passkey suite is HiSparse's accuracy yardstick).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from hisparse_jax.bench import common

REAL_MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass(frozen=True)
class Size:
  model: str
  num_prompts: int
  prompt_tokens: int
  top_k_tokens: int
  device_kv_gib: float
  max_model_len: int
  reps: int
  host_pool_gib: float
  block_size: int = 16


SIZES = {
    "full": Size(REAL_MODEL, num_prompts=6, prompt_tokens=3800, top_k_tokens=512,
                 device_kv_gib=1.5, max_model_len=4096, reps=3, host_pool_gib=1.5),
    "smoke": Size("hisparse-tiny", num_prompts=2, prompt_tokens=200, top_k_tokens=64,
                  device_kv_gib=0.01, max_model_len=256, reps=1, host_pool_gib=0.002),
}


def _prompts_file(size: Size, path: str) -> list[str]:
  from models import loader, passkey

  tokenizer = loader.load_tokenizer(None if size.model == "hisparse-tiny" else size.model)
  depths = [(i + 0.5) / size.num_prompts for i in range(size.num_prompts)]
  prompts = passkey.make_passkey_prompts(tokenizer, size.prompt_tokens, depths, seed=31)
  with open(path, "w") as f:
    for p in prompts:
      f.write(json.dumps({"prompt_token_ids": list(p.token_ids)}) + "\n")
  return [p.key for p in prompts]


def _command(size: Size, prompts: str, cache: str, hisparse: bool) -> list[str]:
  model = [] if size.model == "hisparse-tiny" else [f"--model={size.model}"]
  sparse = (["--hisparse", f"--top_k_tokens={size.top_k_tokens}"] if hisparse else [])
  return [sys.executable, "-m", "hisparse_jax", "generate", *model,
          f"--prompts_file={prompts}", "--max_new_tokens=8",
          f"--device_kv_gib={size.device_kv_gib}", f"--host_pool_gib={size.host_pool_gib}",
          f"--max_model_len={size.max_model_len}",
          f"--block_size={size.block_size}", f"--compilation_cache_dir={cache}", *sparse]


def _time(cmd: list[str]) -> tuple[float, list[str]]:
  env = dict(os.environ)
  env.pop("HISPARSE_COMPILATION_CACHE_DIR", None)
  start = time.perf_counter()
  r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
  seconds = time.perf_counter() - start
  if r.returncode != 0:
    raise RuntimeError(f"cold_start: {' '.join(cmd)} exited {r.returncode}: "
                       f"{r.stderr[-2000:]}")
  return seconds, [t for t in r.stdout.splitlines() if t.startswith("[")]


def run(size_name: str = "full") -> dict:
  size = SIZES[size_name]
  work = tempfile.mkdtemp(prefix="cold_start_")
  prompts = os.path.join(work, "prompts.jsonl")
  keys = _prompts_file(size, prompts)
  cache = os.path.join(work, "xla")
  names = ("dense", "HiSparse")
  result = {}
  texts = {}
  for condition in ("cold", "warm"):
    cache_dir = "" if condition == "cold" else cache
    if condition == "warm":  # fill the cache: one untimed run of each
      for name in names:
        _time(_command(size, prompts, cache_dir, name == "HiSparse"))
    times = {n: [] for n in names}
    for r in range(size.reps):
      for name in names[r % 2:] + names[:r % 2]:
        seconds, out = _time(_command(size, prompts, cache_dir, name == "HiSparse"))
        times[name].append(seconds)
        texts[name] = out
      print(f"cold_start {condition} round {r + 1}/{size.reps}: "
            + ", ".join(f"{n} {times[n][-1]:.1f} s" for n in names)
            + f" (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    med = {n: common.median(times[n]) for n in names}
    result[condition] = {"seconds": times, "median_s": med,
                         "hisparse_vs_dense": med["HiSparse"] / med["dense"]}
  result["engine"], engine_texts = _in_process(size, prompts, names)
  same = texts["dense"] == texts["HiSparse"]
  if not same:
    print(f"cold_start: HiSparse's answers differ from dense's: {texts['HiSparse']} vs "
          f"{texts['dense']}", file=sys.stderr, flush=True)
  files, size_bytes = _cache_entries(cache)
  return {"size": dataclasses.asdict(size), "conditions": result, "keys": keys,
          "answers": texts, "answers_identical": same,
          "engine_answers_identical": engine_texts["dense"] == engine_texts["HiSparse"],
          "cache_programs": files, "cache_bytes": size_bytes,
          "goal_cold_vs_dense": 1.3, "goal_engine_vs_dense": 1.05, "commands": {
              n: " ".join(_command(size, "PROMPTS.jsonl", "DIR", n == "HiSparse")[1:])
              for n in names}}


def _in_process(size: Size, prompts_path: str, names) -> tuple[dict, dict]:
  """The `engine` condition: the job through `LLM.generate` on a warm engine of each kind
  (the generate command's settings, prefix caching off), `size.reps` rounds alternating.
  Returns (the condition's figures, each engine's answers as '[i] text' lines)."""
  import gc  # noqa: PLC0415

  from hisparse_jax.engine.sampling import SamplingParams  # noqa: PLC0415
  from hisparse_jax.entrypoints.llm import LLM  # noqa: PLC0415
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415

  with open(prompts_path) as f:
    prompts = [json.loads(line)["prompt_token_ids"] for line in f]
  params = SamplingParams(temperature=0.0, max_tokens=8)
  model = None if size.model == "hisparse-tiny" else size.model
  engines, times, texts = {}, {n: [] for n in names}, {}
  for name in names:
    hisparse = None
    if name == "HiSparse":
      hisparse = HiSparseConfig.for_max_model_len(size.max_model_len, size.block_size,
                                                  top_k_tokens=size.top_k_tokens)
    engines[name] = LLM(model, device_kv_gib=size.device_kv_gib,
                        host_pool_gib=size.host_pool_gib, max_model_len=size.max_model_len,
                        block_size=size.block_size, hisparse=hisparse,
                        enable_prefix_caching=False)
    engines[name].generate(prompt_token_ids=prompts, sampling_params=params)  # warm-up
  for r in range(size.reps):
    for name in names[r % 2:] + names[:r % 2]:
      start = time.perf_counter()
      outs = engines[name].generate(prompt_token_ids=prompts, sampling_params=params)
      times[name].append(time.perf_counter() - start)
      texts[name] = [f"[{i}] {o.outputs[0].text}" for i, o in enumerate(outs)]
    print(f"cold_start engine round {r + 1}/{size.reps}: "
          + ", ".join(f"{n} {times[n][-1]:.1f} s" for n in names)
          + f" (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
  del engines
  gc.collect()
  med = {n: common.median(times[n]) for n in names}
  return {"seconds": times, "median_s": med,
          "hisparse_vs_dense": med["HiSparse"] / med["dense"]}, texts


def _cache_entries(path: str) -> tuple[int, int]:
  from hisparse_jax.engine import compilation_cache

  return compilation_cache.entries(path)


def format_table(result: dict) -> str:
  rows = []
  for condition, r in result["conditions"].items():
    rows.append([condition, f"{r['median_s']['dense']:.2f}", f"{r['median_s']['HiSparse']:.2f}",
                 f"{r['hisparse_vs_dense']:.2f}x"])
  return (common.format_table(["start", "dense s", "HiSparse s", "HiSparse / dense"], rows)
          + f"\nanswers identical: {result['answers_identical']} (processes), "
          f"{result.get('engine_answers_identical')} (engine); cache: "
          f"{result['cache_programs']} programs, {result['cache_bytes'] / 2**20:.1f} MiB")

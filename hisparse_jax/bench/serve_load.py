"""Suite `serve_load`: concurrent streaming clients against `hisparse-jax serve`.

The server runs the default model in its own process on a free loopback port
(`ServerProcess`); `num_clients` clients stream completions at once over HTTP (httpx,
server-sent events parsed as they arrive), each a retrieval prompt of mixed length with
its own max_tokens, greedy, ignore_eos. Side by side, the same prompts go through
`LLM.generate` in this process with the same engine flags (the engine without the HTTP
front). Rounds alternate between the two; each side's figures are its median round.

JSON: requests/s and output tokens/s of each side, `served_over_offline` = served /
offline output tokens per second (what the HTTP front, the SSE framing and the engine
thread cost), and the served side's time to first token and inter-token latency (the gap
between a stream's consecutive chunks) at p50 and p99 over all streams. The server's
step shapes (and so its compiled programs) depend on when each request arrives: the
warm-up rounds compile most of them, and the JSON counts those first met in the timed
rounds (`server_step_shapes_new`). `serve` compiles in the background
(--compile_in_background, step_shapes.py): a new shape runs padded to a compiled one that
covers it while its own compiles, so only `server_compile_stalls` (foreground compiles in
the timed rounds) make the server wait, a second or more each on this CPU;
`server_background_compiles` and `server_steps_on_covering_shape` count the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np

from hisparse_jax.bench import common

MODEL_NAME = "hisparse-tiny"


@dataclasses.dataclass(frozen=True)
class Size:
  num_clients: int
  context_lens: tuple[int, ...]  # retrieval prompt lengths, cycled over the clients
  max_tokens: tuple[int, ...]  # cycled over the clients
  engine_flags: tuple[str, ...]
  reps: int
  warmup_rounds: int = 3


SIZES = {
    # The device budget holds ~8 of the 64 requests at full length: the host pool and
    # preemption take part, as in a loaded server.
    "full": Size(num_clients=64, context_lens=(128, 256, 512, 1024),
                 max_tokens=(32, 64, 96, 128),
                 engine_flags=("--max_model_len=2048", "--device_kv_gib=0.01",
                               "--host_pool_gib=0.25", "--block_size=16"), reps=3),
    "smoke": Size(num_clients=4, context_lens=(64, 128), max_tokens=(4, 6),
                  engine_flags=("--max_model_len=512", "--device_kv_gib=0.002",
                                "--host_pool_gib=0.01", "--block_size=16"), reps=1,
                  warmup_rounds=1),
}


class ServerProcess:
  """`hisparse-jax serve --port=0 ...` in a subprocess; `url` from its "serving on" line.
  Its log (stderr) is kept in `log` as it comes. `stop()` sends SIGTERM (a drain) and
  returns the exit status."""

  def __init__(self, *flags: str, start_timeout_s: float = 300.0):
    import httpx  # noqa: PLC0415 (a test / bench dependency)

    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "hisparse_jax", "serve", "--port=0", *flags],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    self.log: list[str] = []
    self.url = None
    deadline = time.monotonic() + start_timeout_s
    while self.url is None:
      line = self.proc.stderr.readline()
      if not line:
        raise RuntimeError("the server exited:\n" + "".join(self.log[-30:]))
      self.log.append(line)
      m = re.search(r"serving on (http://\S+)", line)
      if m:
        self.url = m.group(1)
      if time.monotonic() > deadline:
        self.proc.kill()
        raise RuntimeError("the server did not start in time")
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    while time.monotonic() < deadline:  # ready once the engine thread runs
      try:
        if httpx.get(self.url + "/health").status_code == 200:
          return
      except httpx.TransportError:
        pass
      time.sleep(0.1)
    raise RuntimeError("the server never became healthy")

  def _read(self) -> None:
    for line in self.proc.stderr:
      self.log.append(line)

  def metrics(self) -> dict[str, float]:
    """The server's /metrics as {series: value}."""
    import httpx  # noqa: PLC0415

    out = {}
    for line in httpx.get(self.url + "/metrics").text.splitlines():
      if line and not line.startswith("#"):
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out

  def stop(self, timeout_s: float = 60.0) -> int:
    if self.proc.poll() is None:
      self.proc.terminate()
    try:
      rc = self.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      rc = self.proc.wait()
    self._reader.join(5)
    return rc


async def _stream(client, url: str, prompt: list[int], max_tokens: int) -> dict:
  """One streaming completion: its chunk arrival times and text."""
  body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
          "temperature": 0.0, "ignore_eos": True, "stream": True}
  start = time.perf_counter()
  times, text, finish = [], [], None
  async with client.stream("POST", url + "/v1/completions", json=body) as response:
    response.raise_for_status()
    async for line in response.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      choice = json.loads(line[6:])["choices"][0]
      if choice["text"]:
        times.append(time.perf_counter())
        text.append(choice["text"])
      finish = choice["finish_reason"] or finish
  return {"start": start, "times": times, "text": "".join(text), "finish": finish}


def _served_round(url: str, prompts, max_tokens) -> dict:
  import logging  # noqa: PLC0415

  import httpx  # noqa: PLC0415

  logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

  async def main():
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
      return await asyncio.gather(*(_stream(client, url, p, n)
                                    for p, n in zip(prompts, max_tokens)))

  start = time.perf_counter()
  streams = asyncio.run(main())
  return {"seconds": time.perf_counter() - start, "streams": streams}


def _percentiles(xs) -> dict:
  xs = np.asarray(xs, np.float64)
  if xs.size == 0:
    return {"p50": None, "p99": None}
  return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))}


def run(size_name: str = "full", **_) -> dict:
  from hisparse_jax import LLM, SamplingParams  # noqa: PLC0415
  from models import data  # noqa: PLC0415

  size = SIZES[size_name]
  n = size.num_clients
  lens = [size.context_lens[i % len(size.context_lens)] for i in range(n)]
  max_tokens = [size.max_tokens[(i // len(size.context_lens)) % len(size.max_tokens)]
                for i in range(n)]
  prompts = [data.make_retrieval_prompts(1, length, seed=1000 + i)[0].token_ids
             for i, length in enumerate(lens)]
  flags = dict(f[2:].split("=", 1) for f in size.engine_flags)
  llm = LLM(max_model_len=int(flags["max_model_len"]),
            device_kv_gib=float(flags["device_kv_gib"]),
            host_pool_gib=float(flags["host_pool_gib"]), block_size=int(flags["block_size"]))
  params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]

  def offline_round():
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"seconds": time.perf_counter() - start,
            "texts": [o.outputs[0].text for o in outs]}

  server = ServerProcess(f"--served_model_name={MODEL_NAME}", *size.engine_flags)
  try:
    offline_round()  # compiles this process's step programs
    for _ in range(size.warmup_rounds):  # and the server's (its step shapes depend on
      _served_round(server.url, prompts, max_tokens)  # when each request arrives)
    before = server.metrics()
    served, offline = [], []
    for r in range(size.reps):
      order = (("served", "offline") if r % 2 == 0 else ("offline", "served"))
      for side in order:
        if side == "served":
          served.append(_served_round(server.url, prompts, max_tokens))
        else:
          offline.append(offline_round())
    metrics = server.metrics()
  finally:
    rc = server.stop()
  if rc != 0:
    raise RuntimeError(f"the server exited {rc} after SIGTERM:\n" + "".join(server.log[-20:]))
  total_tokens = sum(max_tokens)

  def new(name):  # what the timed rounds added to a server metric
    return metrics.get(name, 0.0) - before.get(name, 0.0)

  served_s = common.median([r["seconds"] for r in served])
  offline_s = common.median([r["seconds"] for r in offline])
  ttft, itl = [], []
  for r in served:
    for s in r["streams"]:
      if s["times"]:
        ttft.append(s["times"][0] - s["start"])
        itl += np.diff(s["times"]).tolist()
  texts_equal = all(s["text"] == t for r in served for s, t in zip(r["streams"],
                                                                     offline[0]["texts"]))
  return {
      "config": dataclasses.asdict(size), "machine": common.machine(),
      "num_clients": n, "output_tokens_per_round": total_tokens,
      "served": {"seconds": served_s, "requests_per_s": n / served_s,
                 "output_tokens_per_s": total_tokens / served_s,
                 "ttft_s": _percentiles(ttft), "itl_s": _percentiles(itl)},
      "offline": {"seconds": offline_s, "requests_per_s": n / offline_s,
                  "output_tokens_per_s": total_tokens / offline_s},
      "served_over_offline": offline_s / served_s,
      "served_round_seconds": [r["seconds"] for r in served],
      "offline_round_seconds": [r["seconds"] for r in offline],
      # Step shapes the server met first in the timed rounds (each a compile stall).
      "server_step_shapes_new": new("hisparse_step_shapes"),
      "server_compile_stalls": new('hisparse_step_compiles{where="foreground"}'),
      "server_background_compiles": new('hisparse_step_compiles{where="background"}'),
      "server_steps_on_covering_shape": new("hisparse_steps_on_covering_shape"),
      "texts_equal": texts_equal,
      "server_preemptions": metrics.get("hisparse_preemptions_total", 0.0),
      "server_exit_status": rc,
  }


def format_table(result: dict) -> str:
  s, o = result["served"], result["offline"]
  ms = lambda x: "-" if x is None else x * 1e3
  rows = [("served (HTTP, SSE)", s["seconds"], s["requests_per_s"], s["output_tokens_per_s"],
           ms(s["ttft_s"]["p50"]), ms(s["ttft_s"]["p99"]), ms(s["itl_s"]["p50"]),
           ms(s["itl_s"]["p99"])),
          ("offline (LLM.generate)", o["seconds"], o["requests_per_s"],
           o["output_tokens_per_s"], "-", "-", "-", "-")]
  return (common.format_table(["side", "s", "req/s", "out tok/s", "TTFT p50 ms",
                               "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"], rows)
          + f"\n{result['num_clients']} concurrent streaming clients, median of "
          f"{result['config']['reps']} alternated rounds; served_over_offline "
          f"{result['served_over_offline']:.2f}; texts equal offline's: "
          f"{'yes' if result['texts_equal'] else 'NO'}; server preemptions "
          f"{result['server_preemptions']:.0f}; rounds served "
          + ", ".join(f"{x:.2f}" for x in result["served_round_seconds"]) + " s, offline "
          + ", ".join(f"{x:.2f}" for x in result["offline_round_seconds"])
          + f" s; in the timed rounds: step shapes first met "
          f"{result['server_step_shapes_new']:.0f}, compile stalls "
          f"{result.get('server_compile_stalls', 0):.0f}, background compiles "
          f"{result.get('server_background_compiles', 0):.0f}, steps on a covering shape "
          f"{result.get('server_steps_on_covering_shape', 0):.0f}")

"""The soak: N minutes of random mixed traffic against `hisparse-jax serve`, watching memory
and the block pools over time (not part of `make test`).

  python -m hisparse_jax.bench.soak --minutes=10 --clients=16 \\
      --out=results/soak_serve.json --plot=results/soak_serve.png

The server runs in a subprocess (the embedded model, HiSparse on, a device pool far
smaller than the traffic's KV, so requests are offloaded and swapped all along). Each
client loops over a random mix: completions and chat, streamed or not, long prompts
that decode sparse, streams dropped mid-way (an abort), and bad requests (injected
faults: each must get its 4xx). Every 5 s the server's RSS (psutil) and its pools'
occupancy (/dashboard/data) are sampled. At the end, with no request left, the pools'
owned blocks must be back to their start value.

Reported: requests by kind and status class, 5xx outside the injected faults (must be
0), RSS growth after the warm-up (the first 20% of the run; must be <= 5%), owned blocks
at the end vs the start, per-sample series (JSON) and a plot of RSS and occupancy.

A server's memory grows with its compiled step programs (a new padded shape: ~20-50 MB
each on CPU) up to `--max_step_programs`; the soak runs at a cap its warm-up reaches,
so what it measures after that is everything else (a leak would show).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import threading
import time

SERVER_FLAGS = ("--max_model_len=1024", "--block_size=16", "--device_kv_gib=0.004",
                "--host_pool_gib=0.05", "--max_num_seqs=32", "--hisparse",
                "--top_k_tokens=128", "--hot_buffer_tokens=128", "--sink_tokens=16",
                "--local_tokens=32", "--sparse_threshold_tokens=256",
                # The compiled step programs kept: what a server's memory grows by (20-50
                # MB per program on CPU, ~130 KB of code each: session 24's runs with
                # JAX_LOG_COMPILES, every RSS step a new program). This traffic reaches
                # ~25 shapes in the warm-up and a few more later; at 24 the later ones
                # run on a covering program.
                "--max_step_programs=24")
WORDS = "bafu bapo baki bare lodu moti kavi rino sela tumo deni nufa keve foli".split()
BAD = [  # (body, endpoint, expected status): injected faults
    ({"model": "hisparse-tiny", "prompt": "x", "max_tokens": -1}, "/v1/completions", 400),
    ({"model": "nope", "prompt": "x"}, "/v1/completions", 404),
    ({"model": "hisparse-tiny", "prompt": "x", "max_tokens": 10**9}, "/v1/completions", 400),
    ({"model": "hisparse-tiny", "messages": "not a list"}, "/v1/chat/completions", 400),
    ({"model": "hisparse-tiny", "prompt": "x", "logprobs": 1000}, "/v1/completions", 400),
]


def _prompt(rng: random.Random, long: bool) -> str:
  n = rng.randint(60, 110) if long else rng.randint(3, 20)
  return " ".join(rng.choice(WORDS) + ":" for _ in range(n))


class Stats:
  def __init__(self):
    self.lock = threading.Lock()
    self.by_kind = collections.Counter()
    self.status = collections.Counter()
    self.unexpected: list[str] = []

  def add(self, kind: str, status: int, expected: int | None = None, text: str = "") -> None:
    with self.lock:
      self.by_kind[kind] += 1
      self.status[f"{status // 100}xx"] += 1
      if expected is not None and status != expected:
        self.unexpected.append(f"{kind}: {status} (expected {expected}) {text[:200]}")
      elif expected is None and status >= 500:
        self.unexpected.append(f"{kind}: {status} {text[:200]}")


def _client(url: str, seed: int, stop: threading.Event, stats: Stats) -> None:
  import httpx  # noqa: PLC0415

  rng = random.Random(seed)
  with httpx.Client(base_url=url, timeout=300) as http:
    while not stop.is_set():
      kind = rng.choices(["completion", "chat", "stream", "long", "abort", "bad"],
                         [3, 2, 3, 2, 1, 1])[0]
      try:
        if kind == "bad":
          body, path, expected = rng.choice(BAD)
          r = http.post(path, json=body)
          stats.add(kind, r.status_code, expected, r.text)
        elif kind == "chat":
          r = http.post("/v1/chat/completions", json={
              "model": "hisparse-tiny", "max_tokens": rng.randint(1, 32),
              "messages": [{"role": "user", "content": _prompt(rng, False)}],
              "temperature": rng.choice([0.0, 0.8])})
          stats.add(kind, r.status_code, None, r.text)
        elif kind in ("stream", "abort"):
          body = {"model": "hisparse-tiny", "prompt": _prompt(rng, rng.random() < 0.5),
                  "max_tokens": rng.randint(8, 96), "stream": True, "ignore_eos": True}
          with http.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            for i, _ in enumerate(r.iter_lines()):
              if kind == "abort" and i >= rng.randint(1, 6):
                break  # leaving the block closes the connection: the server aborts it
          stats.add(kind, status, None)
        else:
          r = http.post("/v1/completions", json={
              "model": "hisparse-tiny", "prompt": _prompt(rng, kind == "long"),
              "max_tokens": rng.randint(1, 64), "temperature": rng.choice([0.0, 1.0]),
              "ignore_eos": rng.random() < 0.5})
          stats.add(kind, r.status_code, None, r.text)
      except httpx.HTTPError as e:
        stats.add(kind, 599, None, f"{type(e).__name__}: {e}")


def _owned_tokens(data: dict) -> dict[str, float]:
  return {t["name"]: t["used_tokens"] for t in data["tiers"] if t["kind"] == "memory_kind"}


def run(minutes: float, clients: int, seed: int = 0) -> dict:
  import httpx  # noqa: PLC0415
  import psutil  # noqa: PLC0415

  from hisparse_jax.bench.common import machine  # noqa: PLC0415
  from hisparse_jax.bench.serve_load import ServerProcess  # noqa: PLC0415

  server = ServerProcess(*SERVER_FLAGS)
  proc = psutil.Process(server.proc.pid)
  try:
    start_owned = _owned_tokens(httpx.get(server.url + "/dashboard/data", timeout=60).json())
    stats, stop = Stats(), threading.Event()
    threads = [threading.Thread(target=_client, args=(server.url, seed + i, stop, stats),
                                daemon=True) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
      t.start()
    samples = []
    while time.monotonic() - t0 < minutes * 60:
      time.sleep(5)
      d = httpx.get(server.url + "/dashboard/data", timeout=60).json()
      samples.append({"t_s": round(time.monotonic() - t0, 1),
                      "rss_bytes": proc.memory_info().rss, "owned_tokens": _owned_tokens(d),
                      "requests": d["requests"], "finished": d["finished"],
                      "step_shapes": d["steps"]["shapes_compiled"]})
    stop.set()
    for t in threads:
      t.join(300)
    time.sleep(1)
    end = httpx.get(server.url + "/dashboard/data", timeout=60).json()
    ok = httpx.post(server.url + "/v1/completions", timeout=60,
                    json={"model": "hisparse-tiny", "prompt": "bafu:", "max_tokens": 4})
  finally:
    exit_status = server.stop()
  warm = [s for s in samples if s["t_s"] >= 0.2 * minutes * 60] or samples
  rss_after_warmup = warm[0]["rss_bytes"]
  rss_end = max(s["rss_bytes"] for s in warm)
  return {
      "machine": machine(), "minutes": minutes, "clients": clients, "server_flags":
      list(SERVER_FLAGS),
      "requests_by_kind": dict(stats.by_kind), "status_classes": dict(stats.status),
      "requests": sum(stats.by_kind.values()),
      "unexpected": stats.unexpected[:50], "num_unexpected": len(stats.unexpected),
      "num_5xx_outside_faults": sum(1 for u in stats.unexpected if ": 5" in u),
      "rss_after_warmup_bytes": rss_after_warmup, "rss_max_after_warmup_bytes": rss_end,
      "rss_growth_after_warmup": rss_end / rss_after_warmup - 1,
      "owned_tokens_start": start_owned, "owned_tokens_end": _owned_tokens(end),
      "requests_left_end": end["requests"],
      "normal_request_after": ok.status_code, "server_exit_status": exit_status,
      "samples": samples,
  }


def plot(result: dict, path: str) -> None:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  t = [s["t_s"] / 60 for s in result["samples"]]
  fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  a.plot(t, [s["rss_bytes"] / 2**20 for s in result["samples"]], label="RSS")
  a.set_ylabel("server RSS (MiB)")
  shapes = a.twinx()  # compiled step programs: each new padded shape is one
  shapes.plot(t, [s.get("step_shapes", 0) for s in result["samples"]], color="gray",
              linestyle="--", label="step shapes compiled")
  shapes.set_ylabel("step shapes compiled")
  a.set_title(f"soak: {result['clients']} clients, {result['requests']:,} requests, "
              f"RSS growth after warm-up {100 * result['rss_growth_after_warmup']:.1f}%")
  for kind in ("device", "pinned_host"):
    b.plot(t, [s["owned_tokens"].get(kind, 0) for s in result["samples"]], label=kind)
  b.set_ylabel("KV tokens in owned blocks")
  b.set_xlabel("minutes")
  b.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0])
  parser.add_argument("--minutes", type=float, default=10.0)
  parser.add_argument("--clients", type=int, default=16)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=None)
  parser.add_argument("--plot", default=None)
  args = parser.parse_args(argv)
  if not (args.minutes > 0 and args.clients > 0):
    parser.error("--minutes and --clients must be positive")
  result = run(args.minutes, args.clients, args.seed)
  summary = {k: v for k, v in result.items() if k not in ("samples", "machine")}
  print(json.dumps(summary, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
      f.write("\n")
  if args.plot:
    plot(result, args.plot)
  failed = (result["num_5xx_outside_faults"] or result["num_unexpected"]
            or result["rss_growth_after_warmup"] > 0.05
            or result["owned_tokens_end"] != result["owned_tokens_start"]
            or result["normal_request_after"] != 200)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())

"""Suite `slow_clients`: do a slow and a stalled streaming client slow the other streams?

`hisparse-jax serve` runs the default model in its own process (`ServerProcess`, a small
device pool, --max_stream_buffer=16). Each round times `num_streams` greedy streams of
`n_tokens` tokens read as fast as they come (httpx, one thread each): once alone, then
again beside two long streams (`long_tokens` tokens) on raw sockets with a 2 KiB receive
buffer, one read 100 bytes every 50 ms ("slow") and one never read ("stalled"). The
engine thread never waits on a socket: each request's outputs queue in its stream's
buffer, and past --max_stream_buffer unread outputs the request is aborted and its blocks
freed (how soon depends on how much the kernel's socket buffers absorb first). The round
then waits until no request runs, closes the two sockets and checks that the pools are
empty.

JSON: the streams' inter-token latency (the gap between a stream's consecutive chunks)
p50 / p99 of each side and round, `with_over_without` = median p99 with the two clients /
median p99 without (goal: <= 2; the rounds alternate, and the VM's noise is of the order
of the effect), the long streams still running when the timed streams ended (2: the
comparison saw both), aborts per round, seconds until no request ran, KV tokens in use
afterwards (0), whether a normal request was then served, and the server's exit status.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import statistics
import threading
import time

from hisparse_jax.bench import common
from hisparse_jax.bench.serve_load import MODEL_NAME, ServerProcess

ABORTS = 'hisparse_requests_total{finish_reason="abort"}'


@dataclasses.dataclass(frozen=True)
class Size:
  num_streams: int
  n_tokens: int  # each timed stream's tokens
  long_tokens: int  # the slow and the stalled stream's max_tokens
  reps: int
  # The long streams' logprobs a token: ~3 KB of SSE a token, so that their answers
  # outgrow the socket buffers on the way (without, ~3,000 tokens fit and none overflows).
  long_logprobs: int = 20
  # Untimed rounds first: the step shapes, the logprobs programs among them, compiled.
  warmup_rounds: int = 1
  engine_flags: tuple[str, ...] = ("--block_size=16", "--device_kv_gib=0.004",
                                   "--host_pool_gib=0.05", "--max_model_len=4096",
                                   "--max_stream_buffer=16", "--nowarmup")
  idle_timeout_s: float = 240.0  # until the long streams are aborted (or done)


SIZES = {
    "full": Size(num_streams=4, n_tokens=200, long_tokens=3000, reps=5),
    "smoke": Size(num_streams=4, n_tokens=200, long_tokens=3000, reps=1, warmup_rounds=0),
}


def raw_stream(url: str, n_tokens: int, read_every_s: float | None,
               logprobs: int | None = None, prompt: str = "lodu:") -> socket.socket:
  """A streaming completion on a raw socket with a tiny receive buffer that reads
  `read_every_s` (100 bytes at a time) or never (None); `logprobs` per token if given.
  The caller closes the socket."""
  host, port = url.split("//", 1)[1].rsplit(":", 1)
  sock = socket.socket()
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
  sock.connect((host, int(port)))
  body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": n_tokens,
                     "temperature": 0.0, "ignore_eos": True, "stream": True,
                     **({"logprobs": logprobs} if logprobs else {})}).encode()
  sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
  if read_every_s is not None:
    def reader():
      try:
        while sock.recv(100):
          time.sleep(read_every_s)
      except OSError:
        pass
    threading.Thread(target=reader, daemon=True).start()
  return sock


def _stream_itls(url: str, n_tokens: int, itls: list[float], chunks: list[int]) -> None:
  import httpx  # noqa: PLC0415 (a bench dependency)

  body = {"model": MODEL_NAME, "prompt": "bafu: bapo baki:", "max_tokens": n_tokens,
          "temperature": 0.0, "ignore_eos": True, "stream": True}
  count, last = 0, None
  with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
    r.raise_for_status()
    for line in r.iter_lines():
      if not line.startswith("data: {"):
        continue
      now = time.perf_counter()
      count += 1
      if last is not None:
        itls.append(now - last)
      last = now
  chunks.append(count)


def timed_streams(url: str, num_streams: int, n_tokens: int) -> dict:
  """`num_streams` concurrent streams of `n_tokens`: their inter-token latency p50 / p99
  (seconds) and each stream's number of chunks."""
  itls: list[float] = []
  chunks: list[int] = []
  threads = [threading.Thread(target=_stream_itls, args=(url, n_tokens, itls, chunks))
             for _ in range(num_streams)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  q = statistics.quantiles(itls, n=100)
  return {"p50": statistics.median(itls), "p99": q[98], "chunks": sorted(chunks)}


def _dashboard(url: str) -> dict:
  import httpx  # noqa: PLC0415

  return httpx.get(url + "/dashboard/data", timeout=60).json()


def run(size_name: str = "full", **_) -> dict:
  size = SIZES[size_name]
  s = ServerProcess(*size.engine_flags)
  rounds = []
  try:
    timed_streams(s.url, size.num_streams, size.n_tokens)  # the first shapes compiled
    for _ in range(size.warmup_rounds + size.reps):
      without = timed_streams(s.url, size.num_streams, size.n_tokens)
      before = s.metrics()
      slow = raw_stream(s.url, size.long_tokens, 0.05, logprobs=size.long_logprobs)
      stalled = raw_stream(s.url, size.long_tokens, None, logprobs=size.long_logprobs)
      try:
        with_them = timed_streams(s.url, size.num_streams, size.n_tokens)
        running_at_end = int(_dashboard(s.url)["requests"]["running"])
        t0 = time.perf_counter()
        d = _dashboard(s.url)
        while d["requests"]["running"] and time.perf_counter() - t0 < size.idle_timeout_s:
          time.sleep(0.2)
          d = _dashboard(s.url)
        idle_s = time.perf_counter() - t0
      finally:
        stalled.close()
        slow.close()
      after = s.metrics()
      rounds.append({"without": without, "with": with_them,
                     "long_streams_running_at_end": running_at_end,
                     "running_after_wait": d["requests"]["running"],
                     "seconds_until_none_ran": idle_s,
                     "aborts": int(after.get(ABORTS, 0) - before.get(ABORTS, 0)),
                     "kv_used_tokens_after": d["tiers"][0]["used_tokens"]})
    rounds = rounds[size.warmup_rounds:]
    import httpx  # noqa: PLC0415

    r = httpx.post(s.url + "/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "bafu: bapo", "max_tokens": 4,
                         "temperature": 0.0})
    still_serving = r.status_code == 200 and bool(r.json()["choices"][0]["text"])
  finally:
    rc = s.stop()
  p99 = lambda side: statistics.median(r[side]["p99"] for r in rounds)
  return {"config": dataclasses.asdict(size), "rounds": rounds,
          "itl_p99_s": {"without": p99("without"), "with": p99("with")},
          "with_over_without": p99("with") / p99("without"),
          "still_serving": still_serving, "server_exit_status": rc}


def format_table(result: dict) -> str:
  rows = []
  for i, r in enumerate(result["rounds"]):
    for side in ("without", "with"):
      rows.append((i, side, r[side]["p50"] * 1e3, r[side]["p99"] * 1e3,
                   r["long_streams_running_at_end"] if side == "with" else "-",
                   r["aborts"] if side == "with" else "-",
                   f"{r['seconds_until_none_ran']:.1f}" if side == "with" else "-"))
  c = result["config"]
  return (common.format_table(["round", "slow + stalled clients", "ITL p50 ms", "ITL p99 ms",
                               "long streams running", "aborts", "s until none ran"], rows)
          + f"\n{c['num_streams']} streams of {c['n_tokens']} tokens; with_over_without "
          f"(median p99) {result['with_over_without']:.2f} (goal <= 2); KV in use after: "
          + ", ".join(str(r["kv_used_tokens_after"]) for r in result["rounds"])
          + f" tokens; still serving: {'yes' if result['still_serving'] else 'NO'}")

"""`GET /dashboard` of `hisparse-jax serve`: the page and its JSON under load, the API-key
rule, and a real headless Chromium that opens the page, lets it refresh, and reads the
tier panels back from the DOM (a screenshot is saved under results/ for the README).

The server runs HiSparse on the embedded model with a device pool of a few long prompts,
so a load of long prompts offloads (host pool in use, hot-buffer lookups and hits)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from hisparse_jax.bench.serve_load import ServerProcess

KEY = "dash-key"
# 1 KiB of KV per token (the embedded model): a device pool of 54 blocks of 16 tokens
# beside the indexer bounds, a host pool of 21k tokens; 8 clients' prompts of ~440 tokens
# (+ 48 generated) do not fit at once and decode sparse (top-k 64 tokens): offloads.
FLAGS = ("--max_model_len=512", "--device_kv_gib=0.0015", "--host_pool_gib=0.02",
         "--block_size=16", "--max_num_seqs=8", "--hisparse", "--top_k_tokens=64",
         "--hot_buffer_tokens=64", "--sink_tokens=16", "--local_tokens=16",
         "--sparse_threshold_tokens=96", "--resident_sparse_min_tokens=0")
# --nowarmup: start-up is not what these tests check, and the warm-up costs 10-35 s a server
# start on 2 cores (vLLM's tests skip CUDA-graph capture with enforce_eager alike);
# test_serve.py's module server and test_serve_warmup.py serve with the default warm-up.
NOWARMUP = "--nowarmup"
PROMPT = " ".join(["bafu: bapo baki: bare lodu: moti kavi: rino"] * 55)  # ~440 tokens
SCREENSHOT = os.path.join("results", "dashboard.png")


@pytest.fixture(scope="module")
def server():
  s = ServerProcess(*FLAGS, NOWARMUP)
  yield s
  assert s.stop() == 0, "".join(s.log[-30:])


class Load:
  """Clients sending long completions until stopped (the server stays busy)."""

  def __init__(self, url: str, clients: int = 8, headers: dict | None = None):
    self.url, self.headers = url, headers or {}
    self.stop_event = threading.Event()
    self.done = 0
    self.errors: list[str] = []
    self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                    for i in range(clients)]
    for t in self.threads:
      t.start()

  def _run(self, i: int) -> None:
    with httpx.Client(timeout=120) as client:
      while not self.stop_event.is_set():
        r = client.post(self.url + "/v1/completions", headers=self.headers, json={
            "model": "hisparse-tiny", "prompt": f"{i} {self.done} " + PROMPT,
            "max_tokens": 48, "temperature": 0.0, "ignore_eos": True})
        if r.status_code != 200:
          self.errors.append(f"{r.status_code} {r.text[:200]}")
          return
        self.done += 1

  def close(self) -> None:
    self.stop_event.set()
    for t in self.threads:
      t.join(180)
    assert not self.errors, self.errors


def _wait_until(predicate, timeout_s: float = 120.0):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    value = predicate()
    if value:
      return value
    time.sleep(0.2)
  raise AssertionError("condition not met in time")


def test_the_page_and_its_data_under_load(server):
  page = httpx.get(server.url + "/dashboard", timeout=60)
  assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
  # Self-contained: nothing loaded from elsewhere (no src/href to another origin).
  assert "<script>" in page.text and not re.search(r'(src|href)\s*=\s*"(https?:)?//', page.text)
  assert "http://" not in page.text.split("<script>", 1)[1]
  load = Load(server.url)
  try:
    def busy():
      d = httpx.get(server.url + "/dashboard/data", timeout=60).json()
      tiers = {t["name"]: t for t in d["tiers"]}
      return d if (tiers["device"]["used_tokens"] > 0 and tiers["pinned_host"]["used_tokens"] > 0
                   and d["hot_buffer"]["hit_ratio"] is not None) else None
    d = _wait_until(busy)
  finally:
    load.close()
  tiers = {t["name"]: t for t in d["tiers"]}
  assert tiers["device"]["capacity_tokens"] > 0 and tiers["pinned_host"]["capacity_bytes"] > 0
  assert d["hisparse"] and d["requests"]["running"] >= 1
  assert d["transfers"]["d2h"]["bytes"] > 0  # write-through of sparse decoders
  assert 0 <= d["hot_buffer"]["hit_ratio"] <= 1
  assert set(d["blocks_selected"]) >= {"device", "hot", "host"}


def test_with_an_api_key_the_dashboard_needs_it():
  s = ServerProcess(f"--api_key={KEY}", *FLAGS[:4], NOWARMUP)
  try:
    for path in ("/dashboard", "/dashboard/data"):
      assert httpx.get(s.url + path).status_code == 401
      assert httpx.get(s.url + path, headers={"Authorization": "Bearer nope"}).status_code == 401
      assert httpx.get(s.url + path,
                       headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
      assert httpx.get(s.url + path, params={"token": KEY}).status_code == 200
      assert httpx.get(s.url + path, params={"token": "nope"}).status_code == 401
    assert httpx.get(s.url + "/health").status_code == 200  # (unguarded, as before)
  finally:
    assert s.stop() == 0


def _chromium() -> str | None:
  for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
    path = shutil.which(name)
    if path:
      return path
  return None


def _browser(binary: str, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
  return subprocess.run(
      [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
       "--hide-scrollbars", "--no-first-run", "--window-size=1400,1000", *args],
      capture_output=True, text=True, timeout=timeout_s)


def _values(dom: str) -> dict[str, str]:
  return dict(re.findall(r'data-metric="([^"]+)"[^>]*?data-value="([^"]*)"', dom))


def test_a_headless_browser_shows_the_tiers_under_load(server):
  binary = _chromium()
  if binary is None:
    pytest.skip("no Chromium here (make test installs Debian's chromium as root; this "
                "machine could not): the browser check did not run")
  load = Load(server.url)
  try:
    _wait_until(lambda: httpx.get(server.url + "/dashboard/data", timeout=60).json()[
        "hot_buffer"]["hit_ratio"] is not None)
    # The page polls every 500 ms; the virtual time budget lets it refresh several times
    # (the fetches themselves are real), then the DOM is dumped.
    url = server.url + "/dashboard?interval_ms=500"
    dom = _browser(binary, "--virtual-time-budget=4000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    refreshes = int(re.search(r'data-refreshes="(\d+)"', dom.stdout).group(1))
    assert refreshes >= 2, refreshes
    values = _values(dom.stdout)
    assert float(values["tier.device.used_tokens"]) > 0, values
    assert float(values["tier.pinned_host.used_tokens"]) > 0, values
    assert float(values["tier.device.capacity_tokens"]) > 0
    assert 0 <= float(values["hot_buffer.hit_ratio"]) <= 1, values
    os.makedirs(os.path.dirname(SCREENSHOT), exist_ok=True)
    shot = _browser(binary, "--virtual-time-budget=4000", f"--screenshot={SCREENSHOT}", url)
    assert shot.returncode == 0, shot.stderr[-2000:]
    with open(SCREENSHOT, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  finally:
    load.close()


def test_generate_and_demo_serve_the_dashboard_with_serve_dashboard():
  """`--serve_dashboard` (generate and demo, through generate_cmd.run) prints the URL
  first and serves the page and its data while the run goes on (and --dashboard_linger_s
  after it)."""
  import sys

  proc = subprocess.Popen(
      [sys.executable, "-m", "hisparse_jax", "generate", "--prompt=bafu: bapo",
       "--max_new_tokens=4", "--serve_dashboard", "--dashboard_linger_s=20"],
      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  try:
    line = proc.stdout.readline()
    match = re.match(r"dashboard: (http://127\.0\.0\.1:\d+/dashboard) ", line)
    assert match, line
    url = match.group(1)
    assert httpx.get(url).status_code == 200
    d = _wait_until(lambda: (r := httpx.get(url + "/data").json())["finished"] and r)
    assert d["finished"] == 1 and d["tokens"]["generated"] == 4
    assert {t["name"] for t in d["tiers"]} == {"device", "pinned_host"}
  finally:
    proc.kill()
    proc.wait()
  out = subprocess.run([sys.executable, "-m", "hisparse_jax", "generate", "--prompt=x",
                        "--serve_dashboard", "--dashboard_port=70000"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2 and "--dashboard_port must be in [0, 65535]" in out.stderr

"""`hisparse-jax bench`'s suites run by name only (not by `--suite=all`) at smoke size:
passkey (the real-model accuracy yardstick, here on the toy model), dsa_decode,
hisparse_throughput, cold_start, third_tier; the README's tables of their committed runs
(and of engine_vs_vllm's real-model runs). (No timing is asserted: a benchmark reports
figures, it does not test them.)"""

import dataclasses
import json
import os

import numpy as np
import pytest
from bench_helpers import PNG_MAGIC, REPO, positive
from matplotlib import image as plt_image

from hisparse_jax.bench import common, dsa_decode, passkey, passkey_engine, report
from hisparse_jax.entrypoints.cli import bench as bench_cmd

PASSKEY_JSON = os.path.join(REPO, "results", "passkey_cpu.json")
PASSKEY_PNG = os.path.join(REPO, "results", "passkey_cpu.png")


@pytest.fixture(scope="module")
def passkey_smoke(tmp_path_factory):
  """The passkey suite (run by name only, not by `all`) at smoke size: the toy model, one
  length, two prompts (the second one's admission offloads the first)."""
  out_dir = tmp_path_factory.mktemp("passkey")
  out, plot = str(out_dir / "passkey.json"), str(out_dir / "passkey.png")
  bench_cmd.run_suites(["passkey"], "smoke", 16, out, plot)
  with open(out) as f:
    return json.load(f), plot


def test_dsa_decode_smoke_fields(tmp_path):
  """The DSA decode suite (by name) at smoke size: every contender ran the same batch; the
  offloaded side loaded every selected token when cold and none when warm."""
  assert "dsa_decode" not in bench_cmd.suite_names("all")
  out = str(tmp_path / "dsa.json")
  bench_cmd.run_suites(["dsa_decode"], "smoke", 16, out)
  with open(out) as f:
    d = json.load(f)["suites"]["dsa_decode"]
  size = dsa_decode.SIZES["smoke"]
  assert [r["context"] for r in d["rows"]] == list(size.contexts)
  for r in d["rows"]:
    assert positive(r["dense_ms"], r["resident_ms"], r["offloaded_ms"],
                     r["offloaded_cold_ms"], r["bytes_bound"])
    assert r["dense_over_offloaded"] == pytest.approx(r["dense_ms"] / r["offloaded_ms"])
    # Cold: index_topk tokens of each row and layer from the host (its newest block's
    # tokens are resident); warm: none.
    layers = size.num_layers * size.batch
    assert size.index_topk * layers - size.block_size * layers <= (
        r["cold_step_tokens_loaded"]) <= size.index_topk * layers
    assert r["h2d_bytes_per_step"] == 0
  assert "DSA decode step" in report.markdown({"machine": common.machine(), "seconds":
                                               {"total": 1.0}, "suites": {"dsa_decode": d}})


def test_readme_dsa_decode_matches_committed_json():
  """README's DSA decode table is the report of results/dsa_decode_cpu.json."""
  with open(os.path.join(REPO, "results", "dsa_decode_cpu.json")) as f:
    result = json.load(f)
  with open(os.path.join(REPO, "README.md")) as f:
    assert report.markdown(result) in f.read()


def test_passkey_is_run_by_name_only():
  assert bench_cmd.suite_names("passkey") == ["passkey"]
  assert "passkey" not in bench_cmd.suite_names("all")


def test_passkey_fields(passkey_smoke):
  result, plot = passkey_smoke
  p = result["suites"]["passkey"]
  size = passkey.SIZES["smoke"]
  (length,) = size.lengths
  assert p["model"] == size.model and p["checkpoint"]["sha256_12"]
  assert [(r["config"], r["status"]) for r in p["rows"]] == [
      ("dense", "run"), ("top-k 64 block 16", "run"),
      ("top-k 64 block 16 streamed (45%, exact prefill)", "run"),
      ("top-k 256 block 16", "covers")]
  dense, sparse, streamed = p["rows"][:3]
  # Streamed: a device pool under half of each prompt's KV; every prompt streams through
  # it and its earlier chunks come back from the host pool.
  assert streamed["streamed"] and not sparse["streamed"]
  assert streamed["streamed_prefill"] == "exact" and streamed["hisparse"][
      "streamed_prefill"] == "exact"
  assert streamed["capacity"]["device"]["tokens"] < 0.5 * streamed["prompt_tokens"][0]
  assert streamed["host"]["offloads"] >= 2 and streamed["host"]["host_loads"] > 0
  assert streamed["num_right"] == sum(a["right"] for a in streamed["answers"])
  for r in (dense, sparse):
    assert r["num_prompts"] == len(size.depths) == len(r["answers"])
    assert r["num_right"] == sum(a["right"] for a in r["answers"])
    assert r["accuracy"] == r["num_right"] / r["num_prompts"]
    assert [a["depth"] for a in r["answers"]] == list(size.depths)
    assert r["prompt_tokens"][1] <= length - passkey.NEW_TOKENS
  assert sparse["hisparse"]["sparse_threshold_tokens"] == sparse["top_k_tokens"] == 64
  assert sparse["hisparse"]["hot_buffer_tokens"] == 64
  # The device pool holds 1.5 requests: HiSparse offloads and loads from the host pool.
  assert sparse["host"]["offloads"] >= 1 and sparse["host"]["host_loads"] > 0
  assert dense["host"]["host_loads"] == dense["host"]["offloads"] == 0
  assert sparse["capacity"]["device"]["blocks"] == dense["capacity"]["device"]["blocks"]
  assert p["dense_accuracy"] == {str(length): dense["accuracy"]}
  assert set(p["smallest_top_k"]) == {str(length)}
  a = p["agreement"]
  assert len(a["prompts"]) == size.agreement_prompts == len(a["prompt_tokens"])
  (row,) = a["rows"]
  assert row["tokens_compared"] == size.agreement_prompts * size.agreement_tokens
  assert 0 <= row["tokens_equal"] <= row["tokens_compared"]
  assert 0 < row["sparse_step_fraction"] <= 1 and 0 < row["context_attended_mean"] <= 1
  table = passkey.format_table(p)
  assert "covers" in table and "smallest top-k" in table
  assert "Passkey retrieval" in report.markdown(result)
  with open(plot, "rb") as f:
    assert f.read(8) == PNG_MAGIC


def test_passkey_smallest_top_k_keeps_dense_from_there_up():
  """The smallest top-k from which on every larger one is as accurate as dense; a top-k
  covering the sequence counts as dense; an error or a dip above breaks the run."""
  size = passkey.Size(model="m", lengths=(1024,), depths=(0.5,), top_ks=(128, 256, 512, 1024),
                      block_sizes=(16, 32), device_requests=1.5, agreement_prompts=1,
                      agreement_tokens=1, agreement_rows=())

  def row(top_k, block_size, accuracy, status="run"):
    return {"length": 1024, "config": "dense" if top_k is None else f"{top_k} {block_size}",
            "top_k_tokens": top_k, "block_size": block_size, "status": status,
            "accuracy": accuracy}

  rows = [row(None, 16, 0.8),
          row(128, 16, 0.8), row(256, 16, 0.6), row(512, 16, 1.0), row(1024, 16, None, "covers"),
          row(128, 32, 0.2), row(256, 32, None, "error"), row(512, 32, 0.8),
          row(1024, 32, None, "covers")]
  assert passkey.smallest_top_k(rows, size) == {"1024": {"16": 512, "32": 512}}
  rows[3]["accuracy"] = 0.6  # 512 at block 16 drops too: only the covering top-k keeps it
  assert passkey.smallest_top_k(rows, size)["1024"]["16"] is None


def test_readme_passkey_matches_committed_json(tmp_path):
  """README's passkey tables are the report of results/passkey_cpu.json (one recorded
  `--suite=passkey` run) and results/passkey_cpu.png is its plot."""
  with open(PASSKEY_JSON) as f:
    result = json.load(f)
  assert list(result["suites"]) == ["passkey"] and result["size"] == "full"
  rows = result["suites"]["passkey"]["rows"]
  run_rows = [r for r in rows if r["config"] != "dense" and r["status"] == "run"]
  assert run_rows and all(r["host"]["host_loads"] > 0 for r in run_rows)  # offloaded rows
  with open(os.path.join(REPO, "README.md")) as f:
    readme = f.read()
  assert report.markdown(result) in readme
  redrawn = str(tmp_path / "redrawn.png")
  passkey.plot(result["suites"]["passkey"], redrawn)
  committed, fresh = plt_image.imread(PASSKEY_PNG), plt_image.imread(redrawn)
  assert committed.shape == fresh.shape
  assert np.abs(committed - fresh).mean() < 0.01


def test_readme_passkey_streamed_matches_committed_json():
  """README's streamed passkey table is the report of results/passkey_streamed_cpu.json
  (`--bench_size=streamed`): the streamed rows ran with a device pool under half of every
  prompt's KV and read blocks back from the host pool."""
  with open(os.path.join(REPO, "results", "passkey_streamed_cpu.json")) as f:
    result = json.load(f)
  assert result["size"] == "streamed"
  rows = result["suites"]["passkey"]["rows"]
  streamed = [r for r in rows if r.get("streamed")]
  assert {r["block_size"] for r in streamed} == {16, 32}
  for r in streamed:
    assert r["status"] == "run" and r["host"]["host_loads"] > 0
    assert r["capacity"]["device"]["tokens"] < 0.5 * r["prompt_tokens"][0]
  with open(os.path.join(REPO, "README.md")) as f:
    assert report.markdown(result) in f.read()


def test_readme_passkey_8k_b32_matches_committed_json():
  """README's 8k block-32 table is the report of results/passkey_8k_b32_cpu.json
  (`--bench_size=8k_b32`, the grid's 8k column at block 32): every HiSparse row ran and read
  blocks back from the host pool."""
  with open(os.path.join(REPO, "results", "passkey_8k_b32_cpu.json")) as f:
    result = json.load(f)
  assert result["size"] == "8k_b32"
  rows = result["suites"]["passkey"]["rows"]
  sparse = [r for r in rows if r["config"] != "dense"]
  assert {r["top_k_tokens"] for r in sparse} == {256, 512, 1024, 2048}
  for r in sparse:
    assert r["block_size"] == 32 and r["status"] == "run" and r["host"]["host_loads"] > 0
  with open(os.path.join(REPO, "README.md")) as f:
    assert report.markdown(result) in f.read()


def test_passkey_device_pool_forces_offloads_at_every_top_k():
  """1.5 requests of blocks while a hot buffer is at most a quarter of a request; past it
  one request + the hot buffer + a quarter (else an offload could not admit the next
  request: the rows ran one request at a time with no host load)."""
  assert passkey_engine.device_pool_blocks(1024, 16, 1.5, None) == 96  # dense
  assert passkey_engine.device_pool_blocks(1024, 16, 1.5, 256) == 96   # top-k = L / 4
  assert passkey_engine.device_pool_blocks(1024, 16, 1.5, 512) == 64 + 32 + 16
  assert passkey_engine.device_pool_blocks(4096, 32, 1.5, 2048) == 128 + 64 + 32
  assert passkey_engine.device_pool_blocks(8192, 16, 1.5, 2048) == 768


@pytest.mark.parametrize("name", ["engine_vs_vllm_cpu.json",
                                  "engine_vs_vllm_vllm_2cores_cpu.json"])
def test_readme_real_model_speed_matches_committed_json(name):
  """README's real-model speed tables are the reports of the recorded engine_vs_vllm runs
  (vLLM at its default threads, and with its compute on both cores), and those runs met
  the issue's goals with identical tokens (a record, not a timing of this machine)."""
  with open(os.path.join(REPO, "results", name)) as f:
    result = json.load(f)
  v = result["suites"]["engine_vs_vllm"]
  assert {"real_decode_heavy", "real_prefill_heavy", "real_long"} <= set(v["workloads"])
  assert all(w["tokens_identical"] for w in v["workloads"].values())
  with open(os.path.join(REPO, "README.md")) as f:
    assert report.markdown(result) in f.read()


@pytest.mark.parametrize(("name", "size", "engines"), [
    ("hisparse_throughput_cpu", "full", {"device-only", "HiSparse", "vLLM"}),
    ("hisparse_throughput_sweep_cpu", "sweep", {"device-only", "HiSparse"})])
def test_readme_hisparse_throughput_matches_committed_json(name, size, engines):
  """README's throughput tables are the report of results/NAME.json (the recorded run with
  all three engines and the sweep; the sweep alone, --bench_size=sweep), and its plot is
  committed."""
  with open(os.path.join(REPO, "results", f"{name}.json")) as f:
    result = json.load(f)
  t = result["suites"]["hisparse_throughput"]
  assert set(t["rows"]) == engines and result["size"] == size
  assert set(t["rows"]["HiSparse"]["sweep"]) == {"1", "2", "4", "8", "16", "32"}
  with open(os.path.join(REPO, "README.md")) as f:
    assert report.markdown(result) in f.read()
  with open(os.path.join(REPO, "results", f"{name}.png"), "rb") as f:
    assert f.read(8) == PNG_MAGIC


def test_hisparse_throughput_sweep_only_report():
  # --bench_size=sweep: no workload rows, no vLLM; the report and the headline rows show
  # the sweep alone (and the plot draws it).
  from hisparse_jax.bench import hisparse_throughput as ht

  size = ht.SIZES["sweep"]
  assert size.num_requests == 0 and not size.with_vllm and size.sweep == ht.SIZES["full"].sweep
  level = lambda x: {"decode_tokens_per_s": x}  # noqa: E731
  t = {"size": dataclasses.asdict(size),
       "rows": {"device-only": {"sweep": {"1": level(10.0), "8": level(40.0)}},
                "HiSparse": {"sweep": {"1": level(10.0), "8": level(50.0)}}},
       "ratios": {"sweep_decode_vs_device_only": {"1": 1.0, "8": 1.25}}, "engines": {}}
  text = "\n".join(report.throughput_lines(t))
  assert "HiSparse throughput sweep" in text and "| engine |" not in text
  assert "\n| 8 | 40.00 | 50.00 | 1.25 |" in text
  figures = [r[1] for r in report.summary_rows({"suites": {"hisparse_throughput": t}})]
  assert figures == ["sweep: HiSparse / device-only decode at 1 at once",
                     "sweep: HiSparse / device-only decode at 8 at once"]
  printed = ht.format_table(t).splitlines()  # the sweep's table alone
  assert printed[0].startswith("at once") and printed[-1].split() == ["8", "40.0", "50.0",
                                                                      "1.25x"]
  # A sweep that alternated the engines lists every timed call beside the median's figure.
  for name, calls in (("device-only", [38.0, 40.0, 41.0]), ("HiSparse", [50.0, 52.0, 49.0])):
    for level in t["rows"][name]["sweep"].values():
      level["rounds_decode_tokens_per_s"] = calls
  text = "\n".join(report.throughput_lines(t))
  assert "taking turns at each level" in text
  assert "\n| 8 | 40.00 | 50.00 | 1.25 | 38.00, 40.00, 41.00 | 50.00, 52.00, 49.00 |" in text


def test_hisparse_throughput_workload_only_report():
  # --bench_size=workload: full's workload rows (vLLM's too), no sweep; neither the report
  # nor the printed table has a sweep section.
  from hisparse_jax.bench import hisparse_throughput as ht

  size, full = ht.SIZES["workload"], ht.SIZES["full"]
  assert size.sweep == () and size.with_vllm
  assert dataclasses.replace(size, sweep=full.sweep) == full
  row = lambda x: {"decode_tokens_per_s": x, "decode_share": 0.1, "e2e_tokens_per_s": 3 * x,  # noqa: E731
                   "max_running": 4, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0,
                   "itl_p50_ms": 3.0, "itl_p99_ms": 4.0, "sweep": {}}
  t = {"size": dataclasses.asdict(size),
       "rows": {"device-only": row(10.0), "HiSparse": row(20.0), "vLLM": row(8.0)},
       "ratios": {"sweep_decode_vs_device_only": {}, "decode_vs_device_only": 2.0,
                  "e2e_vs_device_only": 2.0, "decode_vs_vllm": 2.5, "e2e_vs_vllm": 2.5},
       "engines": {}}
  del t["rows"]["vLLM"]["sweep"]  # (vLLM's row never has one)
  text = "\n".join(report.throughput_lines(t))
  assert "| HiSparse | 20.00 |" in text and "| vLLM | 8.00 |" in text
  assert "Concurrency sweep" not in text
  printed = ht.format_table(t)
  assert "HiSparse decode vs vLLM: 2.50x" in printed and "at once  " not in printed.splitlines()[-1]


def test_hisparse_throughput_smoke_fields(tmp_path):
  # By name only; at smoke size our two engines (no vLLM) on the tiny converted GGUF.
  from hisparse_jax.bench import hisparse_throughput as ht

  assert bench_cmd.suite_names("hisparse_throughput") == ["hisparse_throughput"]
  assert "hisparse_throughput" not in bench_cmd.suite_names("all")
  out = str(tmp_path / "ht.json")
  bench_cmd.run_suites(["hisparse_throughput"], "smoke", 16, out,
                       str(tmp_path / "ht.png"))
  assert (tmp_path / "ht.png").stat().st_size > 0
  with open(out) as f:
    full = json.load(f)
  r = full["suites"]["hisparse_throughput"]
  size = ht.SIZES["smoke"]
  text = report.markdown(full)  # the README's tables of a recorded run
  assert "HiSparse throughput (`hisparse_throughput`)" in text
  assert "| hisparse_throughput | HiSparse decode tok/s / device-only |" in text
  tables = text.split("HiSparse throughput")[1]
  assert tables.count("\n| HiSparse | ") == 1 and "vLLM" not in tables  # our two rows
  assert tables.count("\n| 1 | ") == tables.count("\n| 2 | ") == 1  # the sweep's levels
  assert set(r["rows"]) == {"device-only", "HiSparse"}
  low, high = size.prompt_lens
  assert len(r["prompt_tokens"]) == size.num_requests
  assert all(low - 8 <= n <= high for n in r["prompt_tokens"])
  dense, sparse = r["rows"]["device-only"], r["rows"]["HiSparse"]
  for row in (dense, sparse):
    assert positive(row["e2e_tokens_per_s"], row["seconds"], row["decode_tokens_per_s"],
                     row["ttft_p50_ms"], row["itl_p99_ms"])
    assert row["decode_steps"] >= 1 and 0 < row["decode_share"] <= 1
    # Decode-only steps give each running request at most one token.
    assert row["decode_tokens"] <= row["decode_steps"] * size.num_requests
    assert [int(c) for c in row["sweep"]] == list(size.sweep)
    for level in row["sweep"].values():  # each timed call kept; the level is their median
      calls = level["rounds_decode_tokens_per_s"]
      assert len(calls) == size.sweep_rounds and level["decode_tokens_per_s"] in calls
  assert r["engines"]["HiSparse"]["hisparse"]["top_k_tokens"] == size.top_k_tokens
  assert r["engines"]["device-only"]["hisparse"] is None
  assert r["engines"]["HiSparse"]["host_pool_gib"] == size.host_pool_gib
  assert sparse["max_running"] >= dense["max_running"] >= 1
  assert r["device_only_tokens_identical_to_vllm"] is None  # no vLLM at smoke size


def test_hisparse_throughput_sweep_alternates_engines_and_takes_median_call():
  # Both workers take turns at every level (the order flips each round and each level);
  # rounds only up to SWEEP_ROUNDS_MAX_C; a level's figures are its median timed call.
  from hisparse_jax.bench import hisparse_throughput as ht

  log = []

  class FakeWorker:
    def __init__(self, name, rates):
      self.name, self.rates = name, iter(rates)

    def generate(self, prompts, n):
      log.append((self.name, len(prompts)))
      rate = next(self.rates)  # decode tokens/s of this call (warm-ups included)
      return {"decode_tokens": 100, "decode_s": 100 / rate, "decode_steps": 10,
              "seconds": 2.0, "ttft_s": [0.1], "itl_s": [0.01], "cpu_s": 1.0,
              "token_ids": [[1]] * len(prompts), "max_running": len(prompts)}

  class Tokenizer:
    def encode(self, text, add_special_tokens=True):
      return list(range(len(text.split())))

  size = dataclasses.replace(ht.SIZES["smoke"], sweep=(1, 16), sweep_rounds=3,
                             sweep_prompt_len=20)
  # c = 1: warm-up + 3 timed calls each; c = 16 (> SWEEP_ROUNDS_MAX_C): warm-up + 1.
  dense = FakeWorker("d", [1, 10, 30, 20, 1, 50])
  sparse = FakeWorker("s", [1, 12, 11, 13, 1, 40])
  out = ht._sweep({"device-only": dense, "HiSparse": sparse}, size, Tokenizer(), 0)
  assert [name for name, _ in log] == ["d", "d", "s", "s", "s", "d", "d", "s",  # level 1
                                       "s", "s", "d", "d"]  # level 16 starts with HiSparse
  assert {c for _, c in log} == {1, 16}
  assert out["device-only"][1]["rounds_decode_tokens_per_s"] == pytest.approx([10, 30, 20])
  assert out["device-only"][1]["decode_tokens_per_s"] == pytest.approx(20)
  assert out["HiSparse"][1]["decode_tokens_per_s"] == pytest.approx(12)
  assert out["HiSparse"][16]["rounds_decode_tokens_per_s"] == pytest.approx([40])
  assert "token_ids" not in out["HiSparse"][16]


def test_peer_worker_times_only_steps_that_decode():
  # A step counts when neither it nor the step before scheduled a prompt token: the
  # first decode after a prefill, and every step of a run that never stops prefilling,
  # are left out.
  from hisparse_jax.bench import peer_worker

  # prompt tokens each step scheduled, and the tokens it returned (request 0, 1)
  script = [(300, []), (200, [[1], [2]]), (0, [[3], [4]]), (0, [[5], [6]]), (50, [[7]]),
            (0, [[8], [9]]), (0, [[10]]), (None, [[11]])]
  steps = iter(script)
  current = [None]

  def step():
    prefill, events = next(steps)
    current[0] = prefill
    return iter(list(enumerate(events)))

  done = iter([True] * len(script) + [False])
  r = peer_worker._drive(lambda *a: None, step, lambda: next(done), [[1], [2]], 8,
                         lambda: current[0])
  # Steps 4 and 7 (1-based): 3 and 6 follow a prefill, 8 scheduled what is not known.
  assert r["decode_steps"] == 2
  assert r["decode_tokens"] == 3
  assert 0 < r["decode_s"] <= r["seconds"]
  assert r["token_ids"] == [[1, 3, 5, 7, 8, 10, 11], [2, 4, 6, 9]]


def test_cold_start_runs_generate_with_its_own_flags():
  # The suite times `hisparse-jax generate` processes: every flag it passes is one of
  # generate's (a typo would make each run exit 2), the two commands differ by HiSparse.
  from hisparse_jax.bench import cold_start
  from hisparse_jax.entrypoints.cli import main as cli

  assert bench_cmd.suite_names("cold_start") == ["cold_start"]
  size = cold_start.SIZES["full"]
  dense = cold_start._command(size, "p.jsonl", "", False)
  sparse = cold_start._command(size, "p.jsonl", "", True)
  assert dense[2:4] == ["hisparse_jax", "generate"]
  for arg in sparse[4:]:
    assert arg.startswith("--") and arg[2:].split("=")[0] in cli.command_flags("generate")
  assert set(sparse) - set(dense) == {"--hisparse", f"--top_k_tokens={size.top_k_tokens}"}
  assert "--compilation_cache_dir=" in dense


def test_third_tier_smoke_fields(tmp_path):
  """The third-tier suite (by name) at smoke size: each prompt was loaded from both tiers
  with the recomputed tokens, and the throttled tier's second load was refused."""
  from hisparse_jax.bench import third_tier

  assert "third_tier" not in bench_cmd.suite_names("all")
  out = str(tmp_path / "tt.json")
  bench_cmd.run_suites(["third_tier"], "smoke", 16, out)
  with open(out) as f:
    (case,) = json.load(f)["suites"]["third_tier"]["cases"]
  size = third_tier.SIZES["smoke"][0]
  assert case["tokens_equal"]
  per_prompt = (size.prompt_tokens - 1) // case["block_size"]
  # Each tier engine loads its warm-up prompt and the timed ones.
  assert case["loaded_blocks"] == {"disk": per_prompt * (size.reps + 1),
                                   "remote": per_prompt * (size.reps + 1)}
  assert positive(*case["ttft_median_s"].values())
  gate = case["gate"]
  assert gate["first_tokens_equal"] and gate["refusals"] == 1 and gate["load_jobs"] == 1
  assert gate["expected_load_s"] > gate["expected_recompute_s"]


def test_readme_third_tier_table_matches_committed_json():
  with open("results/third_tier_cpu.json") as f:
    cases = json.load(f)["suites"]["third_tier"]["cases"]
  with open("README.md") as f:
    readme = f.read()
  for c in cases:
    med = c["ttft_median_s"]
    row = next(line for line in readme.splitlines() if line.startswith(f"| {c['model']} ("))
    assert f"{c['speedup_disk']:.1f}x" in row and f"{c['speedup_remote']:.1f}x" in row, row
    assert f"{med['recompute']:.3g}"[:4] in row, row

"""`make gpu-bench` (hisparse_jax/bench/gpu_bench.py) end to end on this CPU, as a lent GPU
would run it but at the smoke sizes: the environment step, then each part in its own
process within the budget, one JSON with every part's rows. The parts' rows are checked
here from that one run (the kernel part: every row against its reference, every kernel's
impls accounted for; the HiSparse part: transfers, miss steps, the engine's equal
tokens); their other behaviour (budgets, failures, lowering for an H200) in
test_gpu_bench_kernels.py and test_gpu_bench_hisparse.py. No figure is asserted (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_helpers import GPU_BENCH_EXPECTED as EXPECTED
from bench_helpers import GPU_BENCH_GPU_ONLY as GPU_ONLY
from bench_helpers import GPU_BENCH_ROW_FIELDS as ROW_FIELDS

from hisparse_jax.bench import gpu_bench
from hisparse_jax.bench import gpu_bench_cases as cases

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """(exit status, printed text, the JSON) of the command as `make gpu-bench` runs it."""
  out = tmp_path_factory.mktemp("gpu_bench") / "gpu_bench.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "hisparse_jax.bench.gpu_bench", f"--out={out}"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  return r.returncode, r.stdout + r.stderr, json.loads(out.read_text())


def test_every_step_passes_and_the_json_names_the_run(run):
  code, printed, result = run
  assert code == 0, printed[-4000:]
  assert result["command"] == "make gpu-bench" and result["gpu"] is False
  assert result["size"] == "smoke" and result["budget_s"] == gpu_bench.CPU_BUDGET_S
  assert "no NVIDIA GPU" in result["gpu_absent_reason"]
  assert result["passed"] == ["environment", "kernels", "hisparse"]
  assert result["failed"] == [] and result["skipped"] == []
  assert result["device"]["platform"] == "cpu"
  steps = {s["name"]: s for s in result["steps"]}
  for name in ("kernels", "hisparse"):  # what a CPU cannot show, said with the reason
    assert any("no NVIDIA GPU" in part for part in steps[name]["skipped_parts"])
    assert f"gpu_bench_{name}" in steps[name]["command"] and "--size=smoke" in \
        steps[name]["command"]
    assert steps[name]["figures"] == result["parts"][name]["summary"]
  assert set(result["parts"]) == {"kernels", "hisparse"}
  assert "summary paged:" in printed  # the parts' own tables are printed
  assert "wrote " in printed and "3 passed, 0 failed" in printed


def test_only_takes_the_parts_and_refuses_others(capsys):
  with pytest.raises(SystemExit) as e:
    gpu_bench.main(["--only=kernels,warp"])
  assert e.value.code == 2
  assert "--only: unknown step(s) warp" in capsys.readouterr().err


def test_the_kernel_part_every_row_correct_every_impl_accounted_for(run):
  result = run[2]["parts"]["kernels"]
  assert {"machine", "size", "budget_s", "rows", "skipped", "summary", "peaks",
          "failures"} <= set(result)
  assert result["size"] == "smoke" and result["failures"] == []
  assert result["machine"]["platform"] == "cpu"
  for row in result["rows"]:
    assert ROW_FIELDS <= set(row), row
    assert row["ok"], row
    assert row["median_ms"] > 0 and row["bytes"] > 0 and row["flops"] > 0
    assert row["roofline_fraction"] is None and row["hbm_fraction"] is None  # no CPU peaks
  for s in result["skipped"]:
    assert s["reason"], s
  for kernel, impls in EXPECTED.items():
    ran = {r["impl"] for r in result["rows"] if r["kernel"] == kernel}
    skipped = {s["impl"] for s in result["skipped"] if s["kernel"] == kernel}
    assert impls <= ran | skipped, (kernel, impls - ran - skipped)
    assert "ours-triton" in ran, kernel
    assert impls & GPU_ONLY <= skipped - ran, kernel
  paged_shapes = {(r["shape"]["batch"], r["shape"]["context"]) for r in result["rows"]
                  if r["kernel"] == "paged"}
  assert paged_shapes == set(cases.SMOKE["paged"])
  assert set(result["summary"]) == set(EXPECTED)
  for s in result["summary"]["paged_8bit"]["shapes"]:
    assert s["speedup_vs_bf16"] > 0
  # The select beside the sparse attention over what it selects (paged at its batch and
  # top-k tokens: SMOKE's (2, 256)).
  # (DSA's select beside the sparse MLA decode at its batch and top-k: SMOKE's (2, 64).)
  union, dsa = sorted(result["summary"]["select"]["shapes"],
                      key=lambda s: s["shape"]["selection"] == "lightning")
  assert (union["shape"]["batch"],
          union["shape"]["top_k_blocks"] * union["shape"]["block_size"]) in set(
              cases.SMOKE["paged"])
  assert (dsa["shape"]["batch"], dsa["shape"]["topk"]) == (
      cases.SMOKE["sparse_mla"]["batch"], cases.SMOKE["sparse_mla"]["topk"])
  for sel in (union, dsa):
    assert sel["sparse_attention_ms"] > 0
    assert sel["select_over_attention"] == pytest.approx(
        sel["ours_ms"] / sel["sparse_attention_ms"])


def _rows(result, part):
  return [r for r in result["rows"] if r["part"] == part]


def test_the_hisparse_part_runs_every_part_and_writes_its_fields(run):
  result = run[2]["parts"]["hisparse"]
  assert set(result) >= {"machine", "size", "budget", "rows", "skipped", "errors", "summary"}
  assert result["size"] == "smoke" and result["errors"] == []
  assert result["machine"]["platform"] == "cpu"
  assert 0 < result["budget"]["spent_s"] < result["budget"]["budget_s"]
  assert result["summary"]["parts"] == ["engine", "miss_step", "transfer", "transfer_kernel"]
  assert result["summary"]["tokens_equal_where_required"] is True
  for row in result["rows"]:
    assert set(row) >= {"part", "name", "config", "figure", "unit", "target", "met"}
    assert row["met"] is None  # (CPU)
  reasons = {(s["part"], s["what"]): s["reason"] for s in result["skipped"]}
  assert "not a GPU" in reasons[("transfer", "share of the PCIe peak")]
  assert not any(s["reason"].startswith("budget") for s in result["skipped"])


def test_the_hisparse_transfers_cover_both_directions_sizes_and_counts(run):
  rows = _rows(run[2]["parts"]["hisparse"], "transfer")
  assert {(r["name"].split()[0], r["config"]["block_size"], r["config"]["num_blocks"])
          for r in rows} == {(d, b, n) for d in ("h2d", "d2h") for b in (16, 64)
                             for n in (16, 256)}
  for r in rows:
    assert r["figure"] > 0 and r["unit"] == "GB/s" and r["pcie_share"] is None
    want = {256: ">= 32 GB/s", 16: ">= 16 GB/s"}[r["config"]["num_blocks"]]
    assert r["target"] == (want if r["config"]["block_size"] == 16 else None)


def test_the_zero_copy_kernel_rows_check_both_paths_and_time_the_kernel(run):
  rows = _rows(run[2]["parts"]["hisparse"], "transfer_kernel")
  checks = {r["name"]: r for r in rows if r["unit"] == "blocks differing"}
  assert set(checks) == {"bit-exact vs numpy (xla)", "bit-exact vs numpy (kernel)"}
  assert all(r["figure"] == 0 and r["target"] == "0" for r in checks.values())
  timed = [r for r in rows if r["unit"] == "GB/s"]
  assert {(r["name"].split()[0], r["config"]["num_blocks"]) for r in timed} == {
      (d, n) for d in ("h2d", "d2h") for n in (16, 256)}
  xla = {r["name"]: r["figure"] for r in _rows(run[2]["parts"]["hisparse"], "transfer")}
  for r in timed:
    assert r["name"].endswith(" (kernel)") and r["config"]["host_copy"] == "kernel"
    assert r["figure"] > 0 and r["config"]["block_size"] == 16
    assert r["vs_xla"] == pytest.approx(r["figure"] / xla[r["name"][:-len(" (kernel)")]])


def test_the_miss_steps_miss_the_fraction_asked(run):
  rows = _rows(run[2]["parts"]["hisparse"], "miss_step")
  off = [r for r in rows if not r["config"].get("overlap_loads")]
  assert len(off) == 3
  base, ten, thirty = off
  assert base["figure"] == 1.0 and base["missed_block_layers"] == 0
  assert base["loaded_block_layers"] == 0
  # smoke: top-k 8 blocks, so 1 and 2 of them (12.5%, 25%) miss per row and layer
  assert ten["measured_miss_fraction"] == pytest.approx(1 / 8)
  assert thirty["measured_miss_fraction"] == pytest.approx(2 / 8)
  assert thirty["loaded_block_layers"] == thirty["missed_block_layers"] > 0
  assert thirty["target"] == "<= 1.3" and ten["target"] is None
  # The same steps with HISPARSE_JAX_OVERLAP_LOADS=1: the option-off steps' tokens and
  # counts (the part fails the run otherwise), the same misses loaded.
  on = [r for r in rows if r["config"].get("overlap_loads")]
  assert len(on) == 3
  for r_on, r_off in zip(on, off):
    assert r_on["tokens_and_counts_equal_option_off"] is True
    assert r_on["missed_block_layers"] == r_off["missed_block_layers"]
    assert r_on["loaded_block_layers"] == r_off["loaded_block_layers"]
    assert r_on["figure"] > 0 and r_on["target"] is None


def test_the_engine_rows_and_the_equal_tokens_check(run):
  rows = {r["name"]: r for r in _rows(run[2]["parts"]["hisparse"], "engine")}
  check = rows["(c) 2x the device pool: leading tokens equal to dense"]
  assert check["hisparse_tokens"][0] == check["dense_tokens"][0]
  assert check["figure"] >= 1 and check["offloads"] > 0 and check["host_loads"] > 0
  assert check["config"]["request_over_device_pool"] == pytest.approx(2.0)
  batch1 = rows["(b) batch 1: HiSparse / dense decode tokens/s"]
  assert batch1["figure"] > 0 and batch1["target"] == ">= 0.95"
  ratio = rows["(a) HiSparse offload / device-only decode tokens/s"]
  assert ratio["figure"] > 0 and ratio["target"] == ">= 2.0"
  offload = rows["(a) HiSparse offload: decode tokens/s"]
  dense = rows["(a) device-only: decode tokens/s"]
  assert offload["max_decoding"] > dense["max_decoding"] == 1  # admission by offload
  assert offload["offloads"] > 0 and offload["host_blocks_selected"] > 0
  assert offload["config"]["H"]["device_blocks"] == dense["config"]["D"]["device_blocks"]
  assert "(a) HiSparse wait (host pool only): decode tokens/s" in rows

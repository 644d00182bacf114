"""`make gpu-check` (hisparse_jax/bench/gpu_check.py) on a machine without a GPU: it runs what
the CPU can, says what it skipped and why, and reports every step even when one fails."""

import json
import shutil
import sys

import pytest

from hisparse_jax.bench import gpu_check

NO_GPU = shutil.which("nvidia-smi") is None


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_without_a_gpu_it_runs_the_cpu_parts_and_names_what_it_skipped(tmp_path, capsys):
  out = tmp_path / "check.json"
  code = gpu_check.main(["--only=transfer", f"--out={out}"])
  printed = capsys.readouterr().out
  result = json.loads(out.read_text())
  assert code == 0, printed
  assert result["gpu"] is False and "no NVIDIA GPU" in result["gpu_absent_reason"]
  assert result["device"]["platform"] == "cpu"
  assert {"device", "pinned_host"} <= set(result["device"]["memory_kinds"])
  assert [s["name"] for s in result["steps"]] == ["environment", "transfer"]
  env, transfer = result["steps"]
  assert env["status"] == "pass"
  assert any("CUDA install" in part for part in env["skipped_parts"])
  assert transfer["status"] == "pass", transfer["output_tail"]
  assert any("PCIe" in part for part in transfer["skipped_parts"])
  rows = transfer["figures"]["rows"]
  assert {r["direction"] for r in rows} == {"h2d", "d2h"}
  assert all(r["engine_gb_per_s"] > 0 and r["pcie_fraction"] is None for r in rows)
  assert "skipped: the CUDA install" in printed and "1 failed" not in printed


def test_a_failing_step_is_reported_and_the_next_one_still_runs(tmp_path):
  runner = gpu_check.Runner(gpu=False, budget_s=60)
  fail = runner.run("selfcheck", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
  ok = runner.run("kernel_bench", [sys.executable, "-c", "print('fine')"])
  assert (fail["status"], fail["reason"]) == ("fail", "exit status 3")
  assert "boom" in fail["output_tail"]
  assert ok["status"] == "pass" and ok["seconds"] >= 0


def test_a_step_past_its_time_is_a_failure_and_an_empty_budget_skips_the_rest():
  runner = gpu_check.Runner(gpu=False, budget_s=6)
  slow = runner.run("selfcheck", [sys.executable, "-c", "import time; time.sleep(30)"])
  assert (slow["status"], slow["reason"]) == ("fail", "timed out")
  late = runner.run("transfer", [sys.executable, "-c", "print('never')"])
  assert late["status"] == "skip" and "no time left" in late["reason"]


def test_a_pytest_run_whose_tests_all_skipped_is_not_a_pass():
  assert gpu_check._pytest_all_skipped("SKIPPED [1] t.py:3: no torch\n1 skipped in 0.1s")
  assert not gpu_check._pytest_all_skipped("3 passed, 1 skipped in 2.0s")
  assert not gpu_check._pytest_all_skipped("1 failed in 2.0s")


def test_unknown_steps_are_refused_naming_the_flag(capsys):
  with pytest.raises(SystemExit) as e:
    gpu_check.main(["--only=selfcheck,warp_drive"])
  assert e.value.code == 2
  assert "--only: unknown step(s) warp_drive" in capsys.readouterr().err

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


def _wheel(folder, name: str) -> None:
  """A one-module wheel `name`-1.0 (`import name` gives VALUE = 42) in folder."""
  import zipfile

  folder.mkdir(parents=True, exist_ok=True)
  info = f"{name}-1.0.dist-info"
  files = {f"{name}.py": "VALUE = 42\n",
           f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
           f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                            "Tag: py3-none-any\n"}
  files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
  with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
    for path, text in files.items():
      z.writestr(path, text)


def test_the_library_peers_install_from_the_wheelhouse_into_the_steps_path(tmp_path,
                                                                         monkeypatch):
  """make gpu-bench's library peers on a machine without network: what does not import is
  installed from wheelhouse/ (--no-index, --no-deps) into .gpu-peers/, which every step
  then has on PYTHONPATH; with no wheelhouse it is a skipped part naming make gpu-wheels."""
  site, house, req = tmp_path / ".gpu-peers", tmp_path / "wheelhouse", tmp_path / "req.txt"
  _wheel(house, "hjpeerprobe")
  req.write_text("hjpeerprobe==1.0\n")
  for attr, value in (("PEERS_SITE", site), ("WHEELHOUSE", house), ("PEERS_REQ", req),
                      ("_PEERS_IMPORT", "import hjpeerprobe; assert hjpeerprobe.VALUE == 42")):
    monkeypatch.setattr(gpu_check, attr, value)
  runner = gpu_check.Runner(gpu=False, budget_s=120)
  assert str(site) not in runner.env()["PYTHONPATH"]
  log, skipped = [], []
  gpu_check._library_peers(runner, sys.executable, log, skipped)
  assert skipped == [] and "installed from wheelhouse/ into .gpu-peers/" in log[-1], log
  assert (site / "hjpeerprobe.py").exists()
  assert runner.env()["PYTHONPATH"].split(":")[:2] == [str(gpu_check.ROOT), str(site)]
  gpu_check._library_peers(runner, sys.executable, log, skipped)  # now it imports
  assert log[-1].endswith("import") and skipped == []

  monkeypatch.setattr(gpu_check, "_PEERS_IMPORT", "import hjpeerprobe_absent")
  shutil.rmtree(house)
  gpu_check._library_peers(runner, sys.executable, log, skipped)
  assert len(skipped) == 1 and "no wheelhouse/" in skipped[0], skipped
  assert "make gpu-wheels" in skipped[0] and "hjpeerprobe_absent" in skipped[0]

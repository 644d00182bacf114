"""`make gpu-bench`'s HiSparse part (bench/gpu_bench_hisparse.py) end to end at its smoke
size on the CPU: every part's rows, (c)'s equal tokens, the JSON's fields; the budget's
skips and the exit status of a correctness failure. No figure is asserted (CPU)."""

import json

import pytest

from hisparse_jax.bench import gpu_bench_hisparse as gbh
from hisparse_jax.bench import gpu_bench_hisparse_engine as engine_part


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_bench") / "hisparse.json"
  code = gbh.main(["--size=smoke", "--out", str(out), "--budget_s", "600"])
  with open(out) as f:
    return code, json.load(f)


def _rows(result, part):
  return [r for r in result["rows"] if r["part"] == part]


def test_smoke_runs_every_part_and_writes_the_json(smoke):
  code, result = smoke
  assert code == 0
  assert set(result) >= {"machine", "size", "budget", "rows", "skipped", "errors", "summary"}
  assert result["size"] == "smoke" and result["errors"] == []
  assert result["machine"]["platform"] == "cpu"
  assert result["budget"]["budget_s"] == 600 and 0 < result["budget"]["spent_s"] < 600
  assert result["summary"]["parts"] == ["engine", "miss_step", "transfer"]
  assert result["summary"]["tokens_equal_where_required"] is True
  for row in result["rows"]:
    assert set(row) >= {"part", "name", "config", "figure", "unit", "target", "met"}
    assert row["met"] is None  # (CPU)
  reasons = {(s["part"], s["what"]): s["reason"] for s in result["skipped"]}
  assert "not a GPU" in reasons[("transfer", "share of the PCIe peak")]
  assert not any(s["reason"].startswith("budget") for s in result["skipped"])


def test_transfer_rows_cover_both_directions_sizes_and_counts(smoke):
  _, result = smoke
  rows = _rows(result, "transfer")
  assert {(r["name"].split()[0], r["config"]["block_size"], r["config"]["num_blocks"])
          for r in rows} == {(d, b, n) for d in ("h2d", "d2h") for b in (16, 64)
                             for n in (16, 256)}
  for r in rows:
    assert r["figure"] > 0 and r["unit"] == "GB/s" and r["pcie_share"] is None
    want = {256: ">= 32 GB/s", 16: ">= 16 GB/s"}[r["config"]["num_blocks"]]
    assert r["target"] == (want if r["config"]["block_size"] == 16 else None)


def test_miss_step_rows_miss_the_fraction_asked(smoke):
  _, result = smoke
  rows = _rows(result, "miss_step")
  assert len(rows) == 3
  base, ten, thirty = rows
  assert base["figure"] == 1.0 and base["missed_block_layers"] == 0
  assert base["loaded_block_layers"] == 0
  # smoke: top-k 8 blocks, so 1 and 2 of them (12.5%, 25%) miss per row and layer
  assert ten["measured_miss_fraction"] == pytest.approx(1 / 8)
  assert thirty["measured_miss_fraction"] == pytest.approx(2 / 8)
  assert thirty["loaded_block_layers"] == thirty["missed_block_layers"] > 0
  assert thirty["target"] == "<= 1.3" and ten["target"] is None


def test_engine_rows_and_the_equal_tokens_check(smoke):
  _, result = smoke
  rows = {r["name"]: r for r in _rows(result, "engine")}
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


def test_compare_tokens():
  assert engine_part.compare_tokens([1, 2, 3], [1, 2, 4]) == (2, True)
  assert engine_part.compare_tokens([5, 2], [1, 2]) == (0, False)
  assert engine_part.compare_tokens([], [1]) == (0, False)
  assert engine_part.compare_tokens([1, 2], [1, 2, 3]) == (2, True)


def test_an_exhausted_budget_skips_and_a_token_mismatch_fails(tmp_path, monkeypatch):
  out = tmp_path / "b.json"
  assert gbh.main(["--size=smoke", "--out", str(out), "--budget_s", "1e-6",
                   "--only", "transfer,miss_step"]) == 0
  result = json.loads(out.read_text())
  assert result["rows"] == []
  assert {(s["part"], s["reason"]) for s in result["skipped"]} >= {
      ("transfer", "budget: no time left"), ("miss_step", "budget: no time left"),
      ("engine", "not in --only")}
  monkeypatch.setattr(engine_part, "run", lambda *args: False)  # (c)'s first token differs
  assert gbh.main(["--size=smoke", "--out", str(out), "--only", "engine"]) == 1
  assert json.loads(out.read_text())["summary"]["tokens_equal_where_required"] is False
  with pytest.raises(SystemExit):
    gbh.main(["--only", "transfer,nope"])

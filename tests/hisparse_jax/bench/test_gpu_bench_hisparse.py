"""`make gpu-bench`'s HiSparse part (bench/gpu_bench_hisparse.py) on the CPU: the budget's
skips and the exit status of a correctness failure (its smoke size end to end, every
part's rows and (c)'s equal tokens, are checked in test_gpu_bench.py, from the whole
command's run)."""

import json

import pytest

from hisparse_jax.bench import gpu_bench_hisparse as gbh
from hisparse_jax.bench import gpu_bench_hisparse_engine as engine_part


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

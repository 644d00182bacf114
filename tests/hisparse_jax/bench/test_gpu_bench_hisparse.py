"""`make gpu-bench`'s HiSparse part (bench/gpu_bench_hisparse.py) on the CPU: the budget's
skips and the exit status of a correctness failure (its smoke size end to end, every
part's rows and (c)'s equal tokens, are checked in test_gpu_bench.py, from the whole
command's run)."""

import json

import numpy as np
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
      ("engine", "not in --only"), ("transfer_kernel", "not in --only")}
  monkeypatch.setattr(engine_part, "run", lambda *args: False)  # (c)'s first token differs
  assert gbh.main(["--size=smoke", "--out", str(out), "--only", "engine"]) == 1
  assert json.loads(out.read_text())["summary"]["tokens_equal_where_required"] is False
  with pytest.raises(SystemExit):
    gbh.main(["--only", "transfer,nope"])


def test_a_kernel_that_moves_wrong_bytes_is_a_correctness_failure(tmp_path, monkeypatch,
                                                                   request):
  from hisparse_jax.bench import transfer  # noqa: PLC0415
  from hisparse_jax.kv_cache import transfer as kv_transfer  # noqa: PLC0415
  from kernels_pallas import block_copy  # noqa: PLC0415

  # The check finds nothing wrong with either path (2 layers, 16 blocks each way) ...
  spec = transfer.KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16",
                              block_size=4)
  rng = np.random.default_rng(0)
  assert transfer.kernel_check(spec, 16, rng) == {"xla": 0, "kernel": 0}
  # ... and sees a block copy that drops its last id: one block of K and of V per layer,
  # each direction.
  real = block_copy.copy_blocks
  monkeypatch.setattr(block_copy, "copy_blocks",
                      lambda s, d, si, di, **kw: real(s, d, si[:-1], di[:-1], **kw))
  programs = (kv_transfer._swap_in_program, kv_transfer._swap_out_program)  # noqa: SLF001
  for cached in programs:  # (built with the real kernel above; again after this test)
    cached.cache_clear()
  request.addfinalizer(lambda: [cached.cache_clear() for cached in programs])
  assert transfer.kernel_check(spec, 16, rng) == {"xla": 0, "kernel": 2 * 2 * 2}
  out = tmp_path / "k.json"
  assert gbh.main(["--size=smoke", "--out", str(out), "--only", "transfer_kernel"]) == 1
  result = json.loads(out.read_text())
  assert result["summary"]["tokens_equal_where_required"] is False
  assert ("transfer_kernel", "timing") in {(s["part"], s["what"]) for s in result["skipped"]}

"""`make gpu-bench`'s kernel part (hisparse_jax/bench/gpu_bench_kernels.py) on a CPU (its smoke
size end to end is checked in test_gpu_bench.py, from the whole command's run): a spent
budget skips cleanly; a failing impl of ours fails the run, a failing peer is a
skip; and the GPU impls' calls at the full sizes lower for an H200 from this host."""

import functools
import json
import sys

import jax
import jax.numpy as jnp
import pytest
from bench_helpers import GPU_BENCH_EXPECTED as EXPECTED

from hisparse_jax.bench import gpu_bench_cases as cases
from hisparse_jax.bench import gpu_bench_kernels as gbk
from kernels_pallas import backend


def test_a_spent_budget_skips_what_is_left_and_exits_cleanly(tmp_path):
  out = tmp_path / "kernels.json"
  assert gbk.main(["--size=smoke", "--budget_s=0", "--only=ragged,sparse_mla",
                   f"--out={out}"]) == 0
  result = json.loads(out.read_text())
  assert result["rows"] == []
  assert {(s["kernel"], s["impl"]) for s in result["skipped"]} == {
      ("ragged", "all"), ("sparse_mla", "all")}
  assert all(s["reason"].startswith("budget") for s in result["skipped"])


def test_unknown_kernels_are_refused_naming_the_flag(capsys, tmp_path):
  with pytest.raises(SystemExit) as e:
    gbk.main(["--only=paged,warp", f"--out={tmp_path / 'x.json'}"])
  assert e.value.code == 2
  assert "--only: unknown kernel(s) warp" in capsys.readouterr().err


def test_a_failing_kernel_of_ours_fails_the_run_and_a_failing_peer_is_a_skip():
  bench = gbk.Bench("smoke", 60.0, reps=1)
  x = jnp.ones((4,), jnp.float32)

  def boom(x):
    raise RuntimeError("no such kernel")

  ident = jax.jit(lambda x: x)
  case = cases.Case("ragged", {"n": 4}, 16, 8, "float32", cases.Impl(ident, (x,)), {
      "xla-reference": cases.Impl(ident, (x,)), "ours-triton": cases.Impl(boom, (x,)),
      "peer": cases.Impl(boom, (x,)), "wrong": cases.Impl(jax.jit(lambda x: 2 * x), (x,))},
      reference_impl="xla-reference")
  bench.run_case(case)
  rows = {r["impl"]: r for r in bench.rows}
  assert rows["xla-reference"]["ok"] and not rows["wrong"]["ok"]
  assert not rows["ours-triton"]["ok"] and "no such kernel" in rows["ours-triton"]["note"]
  assert [s["impl"] for s in bench.skipped] == ["peer"]
  assert len(bench.failures) == 2  # ours raised, "wrong" is off by its whole value


S = jax.ShapeDtypeStruct


def _lower(fn, *args):
  with backend.abstract_gpu():  # the H200 the Pallas lowerings target
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def test_the_gpu_impls_lower_for_an_h200_at_the_full_sizes():
  """What only a GPU runs (Triton and Mosaic GPU kernels, cuDNN) at FULL's shapes, lowered
  from this host: a typo or a refused shape fails here, not in the first GPU minute."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu

  from kernels_pallas.paged_attention import paged_attention
  from kernels_pallas.paged_attention_mgpu import paged_attention_mgpu
  from kernels_pallas.ragged_paged_attention import ragged_paged_attention
  from kernels_pallas.sparse_mla import sparse_mla_decode
  from kernels_pallas.sparse_mla_mgpu import sparse_mla_decode_mgpu

  m = cases.FULL["model"]
  hq, hkv, d, bs, bf, i32 = (m["num_q_heads"], m["num_kv_heads"], m["head_dim"],
                             m["block_size"], jnp.bfloat16, jnp.int32)
  batch, ctx = cases.FULL["paged"][1]
  nb = batch * ctx // bs + 1
  q, pages = S((batch, hq, d), bf), S((nb, bs, hkv, d), bf)
  tables, lens = S((batch, ctx // bs), i32), S((batch,), i32)
  _lower(functools.partial(paged_attention, interpret=False), q, pages, pages, tables, lens)
  _lower(paged_attention_mgpu, q, pages, pages, tables, lens)
  by_head = S((hkv, nb, bs, d), bf)
  _lower(functools.partial(cases._jax_paged, interpret=False), q, by_head, by_head, tables,
         lens)
  scales = S((hkv, nb, bs), jnp.float32)
  for dtype in (jnp.int8, jnp.float8_e4m3fn):
    pages8 = S((hkv, nb, bs, d), dtype)
    _lower(functools.partial(cases._jax_paged, interpret=False), q, pages8, pages8, tables,
           lens, scales, scales)
  _lower(functools.partial(cases._jax_decode, interpret=False), q, S((batch, hkv, ctx, d), bf),
         S((batch, hkv, ctx, d), bf), lens)
  kc = S((batch, ctx, hkv, d), bf)
  _lower(functools.partial(cases._sdpa_decode, implementation="cudnn"), q, kc, kc)
  r = cases.FULL["ragged"]
  rows = len(r["q_lens"])
  _lower(functools.partial(ragged_paged_attention, interpret=False),
         S((sum(r["q_lens"]), hq, d), bf), pages, pages, S((rows, max(r["kv_lens"]) // bs), i32),
         S((rows,), i32), S((rows + 1,), i32))
  seq = cases.FULL["prefill"]["seq"]
  _lower(functools.partial(ragged_paged_attention, interpret=False), S((seq, hq, d), bf),
         S((seq // bs + 1, bs, hkv, d), bf), S((seq // bs + 1, bs, hkv, d), bf),
         S((1, seq // bs), i32), S((1,), i32), S((2,), i32))
  qp, kp = S((1, seq, hq, d), bf), S((1, seq, hkv, d), bf)
  _lower(functools.partial(cases._sdpa, implementation="cudnn", causal=True), qp, kp, kp)
  config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                       causal=True)
  f16 = [S(x.shape, jnp.float16) for x in (qp, kp, kp)]
  _lower(functools.partial(attention_mgpu.attention, config=config), *f16)
  c = cases.FULL["sparse_mla"]
  width = c["rank"] + c["rope"]
  _lower(functools.partial(sparse_mla_decode, sm_scale=width**-0.5, kv_lora_rank=c["rank"],
                           interpret=False),
         S((c["batch"], c["heads"], width), bf),
         S((c["batch"] * c["context"] // c["block_size"] + 1, c["block_size"], 1, width), bf),
         S((c["batch"], c["topk"]), i32))
  _lower(functools.partial(sparse_mla_decode_mgpu, sm_scale=width**-0.5,
                           kv_lora_rank=c["rank"]),
         S((c["batch"], c["heads"], width), bf),
         S((c["batch"] * c["context"] // c["block_size"] + 1, c["block_size"], 1, width), bf),
         S((c["batch"], c["topk"]), i32))


def test_on_a_hopper_gpu_every_impl_is_built_but_the_decode_attention_mgpu():
  """The GPU-only branches of the case builders (Mosaic GPU, cuDNN), built (not run) with a
  Hopper's Env at the smoke sizes: only what cannot apply is skipped there."""
  from hisparse_jax.bench import gpu_bench_select

  env = cases.Env(on_gpu=True, sm90=True, why_not_gpu="", why_not_sm90="")
  # (the kernels whose builders branch on the device; the others build the same anywhere)
  builders = {"paged": cases.paged_cases, "prefill": cases.prefill_cases,
              "sparse_mla": cases.sparse_mla_cases, "select": gpu_bench_select.select_cases}
  for kernel, build in builders.items():
    for case in build(cases.SMOKE, env):
      assert set(case.impls) | set(case.skipped) >= EXPECTED[kernel] - {
          "torch-flash", "torch-cudnn"}, kernel
      skipped = set(case.skipped)
      assert skipped == {"paged": {"jax-mgpu-attention"}, "prefill": set(),
                         "sparse_mla": set(), "select": {"cpp-cpu"}}[kernel], (
                             kernel, case.skipped)


def test_a_torch_peer_past_its_time_keeps_the_shapes_it_finished(tmp_path, monkeypatch):
  """gpu_bench_torch prints everything so far after each shape: a run cut by its timeout
  reports the finished shapes as rows and the rest as skipped, with the reason."""
  spec = cases.torch_specs(cases.SMOKE, ["paged", "prefill"])
  first = spec[0]
  row = {"kernel": first["kernel"], "impl": "torch-flash", "shape": first["shape"],
         "median_ms": 1.0, "min_ms": 0.9, "max_abs_err": 1e-3, "ref_max_abs": 1.0,
         "timer": "cuda-events", "note": "stub"}
  script = tmp_path / "slow_torch.py"
  script.write_text("import json, sys, time\n"
                    f"print(json.dumps({json.dumps({'rows': [row], 'skipped': []})}))\n"
                    "sys.stdout.flush()\ntime.sleep(60)\n")
  monkeypatch.setattr(gbk, "TORCH_SCRIPT", script)
  monkeypatch.setattr(gbk, "find_torch_python", lambda explicit: (sys.executable, ""))
  bench = gbk.Bench("smoke", 4.0, reps=1)  # the peer's share: half of what is left
  bench.run_torch(["paged", "prefill"], None)
  assert [(r["impl"], r["ok"], r["median_ms"]) for r in bench.rows] == [
      ("torch-flash", True, 1.0)]
  late = {(s["kernel"], s["impl"]) for s in bench.skipped}
  assert late == {("paged", "torch-cudnn"), ("prefill", "torch-flash"),
                  ("prefill", "torch-cudnn")}
  assert all("ran past" in s["reason"] for s in bench.skipped)


def test_ragged_accounts_for_ours_mgpu_skipped_off_hopper(tmp_path):
  out = tmp_path / "kernels.json"
  assert gbk.main(["--size=smoke", "--only=ragged", f"--out={out}"]) == 0
  result = json.loads(out.read_text())
  ran = {r["impl"] for r in result["rows"]}
  skipped = {s["impl"]: s["reason"] for s in result["skipped"]}
  assert ran | set(skipped) == EXPECTED["ragged"] and all(r["ok"] for r in result["rows"])
  assert "ours-mgpu" not in ran  # CPU: the Mosaic GPU kernel runs on sm_90 only
  assert skipped["ours-mgpu"].startswith("Mosaic GPU kernel: "), skipped

"""`make gpu-bench`'s kernel part (hisparse_jax/bench/gpu_bench_kernels.py) on a CPU (its smoke
size end to end is checked in test_gpu_bench.py, from the whole command's run): a spent
budget skips cleanly; a failing impl of ours fails the run, a failing peer is a
skip; and the GPU impls' calls at the full sizes lower for an H200 from this host. The
library peers (gpu_bench_peers.py: tokamax, jax-linear-attention) lower and compile for an
H200 at the full sizes, tokamax's xla implementation matches the references on the CPU,
and a library that does not import or refuses a shape is a skip with its reason."""

import dataclasses
import functools
import importlib.util
import json
import re
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from bench_helpers import GPU_BENCH_EXPECTED as EXPECTED

from hisparse_jax.bench import gpu_bench_cases as cases
from hisparse_jax.bench import gpu_bench_kernels as gbk
from hisparse_jax.bench import gpu_bench_peers as peers
from hisparse_jax.sparse import indexer
from hisparse_jax.sparse.config import HiSparseConfig
from kernels_pallas import backend
from kernels_pallas.block_key_bounds import QuantizedBounds
from kernels_pallas.block_scores import block_scores


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
LIBRARY_IMPLS = {"tokamax": set(peers.TOKAMAX_IMPLS),
                 "jla": {"jla-mgpu-attention", "jla-dsa"}}


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
  # jax's own Triton ops (peers) where this jax has them: 0.12.1 removed ops.gpu's
  # paged_attention and decode_attention (deprecated; tokamax carries them), and the bench
  # then lists the two peers as skipped with the ImportError (test_gpu_bench.py's run).
  if importlib.util.find_spec("jax.experimental.pallas.ops.gpu.paged_attention"):
    by_head = S((hkv, nb, bs, d), bf)
    _lower(functools.partial(cases._jax_paged, interpret=False), q, by_head, by_head, tables,
           lens)
    scales = S((hkv, nb, bs), jnp.float32)
    for dtype in (jnp.int8, jnp.float8_e4m3fn):
      pages8 = S((hkv, nb, bs, d), dtype)
      _lower(functools.partial(cases._jax_paged, interpret=False), q, pages8, pages8, tables,
             lens, scales, scales)
  if importlib.util.find_spec("jax.experimental.pallas.ops.gpu.decode_attention"):
    _lower(functools.partial(cases._jax_decode, interpret=False), q,
           S((batch, hkv, ctx, d), bf), S((batch, hkv, ctx, d), bf), lens)
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
  # The select's GPU path: the bounds scored in place (Triton), then XLA's top-k ranking.
  for args in _select_args():  # ours-triton's, then ours-triton-int8's
    _lower(_select(), *args)


def _select():
  sel = cases.FULL["select"]
  blocks = HiSparseConfig(top_k_tokens=sel["top_k_tokens"]).blocks(
      cases.FULL["model"]["block_size"])
  return lambda *a: indexer.select_rows(*a, blocks, "union", scores_kernel=block_scores)


def _select_args():
  """The llama union select's GPU impls' arguments at FULL: bfloat16 bounds (ours-triton),
  int8 QuantizedBounds (ours-triton-int8)."""
  m, sel = cases.FULL["model"], cases.FULL["select"]
  hq, hkv, d, bf = m["num_q_heads"], m["num_kv_heads"], m["head_dim"], jnp.bfloat16
  per_row = sel["context"] // m["block_size"]
  num_rows = sel["batch"] * per_row + 1
  rest = (S((sel["batch"], per_row), jnp.int32), S((sel["batch"],), jnp.int32))
  q = S((sel["batch"], hq, d), bf)
  return [(q, S((num_rows, 2, hkv, d), bf), *rest),
          (q, QuantizedBounds(S((num_rows, 2, hkv, d), jnp.int8),
                              S((num_rows, 2, hkv, 1), jnp.float32)), *rest)]


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="XLA's GPU compiler is not installed (jax[cuda13])")
def test_the_select_rows_compile_for_an_h200_at_the_full_size():
  """ours-triton and ours-triton-int8 of the llama union select (block_scores in place,
  then XLA's top-k), compiled deviceless at FULL: one Triton call each, no gathered
  bounds among the temporaries (a gathered copy would be >= 264 MiB)."""
  from hisparse_jax.engine.gpu_target import load_target

  target = load_target("h200")
  for impl, args in zip(("ours-triton", "ours-triton-int8"), _select_args(), strict=True):
    with target.kernel_context():
      lowered = jax.jit(_select()).trace(*args).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 1, impl
    temp = target.compile(lowered).get_compiled_memory_stats().temp_size_in_bytes
    print(f"select {impl}: temporaries {temp} B")
    assert temp < 128 * 2**20, (impl, temp)


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="XLA's GPU compiler is not installed (jax[cuda13])")
def test_the_paged_tuning_rows_compile_for_an_h200_at_the_first_shape():
  """The Triton knobs (more keys a step, 8 warps, 3 stages: shared memory grows with
  them) and the Mosaic GPU kernel's (128 keys a step, 3 and 4 pipeline slots), compiled by
  XLA's GPU compiler deviceless at the paged case's first FULL shape, where make
  gpu-bench times them."""
  from hisparse_jax.engine.gpu_target import load_target
  from kernels_pallas.paged_attention import paged_attention
  from kernels_pallas.paged_attention_mgpu import paged_attention_mgpu

  m = cases.FULL["model"]
  hq, hkv, d, bs = m["num_q_heads"], m["num_kv_heads"], m["head_dim"], m["block_size"]
  batch, ctx = cases.FULL["paged"][0]
  nb = batch * ctx // bs + 1
  pages = S((nb, bs, hkv, d), jnp.bfloat16)
  args = (S((batch, hq, d), jnp.bfloat16), pages, pages, S((batch, ctx // bs), jnp.int32),
          S((batch,), jnp.int32))
  target = load_target("h200")
  fns = [functools.partial(paged_attention, interpret=False, **knobs)
         for knobs in cases.TRITON_TUNING.values()]
  fns += [functools.partial(paged_attention_mgpu, **knobs)
          for knobs in cases.MGPU_TUNING.values()]
  for fn in fns:
    with target.kernel_context():
      lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert target.compile(lowered) is not None, fn


def test_on_a_hopper_gpu_every_impl_is_built_but_the_decode_attention_mgpu():
  """The GPU-only branches of the case builders (Mosaic GPU, cuDNN), built (not run) with a
  Hopper's Env at the smoke sizes: only what cannot apply is skipped there."""
  from hisparse_jax.bench import gpu_bench_select

  env = cases.Env(on_gpu=True, sm90=True, why_not_gpu="", why_not_sm90="")
  # (the kernels whose builders branch on the device; the others build the same anywhere)
  builders = {"paged": cases.paged_cases, "prefill": cases.prefill_cases,
              "sparse_mla": cases.sparse_mla_cases, "select": gpu_bench_select.all_select_cases}
  for kernel, build in builders.items():
    for case in build(cases.SMOKE, env):
      assert set(case.impls) | set(case.skipped) >= EXPECTED[kernel] - {
          "torch-flash", "torch-cudnn"}, kernel
      skipped = set(case.skipped)
      # (the library peers' impls skip, naming the import error, where not installed)
      absent = {impl for lib, impls in LIBRARY_IMPLS.items() if peers.library(lib)[0] is None
                for impl in impls} & EXPECTED[kernel]
      assert all("does not import" in case.skipped[i] for i in absent), case.skipped
      # (the union select's block bounds have no fp8 form; DSA's keys have both)
      dsa = kernel == "select" and case.shape["selection"] == "lightning"
      assert skipped - absent == {
          "paged": {"jax-mgpu-attention", "jla-mgpu-attention"}, "prefill": set(),
          "sparse_mla": {"jla-dsa"},
          "select": {"cpp-cpu", *(() if dsa else ("ours-triton-fp8",))}}[kernel] - absent, (
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


# -- the library peers (#54): tokamax and jax-linear-attention ---------------------------
MGPU_CALL, TRITON_CALL = "mosaic_gpu_v2", "__gpu$xla.gpu.triton"
needs_gpu_compiler = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
    reason="XLA's GPU compiler is not installed (jax[cuda13])")


@dataclasses.dataclass(frozen=True)
class _H200:
  """What tokamax reads of jax's default device to pick and size its kernels (compute
  capability: the sm90 kernels; SM count: the persistent grid), as an H200 has them."""
  platform: str = "gpu"
  compute_capability: str = "9.0"
  core_count: int = 132
  device_kind: str = "NVIDIA H200"


def _compile_for_h200(fn, *args) -> list[str]:
  """The custom calls of fn lowered for the H200 target, after XLA's GPU compiler compiled
  it deviceless (GpuTarget.compile)."""
  from hisparse_jax.engine.gpu_target import load_target

  target = load_target("h200")
  with target.kernel_context():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  assert target.compile(lowered) is not None
  return re.findall(r"custom_call @([\w$.]+)\(", lowered.as_text())


def _full_shapes():
  m = cases.FULL["model"]
  hq, hkv, d, bf = m["num_q_heads"], m["num_kv_heads"], m["head_dim"], jnp.bfloat16
  seq = cases.FULL["prefill"]["seq"]
  batch, ctx = cases.FULL["paged"][1]
  return ((S((1, seq, hq, d), bf), S((1, seq, hkv, d), bf)),
          (S((batch, hq, d), bf), S((batch, ctx, hkv, d), bf)))


@needs_gpu_compiler
def test_tokamax_peers_lower_and_compile_for_an_h200_at_the_full_sizes():
  """tokamax's Mosaic GPU and Triton attention as the bench calls them (8k causal prefill;
  decode at batch 32 x 32k over contiguous K/V), each one kernel call of its kind, built by
  tokamax's own heuristics for an sm_90 device with 132 SMs and compiled deviceless."""
  tokamax = pytest.importorskip("tokamax")
  from tokamax._src import gpu_utils

  (qp, kp), (qd, kd) = _full_shapes()
  with tokamax.config.cross_compile(True), mock.patch(
      "jax.extend.backend.get_default_device", lambda: _H200()):
    assert gpu_utils.is_sm90()  # (the kernel module tokamax picks: sm90's)
    for impl, call in (("mosaic_gpu", MGPU_CALL), ("triton", TRITON_CALL)):
      prefill = _compile_for_h200(functools.partial(peers.tokamax_sdpa, implementation=impl,
                                                    causal=True), qp, kp, kp)
      decode = _compile_for_h200(functools.partial(peers.tokamax_decode, implementation=impl),
                                 qd, kd, kd)
      other = TRITON_CALL if call == MGPU_CALL else MGPU_CALL
      for calls in (prefill, decode):
        assert call in calls and other not in calls, (impl, calls)


@needs_gpu_compiler
def test_jla_attention_lowers_and_compiles_for_an_h200_at_the_prefill_size():
  """jax-linear-attention's flash_attention takes the 8k GQA prefill (here it refuses only
  for want of a GPU) and, on an H200's 132 SMs, runs its persistent forward: one Mosaic GPU
  call, compiled deviceless."""
  attention = pytest.importorskip("jla.ops.mosaic_gpu.attention")
  from jla.ops.mosaic_gpu import attention_persistent

  (qp, kp), _ = _full_shapes()
  assert attention.supported(qp, kp, kp) == "the Mosaic GPU attention kernel needs a CUDA GPU"
  with mock.patch.object(attention, "supported", lambda q, k, v: None), \
      mock.patch.object(attention_persistent, "sm_count", lambda: 132), \
      mock.patch.object(attention_persistent, "forward",
                        wraps=attention_persistent.forward) as persistent:
    calls = _compile_for_h200(peers.jla_flash, qp, kp, kp)
  assert persistent.called and calls.count(MGPU_CALL) == 1, calls


def test_what_jla_cannot_take_is_a_skip_in_its_own_words():
  """No decode form (q as long as k) and no MLA sparse decode (head dims 64 / 128, v = k):
  the reasons are jla's `supported` answers at the engine's shapes."""
  pytest.importorskip("jla.ops.mosaic_gpu.dsa")
  c = cases.FULL["sparse_mla"]
  why = peers.sparse_mla_skips(c["batch"], c["heads"], c["rank"], c["rope"], c["topk"],
                               jnp.dtype(jnp.bfloat16))["jla-dsa"]
  assert "incompatible q (32, 1, 128, 576)" in why, why
  assert "head_dim must be 64 or 128; got 576" in why, why
  env = cases.Env(on_gpu=True, sm90=True, why_not_gpu="", why_not_sm90="")
  case = next(cases.paged_cases(cases.SMOKE, env))
  assert "must be [B, T, Hkv, D] matching q (2, 1, 8, 64)" in case.skipped["jla-mgpu-attention"]


def test_tokamax_xla_matches_the_references_on_a_cpu_and_its_gpu_kernels_skip():
  """The one library impl with a CPU path, run as the bench runs it at the smoke sizes
  (paged decode and causal prefill over the gathered K/V), checked against each case's
  reference; the GPU-only ones are skipped with the reason."""
  pytest.importorskip("tokamax")
  bench = gbk.Bench("smoke", 60.0, reps=1)
  for build in (cases.paged_cases, cases.prefill_cases):
    case = next(build(cases.SMOKE, bench.env))
    for impl in peers.TOKAMAX_GPU_ONLY:
      assert case.skipped[impl].endswith("GPU-only, and jax's platform is cpu"), case.skipped
    case.impls = {k: v for k, v in case.impls.items()
                  if k in ("tokamax-xla", case.reference_impl)}
    bench.run_case(case)
  rows = {(r["kernel"], r["impl"]): r for r in bench.rows}
  assert bench.failures == [] and "tokamax-xla" not in {s["impl"] for s in bench.skipped}
  for kernel in ("paged", "prefill"):
    row = rows[(kernel, "tokamax-xla")]
    assert row["ok"] and row["ref_max_abs"] > 0 and "implementation='xla'" in row["note"], row


def test_a_library_that_does_not_import_is_a_skip_naming_the_error(monkeypatch):
  monkeypatch.setattr(peers, "library", lambda name: (
      None, f"{name} does not import (ModuleNotFoundError: No module named {name!r})"))
  env = cases.Env(on_gpu=True, sm90=True, why_not_gpu="", why_not_sm90="")
  prefill = next(cases.prefill_cases(cases.SMOKE, env))
  mla = next(cases.sparse_mla_cases(cases.SMOKE, env))
  for case, impls in ((prefill, {*peers.TOKAMAX_IMPLS, "jla-mgpu-attention"}),
                      (mla, {"jla-dsa"})):
    assert impls <= set(case.skipped) and not impls & set(case.impls), case.kernel
    assert all("does not import (ModuleNotFoundError" in case.skipped[i] for i in impls)

"""`hisparse-jax bench --suite=all`: every suite of `all` at smoke size writes its JSON
fields; the README's Results section and plot match the committed run; the bench CLI's bad
flags. The suites run by name only are test_bench_named_suites.py's. (No timing is
asserted: a benchmark reports figures, it does not test them.)"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from bench_helpers import PNG_MAGIC, REPO, positive
from matplotlib import image as plt_image

from hisparse_jax.bench import (
  capacity,
  common,
  decode,
  engine_vs_vllm,
  hot_buffer,
  report,
)
from hisparse_jax.entrypoints.cli import bench as bench_cmd
from hisparse_jax.kv_cache.kv_pool import KVCacheSpec
from kernels_pallas import bench as kernel_bench

RESULTS_JSON = os.path.join(REPO, "results", "bench_cpu.json")
RESULTS_PNG = os.path.join(REPO, "results", "decode_step_vs_context.png")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  """One in-process run of every suite at smoke size (the JSON as written, and paths)."""
  out_dir = tmp_path_factory.mktemp("bench")
  out, plot = str(out_dir / "bench.json"), str(out_dir / "decode.png")
  with pytest.MonkeyPatch.context() as mp:
    # Interpret-mode kernels cost time per grid step: a smaller "small" size keeps this
    # smoke run short (kernels_pallas.bench itself is what the suite runs either way).
    mp.setitem(kernel_bench.SIZES, "small", kernel_bench.Size(2, 4, 2, 16, 8, 4, 16, "float32"))
    # The vLLM peer's venv is not part of `make test`: a second engine process stands in.
    mp.setattr(engine_vs_vllm, "PEER", "hisparse")
    bench_cmd.run_suites(list(bench_cmd.SUITES), "smoke", 16, out, plot)
  with open(out) as f:
    return json.load(f), plot


def test_all_suites_ran_and_machine_is_named(smoke):
  result, _ = smoke
  assert list(result["suites"]) == list(bench_cmd.SUITES)
  m = result["machine"]
  assert m["cpu_cores"] >= 1 and m["jax_version"] and len(m["load_avg_1_5_15"]) == 3
  assert set(result["seconds"]) == {*bench_cmd.SUITES, "total"}


def test_transfer_fields(smoke):
  t = smoke[0]["suites"]["transfer"]
  assert positive(t["h2d_vs_memcpy"], t["d2h_vs_memcpy"])
  assert len(t["profile"]) == 5
  cfg = t["config"]
  assert len(t["rows"]) == 2 * len(cfg["block_sizes"]) * len(cfg["num_blocks"])
  for row in t["rows"]:
    spec = KVCacheSpec(cfg["num_layers"], cfg["num_kv_heads"], cfg["head_dim"], cfg["dtype"],
                       row["block_size"])
    assert row["bytes"] == row["num_blocks"] * spec.bytes_per_block
    assert row["ratio_vs_memcpy"] == pytest.approx(row["numpy_ms"] / row["engine_ms"])


def test_decode_fields(smoke):
  d = smoke[0]["suites"]["decode_sparse_vs_dense"]
  size = decode.SIZES["smoke"]
  assert [r["context"] for r in d["rows"]] == list(size.contexts)
  top_k_blocks = math.ceil(size.top_k_tokens / d["block_size"])
  for r in d["rows"]:
    assert positive(r["dense_over_sparse"], r["bytes_bound"], r["dense_ms"], r["sparse_ms"])
    assert r["blocks_attended_sparse"] == top_k_blocks
    assert r["blocks_attended_dense"] == r["context"] // d["block_size"]
    # The sparse side is offloaded and warm: its cold step loaded, its timed steps not.
    assert r["cold_step_h2d_bytes"] > 0 and r["h2d_bytes_per_step"] == 0
  assert set(d["bytes_bound_by_block_size"]) == {str(b) for b in decode.BOUND_BLOCK_SIZES}
  assert len(d["profile"]) == 4 and isinstance(d["goal_met"], bool)
  # The longest context's sparse step again over int8 key bounds: fewer bound bytes.
  int8 = d["rows"][-1]["int8_bounds"]
  assert positive(int8["sparse_ms"], int8["dense_over_sparse"])
  assert int8["indexer_bytes"] < d["rows"][-1]["indexer_bytes"]
  assert int8["bytes_bound"] > d["rows"][-1]["bytes_bound"]
  assert all("int8_bounds" not in r for r in d["rows"][:-1])


def test_hot_buffer_moves_the_misses(smoke):
  h = smoke[0]["suites"]["hisparse_hot_buffer"]
  size = hot_buffer.SIZES["smoke"]
  assert [r["hit_rate"] for r in h["rates"]] == list(size.rates)
  assert h["loads"] == "block copies (one memory)"  # CPU
  by_rate = {r["hit_rate"]: r for r in h["rates"]}
  assert by_rate[0.0]["measured_hit_rate"] == 0.0 and by_rate[0.0]["missed_blocks_per_step"] > 0
  assert by_rate[0.0]["missed_blocks_per_step"] == h["cold_step_misses"]
  assert by_rate[1.0]["measured_hit_rate"] == 1.0
  assert by_rate[1.0]["missed_blocks_per_step"] == by_rate[1.0]["h2d_bytes_per_step"] == 0
  misses = [r["missed_blocks_per_step"] for r in h["rates"]]
  assert misses == sorted(misses, reverse=True)
  for r in h["rates"]:
    assert r["block_bytes"] == 2 * d_block_bytes(h)
    # What crossed = the misses x block bytes (block copies: exactly, no bucket).
    assert r["loaded_blocks_per_step"] == r["missed_blocks_per_step"]
    assert r["h2d_bytes_per_step"] == r["missed_blocks_per_step"] * r["block_bytes"]
    assert positive(r["step_ms"])


def d_block_bytes(h):
  """K (or V) bytes of one block of one layer of the suite's model: block x kv x d x 4."""
  model = hot_buffer.SIZES["smoke"].model
  return h["block_size"] * model.num_kv_heads * model.head_dim * 4


def test_engine_vs_vllm_fields(smoke):
  e = smoke[0]["suites"]["engine_vs_vllm"]
  assert e["peer"] == "hisparse" and set(e["engines"]) == {"hisparse_jax", "vllm"}
  sizes = engine_vs_vllm.SIZES["smoke"].workloads
  assert list(e["workloads"]) == list(sizes) == ["tiny", "real_tiny"]
  # the real model's stand-in went through the conversion both engines load
  assert list(e["converted"]) == [engine_vs_vllm.SMOKE_GGUF]
  assert set(e["engines_by_model"]["vllm"]) == {"hisparse-tiny", engine_vs_vllm.SMOKE_GGUF}
  for name, w in e["workloads"].items():
    size = sizes[name]
    assert w["workload"] == dataclasses.asdict(size) and w["reps"] == 1
    assert w["tokens_identical"] is True
    rows = w["rows"]
    for row in rows.values():
      assert positive(row["median_s"], row["tokens_per_s"], row["ttft_p50_ms"])
      assert row["tokens_per_s"] == pytest.approx(
          size.num_prompts * size.new_tokens / row["median_s"])
    assert w["speed_vs_vllm"] == pytest.approx(
        rows["hisparse_jax"]["tokens_per_s"] / rows["vllm"]["tokens_per_s"])


def test_engine_vs_vllm_names_the_first_differing_token():
  same = [[5, 6, 7], [8, 9]]
  assert engine_vs_vllm._first_difference(same, [[5, 6, 7], [8, 9]]) is None
  assert engine_vs_vllm._first_difference(same, [[5, 6, 7], [8, 4]]) == (
      "request 1, output token 1: [9] vs [4]")
  prompts = engine_vs_vllm.make_prompts(engine_vs_vllm.Workload(3, 40, 1), seed=0)
  assert [len(p) for p in prompts] == [40, 40, 40] and all(p[0] == 1 for p in prompts)
  assert prompts == engine_vs_vllm.make_prompts(engine_vs_vllm.Workload(3, 40, 1), seed=0)


def test_engine_vs_vllm_text_prompts_are_english_cut_to_length():
  from models import testing
  from models.tokenizer import Tokenizer

  tok = Tokenizer(testing.byte_level_tokenizer(320), bos_token_id=None, eos_token_ids=())
  w = engine_vs_vllm.Workload(3, 200, 1, engine_vs_vllm.SMOKE_GGUF)
  prompts = engine_vs_vllm.make_text_prompts(w, 5, tok)
  assert [len(p) for p in prompts] == [200] * 3 and len({tuple(p) for p in prompts}) == 3
  assert prompts == engine_vs_vllm.make_text_prompts(w, 5, tok)
  text = tok.decode(prompts[0])
  assert text[0].isupper() and ". " in text and text.count(" ") > 30
  assert engine_vs_vllm.SIZES["full"].workloads["real_long"].converted
  assert not engine_vs_vllm.SIZES["full"].workloads["long"].converted


def test_bytes_bound_by_hand():
  """64k tokens, 4 layers x 2 KV heads x 64 float32, block 16, top-k 1,024: dense reads
  65,536 tokens; sparse 64 blocks of 16 + one bound pair per block (4,096 blocks, 1/16 of
  a block's K+V each at float32 / block 16): 65,536 / (1,024 + 4,096) = 12.8."""
  spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", block_size=16)
  b = decode.kv_bytes(spec, 65536, batch=2, top_k_tokens=1024)
  assert b["dense_kv_bytes"] == 2 * 65536 * 4096
  assert b["sparse_kv_bytes"] == 2 * 1024 * 4096
  assert b["indexer_bytes"] == 2 * 4096 * 4096
  assert b["bytes_bound"] == pytest.approx(12.8)
  wide = decode.kv_bytes(KVCacheSpec(4, 2, 64, "float32", 64), 65536, 2, 1024)
  assert wide["bytes_bound"] == pytest.approx(32.0)  # 65,536 / (1,024 + 1,024)
  # Host loads count twice (read from the host pool, written to the hot buffer): 512
  # tokens' worth loaded -> 65,536 / (1,024 + 4,096 + 2 x 512) tokens' bytes.
  loading = decode.kv_bytes(spec, 65536, 2, 1024, h2d_bytes=2 * 512 * 4096)
  assert loading["bytes_bound"] == pytest.approx(65536 / (1024 + 4096 + 1024))


def test_capacity_fields(smoke):
  top = smoke[0]["suites"]["capacity_concurrency"]
  # Two workloads, the same fields: the prefill-heavy one at the top, the decode-heavy one
  # (more new tokens, the goal's) under `decode_heavy`.
  heavy = top["decode_heavy"]
  assert heavy["config"]["max_tokens"] == top["config"]["decode_max_tokens"]
  assert heavy["config"]["max_tokens"] > top["config"]["max_tokens"]
  assert top["goal_met"] == (heavy["throughput_ratio"] >= capacity.GOAL_THROUGHPUT_RATIO)
  for c in (top, heavy):
    _check_capacity_workload(c)


def _check_capacity_workload(c):
  assert positive(c["concurrency_ratio"], c["throughput_ratio"])
  for side in ("device_only", "hisparse_host_pool"):
    run = c[side]
    assert run["max_running"] >= 1
    assert run["generated_tokens"] == c["config"]["num_requests"] * c["config"]["max_tokens"]
    assert len(run["seconds_by_round"]) == c["config"]["reps"]
    # The decode-only steps are part of the run; the rest of it is prefill_s.
    assert 0 <= run["decode_s"] <= run["seconds"]
    assert 0 <= run["decode_tokens"] <= run["generated_tokens"]
    assert run["prefill_s"] == pytest.approx(run["seconds"] - run["decode_s"])
    assert run["seconds"] in run["seconds_by_round"]
  # Free decode steps can only make HiSparse's run shorter: the bound is >= the ratio.
  assert c["throughput_ratio_bound"] >= c["throughput_ratio"] * (1 - 1e-9)
  assert c["decode_throughput_ratio"] >= 0
  assert c["concurrency_ratio"] == pytest.approx(
      c["hisparse_host_pool"]["max_running"] / c["device_only"]["max_running"])


def test_engine_vs_hf_same_tokens(smoke):
  """Greedy decoding: the engine, transformers and the plain JAX loop agree exactly."""
  e = smoke[0]["suites"]["engine_vs_hf"]
  assert positive(e["tokens_per_s_ratio_vs_hf"], e["tokens_per_s_ratio_vs_dense_jax"])
  assert e["sequences_identical_to_engine"] == {"hf": 1.0, "dense_jax": 1.0}
  assert e["profile"]["engine_steps"] == e["config"]["new_tokens"]  # prefill samples the 1st
  assert len(e["profile"]["attention_ms_per_layer"]) == 2


def test_scheduler_overhead_fields(smoke):
  s = smoke[0]["suites"]["scheduler_overhead"]
  assert positive(s["host_us_per_seq_step"]) and s["wait_us_per_seq_step"] >= 0
  assert s["measured_steps"] == s["config"]["measured_steps"]
  ctx = s["by_context"]
  assert list(ctx["rows"]) == [str(c) for c in s["config"]["contexts"]]
  assert all(positive(r["host_us_per_step"], r["step_ms"]) for r in ctx["rows"].values())
  rows = [ctx["rows"][str(c)] for c in s["config"]["contexts"]]
  assert ctx["host_ratio_long_vs_short"] == pytest.approx(
      rows[-1]["host_us_per_step_cold"] / rows[0]["host_us_per_step_cold"])
  assert ctx["host_ratio_long_vs_short_warm"] == pytest.approx(
      rows[-1]["host_us_per_step"] / rows[0]["host_us_per_step"])
  assert s["running_seqs"] == s["config"]["num_seqs"]
  assert 1 <= len(s["profile"]) <= 8 and all("function" in p for p in s["profile"])


def test_serve_load_fields(smoke):
  """The served streams give the offline texts; the server drained and exited 0."""
  sl = smoke[0]["suites"]["serve_load"]
  assert sl["texts_equal"] and sl["server_exit_status"] == 0
  assert sl["server_compile_stalls"] >= 0 and sl["server_steps_on_covering_shape"] >= 0
  assert positive(sl["served_over_offline"], sl["served"]["output_tokens_per_s"],
                   sl["offline"]["output_tokens_per_s"], sl["served"]["ttft_s"]["p50"])
  assert len(sl["served_round_seconds"]) == len(sl["offline_round_seconds"]) == \
      sl["config"]["reps"]
  assert sl["served"]["seconds"] == pytest.approx(common.median(sl["served_round_seconds"]))
  assert sl["served_over_offline"] == pytest.approx(
      sl["offline"]["seconds"] / sl["served"]["seconds"])


def test_kernel_fields(smoke):
  k = smoke[0]["suites"]["kernel"]
  assert set(k["summary"]) == {"paged_attention", "ragged_paged_attention", "write_kv",
                               "block_key_bounds", "paged_attention int8",
                               "ragged_paged_attention int8", "sparse_mla_decode"}
  assert all(positive(v["pallas_over_reference"]) for v in k["summary"].values())
  assert positive(k["summary"]["paged_attention int8"]["pallas_over_float_cache"])
  rows = {(r["kernel"], r["impl"]): r for r in k["rows"]}
  # KV bytes of int8 values + a float32 scale per token and head: (d + 4) / (4 d) of the
  # float32 cache's; q and the output (float32) count alike in both.
  c = k["config"]
  qo = 2 * c["batch"] * c["num_q_heads"] * c["head_dim"] * 4
  f32, i8 = (rows[(n, "xla-reference")]["bytes_moved"] - qo
             for n in ("paged_attention", "paged_attention int8"))
  assert i8 / f32 == pytest.approx((c["head_dim"] + 4) / (4 * c["head_dim"]))


def test_plot_is_a_png(smoke):
  with open(smoke[1], "rb") as f:
    assert f.read(8) == PNG_MAGIC


def test_interleaved_rotates_the_order():
  calls = []
  times = common.interleaved({n: (lambda n=n: calls.append(n)) for n in "abc"}, reps=3,
                             warmup=0)
  assert calls == list("abc" "bca" "cab")
  assert all(len(t) == 3 for t in times.values())


@pytest.mark.parametrize("flags, message", [
    (["--suite=nope"], "--suite: unknown suite 'nope'"),
    (["--suite=kernel", "--bench_plot=x.png"], "--bench_plot:"),
])
def test_cli_bad_flags_exit_2(flags, message):
  proc = subprocess.run([sys.executable, "-m", "hisparse_jax", "bench", *flags], cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 2
  assert message in proc.stderr and "Traceback" not in proc.stderr


def test_readme_results_match_committed_json(tmp_path):
  """The README tables are the report of the committed JSON, and the committed plot is
  the plot of that JSON (redrawn here, compared pixel by pixel)."""
  with open(RESULTS_JSON) as f:
    result = json.load(f)
  assert list(result["suites"]) == list(bench_cmd.SUITES)  # one recorded `--suite=all` run
  with open(os.path.join(REPO, "README.md")) as f:
    readme = f.read()
  assert report.markdown(result) in readme
  redrawn = str(tmp_path / "redrawn.png")
  decode.plot(result["suites"]["decode_sparse_vs_dense"], redrawn)
  committed, fresh = plt_image.imread(RESULTS_PNG), plt_image.imread(redrawn)
  assert committed.shape == fresh.shape
  assert np.abs(committed - fresh).mean() < 0.01

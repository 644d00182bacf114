"""hisparse_throughput's long rows (#53): three engines at one device budget per length
(device-only, HiSparse admission "offload", admission "wait"). The smoke rows run the
real protocol on a tiny GGUF and are checked for their fields and for what a user would
see (offload runs more requests at once, at the capacity line's count, with host
selections); the must-show and the comparison are checked on hand-made rows. No timing
is asserted."""

import dataclasses
import json
import math

import pytest

from hisparse_jax.bench import hisparse_throughput as ht
from hisparse_jax.bench import report
from hisparse_jax.bench import throughput_long as tl
from hisparse_jax.entrypoints.cli import bench as bench_cmd
from hisparse_jax.entrypoints.cli import main as cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _finite_positive(*xs):
  return all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in xs)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out_dir = tmp_path_factory.mktemp("long")
  out, plot = str(out_dir / "long.json"), str(out_dir / "long.png")
  bench_cmd.run_suites(["hisparse_throughput"], "long_smoke", 16, out, plot)
  with open(out) as f:
    return json.load(f), plot


def test_smoke_rows_have_every_engine_at_one_device_budget(smoke):
  result, _ = smoke
  t = result["suites"]["hisparse_throughput"]
  size = tl.SIZES["long_smoke"]
  (row,) = t["lengths"]
  assert row["length"] == row["max_model_len"] == size.lengths[0]
  assert list(row["rows"]) == list(tl.ENGINES) == list(row["engines"])
  assert len(row["prompt_tokens"]) == size.num_prompts
  assert max(row["prompt_tokens"]) + size.new_tokens == row["request_tokens"] <= row["length"]
  # The same device blocks for every engine (the HiSparse two get their reserve on top).
  pools = row["pools"]
  assert pools["device_blocks"] == size.device_prompts * (pools["request_blocks"] + 1) + 1
  assert {e["device_blocks"] for e in row["engines"].values()} == {pools["device_blocks"]}
  gib = pools["device_kv_gib"]
  assert gib["HiSparse offload"] == gib["HiSparse wait"] > gib["device-only"]
  assert row["engines"]["device-only"]["hisparse"] is None
  for name, admission in tl.ADMISSION.items():
    hs = row["engines"][name]["hisparse"]
    assert hs["admission"] == admission
    assert hs["top_k_tokens"] == hs["hot_buffer_tokens"] == size.top_k_tokens
    assert row["engines"][name]["host_pool_gib"] == pytest.approx(pools["host_pool_gib"])


def test_smoke_rows_offload_runs_what_the_capacity_line_says(smoke):
  result, _ = smoke
  (row,) = result["suites"]["hisparse_throughput"]["lengths"]
  size = tl.SIZES["long_smoke"]
  dense, offload, wait = (row["rows"][n] for n in tl.ENGINES)
  assert dense["max_decoding"] == size.device_prompts
  runs = offload["hisparse_runs_at_once"]
  assert f"HiSparse runs {runs} at once" in offload["capacity_line"]
  assert offload["max_decoding"] == min(runs, size.num_prompts) > dense["max_decoding"]
  assert offload["offloads"] > 0 and offload["host_blocks_selected"] > 0
  assert wait["hisparse_runs_at_once"] is None and dense["hisparse_runs_at_once"] is None
  assert "HiSparse admission 'wait'" in wait["capacity_line"]
  assert wait["max_decoding"] < offload["max_decoding"]
  assert dense["host_blocks_selected"] == dense["offloads"] == 0


def test_smoke_rows_figures_and_answers(smoke):
  result, plot = smoke
  t = result["suites"]["hisparse_throughput"]
  (row,) = t["lengths"]
  size = tl.SIZES["long_smoke"]
  for r in row["rows"].values():
    assert _finite_positive(r["decode_tokens_per_s"], r["e2e_tokens_per_s"], r["seconds"],
                            r["warm_up_seconds"], r["ttft_p50_ms"])
    assert r["decode_steps"] >= 1 and 0 < r["decode_share"] <= 1
    assert r["decode_tokens"] <= r["decode_steps"] * size.num_prompts
    assert r["new_step_shapes"] >= 0 and "token_ids" not in r
    assert [a["depth"] for a in r["answers"]] == tl.depths(size.num_prompts)
    assert all(len(a["key"]) == 5 and a["right"] == (a["answer"] == a["key"])
               for a in r["answers"])
    assert r["num_right"] == sum(a["right"] for a in r["answers"])
  assert all(_finite_positive(x) for x in row["ratios"].values())
  for a in row["answers"].values():
    assert a["answers_equal_device_only"] == (not a["answers_differ"])
    assert 0 <= a["tokens_identical_to_device_only"] <= size.num_prompts
  assert t["must_show"] is None  # (no 6k row at smoke size)
  printed = ht.format_table(t)
  assert printed.count("HiSparse offload") == 1 and "offload decode vs device-only" in printed
  text = report.markdown(result)
  assert "HiSparse admission by offload (`hisparse_throughput --bench_size=long_smoke`)" in text
  assert text.count(f"\n| {row['length']:,} | ") == len(tl.ENGINES)
  assert "| hisparse_throughput | long 512: offload / wait decode tok/s |" in text
  with open(plot, "rb") as f:
    assert f.read(8) == PNG_MAGIC


def test_long_sizes_are_the_issues_rows_and_reach_the_cli():
  long, six, rest = tl.SIZES["long"], tl.SIZES["long_6k"], tl.SIZES["long_2k_8k"]
  assert (long.num_prompts, long.device_prompts, long.top_k_tokens) == (8, 3, 1024)
  assert tl.resolve_lengths(long, 8192) == [2048, 6144, 8192]  # the model's longest last
  assert tl.resolve_lengths(six, 8192) == [tl.MUST_SHOW_LENGTH]
  assert tl.resolve_lengths(rest, 8192) == [2048, 8192]  # long's rows, run after long_6k
  assert dataclasses.replace(six, lengths=long.lengths) == long
  assert dataclasses.replace(rest, lengths=long.lengths) == long
  with pytest.raises(ValueError, match="the model's context"):
    tl.resolve_lengths(long, 4096)
  depths = tl.depths(8)
  assert depths[0] == 0.1 and depths[-1] == 0.9 and depths == sorted(depths)
  # `--bench_size` takes them, and the CLI finds them among the suite's sizes.
  assert set(tl.SIZES) - {"long_smoke"} <= set(cli.FLAGS["bench_size"].parser.enum_values)
  assert set(tl.SIZES) <= set(ht.SIZES)


def _row(decode, e2e, answers, host=0.0):
  return {"decode_tokens_per_s": decode, "e2e_tokens_per_s": e2e,
          "answers": [{"answer": a, "key": "12345"} for a in answers],
          "host_blocks_selected": host, "token_ids": [[int(a or 0)] for a in answers]}


def test_compare_records_a_differing_answer_and_must_show_needs_all_three():
  rows = {"device-only": _row(10.0, 100.0, ["12345", "12345"]),
          "HiSparse offload": _row(16.0, 150.0, ["12345", "99999"], host=40.0),
          "HiSparse wait": _row(8.0, 120.0, ["12345", "12345"])}
  ratios, answers = tl.compare(rows)  # a differing answer is recorded, not raised
  assert ratios["offload_vs_device_only_decode"] == pytest.approx(1.6)
  assert ratios["offload_vs_wait_decode"] == pytest.approx(2.0)
  assert ratios["offload_vs_wait_e2e"] == pytest.approx(1.25)
  assert answers["HiSparse offload"]["answers_differ"] == [
      {"request": 1, "device_only": "12345", "hisparse": "99999", "key": "12345"}]
  assert answers["HiSparse offload"]["tokens_identical_to_device_only"] == 1
  assert answers["HiSparse wait"]["answers_equal_device_only"]

  def length(rows):
    ratios, answers = tl.compare(rows)
    return {"length": tl.MUST_SHOW_LENGTH, "rows": rows, "ratios": ratios, "answers": answers}

  shown = tl.must_show([length(rows)])
  assert shown["decode_vs_device_only"] == pytest.approx(1.6) and not shown["holds"]
  rows["HiSparse offload"] = _row(16.0, 150.0, ["12345", "12345"], host=40.0)
  assert tl.must_show([length(rows)])["holds"]
  rows["HiSparse offload"] = _row(14.0, 150.0, ["12345", "12345"], host=40.0)  # 1.4x
  assert not tl.must_show([length(rows)])["holds"]
  rows["HiSparse offload"] = _row(16.0, 150.0, ["12345", "12345"], host=0.0)  # no host
  assert not tl.must_show([length(rows)])["holds"]
  assert tl.must_show([{**length(rows), "length": 2048}]) is None

"""`hisparse-jax serve`'s warm-up (--warmup, engine/warmup.py) in real server processes:
the smoke size of `bench --suite=warm_restart` (hisparse-tiny). A writer serve
(--nowarmup) stores prompts on the disk tier and stops; a restarted serve warms up before
"serving on" (its log line names the programs), owns no block and has counted nothing
after it, and answers every disk-tier hit with the writer's text. No timing is asserted
(the full size's figures are in results/warm_restart_cpu.json)."""

from __future__ import annotations

import json

from hisparse_jax.bench import warm_restart
from hisparse_jax.entrypoints.cli import bench as bench_cmd
from hisparse_jax.entrypoints.cli import main as cli


def test_restarted_serve_warms_up_and_serves_disk_hits_with_the_same_text():
  assert bench_cmd.suite_names("warm_restart") == ["warm_restart"]
  assert "warm_restart" not in bench_cmd.suite_names("all")
  assert "warmup" in cli.command_flags("serve")
  result = warm_restart.run("smoke")
  size = warm_restart.SIZES["smoke"]
  (restart,) = result["restarts"]
  assert result["summary"]["warmup_first"]["ratio_ttft"] > 0
  assert restart["exit_code"] == 0
  assert restart["warmup_programs"] > 0, restart["warmup_log"]
  metrics = restart["metrics_after_warmup"]
  assert metrics['hisparse_step_compiles{where="warmup"}'] > 0
  assert metrics['hisparse_step_compiles{where="foreground"}'] == 0
  idle = {k: v for k, v in metrics.items() if not k.startswith("hisparse_step_compiles")}
  assert idle and all(v == 0 for v in idle.values()), idle
  hits = restart["hits"]
  assert [h["prompt"] for h in hits] == [0, 1, 2, 0]
  full_blocks = (size.prompt_tokens - 1) // size.block_size
  assert [h["loaded_blocks"] for h in hits] == [full_blocks] * len(hits)
  assert restart["all_disk_hits"] and restart["same_text"]
  assert all(h["text"] for h in hits) and restart["recompute_ttft_s"] > 0
  assert "warmup_first" in warm_restart.format_table(result)


def test_readme_warm_restart_table_matches_committed_json():
  with open("results/warm_restart_cpu.json") as f:
    summary = json.load(f)["suites"]["warm_restart"]["summary"]
  with open("README.md") as f:
    readme = f.read()
  for name, label in (("nowarmup", "| `--nowarmup` |"), ("warmup", "| warm-up (default) |")):
    s = summary[name]
    row = next(line for line in readme.splitlines() if line.startswith(label))
    assert f"{s['ratio_ttft']:.2f}x" in row and f"{s['first_ttft_s']:.3g} s" in row, row
    assert f"{s['start_to_serving_s']:.1f} s" in row, row
    assert s["all_disk_hits"] and s["same_text"]
  assert summary["warmup"]["ratio_ttft"] <= 1.3  # the goal, as recorded

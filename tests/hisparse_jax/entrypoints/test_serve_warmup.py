"""`hisparse-jax serve`'s warm-up (--warmup, engine/warmup.py) in real server processes:
the smoke size of `bench --suite=warm_restart` (hisparse-tiny). A writer serve
(--nowarmup) stores prompts on the disk tier and stops; a restarted serve warms up before
"serving on" (its log line names the programs), owns no block and has counted nothing
after it, and answers every disk-tier hit with the writer's text. No timing is asserted
(the full size's figures are in results/warm_restart_cpu.json)."""

from __future__ import annotations

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

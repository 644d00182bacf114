"""`hisparse-jax demo` (what `make demo` runs), smaller: 5 prompts of 99 tokens, in a subprocess.

The full demo (8 prompts of 1,038 tokens) is `make demo`; this run keeps its shape: more
requests than the device pool holds once they decode, so some are swapped out to the host
pool and read back from it.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from hisparse_jax import demo_cmd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_swaps_to_the_host_pool_and_marks_every_answer(tmp_path):
  metrics_json = tmp_path / "metrics.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "hisparse_jax", "demo", "--demo_num_prompts=5",
                      "--demo_context_len=100", "--max_num_batched_tokens=64",
                      f"--metrics_json={metrics_json}"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout.splitlines()
  # Device pool: 3 prompts of 7 blocks + 1 spare block each = 24 blocks = 384 tokens.
  assert out[0].startswith("demo: 5 key-value retrieval prompts of 99 tokens (seed 4242), 31 "
                           "output tokens each, up to 8 at once; device KV pool 384 tokens")
  for kind in ("memory_kind=device]: 0.00 GiB = 24 blocks x 16 tokens = 384 tokens",
               "memory_kind=pinned_host]", "total]"):
    assert f"KV cache capacity [{kind}" in r.stderr
  answers = [ln for ln in out if re.match(r"\[\d\] (RIGHT|WRONG) ", ln)]
  assert len(answers) == 5
  assert all("99 prompt tokens, 31 generated" in ln for ln in answers)
  num_right = sum(ln.split()[1] == "RIGHT" for ln in answers)
  assert f"{num_right}/5 right" in out
  metrics = json.loads(metrics_json.read_text())
  preemptions = metrics["hisparse_preemptions_total"]
  host_blocks = metrics['hisparse_blocks_selected_total{source="host"}']
  assert preemptions >= 1 and host_blocks >= 1
  assert metrics['hisparse_transfer_bytes_total{direction="d2h"}'] > 0
  assert metrics['hisparse_transfer_bytes_total{direction="h2d"}'] == host_blocks * 16 * 1024
  assert f"preemptions (swap-out to the host pool): {preemptions:.0f}" in r.stdout
  assert out[-1] == (f"host pool used: {preemptions:.0f} preemptions by swap-out, "
                     f"{host_blocks:,.0f} blocks read after coming back from the host pool; "
                     f"{num_right}/5 answers right")


@pytest.mark.parametrize("prompt_len,expected_tokens", [
    (1038, 24), (99, 31), (198, 28), (1024, 24), (1025, 33)])
def test_demo_outputs_are_long_enough_for_two_new_blocks(prompt_len, expected_tokens):
  got = demo_cmd.demo_settings(prompt_len, bytes_per_token=1024, block_size=16,
                               num_prompts=8)
  assert got["max_new_tokens"] == expected_tokens
  prompt_blocks = -(-prompt_len // 16)
  # Blocks holding K/V after the last output token's K/V is written (the position of
  # output token t is prompt_len + t - 1; the last one's K/V is never computed).
  final_blocks = -(-(prompt_len + expected_tokens - 1) // 16)
  assert final_blocks >= prompt_blocks + 2
  usable_device_blocks = int(got["device_kv_gib"] * 2**30) // (16 * 1024) - 1
  assert usable_device_blocks == 3 * (prompt_blocks + 1)
  assert got["max_model_len"] % 16 == 0 and got["max_model_len"] >= prompt_len + expected_tokens
  # An explicit --max_new_tokens is kept; the device pool does not depend on it.
  mine = demo_cmd.demo_settings(prompt_len, 1024, 16, 8, max_new_tokens=5)
  assert mine["max_new_tokens"] == 5 and mine["device_kv_gib"] == got["device_kv_gib"]

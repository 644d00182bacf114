"""`hisparse-jax demo --model=hisparse-tiny` (the toy demo), smaller: 5 prompts of 99
tokens, in a subprocess.

`make demo` runs the real model (demo_real.py: a chat reply and passkey prompts of ~4k
tokens; tests/test_readme_commands.py runs it small); the toy demo's full size is 8
prompts of 1,026 tokens. This run keeps its shape with
HiSparse settings scaled to the short prompts: more requests than the device pool holds
once they decode, so decoding requests are offloaded (their KV written through to the
host pool) and their selected blocks are loaded back from it into hot buffers.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from hisparse_jax.entrypoints.cli import demo as demo_cmd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_offloads_to_the_host_pool_and_marks_every_answer(tmp_path):
  metrics_json = tmp_path / "metrics.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "hisparse_jax", "demo", "--model=hisparse-tiny",
                      "--demo_num_prompts=5",
                      "--demo_context_len=100", "--max_num_batched_tokens=64",
                      "--top_k_tokens=32", "--hot_buffer_tokens=32", "--sink_tokens=16",
                      "--local_tokens=16", "--sparse_threshold_tokens=48",
                      f"--metrics_json={metrics_json}"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout.splitlines()
  # Device pool: 3 prompts of 7 blocks + 1 spare block each = 24 blocks = 384 tokens (the
  # budget adds HiSparse's indexer and hot-buffer-state bytes, so the pool keeps them).
  assert out[0].startswith("demo: 5 key-value retrieval prompts of 99 tokens (seed 4242), 31 "
                           "output tokens each, up to 8 at once; device KV pool 384 tokens")
  assert "HiSparse top-k 32 tokens, hot buffer 32 tokens" in out[0]
  for kind in ("memory_kind=device]: 0.39 MiB = 24 blocks x 16 tokens = 384 tokens",
               "memory_kind=pinned_host]", "total]"):
    assert f"KV cache capacity [{kind}" in r.stderr
  assert "HiSparse: indexer key bounds" in r.stderr and "HiSparse runs" in r.stderr
  answers = [ln for ln in out if re.match(r"\[\d\] (RIGHT|WRONG) ", ln)]
  assert len(answers) == 5
  assert all("99 prompt tokens, 31 generated" in ln for ln in answers)
  num_right = sum(ln.split()[1] == "RIGHT" for ln in answers)
  assert f"{num_right}/5 right" in out
  m = json.loads(metrics_json.read_text())
  offloads, loads = m["hisparse_offloads_total"], m["hisparse_hot_buffer_loads_total"]
  preemptions = m["hisparse_preemptions_total"]
  host_blocks = m['hisparse_blocks_selected_total{source="host"}']
  assert offloads >= 1 and loads >= 1 and host_blocks >= 1
  assert m['hisparse_transfer_bytes_total{direction="d2h"}'] > 0  # write-through
  # h2d bytes: in-step loads (block-layers of 16 x 512 bytes) + swap-ins (whole blocks).
  assert m['hisparse_transfer_bytes_total{direction="h2d"}'] == (
      loads * 16 * 512 + m['hisparse_transfer_blocks_total{direction="h2d"}'] * 16 * 1024)
  assert f"preemptions (swap-out to the host pool): {preemptions:.0f}" in r.stdout
  hot_blocks = m['hisparse_blocks_selected_total{source="hot"}']
  h2d, d2h = (m[f'hisparse_transfer_bytes_total{{direction="{d}"}}'] / 2**20
              for d in ("h2d", "d2h"))
  # Last, a prompt to try with generate, in the model's words (tests/test_readme_commands.py
  # runs it through generate and checks the answer).
  assert out[-1] == demo_cmd.example_line()
  assert "--prompt='bafu: bapo\\nbaki: bare\\n? baki:' (answer: bare)" in out[-1]
  assert out[-2] == (f"host pool used: {offloads:.0f} offloads, {loads:,.0f} block-layers "
                     f"loaded from the host pool into hot buffers, {preemptions:.0f} "
                     f"preemptions by swap-out, {host_blocks:,.0f} blocks read from the host "
                     f"pool in all; hot-buffer hit ratio "
                     f"{100 * hot_blocks / (hot_blocks + host_blocks):.1f}% ({hot_blocks:,.0f} "
                     f"hot / {hot_blocks + host_blocks:,.0f} offloaded blocks selected); "
                     f"moved host -> device {h2d:.2f} MiB, device -> host {d2h:.2f} MiB; "
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

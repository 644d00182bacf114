"""What both demos of `hisparse-jax demo` share (demo.py: the dispatcher and the toy demo;
demo_real.py: the real model's): the engine sizes a demo picks from its prompts' length
(`demo_settings`: a device pool too small for all of them, so requests are offloaded or
swapped out) and the line that reports how the run used the host pool. Neither demo
imports the other for these.
"""

from __future__ import annotations

import math

GIB = 2**30
# The device pool holds the prompts of this many requests plus one block each: the
# scheduler admits them (it keeps one spare block per running request), and once they
# decode past their spare block they no longer fit, so the newest are preempted by
# swap-out to the host pool and come back later.
DEVICE_POOL_PROMPTS = 3
# Output tokens per request (at least): the answer line, and more, so that every request
# needs two new blocks while it decodes (the answer is the first line of the output).
DEMO_MAX_NEW_TOKENS = 24
DEMO_MAX_NUM_SEQS = 8


def demo_settings(prompt_len: int, bytes_per_token: int, block_size: int, num_prompts: int,
                  max_new_tokens: int | None = None,
                  reserved_bytes=lambda device_blocks, host_blocks, max_model_len: 0,
                  device_pool_prompts: float = DEVICE_POOL_PROMPTS
                  ) -> dict[str, float | int]:
  """The engine sizes of the demo: max_new_tokens (None: chosen here), max_model_len,
  device and host budgets (GiB).

  The device pool gets device_pool_prompts * (prompt blocks + 1) usable blocks; a
  request needs prompt blocks + >= 2 while it decodes (DEMO_MAX_NEW_TOKENS), so the
  requests admitted together outgrow the pool. `reserved_bytes(device blocks, host
  blocks, max_model_len)`: the device bytes HiSparse needs besides the pool, added to the
  budget.
  """
  prompt_blocks = math.ceil(prompt_len / block_size)
  # The K/V of output token t (1-based) sits at position prompt_len + t - 1; two blocks
  # past the prompt's are reached at t = (prompt_blocks + 1) * block_size - prompt_len + 1,
  # written in the step that samples the next token.
  two_new_blocks = (prompt_blocks + 1) * block_size - prompt_len + 2
  if max_new_tokens is None:
    max_new_tokens = max(DEMO_MAX_NEW_TOKENS, two_new_blocks)
  max_model_len = block_size * math.ceil((prompt_len + max_new_tokens) / block_size)
  blocks_per_request = max_model_len // block_size
  bytes_per_block = bytes_per_token * block_size
  # +1: the null block; +0.5: so that int(gib * GIB) never rounds a block away.
  device_blocks = max(int(device_pool_prompts * (prompt_blocks + 1)), blocks_per_request) + 1.5
  host_blocks = 2 * num_prompts * blocks_per_request + 1.5
  reserved = reserved_bytes(int(device_blocks), int(host_blocks), max_model_len)
  return dict(max_new_tokens=max_new_tokens, max_model_len=max_model_len,
              device_kv_gib=(device_blocks * bytes_per_block + reserved) / GIB,
              host_pool_gib=host_blocks * bytes_per_block / GIB,
              max_num_seqs=DEMO_MAX_NUM_SEQS)


def host_pool_line(result) -> str:
  """How the run used the host pool (from its metrics), and the answers right."""
  m = result.metrics
  preemptions = m.get("hisparse_preemptions_total", 0.0)
  offloads = m.get("hisparse_offloads_total", 0.0)
  loads = m.get("hisparse_hot_buffer_loads_total", 0.0)
  host_blocks = m.get('hisparse_blocks_selected_total{source="host"}', 0.0)
  hot_blocks = m.get('hisparse_blocks_selected_total{source="hot"}', 0.0)
  hit = (f"{100.0 * hot_blocks / (hot_blocks + host_blocks):.1f}%"
         if hot_blocks + host_blocks else "-")
  h2d, d2h = (m.get(f'hisparse_transfer_bytes_total{{direction="{d}"}}', 0.0) / 2**20
              for d in ("h2d", "d2h"))
  used = "used" if host_blocks > 0 else "NOT used"
  return (f"host pool {used}: {offloads:.0f} offloads, {loads:,.0f} block-layers loaded "
          f"from the host pool into hot buffers, {preemptions:.0f} preemptions by swap-out, "
          f"{host_blocks:,.0f} blocks read from the host pool in all; hot-buffer hit ratio "
          f"{hit} ({hot_blocks:,.0f} hot / {hot_blocks + host_blocks:,.0f} offloaded blocks "
          f"selected); moved host -> device {h2d:.2f} MiB, device -> host {d2h:.2f} MiB; "
          f"{result.num_right}/{result.num_expected} answers right")

"""Scheduler with HiSparse, narrated with exact orders and block ids (block_size 4, no
model): write-through as blocks fill, offload before preemption, admission through
offload (host-backed), and a preempted sparse decoder coming back offloaded.

Settings: top-k 2 blocks (a sink and a local block), sequences longer than 8 tokens decode
sparsely. The steps fake the engine as test_scheduler does (`_step`), so block manager
invariants are checked after every step.
"""

from test_scheduler import _ids, _make, _names, _request, _step

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.sampling import SamplingParams


def _hisparse(hot_buffer_tokens: int) -> HiSparseConfig:
  return HiSparseConfig(top_k_tokens=8, hot_buffer_tokens=hot_buffer_tokens, sink_tokens=4,
                        local_tokens=4, sparse_threshold_tokens=8)


def _plans(plans):
  return [(_ids(p.device_ids), _ids(p.host_ids)) for p in plans]


def test_sparse_decoders_write_through_and_offload_instead_of_preempting():
  bm, sched = _make(num_device_blocks=10, num_host_blocks=17, hisparse=_hisparse(8))
  a, b = _request("a", 12, 0), _request("b", 12, 1)
  sched.add(a)
  sched.add(b)
  # Step 1: both prompts (3 blocks each); 12 tokens = dense prefill.
  out, chunks = _step(sched)
  assert chunks == [("a", 0, 12), ("b", 0, 12)] and out.swap_out == []
  # Step 2: 13 tokens > 8: sparse decoders. Their 3 full, computed blocks are written
  # through to the host (one d2h plan each, before the forward), then each opens block 4.
  out, chunks = _step(sched)
  assert chunks == [("a", 12, 1), ("b", 12, 1)]
  assert _plans(out.swap_out) == [([1, 2, 3], [1, 2, 3]), ([4, 5, 6], [4, 5, 6])]
  assert bm.host_copy_ids("a") == [1, 2, 3] and bm.block_table("a") == [1, 2, 3, 7]
  assert bm.device_pool.num_free_blocks == 1 and not bm.is_offloaded("a")
  for _ in range(3):  # tokens 13..15 fill block 4: nothing new to write
    out, _ = _step(sched)
    assert out.swap_out == [] and out.offloaded == []
  # Step 6: block 4 is full and computed: written through. a takes the last free block
  # (9); b finds none, so a (the larger gain: 4 resident copies - 2 hot slots) is
  # OFFLOADED instead of anyone being preempted: its 4 written-through device blocks are
  # dropped (table entries -> 0), it gets 2 hot-buffer slots, and b gets a freed block.
  out, chunks = _step(sched)
  assert chunks == [("a", 16, 1), ("b", 16, 1)]
  assert _plans(out.swap_out) == [([7], [7]), ([8], [8])]
  assert _names(out.offloaded) == ["a"] and out.preempted == [] and out.recomputed == []
  assert bm.block_table("a") == [0, 0, 0, 0, 9] and bm.host_copy_ids("a") == [1, 2, 3, 7]
  assert bm.hot_slots("a") == [7, 3] and bm.is_offloaded("a")
  assert bm.block_table("b") == [4, 5, 6, 8, 2] and not bm.is_offloaded("b")
  assert bm.device_pool.num_free_blocks == 1


def test_waiting_request_is_admitted_by_offloading_sparse_decoders():
  bm, sched = _make(num_device_blocks=12, num_host_blocks=40, hisparse=_hisparse(8))
  a, b, c = _request("a", 12, 0), _request("b", 12, 1), _request("c", 8, 2)
  sched.add(a)
  sched.add(b)
  _step(sched)
  _step(sched)
  assert bm.device_pool.num_free_blocks == 3
  # c needs 2 blocks + 1 spare per running request = 4 > 3 free: a is offloaded (3
  # dropped - 2 slots = 1 block) and c is admitted; dense admission would have waited.
  sched.add(c)
  out, chunks = _step(sched)
  assert chunks == [("a", 13, 1), ("b", 13, 1), ("c", 0, 8)]
  assert _names(out.offloaded) == ["a"] and _names(sched.running) == ["a", "b", "c"]
  assert bm.block_table("a") == [0, 0, 0, 7] and bm.hot_slots("a") == [9, 10]
  assert bm.block_table("c") == [11, 3]


def test_preempted_sparse_decoder_comes_back_offloaded():
  bm, sched = _make(num_device_blocks=11, num_host_blocks=60, hisparse=_hisparse(12))
  short = SamplingParams(temperature=0.0, max_tokens=6)
  a, b = (Request(i, list(range(10 * n, 10 * n + 12)), short, seed=0, arrival_time=float(n))
          for n, i in enumerate("ab"))
  c = _request("c", 8, 2)
  for r in (a, b, c):
    sched.add(r)
  preempted, host_table, swapped_in = [], None, None
  for _ in range(30):
    out, _ = _step(sched)
    for r in list(sched.running):
      if len(r.output_token_ids) >= r.sampling_params.max_tokens:  # the engine's "length"
        sched.remove(r)
    preempted += _names(out.preempted)
    if out.swapped_in:
      swapped_in = (out, c.num_computed_tokens)
      break
    if bm.is_swapped("c"):
      host_table = bm.host_block_table("c")
  # c (newest) was preempted by swap-out while a and b decoded; when they finished, c came
  # back OFFLOADED: only its last block was copied back, its full computed blocks stayed on
  # the host as its host copies, and it got 3 hot-buffer slots.
  assert preempted == ["c"] and swapped_in is not None
  out, num_computed = swapped_in
  assert _names(out.swapped_in) == ["c"] and bm.is_offloaded("c")
  kept = num_computed // 4
  assert bm.host_copy_ids("c") == host_table[:kept]
  assert bm.block_table("c")[:kept] == [0] * kept and 0 not in bm.block_table("c")[kept:]
  assert _ids(out.swap_in[0].host_ids) == host_table[kept:]
  assert len(bm.hot_slots("c")) == 3

"""Scheduler, narrated with exact orders and block ids (block_size 4, no model).

The tests drive the Scheduler over a real BlockManager and fake the engine's postprocess:
each scheduled chunk advances `num_computed_tokens`, and a chunk that ends at the last
token appends an output token. Both pools reserve block 0 (the null block), so ids start
at 1. Chunks are written as (request_id, start, num_tokens).
"""

import numpy as np
import pytest

from hisparse_jax.engine.request import Request, RequestStatus
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.engine.scheduler import Scheduler
from hisparse_jax.kv_cache.block_manager import BlockManager

BS = 4


def _request(request_id: str, num_tokens: int, arrival: float, first: int | None = None):
  first = 10 * arrival if first is None else first  # distinct tokens: no accidental prefix hit
  return Request(request_id, [int(first) + i for i in range(num_tokens)],
                 SamplingParams(max_tokens=100), seed=0, arrival_time=float(arrival))


def _make(num_device_blocks=33, num_host_blocks=17, prefix_caching=False, **kwargs):
  bm = BlockManager(num_device_blocks, num_host_blocks, BS,
                    enable_prefix_caching=prefix_caching)
  kwargs = {"max_num_seqs": 4, "max_num_batched_tokens": 64, **kwargs}
  return bm, Scheduler(bm, **kwargs)


def _step(sched: Scheduler, token: int = 5):
  """schedule() plus the engine's bookkeeping; returns (output, [(id, start, n), ...])."""
  out = sched.schedule()
  for chunk in out.chunks:
    chunk.request.num_computed_tokens = chunk.start + chunk.num_tokens
    if chunk.samples:
      chunk.request.output_token_ids.append(token)
  sched.bm.finish_step()
  sched.bm.check_invariants()
  return out, [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def _ids(x):
  return np.asarray(x).tolist()


def _names(requests):
  return [r.request_id for r in requests]


def test_fcfs_budget_chunks_and_max_num_seqs():
  bm, sched = _make(max_num_seqs=2, max_num_batched_tokens=8)
  a, b, c = _request("a", 10, 0), _request("b", 6, 1), _request("c", 3, 2)
  for r in (a, b, c):
    sched.add(r)

  # Step 1: a is admitted first (FCFS) and gets the whole budget: its first chunk of 8.
  # a holds blocks [1, 2, 3] (10 tokens); the chunk writes slots 4..11 (blocks 1, 2).
  out, chunks = _step(sched)
  assert chunks == [("a", 0, 8)]
  assert _ids(out.chunks[0].slot_ids) == list(range(4, 12))
  assert not out.chunks[0].samples and a.output_token_ids == []
  assert _names(sched.running) == ["a"] and _names(sched.waiting) == ["b", "c"]
  assert bm.block_table("a") == [1, 2, 3]

  # Step 2: a's last 2 prompt tokens (sampled: it ends at the prompt's end), then b gets
  # the 6 tokens left in the budget: its whole prompt, in blocks [4, 5] (slots 16..21).
  out, chunks = _step(sched)
  assert chunks == [("a", 8, 2), ("b", 0, 6)]
  assert [c.samples for c in out.chunks] == [True, True]
  assert _ids(out.chunks[1].slot_ids) == list(range(16, 22))
  # c waits: max_num_seqs=2 are running.
  assert _names(sched.running) == ["a", "b"] and _names(sched.waiting) == ["c"]

  # Step 3: both running requests decode one token each; c still waits for a seat.
  # a's token 10 goes to block 3 offset 2 (slot 14), b's token 6 to block 5 offset 2 (22).
  out, chunks = _step(sched)
  assert chunks == [("a", 10, 1), ("b", 6, 1)]
  assert [_ids(c.slot_ids) for c in out.chunks] == [[14], [22]]
  assert _names(sched.waiting) == ["c"]

  # a finishes: its seat goes to c, which is admitted after b's decode in the same step.
  sched.remove(a)
  out, chunks = _step(sched)
  assert chunks == [("b", 7, 1), ("c", 0, 3)]
  assert _names(sched.running) == ["b", "c"] and not sched.waiting
  assert sched.num_unfinished == 2


def test_budget_left_by_decodes_limits_the_prefill_chunk():
  _, sched = _make(max_num_batched_tokens=6)
  a, b = _request("a", 3, 0), _request("b", 13, 1)
  sched.add(a)
  assert _step(sched)[1] == [("a", 0, 3)]
  sched.add(b)
  # a decodes first (1 token), b's prefill gets the other 5 tokens, then 5, 5, 3 ... while
  # a keeps decoding one token per step ahead of it.
  assert _step(sched)[1] == [("a", 3, 1), ("b", 0, 5)]
  assert _step(sched)[1] == [("a", 4, 1), ("b", 5, 5)]
  assert _step(sched)[1] == [("a", 5, 1), ("b", 10, 3)]
  assert b.output_token_ids == [5]  # the chunk that reached the prompt's end sampled
  assert _step(sched)[1] == [("a", 6, 1), ("b", 13, 1)]


def test_chunked_prefill_off_admits_only_whole_prompts():
  _, sched = _make(max_num_batched_tokens=8, enable_chunked_prefill=False)
  a, b = _request("a", 6, 0), _request("b", 4, 1)
  sched.add(a)
  sched.add(b)
  # b's 4 tokens do not fit the 2 left after a's 6: b waits a step rather than split.
  assert _step(sched)[1] == [("a", 0, 6)]
  assert _step(sched)[1] == [("a", 6, 1), ("b", 0, 4)]


def _three_growing(num_host_blocks=17):
  """Device of 6 usable blocks; a, b, c of 4 prompt tokens (1 block each), admitted in one
  step, then decoding until position 8, where each needs a third block."""
  bm, sched = _make(num_device_blocks=7, num_host_blocks=num_host_blocks)
  reqs = [_request(n, 4, t) for t, n in enumerate("abc")]
  for r in reqs:
    sched.add(r)
  assert _step(sched)[1] == [("a", 0, 4), ("b", 0, 4), ("c", 0, 4)]
  # Position 4 opens a second block for each: a [1, 4], b [2, 5], c [3, 6]; none free.
  for position in range(4, 8):
    out, chunks = _step(sched)
    assert chunks == [(n, position, 1) for n in "abc"] and not out.preempted
  assert [bm.block_table(n) for n in "abc"] == [[1, 4], [2, 5], [3, 6]]
  assert bm.device_pool.num_free_blocks == 0
  return bm, sched, reqs


def test_preemption_swaps_out_the_newest_running_request():
  bm, sched, (a, b, c) = _three_growing()
  # Position 8: a needs a block, none is free: the newest request, c, is swapped out to
  # host blocks [1, 2]; its device blocks (freed tail first: 6, 3) go to a, then b.
  out, chunks = _step(sched)
  assert _names(out.preempted) == ["c"] and not out.recomputed
  (plan,) = out.swap_out
  assert (_ids(plan.device_ids), _ids(plan.host_ids)) == ([3, 6], [1, 2])
  assert chunks == [("a", 8, 1), ("b", 8, 1)]
  assert bm.block_table("a") == [1, 4, 6] and bm.block_table("b") == [2, 5, 3]
  assert c.status == RequestStatus.SWAPPED and c.num_preemptions == 1
  # Swapped, not dropped: its 8 computed tokens stay computed (9 tokens: 4 + 5 sampled).
  assert c.num_computed_tokens == 8 and c.num_tokens == 9
  assert _names(sched.running) == ["a", "b"] and _names(sched.swapped) == ["c"]

  # a finishes; its blocks (freed tail first: 6, 4, 1) take c back before anything else:
  # host [1, 2] -> device [6, 4], and c decodes position 8 in the same step.
  sched.remove(a)
  sched.add(_request("d", 2, 9))
  out, chunks = _step(sched)
  (plan,) = out.swap_in
  assert (_ids(plan.host_ids), _ids(plan.device_ids)) == ([1, 2], [6, 4])
  assert _names(out.swapped_in) == ["c"]
  assert chunks[:2] == [("b", 9, 1), ("c", 8, 1)]
  assert c.status == RequestStatus.RUNNING and c.num_swapped_in_blocks == 2
  assert bm.block_table("c") == [6, 4, 1]  # its third block for position 8: a's last one


def test_swapped_come_back_oldest_first_before_new_admissions():
  bm, sched, (a, b, c) = _three_growing()
  _step(sched)  # c is swapped out (previous test)
  # At position 12, a needs a block again: the newest running request, b, is swapped out.
  for position in range(9, 12):
    assert _step(sched)[1] == [("a", position, 1), ("b", position, 1)]
  out, chunks = _step(sched)
  assert _names(out.preempted) == ["b"] and chunks == [("a", 12, 1)]
  assert _names(sched.swapped) == ["b", "c"]  # arrival order, whatever the preemption order
  e = _request("e", 3, 9)
  sched.add(e)
  # While anyone is swapped out, e waits even though it would fit.
  out, chunks = _step(sched)
  assert chunks == [("a", 13, 1)] and not out.swap_in and _names(sched.waiting) == ["e"]
  # a finishes, all 6 blocks are free. b (oldest) comes back first: 3 blocks, plus 1 for
  # its token at position 12. c would need 3 (2 + 1 for position 8); 2 are left, so c
  # stays on the host rather than come back without room to decode (and at once leave).
  sched.remove(a)
  out, chunks = _step(sched)
  assert _names(out.swapped_in) == ["b"] and chunks == [("b", 12, 1)]
  assert _names(sched.swapped) == ["c"] and _names(sched.waiting) == ["e"]
  out, chunks = _step(sched)
  assert chunks == [("b", 13, 1)] and not out.preempted and not out.swap_in
  sched.remove(b)
  out, chunks = _step(sched)
  # c returns, then e (nobody swapped any more) is admitted behind it in the same step.
  assert _names(out.swapped_in) == ["c"]
  assert chunks == [("c", 8, 1), ("e", 0, 3)]
  assert _names(sched.running) == ["c", "e"]


def test_recompute_when_the_host_pool_is_full():
  # The host pool has 1 usable block: c's 2 blocks cannot go there.
  bm, sched, (a, b, c) = _three_growing(num_host_blocks=2)
  out, chunks = _step(sched)
  assert _names(out.recomputed) == ["c"] and not out.swap_out and not out.preempted
  assert chunks == [("a", 8, 1), ("b", 8, 1)]
  assert c.status == RequestStatus.WAITING and c.num_computed_tokens == 0
  assert _names(sched.waiting) == ["c"] and "c" not in bm
  assert c.num_preemptions == 1 and len(c.output_token_ids) == 5
  sched.remove(a)
  # 3 blocks free: c's 9 tokens need 3, plus 1 spare for b's decoding: c waits.
  assert _step(sched)[1] == [("b", 9, 1)]
  sched.remove(b)
  # c is admitted again with its prompt AND its 5 outputs as one prefill of 9 tokens; the
  # chunk ends at its last token, so it samples its 6th output right away.
  out, chunks = _step(sched)
  assert chunks == [("c", 0, 9)]
  assert c.prefill_len == 9 and out.chunks[0].samples and len(c.output_token_ids) == 6
  assert not c.is_prefilling
  assert _step(sched)[1] == [("c", 9, 1)]


def test_prefix_cache_hit_skips_computed_tokens():
  bm, sched = _make(prefix_caching=True)
  a = _request("a", 10, 0, first=0)  # tokens 0..9: blocks [1, 2] full, 3 partial
  sched.add(a)
  assert _step(sched)[1] == [("a", 0, 10)]
  # b shares a's first 8 tokens (2 full blocks): they are hits, only 3 tokens are computed.
  b = Request("b", list(range(8)) + [50, 51, 52], SamplingParams(), seed=0, arrival_time=1.0)
  sched.add(b)
  out, chunks = _step(sched)
  assert chunks == [("a", 10, 1), ("b", 8, 3)]
  assert bm.block_table("b") == [1, 2, 4] and bm.block_table("a") == [1, 2, 3]
  assert bm.device_pool.ref_cnt(1) == 2 and bm.device_pool.ref_cnt(2) == 2
  # A prompt equal to a cached prefix still computes its last token (logits needed).
  c = Request("c", list(range(8)), SamplingParams(), seed=0, arrival_time=2.0)
  sched.add(c)
  out, chunks = _step(sched)
  assert ("c", 4, 4) in chunks  # block 1 hit; block 2 holds the last token: computed


def test_a_waiting_prompt_is_hashed_once_and_hits_as_if_hashed_anew(monkeypatch):
  """A request that waits for blocks keeps its prompt's chained hashes (Request.block_hashes)
  instead of hashing the prompt again at every step (a 2,048-token prompt at the head of
  the queue cost ~0.2 ms a step); admission then hits the prefix cache with them exactly
  as with hashes computed from the tokens."""
  from hisparse_jax.kv_cache import kv_hash

  bm, sched = _make(num_device_blocks=9, prefix_caching=True)  # 8 usable blocks
  a = _request("a", 24, 0, first=0)  # 6 blocks: b (4 more) cannot join until a finishes
  sched.add(a)
  _step(sched)
  b = Request("b", list(range(8)) + [90 + i for i in range(8)], SamplingParams(), seed=0,
              arrival_time=1.0)
  sched.add(b)
  hashed = []
  real = kv_hash.hash_block_tokens
  monkeypatch.setattr(kv_hash, "hash_block_tokens",
                      lambda *args: hashed.append(args[1]) or real(*args))
  for _ in range(3):
    _step(sched)
    assert sched.waiting and sched.waiting[0] is b
  # (The test's invariant checks hash a's blocks too: count b's own blocks.)
  def times_hashed():
    return [sum(list(t) == b.prompt_token_ids[i:i + BS] for t in hashed) for i in (8, 12)]
  assert times_hashed() == [1, 1]  # once, not at each of the 3 steps
  assert b.block_hashes == kv_hash.hash_full_blocks(b.prompt_token_ids, BS)
  sched.remove(a)
  out, chunks = _step(sched)
  assert chunks == [("b", 8, 8)]  # a's first 2 blocks (its tokens 0..7) are hits
  assert bm.block_table("b")[:2] == [1, 2]


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens"])
def test_bad_limits_are_refused(field):
  bm = BlockManager(5, 5, BS)
  kwargs = {"max_num_seqs": 1, "max_num_batched_tokens": 1, field: 0}
  with pytest.raises(ValueError, match=field):
    Scheduler(bm, **kwargs)

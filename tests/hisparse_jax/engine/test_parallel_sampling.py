"""SamplingParams.n > 1: n sequences over one prefill of the prompt.

The n sequences of a request share the prompt's KV blocks (forked when the final prefill
chunk is scheduled, the last block copied on write) and sample their first tokens from
the same prompt logits. These tests check that the prompt is computed once, that the
blocks are shared (not found again in the prefix cache: it is off here), that each
sequence samples as a lone request with its own seed would, and that seats, preemption,
HiSparse offloading and aborts keep every block accounted for.
"""

from __future__ import annotations

import pytest
from engine_fixtures import (
  BLOCK_SIZE,
  MAX_MODEL_LEN,
  NUM_HOST_BLOCKS,
  SIX_PROMPTS,
  assert_all_blocks_free,
  gib_for_blocks,
  make_engine,
  reference_greedy,
  run,
  tiny_model,
)

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import RequestOutputKind, SamplingParams

PROMPT = SIX_PROMPTS[1]  # 17 tokens: two full blocks of 8 and a partial one


def _record_chunks(engine):
  """Wraps the scheduler; returns a list that gets each step's (request_id, start,
  num_tokens) chunks."""
  steps, schedule = [], engine.scheduler.schedule

  def recording():
    out = schedule()
    steps.append([(c.request.request_id, c.start, c.num_tokens) for c in out.chunks])
    engine.copies_on_write = getattr(engine, "copies_on_write", 0) + len(out.copies)
    return out

  engine.scheduler.schedule = recording
  return steps


def test_n_sequences_compute_the_prompt_once_and_share_its_blocks():
  engine = make_engine(enable_prefix_caching=False, max_num_batched_tokens=8)
  steps = _record_chunks(engine)
  engine.add_request("a", prompt_token_ids=PROMPT,
                     sampling_params=SamplingParams(n=3, seed=1, max_tokens=6))
  bm = engine.block_manager
  while not any(n == 0 for step in steps for _, _, n in step):
    engine.step()  # chunked prefill (8 tokens a step) up to the fork
  # The final chunk and two rows that compute nothing and sample from its logits.
  assert steps[-1] == [("a", 16, 1), ("1_a", 17, 0), ("2_a", 17, 0)]
  tables = [bm.block_table(s) for s in ("a", "1_a", "2_a")]
  assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
  assert all(bm.device_pool.ref_cnt(b) == 3 for b in tables[0])
  engine.check_invariants()
  (out,) = run(engine).values()
  prefill = [(s, start, n) for step in steps for s, start, n in step if start < len(PROMPT)]
  assert sum(n for _, _, n in prefill) == len(PROMPT)
  assert {s for s, _, n in prefill if n} == {"a"}
  # Only the shared partial block was copied, twice: the last sequence to write it kept
  # the original (the full blocks are never written again).
  assert engine.copies_on_write == 2
  assert [c.index for c in out.outputs] == [0, 1, 2]
  assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
  assert_all_blocks_free(engine)


def test_each_sequence_samples_as_a_lone_request_with_seed_plus_index():
  """Sequence i of a seeded request with n > 1 gives the tokens of a lone request
  seeded seed + i (vLLM's rule), whatever else runs beside it."""
  engine = make_engine()
  engine.add_request("other", prompt_token_ids=SIX_PROMPTS[2],
                     sampling_params=SamplingParams(seed=5, max_tokens=9))
  engine.add_request("n3", prompt_token_ids=PROMPT,
                     sampling_params=SamplingParams(n=3, seed=11, max_tokens=10, top_k=20))
  together = run(engine)["n3"]
  alone = []
  for i in range(3):
    engine = make_engine()
    engine.add_request("x", prompt_token_ids=PROMPT,
                       sampling_params=SamplingParams(seed=11 + i, max_tokens=10, top_k=20))
    alone.append(run(engine)["x"].outputs[0].token_ids)
  assert [c.token_ids for c in together.outputs] == alone
  assert len({tuple(t) for t in alone}) == 3  # the seeds do differ


def test_top_k_1_sequences_equal_the_dense_greedy_reference():
  """(vLLM refuses n > 1 when greedy; top_k 1 draws the most likely token all the same.)"""
  engine = make_engine()
  engine.add_request("g", prompt_token_ids=PROMPT,
                     sampling_params=SamplingParams(n=2, top_k=1, max_tokens=12))
  out = run(engine)["g"]
  (expected,) = reference_greedy(tiny_model(), [PROMPT], 12)
  assert [c.token_ids for c in out.outputs] == [expected, expected]


@pytest.mark.parametrize("hisparse", [None, HiSparseConfig(
    top_k_tokens=16, hot_buffer_tokens=16, sink_tokens=8, local_tokens=8,
    sparse_threshold_tokens=16, resident_sparse_min_tokens=0)], ids=["dense", "hisparse"])
def test_forked_sequences_survive_preemption_and_offload(hisparse):
  """Three requests of n = 2 on a small device pool: copies on write, swap-outs of
  sequences whose blocks are shared (and, with HiSparse, offloads); the tokens equal
  those of a pool large enough for all, and every block comes back."""
  params = SamplingParams(n=2, seed=3, max_tokens=24, top_k=8)
  prompts = SIX_PROMPTS[1:4]

  def tokens(num_dense_blocks):
    # (With HiSparse, the indexer's bounds and the hot buffers come out of the budget.)
    config = EngineConfig(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=6,
                          max_num_batched_tokens=16, hisparse=hisparse,
                          device_kv_gib=gib_for_blocks(tiny_model().config, num_dense_blocks),
                          host_pool_gib=gib_for_blocks(tiny_model().config, NUM_HOST_BLOCKS))
    engine = Engine(config, model=tiny_model(), model_config=tiny_model().config)
    for i, p in enumerate(prompts):
      engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=params)
    outs = run(engine)
    assert_all_blocks_free(engine)
    return engine, {k: [c.token_ids for c in o.outputs] for k, o in outs.items()}

  small, got = tokens(17 if hisparse else 13)
  _, expected = tokens(80)
  assert got == expected
  assert small.metrics()["hisparse_preemptions_total"] > 0


def test_seats_are_reserved_for_the_sequences_to_fork():
  """max_num_seqs 4: a request of n = 3 holds 3 seats from admission on, so a second
  one waits until seats come free; the running set never exceeds 4 sequences."""
  engine = make_engine(max_num_seqs=4)
  for name in ("a", "b"):
    engine.add_request(name, prompt_token_ids=PROMPT,
                       sampling_params=SamplingParams(n=3, seed=0, max_tokens=4))
  engine.step()
  assert [r.request_id for r in engine.scheduler.running] == ["a", "1_a", "2_a"]
  assert [r.request_id for r in engine.scheduler.waiting] == ["b"]
  outs = run(engine)
  assert sorted(outs) == ["a", "b"] and all(len(o.outputs) == 3 for o in outs.values())
  with pytest.raises(ValueError, match="n=5 exceeds max_num_seqs=4"):
    engine.add_request("c", prompt_token_ids=PROMPT, sampling_params=SamplingParams(n=5))
  assert_all_blocks_free(engine)


@pytest.mark.parametrize("when", ["prefilling", "decoding"])
def test_abort_ends_every_sequence(when):
  engine = make_engine(max_num_batched_tokens=8)
  engine.add_request("a", prompt_token_ids=SIX_PROMPTS[2],
                     sampling_params=SamplingParams(n=3, max_tokens=20))
  for _ in range(1 if when == "prefilling" else 8):
    engine.step()
  assert engine.abort_request("a")
  assert not engine.abort_request("a")
  (out,) = engine.step()
  assert out.request_id == "a" and out.finished
  assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
  assert engine.scheduler.num_reserved_seats == 0
  assert not engine.has_unfinished_requests()
  assert_all_blocks_free(engine)
  # The id is free again.
  engine.add_request("a", prompt_token_ids=PROMPT, sampling_params=SamplingParams(n=2))
  assert len(run(engine)["a"].outputs) == 2


def test_output_kinds_with_n():
  params = dict(n=3, seed=2, max_tokens=5)
  streams = {}
  for kind in RequestOutputKind:
    engine = make_engine()
    engine.add_request("a", prompt_token_ids=PROMPT,
                       sampling_params=SamplingParams(**params, output_kind=kind))
    streams[kind] = []
    while engine.has_unfinished_requests():
      streams[kind] += engine.step()
  final = streams[RequestOutputKind.FINAL_ONLY]
  assert len(final) == 1 and final[0].finished
  whole = [c.token_ids for c in final[0].outputs]
  cumulative = streams[RequestOutputKind.CUMULATIVE]
  assert all(len(o.outputs) == 3 for o in cumulative)
  assert [c.token_ids for c in cumulative[-1].outputs] == whole
  assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
  deltas = [[] for _ in range(3)]
  for o in streams[RequestOutputKind.DELTA]:
    for c in o.outputs:
      deltas[c.index] += c.token_ids
  assert deltas == whole


def test_n_validation_names_the_field():
  with pytest.raises(ValueError, match="^n must be at least 1, got 0$"):
    SamplingParams(n=0)
  with pytest.raises(ValueError, match="n must be an int"):
    SamplingParams(n=2.5)
  with pytest.raises(ValueError, match="^n must be 1 when using greedy sampling, got 2$"):
    SamplingParams(n=2, temperature=0.0)

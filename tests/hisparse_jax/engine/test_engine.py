"""Engine: tokens a user would see, against a full-recompute dense reference.

One tiny random Llama (vocab 97) and one engine geometry (engine_fixtures): block_size 8,
max_model_len 64, 4 sequences and 64 tokens per step, 12 usable device blocks (96 tokens),
32 usable host blocks. Six prompts of 3..40 tokens asking for 20 tokens each need up to
8 blocks apiece, so running them together swaps requests out to the host pool.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_fixtures import (
  MAX_MODEL_LEN,
  SIX_PROMPTS,
  VOCAB,
  add_all,
  assert_all_blocks_free,
  make_engine,
  random_prompts,
  reference_greedy,
  run,
  tiny_model,
)

from hisparse_jax.engine.engine import EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from models.llama import LlamaForCausalLM

PROMPTS = SIX_PROMPTS
NUM_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)


@pytest.fixture(scope="module")
def reference():
  return reference_greedy(tiny_model(), PROMPTS, NUM_TOKENS)


def _tokens(outputs, prefix="r"):
  return [outputs[f"{prefix}{i}"].outputs[0].token_ids for i in range(len(outputs))]


def _record(engine):
  """Wraps the scheduler so every step's SchedulerOutput is kept."""
  log, schedule = [], engine.scheduler.schedule

  def recording():
    out = schedule()
    log.append(out)
    return out

  engine.scheduler.schedule = recording
  return log


@pytest.fixture(scope="module")
def concurrent():
  """All six prompts at once on the small device pool (pressure: swap-outs)."""
  engine = make_engine()
  add_all(engine, PROMPTS, GREEDY)
  return engine, run(engine)


def test_greedy_batch_matches_full_recompute_reference(concurrent, reference):
  engine, outputs = concurrent
  assert _tokens(outputs) == reference
  for out in outputs.values():
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == NUM_TOKENS
    assert out.metrics.time_to_first_token_s > 0
  m = engine.metrics()
  assert m['hisparse_requests_total{finish_reason="length"}'] == len(PROMPTS)
  assert m["hisparse_generation_tokens_total"] == len(PROMPTS) * NUM_TOKENS
  assert m["hisparse_prompt_tokens_total"] == sum(map(len, PROMPTS))


def test_swap_preemption_gives_the_tokens_of_an_unpressured_run(concurrent, reference):
  engine, outputs = concurrent
  m = engine.metrics()
  assert m["hisparse_preemptions_total"] > 0
  assert m['hisparse_transfer_blocks_total{direction="d2h"}'] > 0
  assert m['hisparse_transfer_blocks_total{direction="h2d"}'] > 0
  # Blocks read back from the host pool are counted as such, per request and in total.
  assert m['hisparse_blocks_selected_total{source="host"}'] > 0
  preempted = [o for o in outputs.values() if o.metrics.num_preemptions]
  assert preempted and all(o.metrics.blocks_selected["host"] > 0 for o in preempted)
  assert sum(o.metrics.blocks_selected["host"] for o in outputs.values()) == (
      m['hisparse_blocks_selected_total{source="host"}'])

  # The same requests one at a time: each fits the device alone, nothing moves.
  serial = make_engine()
  tokens = []
  for i, prompt in enumerate(PROMPTS):
    serial.add_request(f"s{i}", prompt_token_ids=prompt, sampling_params=GREEDY)
    tokens.append(run(serial)[f"s{i}"].outputs[0].token_ids)
  ms = serial.metrics()
  assert ms["hisparse_preemptions_total"] == 0
  assert ms['hisparse_transfer_blocks_total{direction="d2h"}'] == 0
  assert ms['hisparse_transfer_blocks_total{direction="h2d"}'] == 0
  assert tokens == _tokens(outputs) == reference


def test_overlapped_steps_equal_one_step_at_a_time(concurrent, reference):
  # Async scheduling (the default) plans step t + 1 before step t's tokens are on the
  # host: the same requests one step at a time give the same tokens, and the tokens of
  # each step come back one call later (so one more step() call in all).
  engine, outputs = concurrent
  sync = make_engine(async_scheduling=False)
  add_all(sync, PROMPTS, GREEDY)
  sync_outputs = run(sync)
  assert _tokens(sync_outputs) == _tokens(outputs) == reference
  assert sync.metrics()["hisparse_preemptions_total"] > 0
  assert sync.num_steps < engine.num_steps
  assert sync._inflight is None and engine._inflight is None


def test_every_block_is_free_after_all_finish(concurrent):
  engine, outputs = concurrent
  assert sorted(outputs) == sorted(f"r{i}" for i in range(len(PROMPTS)))
  assert not engine.has_unfinished_requests()
  assert_all_blocks_free(engine)
  assert engine.transfer.poll() == 0


def test_chunked_prefill_gives_the_unchunked_tokens(concurrent, reference):
  engine = make_engine(max_num_batched_tokens=16)
  steps = _record(engine)
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  assert _tokens(outputs) == _tokens(concurrent[1]) == reference
  assert all(out.num_tokens <= 16 for out in steps)
  assert max(out.num_tokens for out in steps) == 16
  # The 40-token prompt r2 was computed in at least 3 pieces that cover it exactly.
  r2 = [(c.start, c.num_tokens) for out in steps for c in out.chunks
        if c.request.request_id == "r2" and c.start < 40]
  assert len(r2) >= 3 and sum(n for _, n in r2) == 40 and r2[0][0] == 0
  assert_all_blocks_free(engine)


def test_recompute_when_the_host_pool_is_full():
  # Three 17-token prompts decode to 57 tokens (8 blocks) each on 12 device blocks. At
  # position 32 the newest is swapped out (4 blocks into the 8 usable host blocks); at
  # position 48 the next victim holds 6 blocks, which the 4 host blocks left cannot take:
  # it is dropped and computed again (prompt and outputs in one prefill).
  prompts = random_prompts((17, 17, 17, 17), seed=5)
  params = SamplingParams(temperature=0.0, max_tokens=40)
  engine = make_engine(num_host_blocks=9)
  steps = _record(engine)
  add_all(engine, prompts, params)
  outputs = run(engine)
  recomputed = [r.request_id for out in steps for r in out.recomputed]
  swapped = [r.request_id for out in steps for r in out.preempted]
  assert recomputed and swapped
  for rid in set(recomputed):  # one prefill from 0 at admission, one per recomputation
    starts = [c.start for out in steps for c in out.chunks if c.request.request_id == rid]
    assert starts.count(0) == 1 + recomputed.count(rid)
    assert outputs[rid].metrics.num_preemptions >= recomputed.count(rid)
  assert _tokens(outputs) == reference_greedy(tiny_model(), prompts, 40)
  assert_all_blocks_free(engine)


def test_prefix_caching_on_and_off_give_the_same_tokens():
  rng = np.random.default_rng(1)
  prefix = rng.integers(0, VOCAB, size=24).tolist()
  prompts = [prefix + rng.integers(0, VOCAB, size=n).tolist() for n in (3, 9, 1, 14)]
  tokens, hits = {}, {}
  for caching in (True, False):
    engine = make_engine(enable_prefix_caching=caching)
    engine.add_request("r0", prompt_token_ids=prompts[0], sampling_params=GREEDY)
    run(engine)  # r0's prefix blocks are cached (and stay so after it finished)
    add_all(engine, prompts[1:], GREEDY, prefix="p")
    outputs = run(engine)
    tokens[caching] = [outputs[f"p{i}"].outputs[0].token_ids for i in range(3)]
    m = engine.metrics()
    hits[caching] = m['hisparse_prefix_cache_hits_total{memory_kind="device"}']
    assert_all_blocks_free(engine)
  assert tokens[True] == tokens[False] == reference_greedy(tiny_model(), prompts[1:],
                                                           NUM_TOKENS)
  assert hits[True] >= 3 * 3 and hits[False] == 0  # 3 full prefix blocks per later prompt


def test_abort_frees_blocks_and_the_others_go_on(reference):
  engine = make_engine()
  add_all(engine, PROMPTS[:5], GREEDY)
  for _ in range(3):
    engine.step()
  running = engine.scheduler.running[0].request_id
  waiting = engine.scheduler.waiting[-1].request_id
  used = engine.block_manager.device_pool.num_used_blocks
  held = len(engine.block_manager.block_table(running))
  assert engine.abort_request(running) and engine.abort_request(waiting)
  assert not engine.abort_request(running)  # finished already: nothing to do
  assert not engine.abort_request("nobody")
  assert engine.block_manager.device_pool.num_used_blocks == used - held
  assert running not in engine.block_manager
  outputs = run(engine)
  for rid in (running, waiting):
    assert outputs[rid].outputs[0].finish_reason == "abort"
  for i in range(5):
    if f"r{i}" not in (running, waiting):
      assert outputs[f"r{i}"].outputs[0].token_ids == reference[i]
      assert outputs[f"r{i}"].outputs[0].finish_reason == "length"
  assert engine.metrics()['hisparse_requests_total{finish_reason="abort"}'] == 2
  assert_all_blocks_free(engine)
  # Finished requests are forgotten (a long-running server keeps no history); an id can
  # be used again.
  assert engine.requests == {}
  i = int(running[1:])
  engine.add_request(running, prompt_token_ids=PROMPTS[i], sampling_params=GREEDY)
  assert run(engine)[running].outputs[0].token_ids == reference[i]


def test_seeded_sampling_is_reproducible_across_batch_compositions():
  params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=12, seed=123)
  prompt = PROMPTS[0]
  alone = make_engine()
  alone.add_request("x", prompt_token_ids=prompt, sampling_params=params)
  x_alone = run(alone)["x"].outputs[0].token_ids
  crowd = make_engine(max_num_batched_tokens=16)
  for i in (1, 4, 5):  # other requests, other seeds, chunked, arriving first
    crowd.add_request(f"o{i}", prompt_token_ids=PROMPTS[i], sampling_params=dataclasses.replace(
        params, seed=i))
  crowd.step()
  crowd.add_request("x", prompt_token_ids=prompt, sampling_params=params)
  outputs = run(crowd)
  assert outputs["x"].outputs[0].token_ids == x_alone and len(x_alone) == 12
  other = make_engine()
  other.add_request("x", prompt_token_ids=prompt,
                    sampling_params=dataclasses.replace(params, seed=124))
  assert run(other)["x"].outputs[0].token_ids != x_alone
  greedy = reference_greedy(tiny_model(), [prompt], 12)[0]
  assert x_alone != greedy  # temperature 0.9 really samples


def test_stop_token_eos_and_max_tokens(reference):
  ref = reference[1]
  stop = ref[3]
  k = ref.index(stop)
  engine = make_engine()
  engine.add_request("stop", prompt_token_ids=PROMPTS[1],
                     sampling_params=dataclasses.replace(GREEDY, stop_token_ids=[stop]))
  engine.add_request("len", prompt_token_ids=PROMPTS[1],
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=5))
  outputs = run(engine)
  stopped, length = outputs["stop"].outputs[0], outputs["len"].outputs[0]
  assert (stopped.token_ids, stopped.finish_reason) == (ref[:k + 1], "stop")
  assert (length.token_ids, length.finish_reason) == (ref[:5], "length")
  # The model's eos ends a request unless ignore_eos; it is the last token returned.
  model = tiny_model()
  eos_config = dataclasses.replace(model.config, eos_token_id=(VOCAB - 1, stop))
  engine = make_engine(model, eos_config)
  engine.add_request("eos", prompt_token_ids=PROMPTS[1], sampling_params=GREEDY)
  engine.add_request("ign", prompt_token_ids=PROMPTS[1],
                     sampling_params=dataclasses.replace(GREEDY, ignore_eos=True))
  outputs = run(engine)
  eos, ignored = outputs["eos"].outputs[0], outputs["ign"].outputs[0]
  assert (eos.token_ids, eos.finish_reason) == (ref[:k + 1], "stop")
  assert (ignored.token_ids, ignored.finish_reason) == (ref, "length")
  assert_all_blocks_free(engine)


def test_max_model_len_ends_a_request_with_length():
  engine = make_engine()
  prompt = PROMPTS[2]  # 40 tokens: room for 24 more
  engine.add_request("x", prompt_token_ids=prompt,
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=100))
  out = run(engine)["x"]
  completion = out.outputs[0]
  assert completion.finish_reason == "length"
  assert len(prompt) + len(completion.token_ids) == MAX_MODEL_LEN
  assert completion.token_ids == reference_greedy(tiny_model(), [prompt], 24)[0]


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt_token_ids=[]), "prompt"),
    (dict(prompt_token_ids=[1, VOCAB]), "prompt_token_ids"),
    (dict(prompt_token_ids=[-1]), "prompt_token_ids"),
    (dict(prompt_token_ids=[1] * MAX_MODEL_LEN), "max_model_len"),
    (dict(prompt="hello"), "tokenizer"),
    (dict(), "prompt"),
    (dict(prompt_token_ids=[1], sampling_params={"max_tokens": 3}), "sampling_params"),
])
def test_bad_requests_raise_value_error_naming_the_field(kwargs, field):
  engine = make_engine()
  with pytest.raises(ValueError, match=field):
    engine.add_request("bad", **kwargs)
  assert not engine.has_unfinished_requests() and "bad" not in engine.requests
  engine.add_request("ok", prompt_token_ids=[1, 2, 3], sampling_params=GREEDY)
  with pytest.raises(ValueError, match="already in use"):
    engine.add_request("ok", prompt_token_ids=[1])


def test_bad_engine_config_is_refused():
  with pytest.raises(ValueError, match="max_num_batched_tokens"):
    EngineConfig(max_model_len=128, max_num_batched_tokens=64, enable_chunked_prefill=False)
  with pytest.raises(ValueError, match="block_size"):
    EngineConfig(block_size=12)


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(reference):
  engine = make_engine()
  dispatch = engine.runner.dispatch  # the jitted step starts here
  calls = []

  def failing(batch, prev_tokens=None):
    calls.append(batch.num_seqs)
    if len(calls) == 2:
      raise RuntimeError("injected")
    return dispatch(batch, prev_tokens)

  engine.runner.dispatch = failing
  add_all(engine, PROMPTS[:2], GREEDY)
  outputs = run(engine)
  assert {o.outputs[0].finish_reason for o in outputs.values()} == {"error"}
  assert all("RuntimeError: injected" in o.error for o in outputs.values())
  assert_all_blocks_free(engine)
  engine.add_request("after", prompt_token_ids=PROMPTS[3], sampling_params=GREEDY)
  assert run(engine)["after"].outputs[0].token_ids == reference[3]
  assert engine.metrics()['hisparse_requests_total{finish_reason="error"}'] == 2


def test_recompilation_is_bounded_over_many_batch_shapes():
  engine = make_engine()
  rng = np.random.default_rng(3)
  lengths = [1, 2, 7, 8, 9, 15, 16, 17, 30, 31, 33, 44]
  pending = random_prompts(lengths, seed=3)
  i = 0
  while pending or engine.has_unfinished_requests():
    for _ in range(int(rng.integers(0, 3))):
      if pending:
        n = int(rng.integers(1, MAX_MODEL_LEN - len(pending[0])))
        engine.add_request(f"q{i}", prompt_token_ids=pending.pop(0),
                           sampling_params=SamplingParams(temperature=0.0, max_tokens=min(n, 12)))
        i += 1
    engine.step()
  assert i == len(lengths)
  shapes = engine.runner.shapes_compiled
  # Buckets: tokens 16/32/64, sequences 4, block-table width 4/8, greedy: at most 6.
  assert {t for t, _, _, _ in shapes} <= {16, 32, 64}
  assert {(b, g) for _, b, _, g in shapes} == {(4, True)}
  assert {w for _, _, w, _ in shapes} <= {4, 8}
  assert len(shapes) <= 6
  assert_all_blocks_free(engine)


def test_a_failed_swap_in_ends_the_requests_of_that_step_only(reference):
  engine = make_engine()
  steps = _record(engine)
  swap_in = engine.transfer.swap_in

  def failing_once(*args):
    engine.transfer.swap_in = swap_in
    raise RuntimeError("h2d failed")

  engine.transfer.swap_in = failing_once
  add_all(engine, PROMPTS, GREEDY)
  outputs = run(engine)
  failed = {rid for rid, o in outputs.items() if o.outputs[0].finish_reason == "error"}
  step = next(out for out in steps if out.swap_in)  # the first swap-in failed ...
  assert {r.request_id for r in step.swapped_in} <= failed  # ... and ended who came back
  assert failed == {c.request.request_id for c in step.chunks} | {
      r.request_id for r in step.swapped_in + step.preempted}
  for i in range(len(PROMPTS)):
    if f"r{i}" not in failed:
      assert outputs[f"r{i}"].outputs[0].token_ids == reference[i]
  assert_all_blocks_free(engine)


def test_step_arrays_are_padded_to_buckets():
  engine = make_engine()
  engine.add_request("a", prompt_token_ids=[5, 6, 7], sampling_params=GREEDY)
  engine.add_request("b", prompt_token_ids=list(range(10, 30)),
                     sampling_params=SamplingParams(temperature=0.5, top_k=3, seed=9))
  out = engine.scheduler.schedule()
  tables = engine.block_manager.block_tables(["a", "b"], 3)
  assert tables.tolist() == [[1, 0, 0], [2, 3, 4]]
  batch = engine.runner.build_batch(out.chunks, tables)
  engine.block_manager.finish_step()
  # 23 tokens -> 32 rows, 2 sequences -> 4, width 3 -> 4 blocks.
  chex.assert_shape([batch.input_ids, batch.positions, batch.metadata.slot_ids], (32,))
  chex.assert_shape(batch.metadata.block_tables, (4, 4))
  chex.assert_shape([batch.metadata.kv_lens, batch.logits_indices, batch.seeds], (4,))
  chex.assert_shape(batch.metadata.cu_q_lens, (5,))
  assert batch.input_ids[:23].tolist() == [5, 6, 7] + list(range(10, 30))
  assert batch.positions[:23].tolist() == [0, 1, 2] + list(range(20))
  assert batch.metadata.slot_ids.tolist() == [8, 9, 10] + list(range(16, 36)) + [-1] * 9
  assert batch.metadata.cu_q_lens.tolist() == [0, 3, 23, 23, 23]
  assert batch.metadata.kv_lens.tolist() == [3, 20, 0, 0]
  assert batch.logits_indices.tolist()[:2] == [2, 22]
  assert batch.temperature.tolist() == [0.0, 0.5, 0.0, 0.0]
  assert batch.top_k.tolist() == [0, 3, 0, 0] and batch.seeds[1] == 9
  # Engines over one model structure share the jitted step (and its compiled programs).
  assert make_engine().runner._step is engine.runner._step


def test_a_host_prefix_hit_is_swapped_in_and_gives_the_same_tokens(reference):
  engine = make_engine()
  add_all(engine, PROMPTS, GREEDY)
  run(engine)  # r2 is swapped out on the way: its full blocks stay cached on the host
  assert engine.block_manager.host_pool.num_cached_blocks > 0
  add_all(engine, random_prompts((44, 44), seed=9), GREEDY, prefix="f")
  run(engine)  # these evict r2's cached device blocks
  engine.add_request("again", prompt_token_ids=PROMPTS[2], sampling_params=GREEDY)
  out = run(engine)["again"]
  m = engine.metrics()
  assert m['hisparse_prefix_cache_hits_total{memory_kind="pinned_host"}'] > 0
  assert out.metrics.blocks_selected["host"] > 0
  assert out.outputs[0].token_ids == reference[2]
  assert_all_blocks_free(engine)


def test_bfloat16_cache_stored_as_uint16_matches_a_bfloat16_reference():
  model = LlamaForCausalLM(tiny_model().config, dtype=jnp.bfloat16, seed=0)
  engine = make_engine(model, dtype="bfloat16")
  assert engine.device_pool.storage_dtype == np.uint16  # CPU: bit-for-bit bf16 (KVPool)
  prompts = random_prompts((5, 30, 17), seed=0)
  add_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=10))
  outputs = run(engine)
  assert _tokens(outputs) == reference_greedy(model, prompts, 10)


@pytest.mark.parametrize("kernel_backend", ["xla", "reference"])
def test_nan_filled_free_blocks_change_no_token(reference, kernel_backend):
  # A freed block may hold anything (an earlier request's activations overflowed): every
  # slot a request does not own yet is NaN or inf, and its tokens are still the reference's.
  engine = make_engine(kernel_backend=kernel_backend)
  pool = engine.device_pool
  free = np.asarray(engine.block_manager.device_pool.free_block_ids() + [0])
  poisoned = []
  for i, a in enumerate(pool.arrays()):
    a = np.array(a)
    a[free] = np.nan if i % 2 == 0 else np.inf  # K NaN, V inf
    poisoned.append(jax.device_put(a, pool.sharding))
  pool.set_arrays(poisoned)
  add_all(engine, PROMPTS, GREEDY)
  assert _tokens(run(engine)) == reference
  assert_all_blocks_free(engine)

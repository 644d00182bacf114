"""Hypothesis state machine over the whole `Engine`: random arrivals, lengths, aborts and
steps on pools small enough that requests are swapped out to the host pool and, when the
host pool is full too, dropped and computed again.

Every example starts with a burst that forces both (FIRST_BURST); then rules add bursts of
requests, abort unfinished ones and step. After every rule: `Engine.check_invariants()`
(block-manager invariants, queues hold exactly the unfinished requests, only they hold
blocks); no request is reported after its finishing output; an ended request holds no
block; every output is a prefix of the full-recompute dense reference of its prompt (not
for HiSparse with a top-k that drops blocks, see `dense_tokens`). Teardown runs the engine
dry and checks that every request added finished exactly once and that both pools are
back at their baseline (prefix-cached blocks count as free).

The engine is the tiny random Llama of engine_fixtures (block_size 8, max_model_len 64,
4 sequences), greedy. Dense: 64-token steps, 12 usable device blocks and 8 usable host
blocks (the pools of test_engine's recompute test: shared compiled programs). HiSparse
(sequences past 16 tokens decode sparsely): 16-token steps (few compiled programs), the
device budget of 16 dense blocks, 16 usable host blocks.
"""

import functools

from engine_fixtures import (
  BLOCK_SIZE,
  MAX_MODEL_LEN,
  assert_all_blocks_free,
  gib_for_blocks,
  random_prompts,
  reference_greedy,
  tiny_model,
)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
  RuleBasedStateMachine,
  initialize,
  invariant,
  rule,
  run_state_machine_as_test,
)

from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.sparse.config import HiSparseConfig

NUM_DEVICE_BLOCKS = 13  # null block + 12: a request of max_model_len needs 8
NUM_HOST_BLOCKS = 9  # null block + 8: the host pool fills, so victims are recomputed too
# HiSparse also writes full blocks through to the host pool: twice the host blocks, so that
# victims are swapped out there too, not only recomputed.
NUM_HISPARSE_HOST_BLOCKS = 17
_SHARED = random_prompts((16,), seed=21)[0]  # a common prefix: prefix-cache hits
PROMPTS = random_prompts((17, 17, 17, 17, 1, 3, 8, 9, 24, 33, 47), seed=20) + [
    _SHARED + p for p in random_prompts((4, 11), seed=22)]
# Every example starts with test_engine's recompute scenario: four 17-token prompts asking
# for 40 tokens (8 blocks each at the end) outgrow 12 device blocks; the first victims are
# swapped out, and once the 8 host blocks are taken the next ones are recomputed.
FIRST_BURST = [(i, 40) for i in range(4)]
# Sequences past 16 tokens decode sparsely. SMALL: 2 blocks a step (the sink block and the
# newest), the rest from the indexer's top-k. FULL: top-k covers max_model_len, so every
# sparse step selects all blocks and must give the dense tokens (DESIGN.md invariant).
SMALL_HISPARSE = HiSparseConfig(top_k_tokens=16, sink_tokens=8, local_tokens=8,
                                sparse_threshold_tokens=16)
FULL_HISPARSE = HiSparseConfig(top_k_tokens=MAX_MODEL_LEN, hot_buffer_tokens=MAX_MODEL_LEN,
                               sink_tokens=8, local_tokens=8, sparse_threshold_tokens=16)
SETTINGS = settings(max_examples=6, stateful_step_count=20, deadline=None)


@functools.cache
def dense_reference() -> tuple[tuple[int, ...], ...]:
  """Greedy tokens of every prompt up to max_model_len (full recompute, dense)."""
  out = reference_greedy(tiny_model(), PROMPTS, MAX_MODEL_LEN - 1)
  return tuple(tuple(ids[:MAX_MODEL_LEN - len(p)]) for ids, p in zip(out, PROMPTS))


def _engine(hisparse: HiSparseConfig | None) -> Engine:
  model = tiny_model()
  # HiSparse takes its key bounds and hot buffers out of the same device budget: the
  # budget of 15 dense blocks leaves it at most 13 with bfloat16 bounds (the default; the
  # exact count is the planner's).
  device_blocks = NUM_DEVICE_BLOCKS if hisparse is None else 15
  host_blocks = NUM_HOST_BLOCKS if hisparse is None else NUM_HISPARSE_HOST_BLOCKS
  config = EngineConfig(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                        max_num_batched_tokens=64 if hisparse is None else 16,
                        device_kv_gib=gib_for_blocks(model.config, device_blocks),
                        host_pool_gib=gib_for_blocks(model.config, host_blocks),
                        hisparse=hisparse)
  engine = Engine(config, model=model, model_config=model.config)
  assert engine.device_pool.num_blocks <= NUM_DEVICE_BLOCKS
  assert engine.host_pool.num_blocks == host_blocks
  return engine


class EngineMachine(RuleBasedStateMachine):
  """Random traffic on one small engine; see the module docstring."""

  hisparse: HiSparseConfig | None = None
  # Whether outputs must be prefixes of the dense reference. Not with a top-k that drops
  # blocks: a sparse decode step and the dense prefill that recomputes the same tokens
  # (after a recompute preemption or a prefix-cache hit) attend to different blocks.
  dense_tokens = True
  pressure: dict[str, int]  # counts over all examples: swap-outs, recomputations

  def __init__(self):
    super().__init__()
    self.engine = _engine(self.hisparse)
    self.baseline = {kind: pool.num_free_blocks
                     for kind, pool in self.engine.block_manager.pools.items()}
    schedule = self.engine.scheduler.schedule

    def counting():
      out = schedule()
      self.pressure["swapped_out"] += len(out.preempted)
      self.pressure["recomputed"] += len(out.recomputed)
      return out

    self.engine.scheduler.schedule = counting
    self.prompt_of: dict[str, int] = {}
    self.max_tokens: dict[str, int] = {}
    self.tokens: dict[str, list[int]] = {}  # streamed so far
    self.finished: dict[str, str] = {}  # request id -> finish reason
    self.aborted: set[str] = set()

  # --- Rules ---------------------------------------------------------------------

  @initialize()
  def first_burst(self):
    self.add_requests(FIRST_BURST)

  @rule(arrivals=st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(1, 48)),
                          min_size=1, max_size=4))
  def add_requests(self, arrivals):
    """A burst of arrivals: (prompt index, max_tokens) each."""
    for prompt, max_tokens in arrivals:
      request_id = f"q{len(self.prompt_of)}"
      self.engine.add_request(request_id, prompt_token_ids=PROMPTS[prompt],
                              sampling_params=SamplingParams(temperature=0.0,
                                                             max_tokens=max_tokens))
      self.prompt_of[request_id] = prompt
      self.max_tokens[request_id] = max_tokens
      self.tokens[request_id] = []

  @rule(index=st.integers(0, 63))
  def abort_request(self, index):
    unfinished = sorted(self.engine.requests)
    if not unfinished:
      return
    request_id = unfinished[index % len(unfinished)]
    assert self.engine.abort_request(request_id)
    assert not self.engine.abort_request(request_id)  # ends once
    self.aborted.add(request_id)

  @rule(num_steps=st.integers(1, 4))
  def step(self, num_steps):
    for _ in range(num_steps):
      self._step()

  def _step(self):
    for out in self.engine.step():
      request_id = out.request_id
      assert request_id not in self.finished, f"{request_id} reported after it finished"
      seen = self.tokens[request_id]
      tokens = out.outputs[0].token_ids  # cumulative: what it reported before, and more
      assert tokens[:len(seen)] == seen and len(tokens) >= len(seen)
      self.tokens[request_id] = list(tokens)
      if self.dense_tokens:
        reference = dense_reference()[self.prompt_of[request_id]]
        assert tuple(tokens) == reference[:len(tokens)], (request_id, out)
      if out.finished:
        self.finished[request_id] = out.outputs[0].finish_reason
        self._check_finish(request_id, out)
    self.engine.check_invariants()

  def _check_finish(self, request_id, out):
    assert out.error is None
    if request_id in self.aborted:
      assert out.outputs[0].finish_reason == "abort"
      return
    room = MAX_MODEL_LEN - len(PROMPTS[self.prompt_of[request_id]])
    assert out.outputs[0].finish_reason == "length"  # the tiny model has no eos
    assert len(out.outputs[0].token_ids) == min(self.max_tokens[request_id], room)

  # --- Invariants ----------------------------------------------------------------

  @invariant()
  def ended_requests_hold_nothing(self):
    self.engine.check_invariants()
    for request_id in set(self.finished) | self.aborted:
      assert request_id not in self.engine.requests
      assert request_id not in self.engine.block_manager

  def teardown(self):
    for _ in range(5000):
      if not self.engine.has_unfinished_requests():
        break
      self._step()
    self._step()  # collects the outputs of requests aborted last
    assert not self.engine.has_unfinished_requests()
    assert sorted(self.finished) == sorted(self.prompt_of)  # each once (checked in _step)
    assert_all_blocks_free(self.engine)
    assert {kind: pool.num_free_blocks
            for kind, pool in self.engine.block_manager.pools.items()} == self.baseline


def _run(machine: type[EngineMachine]) -> dict[str, int]:
  machine.pressure = {"swapped_out": 0, "recomputed": 0}
  run_state_machine_as_test(machine, settings=SETTINGS)
  return machine.pressure


def test_random_traffic_dense():
  pressure = _run(EngineMachine)
  assert pressure["swapped_out"] > 0 and pressure["recomputed"] > 0, pressure


class FullHiSparseMachine(EngineMachine):
  hisparse = FULL_HISPARSE


def test_random_traffic_hisparse_top_k_covering_all_blocks():
  pressure = _run(FullHiSparseMachine)
  assert pressure["swapped_out"] > 0, pressure


class SmallHiSparseMachine(EngineMachine):
  hisparse = SMALL_HISPARSE
  dense_tokens = False


def test_random_traffic_hisparse_small_top_k():
  pressure = _run(SmallHiSparseMachine)
  assert pressure["swapped_out"] > 0, pressure

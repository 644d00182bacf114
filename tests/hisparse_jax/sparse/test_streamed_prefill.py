"""Prompts longer than the device pool, served with HiSparse: the prompt is allocated chunk
by chunk, its computed blocks are written through to the host pool and dropped from the
device when the device is short, and its later chunks attend over all their earlier
blocks, loaded in groups through the hot buffer (streamed_prefill="exact", the default),
or over the top-k of them ("sparse"), plus their own (Scheduler._extend_streamed,
sparse/attention.py).

The tiny random Llama of engine_fixtures with block_size 8, max_model_len 256, prefill
chunks of 16 tokens and a device pool of 16 usable blocks (128 tokens): a top-k of 4
blocks and a hot buffer of 4, so a 200-token prompt needs 25 blocks and streams. Without
HiSparse the same budget is refused at start.
"""

import dataclasses

import pytest
from engine_fixtures import (
  assert_all_blocks_free,
  gib_for_blocks,
  random_prompts,
  reference_greedy,
  run,
  tiny_model,
)

from hisparse_jax import HiSparseConfig
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.engine.scheduler import Scheduler

MAX_MODEL_LEN = 256
HISPARSE = HiSparseConfig(top_k_tokens=32, hot_buffer_tokens=32, sink_tokens=8,
                          local_tokens=8, sparse_threshold_tokens=32)
NUM_DEVICE_BLOCKS = 24  # planned: 16 usable after the indexer's key bounds


def _engine(hisparse=HISPARSE, **overrides):
  model = tiny_model()
  fields = dict(block_size=8, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                max_num_batched_tokens=16,
                device_kv_gib=gib_for_blocks(model.config, NUM_DEVICE_BLOCKS),
                host_pool_gib=gib_for_blocks(model.config, 80), hisparse=hisparse)
  return Engine(EngineConfig(**{**fields, **overrides}), model=model,
                model_config=model.config)


def _record_rows(engine):
  """Wraps build_batch; returns a list that gets, per step, (device blocks in use, rows
  of prefill chunks that are sparse, blocks the rows' attention reads, sparse rows of one
  token)."""
  seen, build = [], engine.runner.build_batch

  def recording(chunks, tables, tiers=None):
    batch = engine_build(chunks, tables, tiers)
    sparse = batch.metadata.sparse_rows[:len(chunks)]
    seen.append((engine.block_manager.device_pool.num_used_blocks,
                 sum(bool(s) and c.num_tokens > 1 for c, s in zip(chunks, sparse)),
                 int(batch.blocks_attended.sum()),
                 sum(bool(s) and c.num_tokens == 1 for c, s in zip(chunks, sparse))))
    return batch

  engine_build = build
  engine.runner.build_batch = recording
  return seen


def test_dense_engine_refuses_the_budget_hisparse_streams_through():
  with pytest.raises(ValueError, match="--device_kv_gib.*one request of --max_model_len=256"):
    _engine(hisparse=None)
  engine = _engine()
  assert engine.device_pool.num_blocks - 1 == 16  # 128 tokens: half a max_model_len request
  lines = engine.capacity.log_lines(MAX_MODEL_LEN)
  assert "one request may be up to 256 tokens, beyond the 128 of device" in lines[-1]


@pytest.mark.parametrize("mode", ["exact", "sparse"])
def test_a_prompt_longer_than_the_device_pool_is_served(mode):
  engine = _engine(dataclasses.replace(HISPARSE, streamed_prefill=mode))
  seen = _record_rows(engine)
  prompt = random_prompts([200], seed=3)[0]  # 25 blocks > 16
  engine.add_request("long", prompt_token_ids=prompt,
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=8))
  outputs = run(engine)
  tokens = outputs["long"].outputs[0].token_ids
  assert len(tokens) == 8
  m = engine.metrics()
  assert m["hisparse_offloads_total"] >= 1
  assert m["hisparse_hot_buffer_loads_total"] > 0  # earlier chunks read back from the host
  assert sum(rows for _, rows, _, _ in seen) >= 5  # the later chunks attended sparse
  assert max(used for used, _, _, _ in seen) <= 16
  # The request's blocks by source add up to what its rows read (a chunk: its earlier
  # blocks (exact: all; sparse: the selected) from device / hot buffer / host, its own
  # from the device).
  selected = outputs["long"].metrics.blocks_selected
  assert sum(selected.values()) == pytest.approx(sum(b for _, _, b, _ in seen))
  assert selected["host"] > 0 and selected["hot"] > 0  # (exact: the decode rows' hits)
  assert_all_blocks_free(engine)
  # The first token comes from the streamed prefill alone (exact; sparse: its last chunk
  # attended over 4 of its 23 earlier blocks, on this model the dense token too). The
  # later tokens decode sparse over 4 blocks and may drift.
  reference = reference_greedy(tiny_model(), [prompt], 8)[0]
  assert tokens[0] == reference[0]


def test_an_exact_streamed_prefill_gives_the_dense_prompt_logprobs():
  # A 200-token prompt streamed in 16-token chunks through 16 device blocks, each chunk
  # over up to 23 earlier blocks in groups of the hot buffer's 4: the logprob of every
  # prompt token equals the dense engine's (a device pool that holds it all).
  prompt = random_prompts([200], seed=6)[0]
  params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
  streamed = _engine()
  streamed.add_request("s", prompt_token_ids=prompt, sampling_params=params)
  got = run(streamed)["s"]
  assert streamed.metrics()["hisparse_hot_buffer_loads_total"] > 0
  assert got.outputs[0].token_ids[0] == reference_greedy(tiny_model(), [prompt], 1)[0][0]
  dense = _engine(hisparse=None, device_kv_gib=gib_for_blocks(tiny_model().config, 40))
  dense.add_request("d", prompt_token_ids=prompt, sampling_params=params)
  want = run(dense)["d"]
  for j in range(1, 200):
    (entry,) = got.prompt_logprobs[j].values()
    (reference,) = want.prompt_logprobs[j].values()
    assert entry.logprob == pytest.approx(reference.logprob, abs=1e-4), j
  assert_all_blocks_free(streamed)


def test_streamed_prompts_share_the_device_with_others_and_all_finish():
  # Two long prompts and three short ones at once: the long ones stream, offload and are
  # preempted to the host pool and back; every request finishes, nothing leaks; the short
  # ones (dense throughout) give the dense tokens.
  engine = _engine()
  prompts = random_prompts([200, 9, 150, 30, 5], seed=4)
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", prompt_token_ids=p,
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=10))
  outputs = run(engine)
  assert all(len(outputs[f"r{i}"].outputs[0].token_ids) == 10 for i in range(5))
  reference = reference_greedy(tiny_model(), [prompts[1], prompts[4]], 10)
  assert outputs["r1"].outputs[0].token_ids == reference[0]
  assert outputs["r4"].outputs[0].token_ids == reference[1]
  assert engine.metrics()["hisparse_offloads_total"] >= 2
  assert_all_blocks_free(engine)


def test_a_long_prompt_with_n_sequences_is_refused_naming_n():
  engine = _engine()
  prompt = random_prompts([200], seed=5)[0]
  with pytest.raises(ValueError, match=r"^n=2: .*holds 128 tokens, and the prompt has 200"):
    engine.add_request("n2", prompt_token_ids=prompt,
                       sampling_params=SamplingParams(n=2, max_tokens=4))
  engine.add_request("n2", prompt_token_ids=prompt[:100],
                     sampling_params=SamplingParams(n=2, seed=0, max_tokens=4))
  outputs = run(engine)
  assert len(outputs["n2"].outputs) == 2
  assert_all_blocks_free(engine)


def test_a_device_pool_below_the_streamed_working_set_is_refused():
  # hot buffer 4 + a 16-token chunk (2 blocks) + 2 = 8 blocks; plan 7 usable.
  with pytest.raises(ValueError, match="HiSparse streams a request through 8 blocks"):
    _engine(device_kv_gib=gib_for_blocks(tiny_model().config, 7 + 1 + 4))


@pytest.mark.parametrize(("mode", "bounds_dtype"), [("exact", "bfloat16"),
                                                     ("sparse", "bfloat16"),
                                                     ("sparse", "int8")])
def test_offloaded_chunks_over_every_earlier_block_give_the_dense_tokens(monkeypatch, mode,
                                                                         bounds_dtype):
  # The engine's streamed path end to end, made exact: a 100-token prompt streamed in
  # 16-token chunks, offloaded before every chunk (its computed blocks written through and
  # dropped: every chunk reads its earlier blocks back from the host pool), with a top-k
  # covering every block. Its sparse_threshold_tokens (256) is above the request's
  # length, so only the offload makes its decode rows sparse (a dense row would read the
  # dropped blocks' null entries). The greedy tokens equal the dense reference's.
  extend = Scheduler._extend_streamed

  def offload_first(self, request, end, out):
    if request.num_computed_tokens >= self.bm.block_size:
      self._write_through(request, out)
      self.bm.offload(request.request_id, self.hot_buffer_blocks)
    return extend(self, request, end, out)

  monkeypatch.setattr(Scheduler, "_streams", lambda self, request, num_blocks: True)
  monkeypatch.setattr(Scheduler, "_extend_streamed", offload_first)
  covering = HiSparseConfig(top_k_tokens=MAX_MODEL_LEN, hot_buffer_tokens=MAX_MODEL_LEN,
                            sink_tokens=8, local_tokens=8, sparse_threshold_tokens=256,
                            streamed_prefill=mode, bounds_dtype=bounds_dtype)
  engine = _engine(covering, device_kv_gib=gib_for_blocks(tiny_model().config, 80))
  seen = _record_rows(engine)
  prompt = random_prompts([100], seed=3)[0]
  engine.add_request("a", prompt_token_ids=prompt,
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=10))
  outputs = run(engine)
  assert sum(rows for _, rows, _, _ in seen) == 6  # chunks 2-7 of 7 read host blocks
  assert sum(rows for _, _, _, rows in seen) == 9  # every decode row
  assert engine.metrics()["hisparse_hot_buffer_loads_total"] > 0
  assert outputs["a"].outputs[0].token_ids == reference_greedy(tiny_model(), [prompt], 10)[0]
  assert_all_blocks_free(engine)

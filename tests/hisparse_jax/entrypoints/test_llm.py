"""`hisparse_jax.LLM`: batch generation, per-prompt sampling, figures; the status line."""

import dataclasses

import numpy as np
import pytest
from engine_fixtures import dense_last_logits

import hisparse_jax
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.entrypoints.llm import LLM, PromptError
from hisparse_jax.observability.status import StatusLogger, status_line
from models import data
from models.loader import load_pretrained
from models.testing import save_random_checkpoint

BLOCK_SIZE = 16


def save_tiny_checkpoint(out_dir) -> str:
  """A random 2-layer Llama over the default model's vocabulary, in HF layout: 2 layers x 1
  KV head x 16 dims, so 256 KV bytes per float32 token."""
  return save_random_checkpoint(out_dir, seed=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llm"))


@pytest.fixture(scope="module")
def llm(checkpoint):
  # 256 B/token * 16 tokens = 4 KiB blocks: 64 device blocks, 128 host blocks. Few
  # compiled shapes: block tables 4 wide (64 tokens), steps of 16 or 32 tokens, 4 seqs.
  return LLM(checkpoint, block_size=BLOCK_SIZE, device_kv_gib=65 * 4096 / 2**30,
             host_pool_gib=129 * 4096 / 2**30, max_model_len=64, max_num_seqs=4,
             max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference_greedy(checkpoint):
  """Greedy tokens by re-running the full dense forward (no KV cache) for every token."""
  model, _, _ = load_pretrained(checkpoint)

  def greedy(prompt, num_tokens):
    out = []
    for _ in range(num_tokens):
      out.append(int(np.argmax(dense_last_logits(model, prompt + out))))
    return out
  return greedy


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [[data.BOS_ID] + rng.choice(data.CONTENT_IDS, n - 1).tolist() for n in lengths]


def test_token_prompts_give_reference_greedy_tokens_in_input_order(llm, reference_greedy):
  prompts = _prompts([50, 5, 37])  # the longest first (prefill in chunks of <= 32)
  outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
      temperature=0.0, max_tokens=6, ignore_eos=True))
  assert [o.prompt_token_ids for o in outputs] == prompts
  for prompt, out in zip(prompts, outputs):
    assert out.outputs[0].token_ids == reference_greedy(prompt, 6)
    assert out.finished and out.outputs[0].finish_reason == "length"
    # The text reads on from the prompt (vLLM's detokenization: a word's space first).
    assert llm.tokenizer.decode(prompt) + out.outputs[0].text == llm.tokenizer.decode(
        prompt + out.outputs[0].token_ids)
    # Attention read every block of the sequence in each of its steps, all on the device.
    assert out.metrics.blocks_selected["device"] > 0 and out.metrics.blocks_selected["host"] == 0
    assert out.metrics.time_to_first_token_s > 0 and out.metrics.decode_tokens_per_s > 0
  assert not llm.engine.has_unfinished_requests()


def test_one_token_prompt_as_a_flat_list(llm, reference_greedy):
  prompt = _prompts([9], seed=1)[0]
  (out,) = llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0.0,
      max_tokens=3, ignore_eos=True))
  assert out.prompt_token_ids == prompt
  assert out.outputs[0].token_ids == reference_greedy(prompt, 3)


def test_text_prompts_tokenize_like_their_ids(llm):
  text = "bafu: bapo\nbaki: bare\n? baki:"
  ids = llm.tokenizer.encode(text)
  assert ids[0] == data.BOS_ID and len(ids) == 1 + 3 + 3 + 2
  assert data.TOKEN_TO_ID[data.UNK] not in ids
  sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
  by_text, by_dict = llm.generate([text, {"prompt_token_ids": ids}], sp)
  (by_ids,) = llm.generate(prompt_token_ids=[ids], sampling_params=sp)
  assert by_text.prompt_token_ids == ids
  assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids


def test_sampling_params_per_prompt(llm, reference_greedy):
  prompts = _prompts([20, 20, 33], seed=2)
  first = reference_greedy(prompts[2], 1)[0]
  outputs = llm.generate(prompt_token_ids=prompts, sampling_params=[
      SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
      SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
      SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[first], ignore_eos=True)])
  assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 5, 1]
  assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length", "stop"]
  assert outputs[2].outputs[0].token_ids == [first]


def test_seeded_sampling_is_reproducible(llm):
  prompts = _prompts([12, 40], seed=3)
  sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=8, seed=7,
                      ignore_eos=True)
  a = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
  b = llm.generate(prompt_token_ids=prompts[::-1], sampling_params=sp)  # other batch order
  c = llm.generate(prompt_token_ids=prompts,
                   sampling_params=dataclasses.replace(sp, seed=8))
  assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b[::-1]]
  assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in c]


def test_metrics_count_what_generate_did(llm):
  before = llm.metrics()
  prompts = _prompts([17, 50, 3], seed=4)
  outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
      temperature=0.0, max_tokens=4, ignore_eos=True))
  after = llm.metrics()
  delta = lambda key: after[key] - before.get(key, 0.0)
  assert delta("hisparse_generation_tokens_total") == 12
  assert delta("hisparse_prompt_tokens_total") == 70
  assert delta('hisparse_requests_total{finish_reason="length"}') == 3
  assert delta('hisparse_blocks_selected_total{source="device"}') == sum(
      o.metrics.blocks_selected["device"] for o in outputs)
  assert delta('hisparse_blocks_selected_total{source="host"}') == 0
  assert after['hisparse_kv_capacity_tokens{memory_kind="device"}'] == 64 * BLOCK_SIZE
  assert after['hisparse_kv_capacity_tokens{memory_kind="pinned_host"}'] == 128 * BLOCK_SIZE
  assert llm.capacity["device"].num_tokens == 64 * BLOCK_SIZE
  assert after['hisparse_kv_usage_ratio{memory_kind="device"}'] == 0.0  # all freed again
  assert after['hisparse_num_requests{state="running"}'] == 0
  assert after["hisparse_time_to_first_token_seconds_count"] >= 3
  for key in ('hisparse_blocks_selected_total{source="hot"}', "hisparse_preemptions_total",
              "hisparse_thrash_total", "hisparse_prefix_cache_queries_total",
              'hisparse_prefix_cache_hits_total{memory_kind="pinned_host"}'):
    assert key in after


def test_bad_input_names_the_prompt_and_leaves_nothing_queued(llm):
  good, vocab = _prompts([8], seed=5)[0], len(data.VOCAB)
  with pytest.raises(PromptError, match=r"prompt 1: .*token id 1031 is outside") as e:
    llm.generate(prompt_token_ids=[good, [1, vocab], good])
  assert e.value.index == 1
  assert not llm.engine.has_unfinished_requests()
  with pytest.raises(ValueError, match="exactly one of prompts and prompt_token_ids"):
    llm.generate()
  with pytest.raises(ValueError, match="sampling_params: 1 given for 2 prompts"):
    llm.generate(prompt_token_ids=[good, good], sampling_params=[SamplingParams(temperature=0.0)])
  with pytest.raises(PromptError, match="prompt 0: a prompt is a string"):
    llm.generate([{"ids": good}])
  assert llm.generate(prompt_token_ids=[]) == []


def test_constructor_refuses_bad_arguments_before_loading():
  with pytest.raises(ValueError, match="hisparse must be a HiSparseConfig or None, got object"):
    LLM("/nonexistent", hisparse=object())
  with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'"):
    LLM("/nonexistent", max_num_seq=3)


def test_public_exports():
  for name in ("LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput",
               "CapacityReport", "KVCacheSpec", "KVPool", "plan_capacity", "TransferEngine",
               "MetricsRegistry"):
    assert getattr(hisparse_jax, name).__name__ == name
  assert hisparse_jax.__version__ == "0.1.0"
  assert set(hisparse_jax.__all__) >= {"LLM", "Engine", "__version__"}


class _FakeEngine:
  def __init__(self):
    self.num_steps = 0
    self.snapshot = {}

  def metrics(self):
    return dict(self.snapshot)


def test_status_line_rates_cover_the_interval():
  engine, clock = _FakeEngine(), iter([10.0, 12.0, 14.0]).__next__
  logger = StatusLogger(engine, every_steps=2, clock=clock)
  engine.num_steps = 1
  assert logger.maybe_log() is None
  engine.num_steps = 2
  engine.snapshot = {
      'hisparse_num_requests{state="running"}': 3, 'hisparse_num_requests{state="swapped"}': 2,
      'hisparse_num_requests{state="waiting"}': 1,
      'hisparse_kv_usage_ratio{memory_kind="device"}': 0.9375,
      'hisparse_kv_usage_ratio{memory_kind="pinned_host"}': 0.0125,
      "hisparse_prefix_cache_queries_total": 8,
      'hisparse_prefix_cache_hits_total{memory_kind="device"}': 1,
      'hisparse_prefix_cache_hits_total{memory_kind="pinned_host"}': 1,
      'hisparse_transfer_bytes_total{direction="h2d"}': 1e9,
      'hisparse_transfer_bytes_total{direction="d2h"}': 3e9,
      "hisparse_generation_tokens_total": 100, "hisparse_preemptions_total": 5}
  assert logger.maybe_log() == (
      "step 2: running 3, swapped 2, waiting 1 reqs; KV usage device 93.8%, host 1.2%; "
      "prefix-cache hit rate 25.0%, hot-buffer hit rate -; h2d 0.50 GB/s, d2h 1.50 GB/s; "
      "generation 50.0 tokens/s; preemptions 5")
  engine.num_steps = 4
  engine.snapshot["hisparse_generation_tokens_total"] = 140
  line = logger.maybe_log()
  assert "h2d 0.00 GB/s" in line and "generation 20.0 tokens/s" in line


def test_status_line_hot_buffer_rate():
  now = {'hisparse_blocks_selected_total{source="hot"}': 30,
         'hisparse_blocks_selected_total{source="host"}': 10}
  assert "hot-buffer hit rate 75.0%" in status_line(7, now, {}, 1.0)
  assert "prefix-cache hit rate -" in status_line(7, now, {}, 1.0)
  # Every offloaded block selected missed: 0%, not "-" (which means none was selected).
  none_hot = {'hisparse_blocks_selected_total{source="host"}': 10}
  assert "hot-buffer hit rate 0.0%" in status_line(7, none_hot, {}, 1.0)
  assert "hot-buffer hit rate -" in status_line(7, {}, {}, 1.0)


def _pieces(llm, token_ids, prompt):
  """Each token's piece of the output text (the engine's incremental detokenization,
  which starts in the prompt's context)."""
  stream = llm.tokenizer.decode_stream(prompt_token_ids=prompt)
  return [stream.step(t) for t in token_ids]


def test_stop_strings_match_across_tokens_and_end_the_text(llm):
  prompt = _prompts([9], seed=5)[0]
  sp = dict(max_tokens=12, ignore_eos=True, temperature=0.0)
  (full,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**sp))
  pieces = _pieces(llm, full.outputs[0].token_ids, prompt)
  assert "".join(pieces) == full.outputs[0].text and full.outputs[0].stop_reason is None
  # A stop string made of the end of one token's piece and the start of the next's.
  i = next(i for i in range(2, len(pieces) - 1) if pieces[i] and pieces[i + 1])
  stop = pieces[i][-1] + pieces[i + 1][0]
  at = full.outputs[0].text.find(stop)  # its first occurrence ends the output
  ends = np.cumsum([len(p) for p in pieces])
  last = int(np.searchsorted(ends, at + len(stop)))  # the token that completes it
  for keep in (False, True):
    (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        **sp, stop=["never-in-this-vocabulary", stop], include_stop_str_in_output=keep))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == full.outputs[0].text[:at + len(stop) if keep else at]
    assert out.outputs[0].token_ids == full.outputs[0].token_ids[:last + 1]


def test_streamed_text_never_shows_what_may_start_a_stop_string(llm):
  prompt = _prompts([9], seed=5)[0]
  full = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
      temperature=0.0, max_tokens=12, ignore_eos=True))[0]
  stop = full.outputs[0].text[-3:] + "#"  # never completes: the output runs to its length
  engine = llm.engine
  rid = engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0.0,
      max_tokens=12, ignore_eos=True, stop=[stop]))
  texts = []
  while engine.has_unfinished_requests():
    texts += [o.outputs[0].text for o in engine.step() if o.request_id == rid]
  assert texts[-1] == full.outputs[0].text  # finished by length: nothing held back any more
  for text in texts[:-1]:  # while running: the last len(stop) - 1 characters held back
    assert full.outputs[0].text.startswith(text)
  assert all(len(t) <= max(0, len(full.outputs[0].text) - 3) for t in texts[:-1])


def test_stop_and_stop_token_ids_validation():
  assert SamplingParams(stop="ab").stop == ("ab",)
  assert SamplingParams(stop=["ab", "cde"]).stop_hold_back == 2
  assert SamplingParams(stop=["ab"], include_stop_str_in_output=True).stop_hold_back == 0
  with pytest.raises(ValueError, match="stop strings must be non-empty strings, got ''"):
    SamplingParams(stop=["x", ""])


def test_stop_token_ids_name_the_token_in_stop_reason(llm):
  prompt = _prompts([9], seed=5)[0]
  (full,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
      temperature=0.0, max_tokens=12, ignore_eos=True))
  token = full.outputs[0].token_ids[3]
  (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0.0,
      max_tokens=12, ignore_eos=True, stop_token_ids=[token]))
  full_ids = full.outputs[0].token_ids
  assert out.outputs[0].token_ids == full_ids[:full_ids.index(token) + 1]
  assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == token
  # The stop token's text is left out of the output (vLLM's rule), unless
  # include_stop_str_in_output.
  tok = llm.tokenizer
  tokens = out.outputs[0].token_ids
  assert tok.decode(prompt) + out.outputs[0].text == tok.decode(prompt + tokens[:-1])
  (kept,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
      temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[token],
      include_stop_str_in_output=True))
  assert tok.decode(prompt) + kept.outputs[0].text == tok.decode(prompt + tokens)

"""The vLLM-shaped offline API: RequestOutput / CompletionOutput / RequestMetrics, the
output kinds `Engine.step()` streams, vLLM's SamplingParams defaults, its prompt forms,
dtype="auto", and copies of vLLM's offline examples (examples/) run as they are."""

import contextlib
import functools
import io
import json
import os
import re
import runpy
import shutil

import numpy as np
import pytest
from engine_fixtures import dense_last_logits

from hisparse_jax import (
  LLM,
  CompletionOutput,
  RequestMetrics,
  RequestOutput,
  RequestOutputKind,
  SamplingParams,
)
from hisparse_jax.entrypoints.llm import PromptError
from models import data
from models.loader import CheckpointError, checkpoint_dtype, load_pretrained
from models.testing import save_random_checkpoint

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return save_random_checkpoint(tmp_path_factory.mktemp("vllm_api"), seed=3)


@pytest.fixture(scope="module")
def llm(checkpoint):
  # 4 KiB blocks (256 B/token x 16): 64 device blocks, 128 host blocks.
  return LLM(checkpoint, block_size=BLOCK_SIZE, device_kv_gib=65 * 4096 / 2**30,
             host_pool_gib=129 * 4096 / 2**30, max_model_len=64, max_num_seqs=4,
             max_num_batched_tokens=32, enable_prefix_caching=True)


def _prompt(n, seed=0):
  rng = np.random.default_rng(seed)
  return [data.BOS_ID] + rng.choice(data.CONTENT_IDS, n - 1).tolist()


def test_request_output_is_vllms_shape(llm):
  text = "bafu: bapo\nbaki: bare\n? baki:"
  (out,) = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=5,
                                               ignore_eos=True))
  assert isinstance(out, RequestOutput) and out.finished and out.error is None
  assert out.prompt == text and out.prompt_token_ids == llm.get_tokenizer().encode(text)
  (completion,) = out.outputs
  assert isinstance(completion, CompletionOutput) and completion.index == 0
  assert completion.finished() and completion.finish_reason == "length"
  assert completion.stop_reason is None and len(completion.token_ids) == 5
  assert completion.text == " " + llm.get_tokenizer().decode(completion.token_ids)
  assert completion.cumulative_logprob is None and completion.logprobs is None
  assert isinstance(out.metrics, RequestMetrics)
  m = out.metrics
  assert m.first_token_time >= m.arrival_time and m.last_token_time >= m.first_token_time
  assert m.time_to_first_token_s == pytest.approx(m.first_token_time - m.arrival_time)
  assert m.decode_tokens_per_s > 0 and m.num_preemptions == 0
  assert m.blocks_selected["device"] > 0 and m.blocks_selected["host"] == 0
  # Token-id prompts have no text; {"prompt": str} is the same request as the string.
  sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
  by_ids, by_text, by_dict = llm.generate(
      [{"prompt_token_ids": out.prompt_token_ids}, text, {"prompt": text}], sp)
  assert by_ids.prompt is None and by_text.prompt == by_dict.prompt == text
  assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids == \
      by_dict.outputs[0].token_ids == completion.token_ids[:3]
  with pytest.raises(ValueError, match=r"a prompt is a string, \{'prompt': str\}"):
    llm.generate([{"text": text}], sp)


def test_num_cached_tokens_counts_prefix_cache_hits(llm):
  prompt = _prompt(40, seed=11)  # 2 full blocks of 16, then 8 tokens
  sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
  (first,) = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
  (again,) = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
  assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
  assert again.outputs[0].token_ids == first.outputs[0].token_ids


def _stream(engine, prompt, **kw):
  rid = engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(
      temperature=0.0, max_tokens=12, ignore_eos=True, **kw))
  outs = []
  while engine.has_unfinished_requests():
    outs += [o for o in engine.step() if o.request_id == rid]
  return outs


@pytest.mark.parametrize("stop", [(), ("#never#",)])
def test_output_kinds_stream_deltas_cumulative_or_final_only(llm, stop):
  engine, prompt = llm.engine, _prompt(20, seed=12)
  cumulative = _stream(engine, prompt, stop=stop)
  final = cumulative[-1].outputs[0]
  assert cumulative[-1].finished and not any(o.finished for o in cumulative[:-1])
  for earlier, later in zip(cumulative, cumulative[1:]):  # each output extends the last
    a, b = earlier.outputs[0], later.outputs[0]
    assert b.token_ids[:len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)
  delta = _stream(engine, prompt, stop=stop, output_kind=RequestOutputKind.DELTA)
  assert sum((o.outputs[0].token_ids for o in delta), []) == final.token_ids
  assert "".join(o.outputs[0].text for o in delta) == final.text
  assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
  assert delta[-1].outputs[0].finish_reason == "length"
  (only,) = _stream(engine, prompt, stop=stop, output_kind=RequestOutputKind.FINAL_ONLY)
  assert only.finished and only.outputs[0] == final
  if stop:  # the text held back for a possible stop string is released at the end
    assert all(len(o.outputs[0].text) <= len(final.text) - len(stop[0]) + 1
               for o in cumulative[:-1])


def test_generate_returns_whole_outputs_whatever_the_kind(llm):
  prompt = _prompt(20, seed=13)
  outs = [llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
      temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=kind))[0]
          for kind in RequestOutputKind]
  assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
  assert outs[0].outputs[0] == outs[1].outputs[0] == outs[2].outputs[0]


def test_sampling_params_defaults_are_vllms():
  sp = SamplingParams()
  assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (1.0, 1.0, 0, 16)
  assert sp.output_kind is RequestOutputKind.CUMULATIVE and not sp.greedy
  assert SamplingParams(max_tokens=None).max_tokens is None
  with pytest.raises(ValueError, match=r"max_tokens must be >= 1, got 0"):
    SamplingParams(max_tokens=0)
  with pytest.raises(ValueError, match=r"max_tokens must be an integer or None, got '8'"):
    SamplingParams(max_tokens="8")
  with pytest.raises(ValueError, match=r"output_kind must be a RequestOutputKind, got 1"):
    SamplingParams(output_kind=1)


def test_default_sampling_is_seeded_and_reproducible(llm):
  prompt = _prompt(20, seed=14)
  sp = SamplingParams(max_tokens=10, ignore_eos=True, seed=7)  # temperature 1.0
  a, b = (llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0] for _ in range(2))
  (greedy,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
      temperature=0.0, max_tokens=10, ignore_eos=True))
  assert a.outputs[0].token_ids == b.outputs[0].token_ids
  assert a.outputs[0].token_ids != greedy.outputs[0].token_ids  # it sampled


def test_max_tokens_none_runs_to_max_model_len(llm):
  prompt = _prompt(50, seed=15)
  (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
      temperature=0.0, max_tokens=None, ignore_eos=True))
  assert out.outputs[0].finish_reason == "length"
  assert len(prompt) + len(out.outputs[0].token_ids) == 64  # max_model_len


def _with_dtype(src, dst, value):
  shutil.copytree(src, dst)
  path = os.path.join(dst, "config.json")
  with open(path) as f:
    config = json.load(f)
  config.pop("torch_dtype", None)
  if value is not None:
    config["torch_dtype"] = value
  with open(path, "w") as f:
    json.dump(config, f)
  return str(dst)


def test_dtype_auto_takes_the_checkpoints_dtype(checkpoint, tmp_path):
  assert checkpoint_dtype(checkpoint) == "float32"
  cases = {"bfloat16": "bfloat16", "float16": "bfloat16", "torch.float32": "float32",
           None: "float32"}
  for i, (value, want) in enumerate(cases.items()):
    assert checkpoint_dtype(_with_dtype(checkpoint, tmp_path / str(i), value)) == want
  bad = _with_dtype(checkpoint, tmp_path / "bad", "int8")
  with pytest.raises(CheckpointError, match=r"torch_dtype 'int8' is not a dtype this engine"):
    checkpoint_dtype(bad)
  bf16 = LLM(_with_dtype(checkpoint, tmp_path / "bf16", "bfloat16"), dtype="auto",
             block_size=BLOCK_SIZE, device_kv_gib=65 * 2048 / 2**30,
             host_pool_gib=129 * 2048 / 2**30, max_model_len=64, max_num_seqs=4)
  assert bf16.config.dtype == "bfloat16" and bf16.engine.device_pool.spec.dtype == "bfloat16"
  with pytest.raises(ValueError, match=r"dtype must be auto, float32 or bfloat16, got 'half'"):
    LLM(checkpoint, dtype="half")


@pytest.mark.parametrize("name", ["basic.py", "generate_with_sampling_params.py", "chat.py"])
def test_vllm_offline_examples_run_as_written(name):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    runpy.run_path(os.path.join(ROOT, "examples", name), run_name="__main__")
  text = out.getvalue()
  if name == "basic.py":
    assert text.count("Prompt:    ") == 4 and text.count("Output:    ") == 4
  elif name == "generate_with_sampling_params.py":  # greedy, then cut at the first ":"
    lines = text.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("[4, 5, 520] -> ' bare bare viko: ")
    assert lines[2].startswith("[4, 5, 520] -> ' bare bare viko' (finish_reason=stop, "
                               "stop_reason=':', 3 tokens")
    assert "(finish_reason=stop, stop_reason=':'" in lines[3]
  else:  # chat: the answer to each conversation's question
    answers = re.findall(r"Generated text: '(.*)'", text)
    assert answers == [" bare", " bare", " mive", " bapo"]


@pytest.fixture(scope="module")
def reference_logits(checkpoint):
  """The last position's logits of the full dense forward (no KV cache) over `ids`."""
  model, _, _ = load_pretrained(checkpoint)
  return functools.partial(dense_last_logits, model)


def _reference_decode(reference_logits, prompt, num_tokens, sp, eos_ids=(2,)):
  """Greedy tokens with vLLM's min_tokens mask and penalties applied in numpy, and the
  raw log-probabilities of each position."""
  out, logprobs = [], []
  for _ in range(num_tokens):
    logits = reference_logits(prompt + out)
    lp = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
    if len(out) < sp.min_tokens:
      logits[list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_ids))] = -np.inf
    counts = np.bincount(out, minlength=len(logits)).astype(np.float32)
    in_prompt = np.zeros(len(logits), bool)
    in_prompt[prompt] = True
    penalty = np.where(in_prompt | (counts > 0), np.float32(sp.repetition_penalty), 1.0)
    logits = logits * np.where(logits > 0, np.float32(1.0) / penalty, penalty)
    logits = (logits - np.float32(sp.frequency_penalty) * counts
              - np.float32(sp.presence_penalty) * (counts > 0))
    token = int(np.argmax(logits))
    out.append(token)
    logprobs.append(lp)
  return out, logprobs


def test_penalties_min_tokens_and_logprobs_match_a_dense_reference(llm, reference_logits):
  # One batch, async scheduling (each decode reads its newest token on the device): rows
  # with penalties beside rows without, so the extras are per row.
  base = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
  params = [SamplingParams(**base),
            SamplingParams(**base, presence_penalty=1.5, frequency_penalty=0.5),
            SamplingParams(**base, repetition_penalty=1.8, logprobs=3),
            SamplingParams(**base, frequency_penalty=-0.3, repetition_penalty=0.6)]
  prompts = [_prompt(n, seed=20 + i) for i, n in enumerate((20, 9, 33, 14))]
  outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
  plain = outs[0].outputs[0].token_ids
  for prompt, sp, out in zip(prompts, params, outs):
    want, lps = _reference_decode(reference_logits, prompt, 10, sp)
    assert out.outputs[0].token_ids == want
    if sp.logprobs is None:
      assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
      continue
    completion = out.outputs[0]
    assert len(completion.logprobs) == 10
    total = 0.0
    for token, position, lp in zip(completion.token_ids, completion.logprobs, lps):
      top = np.argsort(-lp)[:3].tolist()
      assert set(position) == set(top) | {token}
      for t, entry in position.items():
        assert entry.logprob == pytest.approx(float(lp[t]), abs=1e-4)
        assert entry.rank == int((lp > lp[t]).sum()) + 1
        assert entry.decoded_token == llm.get_tokenizer().decode([t])
      total += float(lp[token])
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)
  assert any(out.outputs[0].token_ids != plain for out in outs[1:])
  # min_tokens: a stop token cannot be sampled, nor end the output, before it.
  stop = plain[1]
  (stopped,) = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=SamplingParams(
      temperature=0.0, max_tokens=10, stop_token_ids=[stop]))
  assert stopped.outputs[0].token_ids == plain[:2]
  sp = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop], min_tokens=4)
  (held,) = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=sp)
  want, _ = _reference_decode(reference_logits, prompts[0], 10, sp)
  end = next((i for i, t in enumerate(want) if t == stop and i >= 3), 9)
  assert held.outputs[0].token_ids == want[:end + 1] and len(want[:end + 1]) >= 4
  assert stop not in held.outputs[0].token_ids[:4]


def test_logprobs_stream_with_their_tokens(llm):
  prompt = _prompt(20, seed=30)
  rid = llm.engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(
      temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0,
      output_kind=RequestOutputKind.DELTA))
  deltas = []
  while llm.engine.has_unfinished_requests():
    deltas += [o.outputs[0] for o in llm.engine.step() if o.request_id == rid]
  tokens = sum((d.token_ids for d in deltas), [])
  positions = sum((d.logprobs for d in deltas), [])
  assert len(positions) == len(tokens) == 6
  assert all(list(p) == [t] for p, t in zip(positions, tokens))  # logprobs=0: the token only
  assert deltas[-1].cumulative_logprob == pytest.approx(
      sum(p[t].logprob for p, t in zip(positions, tokens)), abs=1e-5)


def test_prompt_logprobs_match_a_dense_reference(llm, reference_logits):
  """Over a prompt prefilled in two chunks, and already in the prefix cache (a request
  with prompt_logprobs computes its whole prompt all the same, as vLLM's)."""
  prompt = _prompt(40, seed=40)
  llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1))
  sp = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
  (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
  assert out.num_cached_tokens == 0
  assert len(out.prompt_logprobs) == 40 and out.prompt_logprobs[0] is None
  for j in range(1, 40):
    logits = reference_logits(prompt[:j])
    lp = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
    position = out.prompt_logprobs[j]
    assert set(position) == set(np.argsort(-lp)[:2].tolist()) | {prompt[j]}
    for t, entry in position.items():
      assert entry.logprob == pytest.approx(float(lp[t]), abs=1e-4)
      assert entry.rank == int((lp > lp[t]).sum()) + 1
  # Streamed: in the first output only; none without asking.
  rid = llm.engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(
      max_tokens=3, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA))
  seen = []
  while llm.engine.has_unfinished_requests():
    seen += [o.prompt_logprobs for o in llm.engine.step() if o.request_id == rid]
  assert [p is not None for p in seen] == [True] + [False] * (len(seen) - 1)
  assert [list(p) for p in seen[0][1:]] == [[t] for t in prompt[1:]]
  (plain,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams())
  assert plain.prompt_logprobs is None


CONVERSATION = [{"role": "system", "content": "bafu: bapo\nbaki: bare"},
                {"role": "user", "content": "? baki:"}]


def test_chat_renders_the_checkpoints_template_as_transformers_does(llm, checkpoint):
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
  ours = llm.get_tokenizer()
  for conversation in (CONVERSATION, CONVERSATION[1:], CONVERSATION + [
      {"role": "assistant", "content": "bare"}, {"role": "user", "content": "? bafu:"}]):
    text = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conversation) == text
    assert ours.apply_chat_template(conversation, tokenize=True) == hf(
        text, add_special_tokens=False)["input_ids"]
  sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
  (chat,) = llm.chat(CONVERSATION, sp)
  (plain,) = llm.generate(["bafu: bapo\nbaki: bare\n? baki:"], sp)
  assert chat.prompt == "<bos>bafu: bapo\nbaki: bare\n? baki:"
  assert chat.prompt_token_ids == plain.prompt_token_ids  # BOS once: the template's
  assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
  batch = llm.chat([CONVERSATION, CONVERSATION[1:]], sp)
  assert [o.prompt for o in batch] == ["<bos>bafu: bapo\nbaki: bare\n? baki:", "<bos>? baki:"]


def test_chat_errors_name_the_conversation(llm):
  with pytest.raises(PromptError, match=r"prompt 1: chat template: roles are system, user "
                                        r"and assistant, got tool"):
    llm.chat([CONVERSATION, [{"role": "tool", "content": "x"}]])
  with pytest.raises(PromptError, match=r"prompt 0: chat template: .*'content'"):
    llm.chat([{"role": "user"}], chat_template="{{ messages[0]['content'] + 1 }}")
  assert not llm.engine.has_unfinished_requests()


def test_vllm_api_parity_compares_tokens_text_finish_and_logprobs(monkeypatch, tmp_path):
  from hisparse_jax.bench import vllm_api_parity as parity

  def completion(ids, text, lps=None, reason="length", more=(), prompt_lps=None):
    return {"token_ids": ids, "text": text, "finish_reason": reason, "stop_reason": None,
            "logprobs": lps, "completions": [ids, *more],
            "completion_logprobs": [lps] + [None] * len(more), "prompt_logprobs": prompt_lps}
  ours = {"a": [completion([1, 2], " x y", [{"1": -0.5}, {"2": -0.25}])],
          "b": [completion([1, 2], " x y")], "c": [completion([1], " x", reason="stop")],
          "n": [completion([1], " x", more=[[1]])],
          "p": [completion([1], " x", prompt_lps=[None, {"4": -1.0}])]}
  theirs = {"a": [completion([1, 2], " x y", [{"1": -0.50005}, {"2": -0.2503, "9": -3.0}])],
            "b": [completion([1, 3], " x z")], "c": [completion([1], " x")],
            "n": [completion([1], " x", more=[[2]])],
            "p": [completion([1], " x", prompt_lps=[None, {"4": -1.01, "5": -2.0}])]}
  rows = parity.compare(ours, theirs)
  assert rows["a"]["tokens_identical"] and rows["a"]["text_identical"]
  assert rows["a"]["max_logprob_diff"] == pytest.approx(3e-4) and not rows["a"]["same"]
  assert not rows["b"]["tokens_identical"] and not rows["b"]["text_identical"]
  assert not rows["c"]["finish_identical"] and not rows["c"]["same"]
  assert not rows["n"]["tokens_identical"]  # the second completion differs
  assert rows["p"]["max_logprob_diff"] == pytest.approx(0.01) and not rows["p"]["same"]
  table = parity.format_table({"cases": rows, "all_same": False})
  assert "3.00e-04" in table and "all cases identical (logprobs within 0.0001): NO" in table
  monkeypatch.setattr(parity, "PEER_PYTHON", str(tmp_path / "absent" / "python"))
  skipped = parity.run()
  assert "is absent (make peers builds it)" in skipped["skipped"]
  assert parity.format_table(skipped).startswith("vllm_api_parity skipped: ")


def test_detokenize_false_gives_token_ids_only(llm):
  prompt = _prompt(20, seed=31)
  sp = dict(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
  (text,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**sp))
  (ids,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
      **sp, detokenize=False))
  assert ids.outputs[0].token_ids == text.outputs[0].token_ids and text.outputs[0].text
  assert ids.outputs[0].text == ""
  assert all(lp.decoded_token is None for p in ids.outputs[0].logprobs for lp in p.values())
  with pytest.raises(ValueError, match=r"stop strings need detokenize=True"):
    SamplingParams(stop=["x"], detokenize=False)

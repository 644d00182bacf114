"""Bad input through the library: a ValueError with the message the CLI prints, and the
requests already in the engine go on untouched.

The CLI side of each row (exit 2, one line, the flag named) is
tests/hisparse_jax/entrypoints/test_bad_input_cli.py;
the CLI prints these messages with the flag's `--` in front where the field is a flag
(`top_p` -> `--top_p`), a prompt's source in front of a prompt error (`--prompt #2: `,
`FILE line N: `) and `--model: ` in front of a checkpoint error. The CLI checks prompts by
`request.check_prompt` before it loads the model; the engine must refuse the same prompts
with the same messages, which `test_the_engine_refuses_by_the_cli_rule` holds it to.
"""

import dataclasses
import re

import pytest
from engine_fixtures import (
  BLOCK_SIZE,
  MAX_MODEL_LEN,
  VOCAB,
  add_all,
  assert_all_blocks_free,
  gib_for_blocks,
  make_engine,
  random_prompts,
  reference_greedy,
  run,
  tiny_model,
)

from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.request import check_prompt
from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.entrypoints.cli.generate import read_prompts_file
from hisparse_jax.entrypoints.llm import LLM, PromptError
from hisparse_jax.sparse.config import HiSparseConfig
from models.loader import load_tokenizer
from models.testing import save_random_checkpoint

PROMPTS = random_prompts((21, 9), seed=11)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)

# Prompts the engine refuses: (prompt_token_ids, message).
BAD_PROMPTS = {
    "prompt longer than max_model_len": (
        [1] * MAX_MODEL_LEN,
        "prompt has 64 tokens; max_model_len=64 leaves no room for an output token"),
    "empty prompt": ([], "prompt is empty"),
    "token id outside the vocabulary": (
        [1, VOCAB], "prompt_token_ids: token id 97 is outside the vocabulary [0, 97)"),
    "negative token id": (
        [-1, 2], "prompt_token_ids: token id -1 is outside the vocabulary [0, 97)"),
}
# Sampling parameters refused on construction: (kwargs, message).
BAD_SAMPLING = {
    "max_tokens < 1": (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    "negative temperature": (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
    "temperature nan": (dict(temperature=float("nan")), "temperature must be >= 0, got nan"),
    "top_p = 0": (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    "top_p > 1": (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
}


@pytest.fixture(scope="module")
def reference():
  return reference_greedy(tiny_model(), PROMPTS, GREEDY.max_tokens)


def _in_flight(engine):
  """Two requests admitted and part-computed."""
  add_all(engine, PROMPTS, GREEDY)
  for _ in range(2):
    engine.step()
  engine.check_invariants()
  return sorted(engine.requests)


def _assert_others_unaffected(engine, before, reference):
  assert sorted(engine.requests) == before  # nothing added, nothing lost
  engine.check_invariants()
  outputs = run(engine)
  assert [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
  assert {o.outputs[0].finish_reason for o in outputs.values()} == {"length"}
  assert_all_blocks_free(engine)


@pytest.mark.parametrize("what", sorted(BAD_PROMPTS))
def test_bad_prompt_raises_and_the_others_go_on(what, reference):
  ids, message = BAD_PROMPTS[what]
  engine = make_engine()
  before = _in_flight(engine)
  with pytest.raises(ValueError) as info:
    engine.add_request("bad", prompt_token_ids=ids, sampling_params=GREEDY)
  assert str(info.value) == message
  _assert_others_unaffected(engine, before, reference)


@pytest.mark.parametrize("what", sorted(BAD_PROMPTS))
def test_the_engine_refuses_by_the_cli_rule(what):
  ids, message = BAD_PROMPTS[what]
  with pytest.raises(ValueError) as info:
    check_prompt(ids, vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
  assert str(info.value) == message
  assert check_prompt([0, VOCAB - 1], vocab_size=VOCAB, max_model_len=3) == [0, VOCAB - 1]


def test_empty_text_prompt_is_refused(reference):
  # A tokenizer that adds BOS makes "" one token: still an empty prompt.
  tokenizer = load_tokenizer(None)
  assert tokenizer.encode("") == [tokenizer.bos_token_id]
  with pytest.raises(ValueError, match="^prompt is empty$"):
    check_prompt(tokenizer.encode(""), vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN, text="")
  engine = make_engine(tokenizer=tokenizer)
  before = _in_flight(engine)
  with pytest.raises(ValueError) as info:
    engine.add_request("bad", prompt="", sampling_params=GREEDY)
  assert str(info.value) == "prompt is empty"
  _assert_others_unaffected(engine, before, reference)


@pytest.mark.parametrize("what", sorted(BAD_SAMPLING))
def test_bad_sampling_params_raise_and_the_others_go_on(what, reference):
  kwargs, message = BAD_SAMPLING[what]
  engine = make_engine()
  before = _in_flight(engine)
  with pytest.raises(ValueError) as info:
    engine.add_request("bad", prompt_token_ids=[1, 2],
                       sampling_params=SamplingParams(**kwargs))
  assert str(info.value) == message
  with pytest.raises(ValueError, match=re.escape(message)):
    dataclasses.replace(GREEDY, **kwargs)  # no way around the check
  _assert_others_unaffected(engine, before, reference)


@pytest.mark.parametrize("stop", [-5, VOCAB, 10**30])
def test_a_stop_token_id_outside_the_vocabulary_is_refused(stop, reference):
  # (found fuzzing serve: 10**30 with min_tokens reached the step's int32 stop-id rows as
  # an OverflowError that finished every request of the step with "error")
  engine = make_engine()
  before = _in_flight(engine)
  with pytest.raises(ValueError) as info:
    engine.add_request("bad", prompt_token_ids=[1, 2], sampling_params=dataclasses.replace(
        GREEDY, stop_token_ids=[3, stop], min_tokens=2))
  assert str(info.value) == (f"stop_token_ids: token id {stop} is outside the vocabulary "
                             f"[0, {VOCAB})")
  _assert_others_unaffected(engine, before, reference)


def test_a_top_k_past_int32_keeps_every_token():
  # (it reached the step's int32 array as an OverflowError that failed the request;
  # `hisparse-jax generate --top_k=10**30` printed that traceback)
  sampled = SamplingParams(temperature=1.0, max_tokens=12)
  tokens = []
  for top_k in (0, 10**30):
    engine = make_engine()
    add_all(engine, PROMPTS, dataclasses.replace(sampled, top_k=top_k))
    outputs = run(engine)
    assert {o.outputs[0].finish_reason for o in outputs.values()} == {"length"}
    tokens.append([outputs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))])
  assert tokens[0] == tokens[1]


def test_bad_engine_settings():
  with pytest.raises(ValueError) as info:
    HiSparseConfig(top_k_tokens=64, hot_buffer_tokens=32)
  assert str(info.value) == (
      "HiSparseConfig.hot_buffer_tokens (32) must be >= top_k_tokens (64): a step's selected "
      "blocks must fit the hot buffer at once")
  for block_size in (12, 0, -8):
    with pytest.raises(ValueError) as info:
      EngineConfig(block_size=block_size)
    assert str(info.value) == f"block_size must be a power of two, got {block_size}"


def test_capacity_refusals_name_the_flag():
  model = tiny_model()  # 256 KV bytes per token: 2 KiB blocks of 8 tokens
  fields = dict(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
  with pytest.raises(ValueError) as info:
    Engine(EngineConfig(**fields, device_kv_gib=gib_for_blocks(model.config, 13),
                        host_pool_gib=1e6), model=model, model_config=model.config)
  assert re.fullmatch(
      r"--host_pool_gib=1000000\.0 asks for 1,000,000\.00 GiB of pinned host memory, above 95% "
      r"of the available RAM \(\d+\.\d\d GiB available, at most \d+\.\d\d GiB\)",
      str(info.value)), str(info.value)
  # On CPU the device pool is host RAM: a device budget beyond it is refused the same way.
  with pytest.raises(ValueError) as info:
    Engine(EngineConfig(**fields, device_kv_gib=1e6, host_pool_gib=0.001), model=model,
           model_config=model.config)
  assert re.fullmatch(
      r"--device_kv_gib=1000000\.0 and --host_pool_gib=0\.001 ask for 1,000,000\.00 GiB in "
      r"all; on CPU both pools are host RAM, and that is above 95% of the available RAM "
      r"\(\d+\.\d\d GiB available, at most \d+\.\d\d GiB\)", str(info.value)), str(info.value)
  # 8 blocks, one the null block: 7 usable, but 64 tokens need 8.
  with pytest.raises(ValueError) as info:
    Engine(EngineConfig(**fields, device_kv_gib=gib_for_blocks(model.config, 8),
                        host_pool_gib=gib_for_blocks(model.config, 33)),
           model=model, model_config=model.config)
  assert str(info.value) == (
      "--device_kv_gib: the device KV budget of 17,408 bytes = 0.02 MiB (--device_kv_gib) "
      "holds 7 usable blocks after the null block and 0 bytes reserved for the indexer and "
      "hot buffers, but one request of --max_model_len=64 tokens needs 8 blocks of 8 tokens "
      "(16,384 bytes); raise --device_kv_gib or lower --max_model_len")


def test_llm_names_the_bad_prompt_and_the_engine_goes_on(tmp_path):
  # The geometry of test_llm's LLM (shared compiled programs within one pytest process).
  llm = LLM(save_random_checkpoint(tmp_path / "ckpt", seed=3), block_size=16,
            device_kv_gib=65 * 4096 / 2**30, host_pool_gib=129 * 4096 / 2**30,
            max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
  sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
  (good,) = llm.generate(["bafu: bapo\n? bafu:"], sp)
  cases = [([{"prompt_token_ids": [1] * 64}], 0,
            "prompt has 64 tokens; max_model_len=64 leaves no room for an output token"),
           ([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, 5000]}], 1,
            "prompt_token_ids: token id 5000 is outside the vocabulary [0, 1031)"),
           (["bafu:", ""], 1, "prompt is empty")]
  for prompts, index, message in cases:
    with pytest.raises(PromptError) as info:
      llm.generate(prompts, sp)
    assert (info.value.index, info.value.reason) == (index, message)
    assert str(info.value) == f"prompt {index}: {message}"
    assert not llm.engine.has_unfinished_requests()
  (again,) = llm.generate(["bafu: bapo\n? bafu:"], sp)
  assert again.outputs[0].token_ids == good.outputs[0].token_ids


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "a"}\n{"prompt": "\xff"}\n', "--prompts_file={f}: not UTF-8 text (byte 0xff "
                                               "on line 2)"),
    (b'\n{"prompt": "a",}\n', "{f} line 2: not valid JSON (Expecting property name enclosed "
                             "in double quotes at column 16)"),
    (b'{"prompt": "a", "max_tokens": -3}\n', '{f} line 1: "max_tokens" must be an integer >= '
                                             '1, got -3'),
])
def test_prompts_file_errors_name_the_line(tmp_path, content, message):
  path = tmp_path / "p.jsonl"
  path.write_bytes(content)
  with pytest.raises(ValueError) as info:
    read_prompts_file(str(path))
  assert str(info.value) == message.format(f=path)

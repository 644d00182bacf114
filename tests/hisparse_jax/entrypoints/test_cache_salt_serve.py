"""vLLM's `cache_salt` (#53) in the offline API (a field of `LLM.generate`'s prompt dicts)
and in the OpenAI server's bodies (/v1/completions, /v1/chat/completions): equal prompts
under different salts share no prefix-cache block and give the same tokens, equal salts
share; a bad salt is refused naming the field (PromptError; a 400 with `param`
"cache_salt"); the OpenAPI schema states the field. The server runs in-process
(fastapi's TestClient over `build_app` and an `AsyncEngine`), over a random checkpoint
with the default model's tokenizer and chat template: no subprocess to start."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from hisparse_jax import LLM, SamplingParams
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.entrypoints.async_engine import AsyncEngine
from hisparse_jax.entrypoints.llm import PromptError
from hisparse_jax.entrypoints.openai_server import build_app
from models import data
from models.testing import save_random_checkpoint

BLOCK_SIZE = 16
MODEL = "tiny"
# 4 KiB blocks (256 B/token x 16): 64 device blocks, 128 host blocks (test_vllm_api's).
FIELDS = dict(block_size=BLOCK_SIZE, device_kv_gib=65 * 4096 / 2**30,
              host_pool_gib=129 * 4096 / 2**30, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32)
IDS = [data.BOS_ID] + np.random.default_rng(53).choice(data.CONTENT_IDS, 39).tolist()
HIT = (len(IDS) - 1) // BLOCK_SIZE * BLOCK_SIZE  # 2 blocks: the last token is computed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return save_random_checkpoint(tmp_path_factory.mktemp("cache_salt"), seed=3)


# --- LLM.generate ------------------------------------------------------------------------


def test_llm_generate_takes_cache_salt_in_either_prompt_dict(checkpoint):
  llm = LLM(checkpoint, **FIELDS)
  text = llm.get_tokenizer().decode(IDS[1:])
  sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

  def gen(item):
    (out,) = llm.generate([item], sp, use_tqdm=False)
    return out

  first = gen({"prompt": text, "cache_salt": "a"})
  ids, tokens = first.prompt_token_ids, first.outputs[0].token_ids
  assert first.num_cached_tokens == 0 and len(ids) > 2 * BLOCK_SIZE
  hit = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
  # (prompt item, prompt tokens served from the prefix cache)
  for item, cached in (({"prompt": text, "cache_salt": "b"}, 0),
                       ({"prompt_token_ids": ids, "cache_salt": "a"}, hit),
                       ({"prompt_token_ids": ids, "prompt": text, "cache_salt": "b"}, hit),
                       (text, 0), ({"prompt": text}, hit), ({"prompt_token_ids": ids}, hit)):
    out = gen(item)
    assert out.num_cached_tokens == cached, item
    assert out.outputs[0].token_ids == tokens, item
  for salt in ("", 5, ["a"]):
    with pytest.raises(PromptError, match="^prompt 0: cache_salt must be a non-empty string"):
      gen({"prompt": text, "cache_salt": salt})
  with pytest.raises(PromptError, match="optional 'cache_salt': str"):
    gen({"prompt": text, "salt": "a"})
  assert not llm.engine.has_unfinished_requests()


# --- the OpenAI server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(checkpoint):
  engine = Engine(EngineConfig(model=checkpoint, **FIELDS))
  async_engine = AsyncEngine(engine)
  async_engine.start()
  app = build_app(async_engine, MODEL, max_model_len=engine.config.max_model_len)
  with TestClient(app) as client:
    yield client, engine
  async_engine.shutdown()


def _hits(engine) -> int:
  """Prefix-cache block hits so far, both pools (counted at admission)."""
  bm = engine.block_manager
  return bm.device_pool.prefix_cache_hits + bm.host_pool.prefix_cache_hits


def _post(served, route: str, body: dict) -> tuple[dict, int]:
  """The response's JSON (the raw SSE text for a stream) and the prefix-cache tokens it
  hit."""
  client, engine = served
  before = _hits(engine)
  r = client.post(route, json={"model": MODEL, "max_tokens": 3, "temperature": 0.0, **body})
  assert r.status_code == 200, r.text
  return (r.text if body.get("stream") else r.json()), (_hits(engine) - before) * BLOCK_SIZE


def test_completions_share_the_cache_only_within_one_salt(served):
  route = "/v1/completions"
  first, cached = _post(served, route, {"prompt": IDS, "cache_salt": "a"})
  assert cached == 0
  text = first["choices"][0]["text"]
  for salt, expected in (("b", 0), ("a", HIT), (None, 0), (None, HIT), ("b", HIT)):
    body = {"prompt": IDS} if salt is None else {"prompt": IDS, "cache_salt": salt}
    out, cached = _post(served, route, body)
    assert cached == expected, salt
    assert out["choices"][0]["text"] == text, salt
  stream, cached = _post(served, route, {"prompt": IDS, "cache_salt": "c", "stream": True})
  assert cached == 0 and stream.rstrip().endswith("data: [DONE]")
  _, cached = _post(served, route, {"prompt": IDS, "cache_salt": "c", "stream": True})
  assert cached == HIT
  # JSON may escape a lone surrogate: the body's parser refuses it (a 400 naming the
  # field, as for any string field); the engine hashes one too (test_cache_salt.py).
  client, engine = served
  raw = json.dumps({"model": MODEL, "prompt": IDS, "max_tokens": 3, "cache_salt": "\ud800"})
  r = client.post(route, content=raw, headers={"content-type": "application/json"})
  assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
  assert not engine.has_unfinished_requests()


def test_chat_completions_share_the_cache_only_within_one_salt(served):
  client, engine = served
  # (other words than the completions': no prefix of theirs, salted or not, is cached)
  content = engine.tokenizer.decode(np.random.default_rng(54).choice(data.CONTENT_IDS, 39))
  body = {"messages": [{"role": "user", "content": content}]}
  first, cached = _post(served, "/v1/chat/completions", {**body, "cache_salt": "a"})
  assert cached == 0
  answer = first["choices"][0]["message"]["content"]
  assert first["usage"]["prompt_tokens"] > 2 * BLOCK_SIZE
  hit = (first["usage"]["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
  for salt, expected in (("b", 0), ("a", hit), (None, 0), ("b", hit)):
    out, cached = _post(served, "/v1/chat/completions",
                        body if salt is None else {**body, "cache_salt": salt})
    assert cached == expected, salt
    assert out["choices"][0]["message"]["content"] == answer, salt


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", ["", 5, ["a"], {"a": 1}, True])
def test_a_bad_cache_salt_is_a_400_naming_the_field(served, route, salt):
  client, engine = served
  body = {"model": MODEL, "max_tokens": 2, "cache_salt": salt}
  body.update({"prompt": IDS} if route == "/v1/completions" else
              {"messages": [{"role": "user", "content": "bafu:"}]})
  r = client.post(route, json=body)
  assert r.status_code == 400, r.text
  error = r.json()["error"]
  assert error["param"] == "cache_salt" and error["code"] == 400, error
  assert error["message"].startswith("cache_salt: "), error
  assert not engine.has_unfinished_requests()


def test_the_openapi_schema_states_cache_salt(served):
  client, _ = served
  schemas = client.get("/openapi.json").json()["components"]["schemas"]
  for name in ("CompletionRequest", "ChatRequest"):
    field = schemas[name]["properties"]["cache_salt"]
    assert {"type": "string", "minLength": 1} in field["anyOf"], field
    assert {"type": "null"} in field["anyOf"] and field.get("default") is None, field

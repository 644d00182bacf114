"""`hisparse-jax serve` fuzzed against its own OpenAPI schema (schemathesis; the same run
as `python -m hisparse_jax.bench.fuzz_server`, with fewer cases): >= 500 generated
requests over every route, from a fixed seed, with the API key; no 5xx, every response
as the schema says (status, content type, body, each server-sent event), none slow; then
a normal completion still answers. Before it, the schema itself; after it, the requests
the fuzzing (and probing around it) found answered wrong, each now a 4xx naming the field
or a 200."""

from __future__ import annotations

import httpx
import pytest

from hisparse_jax.bench import fuzz_server
from hisparse_jax.bench.serve_load import ServerProcess

KEY = "fuzz-key"
MODEL = "tiny"
# max_model_len 64: whatever max_tokens a case asks for, a request ends within 64 tokens;
# max_num_seqs 8: fewer batch shapes to compile (the run's time is mostly the step
# programs and sampler variants the cases reach, then decoding: ~40 s on 2 idle cores,
# ~2 min with the rest of the suite beside it). 256 / 16 lose no status the cases reach.
FLAGS = ("--max_model_len=64", "--device_kv_gib=0.0015", "--host_pool_gib=0.05",
         "--block_size=16", "--max_num_seqs=8", "--nowarmup")
# --nowarmup: start-up is not what this test checks, and the warm-up costs 10-35 s a server
# start on 2 cores (vLLM's tests skip CUDA-graph capture with enforce_eager alike);
# test_serve.py's module server and test_serve_warmup.py serve with the default warm-up.
EXAMPLES = 50  # cases per operation with a body and mode: 530 requests in all
SEED = 35
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
  s = ServerProcess(f"--api_key={KEY}", f"--served_model_name={MODEL}", *FLAGS)
  yield s
  assert s.stop() == 0, "".join(s.log[-30:])


def _operations(schema: dict) -> set[str]:
  return {f"{method.upper()} {path}" for path, ops in schema["paths"].items() for method in ops}


def test_openapi_schema_describes_every_route(server):
  schema = httpx.get(server.url + "/openapi.json").json()
  assert _operations(schema) == {
      "GET /health", "GET /v1/models", "GET /metrics", "GET /dashboard", "GET /dashboard/",
      "GET /dashboard/data", "POST /tokenize", "POST /detokenize", "POST /v1/completions",
      "POST /v1/chat/completions"}
  error = {"$ref": "#/components/schemas/ErrorResponse"}
  for name, ops in schema["paths"].items():
    for method, op in ops.items():
      assert "422" not in op["responses"], (method, name)  # (a bad body is a 400 here)
      for status, response in op["responses"].items():
        if status != "200":
          assert response["content"]["application/json"]["schema"] == error, (name, status)
      guarded = name.startswith(("/v1", "/tokenize", "/detokenize", "/dashboard"))
      assert ("401" in op["responses"]) == guarded, name
      assert (op.get("security") is not None) == guarded, name
  for name in ("/v1/completions", "/v1/chat/completions"):
    responses = schema["paths"][name]["post"]["responses"]
    assert {"200", "400", "401", "404", "408", "413", "429", "500", "503"} <= set(responses)
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    data = responses["200"]["content"]["text/event-stream"]["schema"]["properties"]["data"]
    assert data["if"] == {"const": "[DONE]"}
    assert data["else"]["contentMediaType"] == "application/json"
  assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
  request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
  assert request["n"]["maximum"] == 8 and request["max_tokens"]["maximum"] == 63
  assert request["logprobs"]["maximum"] == 20
  # The docs pages stay off.
  assert httpx.get(server.url + "/docs").status_code == 404


def test_fuzz_every_route_no_5xx_no_schema_violation(server):
  summary = fuzz_server.fuzz(server.url, examples=EXAMPLES, seed=SEED, api_key=KEY,
                             workers=8, slow_s=120)
  failures = "\n".join(
      f"{f['operation']} ({f['mode']}) -> {f['status']}: {f['check']}: {f['title']}\n"
      f"{f['message'][:600]}\n{f['curl'][:1000]}" for f in summary["failures"][:10])
  assert summary["num_failures"] == 0, f"{summary['num_failures']} failures:\n{failures}"
  assert summary["responses_5xx"] == 0
  assert summary["requests"] >= 500, summary["requests_by_operation"]
  schema = httpx.get(server.url + "/openapi.json").json()
  assert set(summary["requests_by_operation"]) == _operations(schema)
  # Both modes reached the routes with a body, and the engine served many of them.
  for name in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
               "POST /detokenize"):
    counts = summary["status_counts_by_operation"][name]
    assert counts.get("200", 0) >= 5 and counts.get("400", 0) >= 5, (name, counts)
  # No request reached the catch-all handler or failed an engine step.
  assert not [line for line in server.log if "request failed" in line
              or "step failed" in line], "".join(server.log[-30:])
  assert fuzz_server.normal_completion(server.url, KEY, MODEL) == 200


@pytest.mark.parametrize("path,body,status,param", [
    # A chat_template that raises while rendering (was a 500).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template": "{{ 1 / 0 }}", "max_tokens": 2},
     400, "chat_template"),
    # No messages (rendered an empty conversation and generated from it).
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    # A stop token id outside the vocabulary (10**30 with min_tokens failed the step of
    # every request batched with it; a negative one was taken).
    ("/v1/completions", {"prompt": "baki:", "stop_token_ids": [10**30], "min_tokens": 1},
     400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "baki:", "stop_token_ids": [-5]}, 400, "stop_token_ids"),
    # Chat's own field names in the error (were max_tokens, logprobs).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 1000}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    # An empty text prompt is empty, whatever max_tokens asks.
    ("/v1/completions", {"prompt": "", "max_tokens": 1000}, 400, "prompt"),
    # A top_k past int32 keeps every token (was a failed step).
    ("/v1/completions", {"prompt": "baki:", "top_k": 10**30, "max_tokens": 2}, 200, None),
    # An unknown path: the error shape too.
    ("/v1/nothing", {}, 404, None),
])
def test_findings_answer_4xx_naming_the_field(server, path, body, status, param):
  r = httpx.post(server.url + path, json=body, headers=HEADERS, timeout=120)
  assert r.status_code == status, r.text
  if status != 200:
    error = r.json()["error"]
    assert error["code"] == status and error["param"] == param, error

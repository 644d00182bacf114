"""`hisparse-jax serve` in a subprocess on a free loopback port, driven by the official
`openai` client (sync and async) and by raw HTTP for what a client library would refuse
to send. The engine is the embedded default model with small pools, so the load test
uses the host pool and preemption."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from hisparse_jax import LLM, SamplingParams
from hisparse_jax.bench.serve_load import ServerProcess

KEY = "test-key"
MODEL = "tiny"
# The default model keeps 1 KiB of KV per token: 16 KiB blocks of 16 tokens, ~100 device
# blocks (1,600 tokens): 64 concurrent requests swap to the host pool.
ENGINE_FLAGS = ("--max_model_len=512", "--device_kv_gib=0.0015", "--host_pool_gib=0.05",
                "--block_size=16", "--max_num_seqs=64")
PROMPTS = ["bafu: bapo\nbaki: bare\n? baki:", "lodu: moti\n? lodu:", "kavi: rino\nbafu: sela\n"
           "kavi: tumo\n? bafu:", "sela:"]


class Server(ServerProcess):
  """The server of these tests (the bench's `ServerProcess` with their flags)."""

  def __init__(self, *extra):
    super().__init__(f"--api_key={KEY}", f"--served_model_name={MODEL}", *ENGINE_FLAGS, *extra)

  def client(self, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kwargs)


@pytest.fixture(scope="module")
def server():
  s = Server()
  yield s
  assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def llm():
  return LLM(max_model_len=512, device_kv_gib=0.004, host_pool_gib=0.05, block_size=16,
             max_num_seqs=32)


def _greedy_text(llm, prompt, max_tokens, **kw):
  (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw),
                        use_tqdm=False)
  return out.outputs[0].text


def test_completions_stream_equals_non_stream_equals_llm_generate(server, llm):
  client = server.client()
  for prompt in PROMPTS[:2]:
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                      temperature=0.0)
    pieces = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                       temperature=0.0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(pieces)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == streamed == _greedy_text(llm, prompt, 12)
    assert whole.choices[0].finish_reason == "length"
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))


def test_chat_stream_equals_non_stream_equals_llm_chat(server, llm):
  client = server.client()
  messages = [{"role": "system", "content": "bafu: bapo\nbaki: bare"},
              {"role": "user", "content": "? baki:"}]
  whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                         temperature=0.0)
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                               temperature=0.0, stream=True))
  streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  (expected,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6),
                         use_tqdm=False)
  assert whole.choices[0].message.content == streamed == expected.outputs[0].text
  assert whole.choices[0].message.role == "assistant"
  assert chunks[0].choices[0].delta.role == "assistant"


def test_n_logprobs_and_stop_strings(server, llm):
  client = server.client()
  two = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=2,
                                  temperature=1.0, seed=3, logprobs=2)
  assert [c.index for c in two.choices] == [0, 1]
  for c in two.choices:
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    # (Each token's own text, as vLLM's decoded_token: this model's words lose the space
    # before them when decoded alone.)
    assert "".join(lp.tokens) == c.text.replace(" ", "")
    assert all(len(top) >= 2 for top in lp.top_logprobs)
  assert two.usage.completion_tokens == 16
  again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=2,
                                    temperature=1.0, seed=3)
  assert [c.text for c in again.choices] == [c.text for c in two.choices]  # seeded
  chat = client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "baki:"}], max_tokens=4,
      temperature=0.0, logprobs=True, top_logprobs=3)
  content = chat.choices[0].logprobs.content
  assert len(content) == chat.usage.completion_tokens
  assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
  # A stop string ends the text before it, streamed or not, as LLM.generate's.
  text = _greedy_text(llm, PROMPTS[0], 16)
  stop = text.split()[1]
  expected = _greedy_text(llm, PROMPTS[0], 16, stop=[stop])
  stopped = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16,
                                      temperature=0.0, stop=[stop])
  streamed = "".join(c.choices[0].text for c in client.completions.create(
      model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.0, stop=[stop],
      stream=True))
  assert stopped.choices[0].text == streamed == expected and stop not in expected
  assert stopped.choices[0].finish_reason == "stop"


def test_async_client_concurrent_streams(server, llm):
  async def one(client, prompt):
    text = ""
    async for chunk in await client.completions.create(model=MODEL, prompt=prompt,
                                                       max_tokens=10, temperature=0.0,
                                                       stream=True):
      text += chunk.choices[0].text
    return text

  async def main():
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY,
                                  max_retries=0) as client:
      return await asyncio.gather(*(one(client, p) for p in PROMPTS))

  assert asyncio.run(main()) == [_greedy_text(llm, p, 10) for p in PROMPTS]


def test_models_health_metrics_tokenize_detokenize(server, llm):
  client = server.client()
  assert [m.id for m in client.models.list().data] == [MODEL]
  assert httpx.get(server.url + "/health").status_code == 200
  metrics = server.metrics()
  assert metrics['hisparse_kv_capacity_tokens{memory_kind="pinned_host"}'] > 0
  headers = {"Authorization": f"Bearer {KEY}"}
  tok = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}, headers=headers)
  ids = llm.get_tokenizer().encode(PROMPTS[0])
  assert tok.json() == {"tokens": ids, "count": len(ids), "max_model_len": 512}
  detok = httpx.post(server.url + "/detokenize", json={"tokens": ids[1:]}, headers=headers)
  assert detok.json()["prompt"] == llm.get_tokenizer().decode(ids[1:])


@pytest.mark.parametrize("body,status,param,needle", [
    (b'{"model": "tiny", "prompt": "x",', 400, None, "not valid JSON"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens",
     "valid integer"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens",
     "max_tokens must be >= 1, got -3"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature",
     "temperature must be >= 0, got -1"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "The model `gpt-4` does not exist."),
    ({"model": MODEL, "prompt": "bafu: " * 600}, 400, "prompt",
     "max_model_len=512 leaves no room"),
    ({"model": MODEL}, 400, "prompt", "prompt: Field required"),
    ({"model": MODEL, "prompt": [1, 10**6]}, 400, "prompt", "outside the vocabulary"),
])
def test_bad_requests_get_4xx_naming_the_field(server, body, status, param, needle):
  headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
  content = body if isinstance(body, bytes) else json.dumps(body).encode()
  r = httpx.post(server.url + "/v1/completions", content=content, headers=headers)
  assert r.status_code == status, r.text
  error = r.json()["error"]
  assert needle in error["message"] and error["param"] == param and error["code"] == status
  # The server still answers.
  ok = server.client().completions.create(model=MODEL, prompt="baki:", max_tokens=2)
  assert len(ok.choices) == 1


def test_missing_or_wrong_key_is_401(server):
  for key in (None, "wrong"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                   headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
  with pytest.raises(openai.AuthenticationError):
    openai.OpenAI(base_url=server.url + "/v1", api_key="wrong",
                  max_retries=0).models.list()


def test_load_64_streams_8_disconnect_no_block_leaks(server, llm):
  """64 concurrent streams of mixed lengths on a device pool too small for them (the host
  pool and preemption are used); 8 clients leave mid-stream. The others get LLM.generate's
  tokens, the 8 are aborted, and the pools come back to empty."""
  prompts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 5) for i in range(64)]
  leave = set(range(3, 64, 8))
  # The 8 that leave ask for 300 tokens, so none can finish before its client has gone
  # (64-192 tokens raced the client's loop once steps got faster: 7 aborts, 1 finished).
  lengths = [300 if i in leave else 64 + (i * 29) % 128 for i in range(64)]
  before = server.metrics()
  aborts = 'hisparse_requests_total{finish_reason="abort"}'

  async def one(client, i):
    text = ""
    stream = await client.completions.create(model=MODEL, prompt=prompts[i],
                                             max_tokens=lengths[i], temperature=0.0,
                                             extra_body={"ignore_eos": True}, stream=True)
    async for chunk in stream:
      text += chunk.choices[0].text
      if i in leave and len(text) > 3:
        await stream.close()  # the client goes away mid-stream
        return None
    return text

  async def main():
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                  timeout=600) as client:
      return await asyncio.gather(*(one(client, i) for i in range(64)))

  texts = asyncio.run(main())
  stay = [i for i in range(64) if i not in leave]  # (the others' texts are cut short)
  expected = llm.generate([prompts[i] for i in stay],
                          [SamplingParams(temperature=0.0, max_tokens=lengths[i],
                                          ignore_eos=True) for i in stay], use_tqdm=False)
  for i, out in zip(stay, expected):
    assert texts[i] == out.outputs[0].text, i
  assert all(texts[i] is None for i in leave)
  after = {}
  for _ in range(50):  # the aborts land on the engine's next step
    after = server.metrics()
    if after.get(aborts, 0) - before.get(aborts, 0) >= 8:
      break
    time.sleep(0.1)
  assert after.get(aborts, 0) - before.get(aborts, 0) == 8
  assert after["hisparse_preemptions_total"] > before["hisparse_preemptions_total"]
  for kind in ("device", "pinned_host"):
    assert after[f'hisparse_kv_usage_ratio{{memory_kind="{kind}"}}'] == 0.0, kind
  assert after['hisparse_num_requests{state="running"}'] == 0


def test_sigterm_drains_then_exits_0():
  """A stream running when SIGTERM comes finishes within --drain_timeout_s; requests
  after it get 503 or no connection; the process exits 0."""
  s = Server("--drain_timeout_s=60", "--nowarmup")  # (the module server warms up)
  client = s.client()
  stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200,
                                     temperature=0.0, extra_body={"ignore_eos": True}, stream=True)
  first = next(iter(stream))
  s.proc.send_signal(signal.SIGTERM)
  rest = [c.choices[0] for c in stream]
  assert first.choices[0].text is not None and rest[-1].finish_reason == "length"
  with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
  assert s.stop() == 0
  assert any("server stopped" in line for line in s.log)

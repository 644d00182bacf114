"""An OpenAI-compatible HTTP API over `AsyncEngine` (FastAPI, as vLLM's server): the routes.

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with
                                                  "stream": true, then "data: [DONE]")
    GET  /v1/models, /health, /metrics            (metrics: the engine's Prometheus registry)
    GET  /dashboard, /dashboard/data              (observability/dashboard.py: the live page
                                                   and its JSON; with API keys, a key as
                                                   the header or ?token=KEY)
    POST /tokenize, /detokenize                   (vLLM's extras)

Request fields map onto `SamplingParams` by vLLM's names (n, temperature, top_p, stop,
seed, max_tokens, logprobs, penalties, and vLLM's extra fields top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens). vLLM's `cache_salt` (a non-empty string) reaches the engine: the
request shares cached KV, in every tier, only with requests of the same salt; with
`cache_salt_by_api_key` the salt is derived from the request's API key (and joined to
the body's), so tenants of one server share none (openai_auth.py). Errors are OpenAI's
shape, {"error": {"message", "type", "param", "code"}}: 400 naming the field for a bad
field or an oversize prompt, 404 for an unknown model (vLLM's, and OpenAI's), 401
without one of the keys when keys are set, 503 while the engine is not running; never a
traceback. A stream whose client disconnects is aborted at once.

GET /openapi.json describes every route (the interactive docs stay off): its bodies, its
responses (openai_protocol's models, "text/event-stream" for a stream, the error shape
for each error status it can answer) and, with --api_key, the bearer key as its security
scheme.
tests/hisparse_jax/entrypoints/test_fuzz.py fuzzes the server against it (schemathesis).

The server in modules, one concern each (none imports this one):

    openai_protocol.py   request / response models; a request -> SamplingParams
    openai_errors.py     APIError, the error shape and the handlers that answer in it
    openai_auth.py       the API keys (several: one per tenant) and each key's cache salt
    openai_limits.py     ServerLimits; the gate (key, body size, drain), request limits
    openai_streaming.py  engine streams -> JSON answers and server-sent events
    openai_schema.py     /openapi.json: each route's errors, stream events, the limits
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import fastapi
import prometheus_client
import pydantic
from absl import logging
from fastapi import responses

from hisparse_jax.engine.sampling import RequestOutputKind, SamplingParams
from hisparse_jax.entrypoints import openai_limits
from hisparse_jax.entrypoints.async_engine import AsyncEngine, EngineDeadError, RequestStream
from hisparse_jax.entrypoints.openai_auth import ApiKeys, cache_salt
from hisparse_jax.entrypoints.openai_errors import APIError, install_error_handlers
from hisparse_jax.entrypoints.openai_limits import (
  ServerLimits,
  check_queue,
  install_gate,
  unless_disconnected,
  within_timeout,
)
from hisparse_jax.entrypoints.openai_protocol import (
  ChatCompletionChunk,
  ChatCompletionResponse,
  ChatRequest,
  CompletionChunk,
  CompletionRequest,
  CompletionResponse,
  DetokenizeRequest,
  DetokenizeResponse,
  ModelList,
  SamplingFields,
  TokenizeRequest,
  TokenizeResponse,
  completion_prompts,
  render_chat,
)
from hisparse_jax.entrypoints.openai_schema import openapi_schema, route_responses
from hisparse_jax.entrypoints.openai_streaming import (
  chat_response,
  chat_stream,
  completion_response,
  completion_stream,
  sse,
)
from hisparse_jax.observability import dashboard

__all__ = ["ServerLimits", "build_app"]


def build_app(engine: AsyncEngine, served_model_name: str, *, max_model_len: int,
              api_keys: Sequence[str] = (), cache_salt_by_api_key: bool = False,
              limits: ServerLimits | None = None) -> fastapi.FastAPI:
  """The FastAPI app over a started `AsyncEngine`. `api_keys`: the bearer keys the
  guarded routes take (none: no key needed); `cache_salt_by_api_key`: each request's
  cache salt derived from its key (openai_auth.py: tenants share no cached KV)."""
  if cache_salt_by_api_key and not api_keys:
    raise ValueError("cache_salt_by_api_key needs api_keys: the salt is derived from each "
                     "request's key")
  keys = ApiKeys(api_keys) if api_keys else None
  limits = limits if limits is not None else ServerLimits()
  app = fastapi.FastAPI(title="hisparse-jax", docs_url=None, redoc_url=None)
  app.state.draining = False
  app.state.num_streams = 0  # streaming responses open now
  app.state.adding = 0  # prompts being added to the engine now (their add in an executor)
  tokenizer = engine.engine.tokenizer
  created = int(time.time())
  install_error_handlers(app)
  install_gate(app, engine, limits, keys)
  if keys is not None:
    logging.info("API keys: %d%s", len(keys), "; each request's cache salt from its key"
                 if cache_salt_by_api_key else "")

  def check_model(name: str | None) -> None:
    if name is not None and name != served_model_name:
      raise APIError(404, f"The model `{name}` does not exist.", "model", "NotFoundError")

  # The statuses each route can answer besides 200 (401 only with a key; 503 past the gate;
  # 413 for a POST's body).
  key = (401,) if keys is not None else ()
  engine_errors = (*key, 503, 500)
  post_errors = (400, 404, 413, *engine_errors)

  @app.get("/health", response_class=responses.Response,
           responses={200: {"description": "the engine runs (an empty body)"},
                      **route_responses(503)})
  async def health():
    return responses.Response(status_code=200)

  @app.get("/v1/models", responses=route_responses(*engine_errors, ok=ModelList))
  async def models():
    return {"object": "list", "data": [{
        "id": served_model_name, "object": "model", "created": created,
        "owned_by": "hisparse-jax", "root": served_model_name, "max_model_len": max_model_len}]}

  @app.get("/metrics", response_class=responses.PlainTextResponse,
           responses={200: {"description": "the engine's metrics (Prometheus' text format)",
                            "content": {"text/plain": {"schema": {"type": "string"}}}}})
  async def metrics():
    await asyncio.get_running_loop().run_in_executor(None, engine.refresh_metrics)
    registry = engine.engine.metrics_registry.prometheus_registry
    return responses.Response(prometheus_client.generate_latest(registry),
                              media_type=prometheus_client.CONTENT_TYPE_LATEST)

  @app.get("/dashboard", response_class=responses.HTMLResponse, responses=route_responses(*key))
  @app.get("/dashboard/", response_class=responses.HTMLResponse, responses=route_responses(*key))
  async def dashboard_page():
    return responses.HTMLResponse(dashboard.page(), headers={"Cache-Control": "no-store"})

  @app.get("/dashboard/data", responses={
      200: {"description": "the dashboard's data",
            "content": {"application/json": {"schema": {"type": "object"}}}},
      **route_responses(*key)})
  async def dashboard_data():
    # (the usage gauges brought up to date under the engine's lock, as for a scrape)
    await asyncio.get_running_loop().run_in_executor(None, engine.refresh_metrics)
    return responses.JSONResponse(dashboard.snapshot(engine.engine),
                                  headers={"Cache-Control": "no-store"})

  @app.post("/tokenize", responses=route_responses(*post_errors, ok=TokenizeResponse))
  async def tokenize(body: TokenizeRequest):
    check_model(body.model)
    if body.messages is not None:
      text = render_chat(tokenizer, body.messages, body.add_generation_prompt)
      ids = tokenizer.encode(text, add_special_tokens=False)
    elif body.prompt is not None:
      ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
      raise APIError(400, "give prompt or messages", "prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

  @app.post("/detokenize", responses=route_responses(*post_errors, ok=DetokenizeResponse))
  async def detokenize(body: DetokenizeRequest):
    check_model(body.model)
    vocab = engine.engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
      raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                     "tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


  def check_request(body, prompts: list[dict], *args) -> None:
    """openai_limits.check_request with this server's limits, engine and open streams."""
    openai_limits.check_request(
        body, prompts, *args, limits=limits, tokenizer=tokenizer,
        max_num_seqs=engine.engine.config.max_num_seqs, max_model_len=max_model_len,
        num_streams=app.state.num_streams)

  def stream_response(events: AsyncIterator[dict],
                      streams: list[RequestStream]) -> responses.StreamingResponse:
    app.state.num_streams += 1
    return sse(events, streams, limits.request_timeout_s, on_close=_stream_closed)

  def _stream_closed() -> None:
    app.state.num_streams -= 1

  def request_salt(body: SamplingFields, raw: fastapi.Request) -> str | None:
    """The cache salt a request's prompts run under: the body's cache_salt, or with
    cache_salt_by_api_key, its key's salt (set by the gate) joined to it."""
    if not cache_salt_by_api_key:
      return body.cache_salt
    return cache_salt(raw.state.key_salt, body.cache_salt)

  async def start(request_id: str, prompts: list[dict], sp: SamplingParams,
                  body: pydantic.BaseModel, param: str,
                  salt: str | None) -> list[RequestStream]:
    """One engine request per prompt (under cache salt `salt`), all added (and so
    checked) before any output; a bad one ends those added before it. 429 when the
    engine's queue is full (counting the requests being added now: the check and the
    count are one step of the event loop)."""
    scheduler = engine.engine.scheduler
    waiting = len(scheduler.waiting) + len(scheduler.loading) + app.state.adding
    check_queue(limits, waiting, len(prompts))
    app.state.adding += len(prompts)
    try:
      return await _add_all(request_id, prompts, sp, body, param, salt)
    finally:
      app.state.adding -= len(prompts)

  async def _add_all(request_id: str, prompts: list[dict], sp: SamplingParams,
                     body: pydantic.BaseModel, param: str,
                     salt: str | None) -> list[RequestStream]:
    """The engine's ValueError is a 400 naming the field its message starts with ("n=17
    exceeds ...", "stop_token_ids: ..."), else `param`."""
    streams = []
    try:
      for i, prompt in enumerate(prompts):
        streams.append(await engine.add_request(f"{request_id}-{i}", sp, cache_salt=salt,
                                                 **prompt))
    except (ValueError, EngineDeadError) as e:
      for stream in streams:
        stream.close()
      if isinstance(e, EngineDeadError):
        raise APIError(503, str(e), None, "ServiceUnavailableError") from None
      field = re.match(r"\w+", str(e))
      field = field.group(0) if field else None
      raise APIError(400, str(e), field if field in type(body).model_fields else param
                     ) from None
    except BaseException:
      for stream in streams:
        stream.close()
      raise
    return streams

  @app.post("/v1/completions", responses=route_responses(
      *post_errors, 408, 429, ok=CompletionResponse, stream=CompletionChunk))
  async def completions(body: CompletionRequest, raw: fastapi.Request):
    check_model(body.model)
    if body.echo:
      raise APIError(400, "echo is not supported", "echo")
    prompts = completion_prompts(body.prompt)
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    sp = body.sampling_params(body.max_tokens, body.logprobs, kind)
    check_request(body, prompts, body.max_tokens, body.logprobs, "logprobs", "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await start(request_id, prompts, sp, body, "prompt", request_salt(body, raw))
    name = body.model or served_model_name
    if body.stream:
      return stream_response(completion_stream(streams, request_id, name, body, tokenizer),
                             streams)
    return await unless_disconnected(raw, within_timeout(
        completion_response(streams, request_id, name, body.n, tokenizer),
        limits.request_timeout_s))

  @app.post("/v1/chat/completions", responses=route_responses(
      *post_errors, 408, 429, ok=ChatCompletionResponse, stream=ChatCompletionChunk))
  async def chat(body: ChatRequest, raw: fastapi.Request):
    check_model(body.model)
    if tokenizer is None:
      raise APIError(400, "this model has no tokenizer (chat needs one)", "model")
    text = render_chat(tokenizer, body.messages, body.add_generation_prompt,
                       body.chat_template, body.chat_template_kwargs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    num_top = body.top_logprobs or 0
    if body.top_logprobs is not None and not body.logprobs:
      raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens_field = ("max_completion_tokens" if body.max_completion_tokens is not None
                        else "max_tokens")
    max_tokens = getattr(body, max_tokens_field)
    sp = body.sampling_params(max_tokens, num_top if body.logprobs else None, kind,
                              {"max_tokens": max_tokens_field, "logprobs": "top_logprobs"})
    prompts = [dict(prompt=text, prompt_token_ids=ids)]
    check_request(body, prompts, max_tokens, body.top_logprobs, "top_logprobs", "messages",
                  max_tokens_field)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await start(request_id, prompts, sp, body, "messages",
                          request_salt(body, raw))
    name = body.model or served_model_name
    if body.stream:
      return stream_response(chat_stream(streams, request_id, name, body, tokenizer, num_top),
                             streams)
    return await unless_disconnected(raw, within_timeout(
        chat_response(streams, request_id, name, tokenizer, num_top), limits.request_timeout_s))

  app.openapi = lambda: openapi_schema(
      app, keyed=keys is not None, limits=limits,
      vocab_size=engine.engine.model_config.vocab_size,
      max_num_seqs=engine.engine.config.max_num_seqs, max_model_len=max_model_len)
  return app

"""An OpenAI-compatible HTTP API over `AsyncEngine` (FastAPI, as vLLM's server).

    POST /v1/completions, /v1/chat/completions   (JSON, or server-sent events with
                                                  "stream": true, then "data: [DONE]")
    GET  /v1/models, /health, /metrics            (metrics: the engine's Prometheus registry)
    GET  /dashboard, /dashboard/data              (observability/dashboard.py: the live page
                                                   and its JSON; with --api_key, the key as
                                                   the header or ?token=KEY)
    POST /tokenize, /detokenize                   (vLLM's extras)

Request fields map onto `SamplingParams` by vLLM's names (n, temperature, top_p, stop,
seed, max_tokens, logprobs, penalties, and vLLM's extra fields top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens). vLLM's `cache_salt` (a non-empty string) reaches the engine: the
request shares cached KV, in every tier, only with requests of the same salt. Errors
are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 naming the field
for a bad field or an oversize prompt, 404 for an unknown model (vLLM's, and OpenAI's),
401 without the key when one is set, 503 while the engine is not running; never a
traceback. A stream whose client disconnects is aborted at once.

GET /openapi.json describes every route (the interactive docs stay off): its bodies, its
responses (the models below, "text/event-stream" for a stream, the error shape for each
error status it can answer) and, with --api_key, the bearer key as its security scheme.
tests/hisparse_jax/entrypoints/test_fuzz.py fuzzes the server against it (schemathesis).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import fastapi
import prometheus_client
import pydantic
from absl import logging
from fastapi import responses
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from hisparse_jax.engine.request import CompletionOutput, RequestOutput
from hisparse_jax.engine.sampling import RequestOutputKind, SamplingParams
from hisparse_jax.entrypoints.async_engine import (
  AsyncEngine,
  EngineDeadError,
  RequestStream,
  StreamOverflowError,
)
from hisparse_jax.observability import dashboard

# SamplingParams fields a request may set by vLLM's names (beyond the OpenAI ones).
EXTRA_FIELDS = ("top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos",
                "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")


@dataclasses.dataclass(frozen=True)
class ServerLimits:
  """What one request may ask for, and how much the server takes at once (flags of
  `serve`: --max_request_bytes, ...). A request past a limit gets an OpenAI-shaped 4xx
  naming the field (429 with Retry-After when the server is full), before anything of it
  reaches the engine; the other requests are not affected."""

  max_request_bytes: int = 8 << 20  # the JSON body (413 beyond)
  max_prompts: int = 64  # prompts in one /v1/completions request
  max_prompt_tokens: int = 1 << 20  # all prompts of one request together (after tokenizing)
  max_logprobs: int = 20  # logprobs / top_logprobs (OpenAI's and vLLM's cap)
  max_stop: int = 16  # stop strings
  max_stop_chars: int = 256  # characters of one stop string
  max_stop_token_ids: int = 256
  request_timeout_s: float = 600.0  # a request still running then is aborted (408)
  max_waiting_requests: int = 1024  # queued in the engine, not running yet (429 beyond)
  max_concurrent_streams: int = 256  # streaming responses open at once (429 beyond)
  retry_after_s: int = 1  # the Retry-After of a 429

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
        raise ValueError(f"{f.name} must be a positive number, got {value!r}")


class APIError(Exception):
  def __init__(self, status: int, message: str, param: str | None = None,
               err_type: str = "BadRequestError", headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.err_type = status, message, param, err_type
    self.headers = headers


def _error(status: int, message: str, param: str | None = None,
           err_type: str = "BadRequestError",
           headers: dict | None = None) -> responses.JSONResponse:
  return responses.JSONResponse(
      {"error": {"message": message, "type": err_type, "param": param, "code": status}},
      status_code=status, headers=headers)


class ErrorInfo(pydantic.BaseModel):
  message: str
  type: str
  param: str | None
  code: int


class ErrorResponse(pydantic.BaseModel):
  """Every error's body (OpenAI's shape; `code` is the HTTP status)."""

  error: ErrorInfo


class StreamOptions(pydantic.BaseModel):
  include_usage: bool = False


def _limits(default: Any = None, **bounds) -> Any:
  """A field whose range the schema states (JSON Schema's minimum, maximum, ...) but
  pydantic does not check: `SamplingParams` does, with its own message naming the field
  (one rule for every front end)."""
  return pydantic.Field(default, json_schema_extra=bounds)


class _Sampling(pydantic.BaseModel):
  """The fields both endpoints share (OpenAI's, then vLLM's extras)."""

  model_config = pydantic.ConfigDict(extra="ignore")

  model: str | None = None
  n: int = _limits(1, minimum=1)
  temperature: float | None = _limits(minimum=0)  # None: 1.0 (OpenAI's and vLLM's default)
  top_p: float | None = _limits(exclusiveMinimum=0, maximum=1)
  stop: str | list[str] | None = None
  seed: int | None = None
  presence_penalty: float = _limits(0.0, minimum=-2, maximum=2)
  frequency_penalty: float = _limits(0.0, minimum=-2, maximum=2)
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  top_k: int | None = _limits(minimum=-1)
  min_p: float | None = _limits(minimum=0, maximum=1)
  min_tokens: int = _limits(0, minimum=0)
  repetition_penalty: float | None = _limits(exclusiveMinimum=0)
  ignore_eos: bool = False
  stop_token_ids: list[int] | None = None
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True
  # vLLM's: mixed into the prompt's block hashes, so only requests of the same salt share
  # cached KV (prefix cache, host, disk and remote tiers); a bad one is a 400 naming it.
  cache_salt: str | None = pydantic.Field(None, min_length=1)

  def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                      kind: RequestOutputKind, names: dict[str, str] | None = None
                      ) -> SamplingParams:
    """`names`: the request's own name of a SamplingParams field, for an error's param
    (chat's max_completion_tokens, top_logprobs)."""
    kwargs: dict[str, Any] = dict(
        n=self.n, max_tokens=max_tokens, logprobs=logprobs, seed=self.seed,
        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
        stop=self.stop or (), ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
        stop_token_ids=self.stop_token_ids or (),
        include_stop_str_in_output=self.include_stop_str_in_output,
        skip_special_tokens=self.skip_special_tokens, output_kind=kind)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
      if getattr(self, name) is not None:
        kwargs[name] = getattr(self, name)
    try:
      return SamplingParams(**kwargs)
    except ValueError as e:  # "max_tokens must be >= 1, got -3": the field leads
      field = str(e).split(" ", 1)[0]
      field = (names or {}).get(field, field)
      raise APIError(400, str(e), field if field in type(self).model_fields else None) from None


class CompletionRequest(_Sampling):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = _limits(16, minimum=1)
  logprobs: int | None = _limits(minimum=0)
  echo: bool = _limits(False, enum=[False])  # (not supported)


class ChatMessage(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow")

  # (the schema names the common roles; any string reaches the chat template, which
  # decides: "tool" and "developer" where the model's template takes them)
  role: str = _limits(..., enum=["system", "user", "assistant"])
  content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
  messages: list[ChatMessage] = pydantic.Field(min_length=1)
  max_tokens: int | None = _limits(minimum=1)
  max_completion_tokens: int | None = _limits(minimum=1)
  logprobs: bool = False
  top_logprobs: int | None = _limits(minimum=0)
  add_generation_prompt: bool = True
  chat_template: str | None = None
  chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(pydantic.BaseModel):
  model: str | None = None
  prompt: str | None = None
  messages: list[ChatMessage] | None = None
  add_special_tokens: bool = True
  add_generation_prompt: bool = True


class DetokenizeRequest(pydantic.BaseModel):
  model: str | None = None
  tokens: list[int]


# The responses (for the OpenAPI schema only: the routes return dicts, as built below).
class Usage(pydantic.BaseModel):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int


class CompletionLogprobs(pydantic.BaseModel):
  tokens: list[str]
  token_logprobs: list[float]
  top_logprobs: list[dict[str, float]]
  text_offset: list[int]


class CompletionChoice(pydantic.BaseModel):
  index: int
  text: str
  logprobs: CompletionLogprobs | None
  finish_reason: str | None
  stop_reason: int | str | None = None


class CompletionResponse(pydantic.BaseModel):
  id: str
  object: str
  created: int
  model: str
  choices: list[CompletionChoice]
  usage: Usage


class TopLogprob(pydantic.BaseModel):
  token: str
  logprob: float
  bytes: list[int]


class ChatTokenLogprob(TopLogprob):
  top_logprobs: list[TopLogprob]


class ChatLogprobs(pydantic.BaseModel):
  content: list[ChatTokenLogprob]


class ChatResponseMessage(pydantic.BaseModel):
  role: str
  content: str


class ChatChoice(pydantic.BaseModel):
  index: int
  message: ChatResponseMessage
  logprobs: ChatLogprobs | None
  finish_reason: str | None
  stop_reason: int | str | None = None


class ChatCompletionResponse(pydantic.BaseModel):
  id: str
  object: str
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage


class CompletionChunk(pydantic.BaseModel):
  """One server-sent event of a completions stream (the last: usage, no choices)."""

  id: str
  object: str
  created: int
  model: str
  choices: list[CompletionChoice]
  usage: Usage | None = None


class ChatDelta(pydantic.BaseModel):
  role: str | None = None
  content: str | None = None


class ChatChunkChoice(pydantic.BaseModel):
  index: int
  delta: ChatDelta
  logprobs: ChatLogprobs | None
  finish_reason: str | None
  stop_reason: int | str | None = None


class ChatCompletionChunk(pydantic.BaseModel):
  """One server-sent event of a chat stream (the first: the role; the last: usage)."""

  id: str
  object: str
  created: int
  model: str
  choices: list[ChatChunkChoice]
  usage: Usage | None = None


class ModelCard(pydantic.BaseModel):
  id: str
  object: str
  created: int
  owned_by: str
  root: str
  max_model_len: int


class ModelList(pydantic.BaseModel):
  object: str
  data: list[ModelCard]


class TokenizeResponse(pydantic.BaseModel):
  tokens: list[int]
  count: int
  max_model_len: int


class DetokenizeResponse(pydantic.BaseModel):
  prompt: str


_ERRORS = {400: "a bad field (`param` names it) or body", 401: "no or a wrong API key",
           404: "an unknown model", 408: "the request ran past --request_timeout_s",
           413: "the body is over --max_request_bytes",
           429: "the server is full (--max_waiting_requests, --max_concurrent_streams)",
           500: "an internal error (a bug)",
           503: "the engine is not running, or the server is shutting down"}


def _sse_event(chunk: type[pydantic.BaseModel]) -> dict:
  """The schema of each server-sent event of a stream (OpenAPI 3.1 reads a
  text/event-stream schema as one event's): its data is `chunk` as JSON, the error
  shape (the engine died mid-stream), or, last, "[DONE]"."""
  ref = "#/components/schemas/{}".format
  return {"type": "object", "required": ["data"], "properties": {"data": {
      "type": "string", "if": {"const": "[DONE]"},
      "else": {"contentMediaType": "application/json", "contentSchema": {
          "anyOf": [{"$ref": ref(chunk.__name__)}, {"$ref": ref(ErrorResponse.__name__)}]}}}}}


def _responses(*statuses: int, ok: type[pydantic.BaseModel] | None = None,
               stream: type[pydantic.BaseModel] | None = None) -> dict:
  """A route's `responses=`: its 200 (`ok`'s JSON; with `stream`, also server-sent
  events of that chunk), then the error shape for each of `statuses`."""
  out: dict[int | str, dict] = {}
  if ok is not None:
    out[200] = {"description": "the result", "model": ok}
    if stream is not None:
      out[200]["description"] += ('; with "stream": true, server-sent events ("data: '
                                  '{chunk}" lines, then "data: [DONE]")')
      out[200]["content"] = {"text/event-stream": {"schema": _sse_event(stream)}}
  for status in statuses:
    out[status] = {"model": ErrorResponse, "description": _ERRORS[status]}
  if 429 in statuses:
    out[429]["headers"] = {"Retry-After": {"description": "seconds",
                                           "schema": {"type": "integer"}}}
  return out


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def _text_logprobs(completion: CompletionOutput, tokenizer, offset: int) -> dict | None:
  """The completions API's logprobs object for `completion`'s tokens (legacy shape)."""
  if completion.logprobs is None:
    return None
  tokens, token_lps, top, offsets = [], [], [], []
  for token, position in zip(completion.token_ids, completion.logprobs):
    text = _token_text(tokenizer, token, position)
    tokens.append(text)
    token_lps.append(position[token].logprob)
    top.append({_token_text(tokenizer, t, position): lp.logprob for t, lp in position.items()})
    offsets.append(offset)
    offset += len(text)
  return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top,
          "text_offset": offsets}


def _chat_logprobs(completion: CompletionOutput, tokenizer, num_top: int) -> dict | None:
  """The chat API's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
  if completion.logprobs is None:
    return None
  content = []
  for token, position in zip(completion.token_ids, completion.logprobs):
    top = sorted(position.items(), key=lambda kv: kv[1].rank)[:num_top]
    text = _token_text(tokenizer, token, position)
    content.append({
        "token": text, "logprob": position[token].logprob,
        "bytes": list(text.encode()),
        "top_logprobs": [{"token": _token_text(tokenizer, t, position), "logprob": lp.logprob,
                          "bytes": list(_token_text(tokenizer, t, position).encode())}
                         for t, lp in top]})
  return {"content": content}


def _token_text(tokenizer, token: int, position) -> str:
  entry = position.get(token)
  if entry is not None and entry.decoded_token is not None:
    return entry.decoded_token
  return tokenizer.decode([token], skip_special_tokens=False) if tokenizer else str(token)


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
  """(stream index, output) from several streams as they come. However it ends (done,
  failed, or closed early by a client that left), every stream is closed: a request
  still running is aborted."""
  try:
    if len(streams) == 1:
      async for out in streams[0]:
        yield 0, out
      return
    async for item in _merge_many(streams):
      yield item
  finally:
    for stream in streams:
      stream.close()


async def _merge_many(streams):
  queue: asyncio.Queue = asyncio.Queue()

  async def pump(i, stream):
    try:
      async for out in stream:
        await queue.put((i, out))
      await queue.put((i, None))
    except BaseException as e:  # noqa: BLE001 (handed to the consumer)
      await queue.put((i, e))

  tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
  try:
    left = len(tasks)
    while left:
      i, item = await queue.get()
      if item is None:
        left -= 1
      elif isinstance(item, BaseException):
        raise item
      else:
        yield i, item
  finally:
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def build_app(engine: AsyncEngine, served_model_name: str, *, api_key: str | None = None,
              max_model_len: int, limits: ServerLimits | None = None) -> fastapi.FastAPI:
  """The FastAPI app over a started `AsyncEngine`."""
  limits = limits if limits is not None else ServerLimits()
  app = fastapi.FastAPI(title="hisparse-jax", docs_url=None, redoc_url=None)
  app.state.draining = False
  app.state.num_streams = 0  # streaming responses open now
  app.state.adding = 0  # prompts being added to the engine now (their add in an executor)
  tokenizer = engine.engine.tokenizer
  created = int(time.time())

  @app.exception_handler(RequestValidationError)
  async def _invalid(_request, exc: RequestValidationError):
    first = exc.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
      return _error(400, f"the request body is not valid JSON: {first.get('msg')}")
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return _error(400, f"{where}: {first.get('msg')}", param)

  @app.exception_handler(APIError)
  async def _api_error(_request, exc: APIError):
    return _error(exc.status, exc.message, exc.param, exc.err_type, exc.headers)

  @app.exception_handler(HTTPException)
  async def _http_error(_request, exc: HTTPException):  # (an unknown path, a wrong method)
    return _error(exc.status_code, str(exc.detail), None,
                  "NotFoundError" if exc.status_code == 404 else "BadRequestError",
                  exc.headers)  # (405's Allow)

  @app.exception_handler(Exception)
  async def _unexpected(_request, exc: Exception):
    logging.exception("request failed")
    return _error(500, f"internal error ({type(exc).__name__})", None, "InternalServerError")

  @app.middleware("http")
  async def _gate(request: fastapi.Request, call_next):
    path = request.url.path
    dashboard = path.rstrip("/") in ("/dashboard", "/dashboard/data")
    guarded = path.startswith("/v1") or path in ("/tokenize", "/detokenize") or dashboard
    if api_key is not None and guarded:
      # The dashboard also takes ?token=KEY: a browser opening the page cannot send the
      # header; the page then sends it as the header to /dashboard/data.
      token = request.query_params.get("token") if dashboard else None
      if (request.headers.get("authorization") != f"Bearer {api_key}"
          and not (token is not None and hmac.compare_digest(token, api_key))):
        return _error(401, "invalid or missing API key (Authorization: Bearer KEY)", None,
                      "AuthenticationError")
    if request.method == "POST":  # the body's size, before anything reads it
      declared = request.headers.get("content-length")
      if declared is not None and (not declared.isdigit()
                                   or int(declared) > limits.max_request_bytes):
        return _error(413, f"the request body is {declared} bytes; at most "
                      f"{limits.max_request_bytes} (--max_request_bytes)", None,
                      "RequestTooLargeError")
      if declared is None:  # chunked: counted as it arrives (and kept for the handler)
        chunks, size = [], 0
        async for chunk in request.stream():
          size += len(chunk)
          if size > limits.max_request_bytes:
            return _error(413, f"the request body is over {limits.max_request_bytes} bytes "
                          "(--max_request_bytes)", None, "RequestTooLargeError")
          chunks.append(chunk)
        request._body = b"".join(chunks)  # (starlette replays it to the handler)
    if (path != "/metrics" and not dashboard
        and (app.state.draining or not engine.is_running)):
      message = ("the server is shutting down" if app.state.draining
                 else "the engine is not running")
      return _error(503, message, None, "ServiceUnavailableError")
    return await call_next(request)

  def check_model(name: str | None) -> None:
    if name is not None and name != served_model_name:
      raise APIError(404, f"The model `{name}` does not exist.", "model", "NotFoundError")

  # The statuses each route can answer besides 200 (401 only with a key; 503 past the gate;
  # 413 for a POST's body).
  key = (401,) if api_key is not None else ()
  engine_errors = (*key, 503, 500)
  post_errors = (400, 404, 413, *engine_errors)

  @app.get("/health", response_class=responses.Response,
           responses={200: {"description": "the engine runs (an empty body)"},
                      **_responses(503)})
  async def health():
    return responses.Response(status_code=200)

  @app.get("/v1/models", responses=_responses(*engine_errors, ok=ModelList))
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

  @app.get("/dashboard", response_class=responses.HTMLResponse, responses=_responses(*key))
  @app.get("/dashboard/", response_class=responses.HTMLResponse, responses=_responses(*key))
  async def dashboard_page():
    return responses.HTMLResponse(dashboard.page(), headers={"Cache-Control": "no-store"})

  @app.get("/dashboard/data", responses={
      200: {"description": "the dashboard's data",
            "content": {"application/json": {"schema": {"type": "object"}}}},
      **_responses(*key)})
  async def dashboard_data():
    # (the usage gauges brought up to date under the engine's lock, as for a scrape)
    await asyncio.get_running_loop().run_in_executor(None, engine.refresh_metrics)
    return responses.JSONResponse(dashboard.snapshot(engine.engine),
                                  headers={"Cache-Control": "no-store"})

  @app.post("/tokenize", responses=_responses(*post_errors, ok=TokenizeResponse))
  async def tokenize(body: TokenizeRequest):
    check_model(body.model)
    if body.messages is not None:
      text = _render_chat(tokenizer, body.messages, body.add_generation_prompt)
      ids = tokenizer.encode(text, add_special_tokens=False)
    elif body.prompt is not None:
      ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
      raise APIError(400, "give prompt or messages", "prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

  @app.post("/detokenize", responses=_responses(*post_errors, ok=DetokenizeResponse))
  async def detokenize(body: DetokenizeRequest):
    check_model(body.model)
    vocab = engine.engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
      raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                     "tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

  def check_request(body: _Sampling, prompts: list[dict], max_tokens: int | None,
                    logprobs: int | None, logprobs_field: str, param: str,
                    max_tokens_field: str = "max_tokens") -> None:
    """The request's limits (ServerLimits) and its length against max_model_len, with the
    prompts tokenized here (text prompts get their ids, which the engine then uses)."""
    max_seqs = engine.engine.config.max_num_seqs
    if body.n > max_seqs:
      raise APIError(400, f"n={body.n} exceeds max_num_seqs={max_seqs} (the n sequences of "
                     "a request run together)", "n")
    if len(prompts) > limits.max_prompts:
      raise APIError(400, f"{param}: {len(prompts)} prompts in one request; at most "
                     f"{limits.max_prompts} (--max_prompts_per_request)", param)
    if logprobs is not None and logprobs > limits.max_logprobs:
      raise APIError(400, f"{logprobs_field} must be <= {limits.max_logprobs}, got {logprobs}",
                     logprobs_field)
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > limits.max_stop:
      raise APIError(400, f"stop: {len(stops)} stop strings; at most {limits.max_stop}", "stop")
    if any(len(x) > limits.max_stop_chars for x in stops):
      raise APIError(400, f"stop: a stop string is over {limits.max_stop_chars} characters",
                     "stop")
    if body.stop_token_ids and len(body.stop_token_ids) > limits.max_stop_token_ids:
      raise APIError(400, f"stop_token_ids: {len(body.stop_token_ids)} ids; at most "
                     f"{limits.max_stop_token_ids}", "stop_token_ids")
    total = 0
    for prompt in prompts:
      # ("" stays text: the engine refuses it as empty, where its BOS alone would pass)
      if "prompt_token_ids" not in prompt and prompt["prompt"] and tokenizer is not None:
        prompt["prompt_token_ids"] = tokenizer.encode(prompt["prompt"])
      num = len(prompt.get("prompt_token_ids") or ())
      total += num
      if max_tokens is not None and 0 < num <= max_model_len < num + max_tokens:
        raise APIError(400, f"This model's maximum context length is {max_model_len} "
                       f"tokens. However, you requested {num + max_tokens} tokens ({num} in "
                       f"the {param}, {max_tokens} in the completion). Please reduce the "
                       f"length of the {param} or completion.", max_tokens_field)
    if total > limits.max_prompt_tokens:
      raise APIError(400, f"{param}: {total} prompt tokens in one request; at most "
                     f"{limits.max_prompt_tokens} (--max_request_prompt_tokens)", param)
    if body.stream and app.state.num_streams >= limits.max_concurrent_streams:
      raise APIError(429, f"the server is full: {app.state.num_streams} streams open "
                     f"(--max_concurrent_streams={limits.max_concurrent_streams}); retry "
                     "later", None, "RateLimitError", {"Retry-After": str(limits.retry_after_s)})

  def stream_response(events: AsyncIterator[dict]) -> responses.StreamingResponse:
    app.state.num_streams += 1
    return _sse(events, limits.request_timeout_s, on_close=_stream_closed)

  def _stream_closed() -> None:
    app.state.num_streams -= 1

  async def within_timeout(awaitable):
    try:
      return await asyncio.wait_for(awaitable, limits.request_timeout_s)
    except asyncio.TimeoutError:
      raise APIError(408, f"the request ran past {limits.request_timeout_s:g} s "
                     "(--request_timeout_s) and was aborted", None, "TimeoutError") from None

  async def start(request_id: str, prompts: list[dict], sp: SamplingParams,
                  body: pydantic.BaseModel, param: str) -> list[RequestStream]:
    """One engine request per prompt, all added (and so checked) before any output; a
    bad one ends those added before it. 429 when the engine's queue is full (counting the
    requests being added now: the check and the count are one step of the event loop)."""
    scheduler = engine.engine.scheduler
    waiting = len(scheduler.waiting) + len(scheduler.loading) + app.state.adding
    if waiting + len(prompts) > limits.max_waiting_requests:
      raise APIError(429, f"the server is full: {waiting} requests waiting "
                     f"(--max_waiting_requests={limits.max_waiting_requests}); retry later",
                     None, "RateLimitError", {"Retry-After": str(limits.retry_after_s)})
    app.state.adding += len(prompts)
    try:
      return await _add_all(request_id, prompts, sp, body, param)
    finally:
      app.state.adding -= len(prompts)

  async def _add_all(request_id: str, prompts: list[dict], sp: SamplingParams,
                     body: pydantic.BaseModel, param: str) -> list[RequestStream]:
    """The engine's ValueError is a 400 naming the field its message starts with ("n=17
    exceeds ...", "stop_token_ids: ..."), else `param`."""
    streams = []
    try:
      for i, prompt in enumerate(prompts):
        streams.append(await engine.add_request(
            f"{request_id}-{i}", sp, cache_salt=getattr(body, "cache_salt", None), **prompt))
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

  @app.post("/v1/completions", responses=_responses(
      *post_errors, 408, 429, ok=CompletionResponse, stream=CompletionChunk))
  async def completions(body: CompletionRequest, raw: fastapi.Request):
    check_model(body.model)
    if body.echo:
      raise APIError(400, "echo is not supported", "echo")
    prompts = _completion_prompts(body.prompt)
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    sp = body.sampling_params(body.max_tokens, body.logprobs, kind)
    check_request(body, prompts, body.max_tokens, body.logprobs, "logprobs", "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await start(request_id, prompts, sp, body, "prompt")
    name = body.model or served_model_name
    if body.stream:
      return stream_response(_completion_stream(streams, request_id, name, body, tokenizer))
    return await within_timeout(
        _completion_response(streams, request_id, name, body.n, tokenizer))

  @app.post("/v1/chat/completions", responses=_responses(
      *post_errors, 408, 429, ok=ChatCompletionResponse, stream=ChatCompletionChunk))
  async def chat(body: ChatRequest, raw: fastapi.Request):
    check_model(body.model)
    if tokenizer is None:
      raise APIError(400, "this model has no tokenizer (chat needs one)", "model")
    text = _render_chat(tokenizer, body.messages, body.add_generation_prompt,
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
    streams = await start(request_id, prompts, sp, body, "messages")
    name = body.model or served_model_name
    if body.stream:
      return stream_response(_chat_stream(streams, request_id, name, body, tokenizer, num_top))
    return await within_timeout(_chat_response(streams, request_id, name, tokenizer, num_top))

  def openapi() -> dict:
    """FastAPI's schema less its 422s (a bad body is a 400 here, in the error shape), every
    error as JSON, this server's limits (_deployment_limits), and with a key, the key as
    the guarded routes' security (the header, or ?token= for the dashboard's)."""
    if app.openapi_schema is None:
      schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
      error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
      for path, operations in schema["paths"].items():
        for operation in operations.values():
          operation["responses"].pop("422", None)
          for status, response in operation["responses"].items():
            if status != "200":  # (JSON whatever the route's own media type: the page's)
              response["content"] = error
          if api_key is not None and "401" in operation["responses"]:
            operation["security"] = [{"bearer": []}]
            if path.startswith("/dashboard"):
              operation["security"].append({"token": []})
      components = schema.setdefault("components", {})
      for name in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(name, None)
      # (the chunks, which only the event-stream schemas name)
      components["schemas"].update(models_json_schema(
          [(m, "serialization") for m in (CompletionChunk, ChatCompletionChunk)],
          ref_template="#/components/schemas/{model}")[1]["$defs"])
      _deployment_limits(components["schemas"], limits,
                         vocab_size=engine.engine.model_config.vocab_size,
                         max_num_seqs=engine.engine.config.max_num_seqs,
                         max_model_len=max_model_len)
      if api_key is not None:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "token": {"type": "apiKey", "in": "query", "name": "token"}}
      app.openapi_schema = schema
    return app.openapi_schema

  app.openapi = openapi
  return app


def _deployment_limits(schemas: dict, limits: ServerLimits, *, vocab_size: int,
                       max_num_seqs: int, max_model_len: int) -> None:
  """This server's limits in the request schemas (the server or the engine checks each,
  naming the field): token ids in [0, vocab_size), n <= max_num_seqs, max_tokens <
  max_model_len, a prompt neither "" nor [], `limits`' counts."""
  def walk(node, fn):
    if isinstance(node, dict):
      fn(node)
      for value in node.values():
        walk(value, fn)
    elif isinstance(node, list):
      for value in node:
        walk(value, fn)

  def token_ids(node):
    if node.get("type") == "integer":
      node.update(minimum=0, maximum=vocab_size - 1)

  def non_empty(node):
    if node.get("type") == "string":
      node["minLength"] = 1
    elif node.get("type") == "array":
      node["minItems"] = 1

  for model, field in (("CompletionRequest", "prompt"), ("CompletionRequest", "stop_token_ids"),
                       ("ChatRequest", "stop_token_ids"), ("DetokenizeRequest", "tokens")):
    walk(schemas[model]["properties"][field], token_ids)
  walk(schemas["CompletionRequest"]["properties"]["prompt"], non_empty)
  for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
    if branch.get("items", {}).get("type") in ("string", "array"):  # (a list of prompts)
      branch["maxItems"] = limits.max_prompts
  for model in ("CompletionRequest", "ChatRequest"):
    properties = schemas[model]["properties"]
    properties["n"]["maximum"] = max_num_seqs
    for field in ("max_tokens", "max_completion_tokens"):
      if field in properties:
        properties[field]["maximum"] = max_model_len - 1
    for field in ("logprobs", "top_logprobs"):
      if properties.get(field, {}).get("anyOf"):  # (chat's logprobs is a bool)
        properties[field]["maximum"] = limits.max_logprobs
    for branch in properties["stop"]["anyOf"]:
      if branch.get("type") == "string":
        branch["maxLength"] = limits.max_stop_chars
      elif branch.get("type") == "array":
        branch.update(maxItems=limits.max_stop)
        branch["items"]["maxLength"] = limits.max_stop_chars
    for branch in properties["stop_token_ids"]["anyOf"]:
      if branch.get("type") == "array":
        branch["maxItems"] = limits.max_stop_token_ids


def _render_chat(tokenizer, messages, add_generation_prompt, chat_template=None,
                 kwargs=None) -> str:
  """The conversation as text. Whatever rendering raises is the request's doing (its
  messages, its chat_template: "{{ 1/0 }}", its chat_template_kwargs): a 400."""
  import jinja2  # noqa: PLC0415

  conversation = [m.model_dump(exclude_none=True) for m in messages]
  try:
    return tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt,
                                         **(kwargs or {}))
  except Exception as e:  # noqa: BLE001 (see above)
    param = "chat_template" if chat_template is not None else "messages"
    what = "" if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: "
    where = "rendering failed" if chat_template is not None else "chat template"
    raise APIError(400, f"{param}: {where}: {what}{e}", param) from None


def _completion_prompts(prompt) -> list[dict]:
  """The request's prompts as engine arguments: text, or token ids (OpenAI's forms)."""
  if isinstance(prompt, str):
    return [dict(prompt=prompt)]
  if not prompt:
    raise APIError(400, "prompt is empty", "prompt")
  if all(isinstance(p, int) for p in prompt):
    return [dict(prompt_token_ids=prompt)]
  return [dict(prompt=p) if isinstance(p, str) else dict(prompt_token_ids=p) for p in prompt]


def _sse(events: AsyncIterator[dict], timeout_s: float = math.inf,
         on_close=None) -> responses.StreamingResponse:
  """Server-sent events. A client that disconnects cancels this body: closing `events`
  closes the request streams under it, which aborts their requests. Past `timeout_s` the
  stream ends with an error event (its requests aborted). `on_close`: called once when
  the body ends, however it ends."""
  async def body():
    deadline = time.monotonic() + timeout_s
    try:
      while True:
        try:
          left = None if math.isinf(deadline) else max(0.0, deadline - time.monotonic())
          event = await asyncio.wait_for(events.__anext__(), left)
        except StopAsyncIteration:
          break
        yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
      yield "data: [DONE]\n\n"
    except asyncio.TimeoutError:
      error = {"message": f"the request ran past {timeout_s:g} s (--request_timeout_s) and "
               "was aborted", "type": "TimeoutError", "param": None, "code": 408}
      yield f"data: {json.dumps({'error': error})}\n\n"
    except StreamOverflowError as e:
      error = {"message": str(e), "type": "StreamOverflowError", "param": None, "code": 408}
      yield f"data: {json.dumps({'error': error})}\n\n"
    except Exception as e:  # noqa: BLE001 (the engine died mid-stream: say so, then end)
      error = {"message": str(e), "type": "ServiceUnavailableError", "param": None,
               "code": 503}
      yield f"data: {json.dumps({'error': error})}\n\n"
    finally:
      await events.aclose()
      if on_close is not None:
        on_close()
  return responses.StreamingResponse(body(), media_type="text/event-stream")


async def _completion_response(streams, request_id, name, n, tokenizer) -> dict:
  choices, prompt_tokens, completion_tokens = [], 0, 0
  async for i, out in _merge(streams):
    prompt_tokens += len(out.prompt_token_ids)
    for c in out.outputs:
      completion_tokens += len(c.token_ids)
      choices.append({"index": i * n + c.index, "text": c.text,
                      "logprobs": _text_logprobs(c, tokenizer, 0),
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
      _raise_failed(out)
  choices.sort(key=lambda c: c["index"])
  return {"id": request_id, "object": "text_completion", "created": int(time.time()),
          "model": name, "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}


async def _completion_stream(streams, request_id, name, body, tokenizer):
  created = int(time.time())
  prompt_tokens, completion_tokens, offsets = {}, 0, {}
  async for i, out in _merge(streams):
    prompt_tokens[i] = len(out.prompt_token_ids)
    for c in out.outputs:
      index = i * body.n + c.index
      completion_tokens += len(c.token_ids)
      logprobs = _text_logprobs(c, tokenizer, offsets.get(index, 0))
      offsets[index] = offsets.get(index, 0) + len(c.text)
      yield {"id": request_id, "object": "text_completion", "created": created,
             "model": name, "choices": [{"index": index, "text": c.text, "logprobs": logprobs,
                                         "finish_reason": c.finish_reason,
                                         "stop_reason": c.stop_reason}]}
  if body.stream_options is not None and body.stream_options.include_usage:
    yield {"id": request_id, "object": "text_completion", "created": created, "model": name,
           "choices": [], "usage": _usage(sum(prompt_tokens.values()), completion_tokens)}


async def _chat_response(streams, request_id, name, tokenizer, num_top) -> dict:
  outputs = [out async for _, out in _merge(streams)]  # (FINAL_ONLY: the finished one)
  out = outputs[-1]
  _raise_failed(out)
  choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
              "logprobs": _chat_logprobs(c, tokenizer, num_top),
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
             for c in out.outputs]
  return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
          "model": name, "choices": choices,
          "usage": _usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}


async def _chat_stream(streams, request_id, name, body, tokenizer, num_top):
  created = int(time.time())
  chunk = lambda choices: {"id": request_id, "object": "chat.completion.chunk",
                           "created": created, "model": name, "choices": choices}
  yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None} for i in range(body.n)])
  prompt_tokens, completion_tokens = 0, 0
  async for _, out in _merge(streams):
    prompt_tokens = len(out.prompt_token_ids)
    for c in out.outputs:
      completion_tokens += len(c.token_ids)
      yield chunk([{"index": c.index, "delta": {"content": c.text} if c.text else {},
                    "logprobs": _chat_logprobs(c, tokenizer, num_top),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
  if body.stream_options is not None and body.stream_options.include_usage:
    yield {**chunk([]), "usage": _usage(prompt_tokens, completion_tokens)}


def _raise_failed(out: RequestOutput) -> None:
  if out is not None and out.error is not None:
    raise APIError(500, f"the request failed in the engine: {out.error}", None,
                   "InternalServerError")

"""What the OpenAI server admits: keys, body sizes, request limits, queue room, time.

`ServerLimits` is what one request may ask for and how much the server takes at once
(serve's "limits" flags). `install_gate` runs before every route: the API key (401), the
body's size (413, counted as it arrives when chunked) and the server's state (503 while
the engine is not running or the server drains: `app.state.draining`, which serve sets
on SIGTERM). The routes then call `check_request` (a request's own limits, 400 naming
the field; 429 when too many streams are open), `check_queue` (429 when the engine's
queue is full) and `within_timeout` (408). Every refusal comes before anything of the
request reaches the engine, so other requests are not affected. `unless_disconnected`
aborts a whole-answer (non-streamed) request whose client has gone (vLLM's
`with_cancellation`); a stream's disconnect ends its response (openai_streaming.sse).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import fastapi

from hisparse_jax.entrypoints.async_engine import AsyncEngine
from hisparse_jax.entrypoints.openai_auth import ApiKeys
from hisparse_jax.entrypoints.openai_errors import APIError, error_response


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


def install_gate(app: fastapi.FastAPI, engine: AsyncEngine, limits: ServerLimits,
                 api_keys: ApiKeys | None) -> None:
  """The middleware every request passes first: one of `api_keys` on the guarded routes
  (/v1/*, /tokenize, /detokenize, the dashboard; its key salt then in
  `request.state.key_salt`), then a POST body's size, then 503 unless the engine runs and
  the server is not draining (/metrics and the dashboard still answer).

  A plain ASGI middleware (as vLLM's), not starlette's BaseHTTPMiddleware: that one
  passes every message of a response through a memory stream to a task of its own, so a
  route's `send` can wait there, and a client's disconnect then lands in that `send`.
  A chunked body read here is replayed to the route as one message."""

  async def gate(request: fastapi.Request) -> tuple[fastapi.Response | None, bytes | None]:
    """(the refusal, or None; a chunked body read here, or None)."""
    path = request.url.path
    dashboard = path.rstrip("/") in ("/dashboard", "/dashboard/data")
    guarded = path.startswith("/v1") or path in ("/tokenize", "/detokenize") or dashboard
    if api_keys is not None and guarded:
      key_salt = api_keys.bearer_salt(request.headers.get("authorization"))
      if key_salt is None and dashboard:
        # The dashboard also takes ?token=KEY: a browser opening the page cannot send the
        # header; the page then sends it as the header to /dashboard/data.
        key_salt = api_keys.key_salt(request.query_params.get("token"))
      if key_salt is None:
        return error_response(401, "invalid or missing API key (Authorization: Bearer KEY)",
                              None, "AuthenticationError"), None
      request.state.key_salt = key_salt  # (the routes' cache salt under --cache_salt_by_api_key)
    body = None
    if request.method == "POST":  # the body's size, before anything reads it
      declared = request.headers.get("content-length")
      if declared is not None and (not declared.isdigit()
                                   or int(declared) > limits.max_request_bytes):
        return error_response(413, f"the request body is {declared} bytes; at most "
                              f"{limits.max_request_bytes} (--max_request_bytes)", None,
                              "RequestTooLargeError"), None
      if declared is None:  # chunked: counted as it arrives (and replayed to the route)
        chunks, size = [], 0
        async for chunk in request.stream():
          size += len(chunk)
          if size > limits.max_request_bytes:
            return error_response(413, f"the request body is over "
                                  f"{limits.max_request_bytes} bytes (--max_request_bytes)",
                                  None, "RequestTooLargeError"), None
          chunks.append(chunk)
        body = b"".join(chunks)
    if (path != "/metrics" and not dashboard
        and (app.state.draining or not engine.is_running)):
      message = ("the server is shutting down" if app.state.draining
                 else "the engine is not running")
      return error_response(503, message, None, "ServiceUnavailableError"), None
    return None, body

  def middleware(inner):
    async def asgi(scope, receive, send):
      if scope["type"] != "http":
        await inner(scope, receive, send)
        return
      refusal, body = await gate(fastapi.Request(scope, receive))
      if refusal is not None:
        await refusal(scope, receive, send)
        return
      if body is not None:  # the chunked body read above, then the client's own messages
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
          return pending.pop() if pending else await receive()

        await inner(scope, replay, send)
        return
      await inner(scope, receive, send)
    return asgi

  app.add_middleware(middleware)


def check_request(body, prompts: list[dict], max_tokens: int | None,
                  logprobs: int | None, logprobs_field: str, param: str,
                  max_tokens_field: str = "max_tokens", *, limits: ServerLimits,
                  tokenizer, max_num_seqs: int, max_model_len: int,
                  num_streams: int) -> None:
  """The request's limits (ServerLimits) and its length against max_model_len, with the
  prompts tokenized here (text prompts get their ids, which the engine then uses).
  `body`: a completions or chat request (openai_protocol.SamplingFields); `param` /
  `logprobs_field` / `max_tokens_field`: its own names of the prompt, logprobs and
  max_tokens fields; `num_streams`: streaming responses open now."""
  if body.n > max_num_seqs:
    raise APIError(400, f"n={body.n} exceeds max_num_seqs={max_num_seqs} (the n sequences of "
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
  if body.stream and num_streams >= limits.max_concurrent_streams:
    raise APIError(429, f"the server is full: {num_streams} streams open "
                   f"(--max_concurrent_streams={limits.max_concurrent_streams}); retry "
                   "later", None, "RateLimitError", {"Retry-After": str(limits.retry_after_s)})


def check_queue(limits: ServerLimits, waiting: int, num_new: int) -> None:
  """429 when `num_new` more engine requests would put more than max_waiting_requests
  in the queue (`waiting`: those queued or being added now)."""
  if waiting + num_new > limits.max_waiting_requests:
    raise APIError(429, f"the server is full: {waiting} requests waiting "
                   f"(--max_waiting_requests={limits.max_waiting_requests}); retry later",
                   None, "RateLimitError", {"Retry-After": str(limits.retry_after_s)})


async def within_timeout(awaitable, timeout_s: float):
  """`awaitable`'s result; past `timeout_s` it is cancelled (which aborts its requests)
  and the request answers 408."""
  try:
    return await asyncio.wait_for(awaitable, timeout_s)
  except asyncio.TimeoutError:
    raise APIError(408, f"the request ran past {timeout_s:g} s "
                   "(--request_timeout_s) and was aborted", None, "TimeoutError") from None


async def unless_disconnected(request: fastapi.Request, awaitable):
  """`awaitable`'s result; if the client disconnects first, `awaitable` is cancelled
  (which closes its request streams: the requests are aborted, their blocks freed) and
  the answer is an empty 499 (nginx's "client closed request"; nobody reads it)."""
  task = asyncio.ensure_future(awaitable)

  async def disconnect():
    while (await request.receive())["type"] != "http.disconnect":
      pass  # (the body was read before the route ran: nothing else comes)

  watcher = asyncio.ensure_future(disconnect())
  try:
    await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
  finally:  # (also when this handler itself is cancelled)
    watcher.cancel()
    if not task.done():
      task.cancel()
    await asyncio.gather(task, watcher, return_exceptions=True)
  if task.cancelled():
    return fastapi.responses.Response(status_code=499)
  return task.result()

"""From the engine's request streams to the OpenAI server's answers: JSON, or SSE.

A request's prompts run as engine requests, one `RequestStream` each; `_merge` reads
them as they come and closes every one however the reading ends, which aborts a
request still running (a client that left). The builders below turn the outputs into
OpenAI's bodies: `completion_response` / `chat_response` the whole answer as one dict
(the outputs come FINAL_ONLY), `completion_stream` / `chat_stream` one chunk per step
(DELTA outputs), which `sse` sends as server-sent events ("data: {chunk}", then
"data: [DONE]"; a timeout or a dead engine ends the stream with an error event). `sse`
closes the request streams itself when its response ends: a response cancelled in the
middle of a `send` never resumes its body, so `_merge`'s own closing would wait for GC.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import responses

from hisparse_jax.engine.request import CompletionOutput, RequestOutput
from hisparse_jax.entrypoints.async_engine import RequestStream, StreamOverflowError
from hisparse_jax.entrypoints.openai_errors import APIError


def sse(events: AsyncIterator[dict], streams: Sequence[RequestStream],
        timeout_s: float = math.inf, on_close=None) -> responses.StreamingResponse:
  """Server-sent events of `events`, which reads `streams`. A client that disconnects
  cancels this body: its request streams are closed, which aborts their requests. Past
  `timeout_s` the stream ends with an error event (its requests aborted). `on_close`:
  called once when the response ends, however it ends."""
  closed = False

  def close() -> None:
    nonlocal closed
    if not closed:
      closed = True
      for stream in streams:
        stream.close()
      if on_close is not None:
        on_close()

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
      close()
      await events.aclose()
  return _EventStream(body(), close)


class _EventStream(responses.StreamingResponse):
  """A StreamingResponse that runs `close` (synchronous) when it ends. A response
  cancelled by its client's disconnect while it waits in `send` (behind a middleware's
  stream, say) leaves its body generator suspended at a `yield`: starlette does not close
  it, so its `finally` would run only when the garbage collector finds it, and its
  requests would run on, maybe to the end (`finish_reason` length, not abort)."""

  def __init__(self, body, close):
    super().__init__(body, media_type="text/event-stream")
    self._close = close

  async def __call__(self, scope, receive, send) -> None:
    try:
      await super().__call__(scope, receive, send)
    finally:
      self._close()


async def completion_response(streams, request_id, name, n, tokenizer) -> dict:
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


async def completion_stream(streams, request_id, name, body, tokenizer):
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


async def chat_response(streams, request_id, name, tokenizer, num_top) -> dict:
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


async def chat_stream(streams, request_id, name, body, tokenizer, num_top):
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

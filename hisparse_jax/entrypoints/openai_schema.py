"""The OpenAI server's GET /openapi.json: every route, its bodies, and each answer it gives.

FastAPI writes the schema from the routes and the models of openai_protocol.py; this
module adds what it cannot know: each route's error statuses in the error shape
(`route_responses`, given to the route decorators), a stream's events
("text/event-stream", one event's data a chunk as JSON or "[DONE]"), this deployment's
limits (token ids in the vocabulary, n up to max_num_seqs, ...: `_deployment_limits`)
and, with API keys, the bearer scheme. tests/hisparse_jax/entrypoints/test_fuzz.py fuzzes
the server against it (schemathesis), so each statement here is one the server keeps.
"""

from __future__ import annotations

import fastapi
import pydantic
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from hisparse_jax.entrypoints.openai_errors import ErrorResponse
from hisparse_jax.entrypoints.openai_limits import ServerLimits
from hisparse_jax.entrypoints.openai_protocol import ChatCompletionChunk, CompletionChunk

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


def route_responses(*statuses: int, ok: type[pydantic.BaseModel] | None = None,
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


def openapi_schema(app: fastapi.FastAPI, *, keyed: bool, limits: ServerLimits,
                   vocab_size: int, max_num_seqs: int, max_model_len: int) -> dict:
  """FastAPI's schema less its 422s (a bad body is a 400 here, in the error shape), every
  error as JSON, this server's limits (_deployment_limits), and with a key (`keyed`), the
  key as the guarded routes' security (the header, or ?token= for the dashboard's).
  Built once, then kept in `app.openapi_schema` (FastAPI's cache)."""
  if app.openapi_schema is None:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in schema["paths"].items():
      for operation in operations.values():
        operation["responses"].pop("422", None)
        for status, response in operation["responses"].items():
          if status != "200":  # (JSON whatever the route's own media type: the page's)
            response["content"] = error
        if keyed and "401" in operation["responses"]:
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
    _deployment_limits(components["schemas"], limits, vocab_size=vocab_size,
                       max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    if keyed:
      components["securitySchemes"] = {
          "bearer": {"type": "http", "scheme": "bearer"},
          "token": {"type": "apiKey", "in": "query", "name": "token"}}
    app.openapi_schema = schema
  return app.openapi_schema


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

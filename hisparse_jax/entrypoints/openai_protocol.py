"""The OpenAI API's bodies: request models, response models, and a request -> engine input.

The request models name OpenAI's fields, then vLLM's extras (top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, cache_salt). A field's range is stated in the schema but checked by
`SamplingParams`, whose message names the field (one rule for every front end); a bad
value is an `APIError` 400 naming the request's own field. The response models are
for the OpenAPI schema only: the routes return dicts (openai_streaming.py builds them).
"""

from __future__ import annotations

from typing import Any

import pydantic

from hisparse_jax.engine.sampling import RequestOutputKind, SamplingParams
from hisparse_jax.entrypoints.openai_errors import APIError

# SamplingParams fields a request may set by vLLM's names (beyond the OpenAI ones).
EXTRA_FIELDS = ("top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos",
                "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")


class StreamOptions(pydantic.BaseModel):
  include_usage: bool = False


def _limits(default: Any = None, **bounds) -> Any:
  """A field whose range the schema states (JSON Schema's minimum, maximum, ...) but
  pydantic does not check: `SamplingParams` does, with its own message naming the field
  (one rule for every front end)."""
  return pydantic.Field(default, json_schema_extra=bounds)


class SamplingFields(pydantic.BaseModel):
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


class CompletionRequest(SamplingFields):
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


class ChatRequest(SamplingFields):
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


def render_chat(tokenizer, messages, add_generation_prompt, chat_template=None,
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


def completion_prompts(prompt) -> list[dict]:
  """The request's prompts as engine arguments: text, or token ids (OpenAI's forms)."""
  if isinstance(prompt, str):
    return [dict(prompt=prompt)]
  if not prompt:
    raise APIError(400, "prompt is empty", "prompt")
  if all(isinstance(p, int) for p in prompt):
    return [dict(prompt_token_ids=prompt)]
  return [dict(prompt=p) if isinstance(p, str) else dict(prompt_token_ids=p) for p in prompt]

"""`LLM`: batch generation over the engine, the library API familiar to vLLM users.

    llm = LLM(device_kv_gib=0.01, host_pool_gib=0.1, max_model_len=1152)  # logs capacity
    outputs = llm.generate(["bafu: bapo\\n? bafu:"], SamplingParams(max_tokens=4))
    outputs[0].outputs[0].text, outputs[0].outputs[0].finish_reason, llm.metrics()

Owns the loop a batch call needs on top of `Engine` (add every prompt, step until each
of them finished, hand the outputs back in input order) and what a user watches during
it: a tqdm progress bar on stderr and the periodic status line
(`hisparse_jax.observability.status`).
Serving stacks that need streaming use `llm.engine` (the lower-level `Engine`) directly.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.request import RequestOutput
from hisparse_jax.engine.sampling import RequestOutputKind, SamplingParams
from hisparse_jax.kv_cache.capacity import CapacityReport
from hisparse_jax.observability.status import StatusLogger
from hisparse_jax.sparse.config import HiSparseConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# Steps in a row that neither scheduled a token nor returned an output before `generate`
# gives up on a stuck engine (a healthy run never gets close).
MAX_IDLE_STEPS = 1000


class PromptError(ValueError):
  """A prompt of a `generate` call was refused; `index` is its position in the call."""

  def __init__(self, index: int, message: str):
    super().__init__(f"prompt {index}: {message}")
    self.index = index
    self.reason = message


def _prompt_kwargs(item: Any) -> dict[str, Any]:
  """`add_request` keyword arguments of one prompt item, as vLLM takes them: a string,
  a TextPrompt `{"prompt": str}` or a TokensPrompt `{"prompt_token_ids": [...]}`, either
  dict with an optional `"cache_salt": str` (checked by `add_request`)."""
  if isinstance(item, str):
    return {"prompt": item}
  if (isinstance(item, dict) and "prompt" in item and set(item) <= {"prompt", "cache_salt"}
      and isinstance(item["prompt"], str)):
    return dict(item)
  if isinstance(item, dict) and "prompt_token_ids" in item and set(item) <= {
      "prompt_token_ids", "prompt", "cache_salt"}:  # (a text beside the ids: reported only)
    return dict(item)
  raise ValueError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [...]} "
                   f"(each dict with an optional 'cache_salt': str), got {item!r:.80}")


class LLM:
  """An engine plus the batch `generate` loop.

  Invariant: when `generate` returns or raises, none of the requests it added is still
  in the engine (each finished, or was aborted on the way out).
  """

  def __init__(self, model: str | None = None, *, dtype: str = _DEFAULTS["dtype"],
               block_size: int | None = _DEFAULTS["block_size"],
               device_kv_gib: float | None = _DEFAULTS["device_kv_gib"],
               host_pool_gib: float = _DEFAULTS["host_pool_gib"],
               max_model_len: int = _DEFAULTS["max_model_len"],
               max_num_seqs: int = _DEFAULTS["max_num_seqs"],
               hisparse: HiSparseConfig | None = None, log_every_steps: int = 0,
               **engine_kwargs: Any):
    """Loads the model, allocates both KV pools and logs their capacity.

    Args:
      model: an HF-layout checkpoint directory; None is the embedded hisparse-tiny.
      hisparse: a `HiSparseConfig`: top-k sparse decoding of long sequences (None: dense).
      log_every_steps: log a status line every this many engine steps (0: never).
      **engine_kwargs: any other `EngineConfig` field (max_num_batched_tokens, seed,
        enable_chunked_prefill, enable_prefix_caching, kernel_backend,
        tensor_parallel_size: one engine over a mesh of that many devices, as vLLM's).
    """
    unknown = sorted(set(engine_kwargs) - set(_DEFAULTS))
    if unknown:
      raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
    if log_every_steps < 0:
      raise ValueError(f"log_every_steps must be >= 0, got {log_every_steps}")
    self.config = EngineConfig(model=model, dtype=dtype, block_size=block_size,
                               device_kv_gib=device_kv_gib, host_pool_gib=host_pool_gib,
                               max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                               hisparse=hisparse, **engine_kwargs)
    self.engine = Engine(self.config)
    self.config = self.engine.config  # with the block size resolved
    self.log_every_steps = log_every_steps
    self._request_ids = itertools.count()

  @property
  def capacity(self) -> CapacityReport:
    """KV capacity per memory kind, measured on the allocated pools."""
    return self.engine.capacity

  @property
  def tokenizer(self):
    return self.engine.tokenizer

  def get_tokenizer(self):
    """The checkpoint's tokenizer (`models.tokenizer.Tokenizer`: encode / decode), as
    vLLM's `LLM.get_tokenizer()`; None for a checkpoint without one."""
    return self.engine.tokenizer

  def close(self) -> None:
    """Finishes the third KV tier's pending stores and releases its files and
    connections (`Engine.close`); idempotent. Without a third tier there is nothing to
    release."""
    self.engine.close()

  def __enter__(self) -> LLM:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def metrics(self) -> dict[str, float]:
    """All engine metrics as a flat dict (`name{label="x"}` keys, histogram p50/p99)."""
    return self.engine.metrics()

  def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
           sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
           use_tqdm: bool = True, chat_template: str | None = None,
           add_generation_prompt: bool = True,
           chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
    """Generates a reply to each conversation (vLLM's `LLM.chat`): `messages` is one
    conversation (a list of {"role", "content"} dicts) or a list of them. Each is
    rendered by the checkpoint's chat template (or `chat_template`), tokenized without
    adding special tokens again, and generated as `generate` does; a RequestOutput's
    `prompt` is the rendered text. A conversation the template refuses raises
    `PromptError` naming its index."""
    import jinja2  # noqa: PLC0415 (chat only)

    tokenizer = self.engine.tokenizer
    if tokenizer is None:
      raise ValueError("chat: this model has no tokenizer")
    messages = list(messages)
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    items = []
    for i, conversation in enumerate(conversations):
      try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {}))
      except (jinja2.TemplateError, TypeError, KeyError) as e:
        raise PromptError(i, f"chat template: {e}") from e
      items.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
                    "prompt": text})
    return self.generate(items, sampling_params, use_tqdm=use_tqdm)

  def generate(self, prompts: str | Sequence[str] | None = None,
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
               use_tqdm: bool = True) -> list[RequestOutput]:
    """Generates for every prompt; returns their final outputs in input order.

    Give `prompts` (text; an item may also be `{"prompt": str}` or
    `{"prompt_token_ids": [...]}`, as in vLLM) or `prompt_token_ids` (one list of ids,
    or a list of them). `sampling_params` is one `SamplingParams` for all prompts or one
    per prompt (None: the defaults, vLLM's: temperature 1.0, 16 tokens). A bad prompt
    raises `PromptError` (a ValueError) naming its index; nothing of that call stays
    queued.
    """
    if (prompts is None) == (prompt_token_ids is None):
      raise ValueError("give exactly one of prompts and prompt_token_ids")
    if prompts is not None:
      items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    else:
      ids = list(prompt_token_ids)
      if ids and isinstance(ids[0], (int, np.integer)):  # one prompt: a list of ids
        ids = [ids]
      items = [{"prompt_token_ids": x} for x in ids]
    params = self._params_per_prompt(sampling_params, len(items))
    request_ids: list[str] = []
    try:
      for i, (item, sp) in enumerate(zip(items, params)):
        request_id = f"llm-{next(self._request_ids)}"
        try:
          self.engine.add_request(request_id, sampling_params=sp, **_prompt_kwargs(item))
        except ValueError as e:
          raise PromptError(i, str(e)) from e
        request_ids.append(request_id)
      results = self._run(request_ids, use_tqdm)
    finally:  # an error (or Ctrl-C) leaves nothing of this call in the engine
      for request_id in request_ids:
        self.engine.abort_request(request_id)
    return [results[r] for r in request_ids]

  @staticmethod
  def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
      sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
      params = [sampling_params] * num_prompts
    else:
      params = list(sampling_params)
    if len(params) != num_prompts:
      raise ValueError(f"sampling_params: {len(params)} given for {num_prompts} prompts")
    for i, sp in enumerate(params):
      if not isinstance(sp, SamplingParams):
        raise ValueError(f"sampling_params[{i}] is a {type(sp).__name__}, "
                         "not a SamplingParams")
    # generate hands back whole outputs, whatever a params object asks to stream.
    return [sp if sp.output_kind is RequestOutputKind.CUMULATIVE
            else dataclasses.replace(sp, output_kind=RequestOutputKind.CUMULATIVE)
            for sp in params]

  def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
    """Steps the engine until every request of `request_ids` finished."""
    pending = set(request_ids)
    results: dict[str, RequestOutput] = {}
    status = StatusLogger(self.engine, self.log_every_steps)
    num_generated, start, idle = 0, time.perf_counter(), 0
    seen: dict[str, int] = {}  # output tokens of each request so far
    # disable=None: tqdm turns itself off when stderr is not a terminal.
    with tqdm(total=len(request_ids), desc="Generating", unit="req", file=sys.stderr,
              disable=None if use_tqdm else True, dynamic_ncols=True) as bar:
      while pending:
        outputs = self.engine.step()
        # (a step that waited on a third-tier load is not idle: the load is progress)
        loading = self.engine.tier is not None and self.engine.tier.num_loading
        idle = 0 if outputs or self.engine.last_step_num_tokens or loading else idle + 1
        if idle > MAX_IDLE_STEPS:
          raise RuntimeError(f"the engine made no progress in {MAX_IDLE_STEPS} steps with "
                             f"{len(pending)} requests unfinished")
        for out in outputs:
          if out.request_id not in pending:
            continue
          num_tokens = sum(len(c.token_ids) for c in out.outputs)
          num_generated += num_tokens - seen.get(out.request_id, 0)
          seen[out.request_id] = num_tokens
          if out.finished:
            pending.discard(out.request_id)
            results[out.request_id] = out
            bar.update(1)
        status.maybe_log()
        elapsed = time.perf_counter() - start
        if not bar.disable and elapsed > 0:
          bar.set_postfix_str(f"{num_generated / elapsed:.1f} generated tokens/s",
                              refresh=False)
    return results

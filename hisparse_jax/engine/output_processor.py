"""What a step's sampled tokens become: the request's text, its stop, its outputs.

`OutputProcessor` turns each token the host reads back into the request's state (its
output ids and text, logprobs, whether it stops) and builds the `RequestOutput`s a step
hands out, as each request's `output_kind` asks (vLLM's shapes and rules):

    token -> output_token_ids (+ logprobs) -> detokenize the new token only (DecodeStream)
          -> stop token / EOS (after min_tokens) | stop string (across token boundaries)
          | max_tokens / max_model_len  ->  finish reason (the engine finishes it)
    requests that advanced or finished -> RequestOutput (CUMULATIVE / DELTA / FINAL_ONLY;
          n > 1: one output per request with a CompletionOutput per sequence)

It owns no state across steps: what it reads and writes lives in each `Request` (its
output, text, logprobs and how much of them was handed out).
"""

from __future__ import annotations

import functools
from collections.abc import Collection

from hisparse_jax.engine.request import (
    CompletionOutput,
    Logprob,
    Request,
    RequestMetrics,
    RequestOutput,
    SequenceGroup,
)
from hisparse_jax.engine.sampling import RequestOutputKind


class OutputProcessor:
  """Per-token postprocessing and RequestOutput building for an engine."""

  def __init__(self, tokenizer, eos_token_ids: Collection[int], max_model_len: int):
    self.tokenizer = tokenizer  # models.tokenizer.Tokenizer, or None (ids only)
    self.eos_token_ids = eos_token_ids
    self.max_model_len = max_model_len

  # --- One token -----------------------------------------------------------------

  def append_token(self, request: Request, token: int, logprobs=None) -> str | None:
    """Appends a sampled token to the request's output (and its text and logprobs);
    returns the finish reason it reaches ("stop", "length") or None.

    As vLLM: stop tokens and EOS end an output of at least min_tokens tokens (the
    sampler keeps them out of the first min_tokens) and their text is left out unless
    include_stop_str_in_output; stop strings end an output of more than min_tokens."""
    output = request.output_token_ids
    position = len(request.prompt_token_ids) + len(output)
    output.append(token)
    sp = request.sampling_params
    if logprobs is not None:
      self._add_logprobs(request, token, logprobs)
    stop_token = len(output) >= sp.min_tokens and (
        token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids))
    if request.detokenizer is not None and (not stop_token or sp.include_stop_str_in_output):
      before = len(request.output_text)
      request.output_text += request.detokenizer.step(token)
      if (sp.stop and not stop_token and len(output) > sp.min_tokens
          and self._stop_string(request, before)):
        return "stop"
    if stop_token:
      request.stop_reason = token if token in sp.stop_token_ids else None
      return "stop"
    if ((sp.max_tokens is not None and len(output) >= sp.max_tokens)
        or position + 1 >= self.max_model_len):
      return "length"
    return None

  @staticmethod
  def _stop_string(request: Request, before: int) -> bool:
    """Whether the request's text, which had `before` characters before this token, now
    contains a stop string; if so the text ends before the earliest one (after it with
    include_stop_str_in_output) and stop_reason is that string. Only the new text and
    the longest stop string's length before it are searched."""
    sp = request.sampling_params
    text = request.output_text
    start = max(0, before - max(len(s) for s in sp.stop) + 1)
    found = [(i, s) for s in sp.stop if (i := text.find(s, start)) >= 0]
    if not found:
      return False
    at, stop = min(found)
    request.output_text = text[:at + len(stop) if sp.include_stop_str_in_output else at]
    request.stop_reason = stop
    return True

  def _decoder(self, request: Request):
    """A token id's text for Logprob.decoded_token (None: the request has no text)."""
    if self.tokenizer is None or not request.sampling_params.detokenize:
      return None
    return functools.partial(self.tokenizer.decode,
                             skip_special_tokens=request.sampling_params.skip_special_tokens)

  @staticmethod
  def _position_logprobs(token: int, logprob: float, rank: int, top_ids, top_lps,
                         num_top: int, decode) -> dict[int, Logprob]:
    """{token id: Logprob} of one position: the top `num_top` and `token` itself."""
    position = {}
    for r, (t, lp) in enumerate(zip(top_ids[:num_top].tolist(), top_lps[:num_top].tolist())):
      position[t] = Logprob(lp, r + 1, decode([t]) if decode else None)
    if token not in position:
      position[token] = Logprob(float(logprob), int(rank), decode([token]) if decode else None)
    return position

  def _add_logprobs(self, request: Request, token: int, logprobs) -> None:
    """Appends this token's position to the request's logprobs: the sampled token and
    the top `SamplingParams.logprobs` tokens, each a `Logprob` (vLLM's shape)."""
    sampled, rank, top_ids, top_lps = logprobs
    request.logprobs.append(self._position_logprobs(
        token, sampled, rank, top_ids, top_lps, request.sampling_params.logprobs,
        self._decoder(request)))
    request.cumulative_logprob += float(sampled)

  def add_prompt_logprobs(self, request: Request, position: int, logprobs) -> None:
    """Records the prompt logprobs a step computed for prompt positions `position`
    onwards (the logprob of each prompt token given those before it)."""
    lps, ranks, top_ids, top_lps = logprobs
    decode = self._decoder(request)
    num_top = request.sampling_params.prompt_logprobs
    prompt = request.prompt_token_ids
    for j in range(len(lps)):
      if position + j != len(request.prompt_logprobs):
        continue  # (computed before, by a step that was then recomputed)
      request.prompt_logprobs.append(self._position_logprobs(
          prompt[position + j], lps[j], ranks[j], top_ids[j], top_lps[j], num_top, decode))

  # --- Outputs -------------------------------------------------------------------

  def outputs(self, requests: list[Request]) -> list[RequestOutput]:
    """The outputs of the requests that advanced or finished in a step, in that order;
    the sequences of a request with n > 1 make one output where the first of them is."""
    result, groups = [], {}
    for request in requests:
      if request.group is None:
        output = self._output(request)
        if output is not None:
          result.append(output)
        continue
      seqs = groups.get(id(request.group))
      if seqs is None:
        seqs = groups[id(request.group)] = []
        result.append(request.group)
      seqs.append(request)
    if groups:
      result = [self._group_output(x, groups[id(x)]) if isinstance(x, SequenceGroup) else x
                for x in result]
      result = [o for o in result if o is not None]
    return result

  def _output(self, request: Request) -> RequestOutput | None:
    """The request's output as its `output_kind` streams it (None: nothing to hand out
    now, a FINAL_ONLY request still running)."""
    kind = request.sampling_params.output_kind
    finished = request.is_finished
    if kind is RequestOutputKind.FINAL_ONLY and not finished:
      return None
    ttft = (request.first_token_time - request.arrival_time
            if request.first_token_time is not None else None)
    decode_tps = None
    if request.first_token_time is not None and len(request.output_token_ids) > 1:
      span = request.last_token_time - request.first_token_time
      decode_tps = (len(request.output_token_ids) - 1) / span if span > 0 else None
    metrics = RequestMetrics(
        arrival_time=request.arrival_time, first_token_time=request.first_token_time,
        last_token_time=request.last_token_time, time_to_first_token_s=ttft,
        decode_tokens_per_s=decode_tps, blocks_selected=request.blocks_selected,
        num_preemptions=request.num_preemptions)
    return RequestOutput(
        request_id=request.request_id, prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids, outputs=[self._completion(request)],
        finished=finished, metrics=metrics, num_cached_tokens=request.num_cached_tokens,
        error=request.error, prompt_logprobs=self._prompt_logprobs(request))

  def _group_output(self, group: SequenceGroup, seqs: list[Request]) -> RequestOutput | None:
    """The output of a request with n > 1 whose sequences `seqs` advanced or finished:
    under DELTA their completions, otherwise all n (FINAL_ONLY: once all finished).
    Metrics: the earliest first token, the latest last one, decode tokens/s over all
    sequences, blocks and preemptions summed."""
    first = group.seqs[0]
    kind = first.sampling_params.output_kind
    finished = group.finished
    if kind is RequestOutputKind.FINAL_ONLY and not finished:
      return None
    if kind is not RequestOutputKind.DELTA:
      seqs = group.seqs
    completions = [self._completion(s) for s in sorted(seqs, key=lambda s: s.index)]
    started = [s for s in group.seqs if s.first_token_time is not None]
    first_time = min((s.first_token_time for s in started), default=None)
    last_time = max((s.last_token_time for s in started), default=None)
    decode_tps = None
    if started and last_time > first_time:
      decode_tps = sum(len(s.output_token_ids) - 1 for s in started) / (last_time - first_time)
    blocks = {k: sum(s.blocks_selected[k] for s in group.seqs) for k in first.blocks_selected}
    metrics = RequestMetrics(
        arrival_time=first.arrival_time, first_token_time=first_time,
        last_token_time=last_time,
        time_to_first_token_s=first_time - first.arrival_time if started else None,
        decode_tokens_per_s=decode_tps, blocks_selected=blocks,
        num_preemptions=sum(s.num_preemptions for s in group.seqs))
    return RequestOutput(
        request_id=group.request_id, prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids, outputs=completions, finished=finished,
        metrics=metrics, num_cached_tokens=first.num_cached_tokens,
        error=next((s.error for s in group.seqs if s.error), None),
        prompt_logprobs=self._prompt_logprobs(first))

  def _prompt_logprobs(self, request: Request) -> list | None:
    """The prompt's logprobs once computed (under DELTA in the first output only)."""
    if request.sampling_params.prompt_logprobs is None:
      return None
    if len(request.prompt_logprobs) < request.num_prompt_tokens:
      return None  # not computed (yet: the prefill is under way, or failed)
    if request.sampling_params.output_kind is RequestOutputKind.DELTA:
      if request.prompt_logprobs_reported:
        return None
      request.prompt_logprobs_reported = True
    return request.prompt_logprobs

  def _completion(self, request: Request) -> CompletionOutput:
    """One sequence's completion as its `output_kind` streams it (DELTA: what is new
    since the last one handed out)."""
    kind = request.sampling_params.output_kind
    finished = request.is_finished
    text = request.output_text
    hold = request.sampling_params.stop_hold_back
    if hold and not finished:  # what may still turn out to start a stop string
      text = text[:max(0, len(text) - hold)]
    token_ids = request.output_token_ids
    if kind is RequestOutputKind.DELTA:
      token_ids = token_ids[request.num_output_tokens_reported:]
      text = text[request.num_text_reported:]
      request.num_output_tokens_reported = len(request.output_token_ids)
      request.num_text_reported += len(text)
    elif finished:  # the request is done with them: a copy per request, once
      token_ids = list(token_ids)
    logprobs = cumulative = None
    if request.sampling_params.logprobs is not None:
      cumulative = request.cumulative_logprob
      logprobs = request.logprobs[len(request.logprobs) - len(token_ids):]
    return CompletionOutput(
        index=request.index, text=text, token_ids=token_ids, cumulative_logprob=cumulative,
        logprobs=logprobs, finish_reason=request.finish_reason,
        stop_reason=request.stop_reason)

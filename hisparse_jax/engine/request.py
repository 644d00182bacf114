"""One request's life in the engine, and what the engine hands back for it.

    add_request -> WAITING --admit--> RUNNING <--swap in/out--> SWAPPED
                                        |  (preempted: blocks moved to the host pool)
                                        v
                       FINISHED (stop | length | abort | error)

`num_computed_tokens` counts the tokens whose K/V are in the cache once the steps
scheduled so far have run (the scheduler advances it when it schedules a chunk). A
running request computes its prompt (in chunks), then one token per step: the token
sampled in step t has its K/V computed in step t + 1.

Steps overlap (Engine.step dispatches step t + 1 before it reads step t's tokens), so
a request may have one sampled token not known on the host yet: `num_inflight` (0 or 1)
counts it. `num_tokens` includes it (positions and block slots are planned with it);
`output_token_ids` holds only the known tokens, and step t + 1 takes the pending one
from step t's output on the device (row `inflight_row` of that step).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence

from hisparse_jax.engine.sampling import SamplingParams


def check_prompt(token_ids: Sequence[int], *, vocab_size: int, max_model_len: int,
                 text: str | None = None) -> list[int]:
  """The prompt's token ids as ints, or ValueError naming the field the engine refuses.

  One rule for every front end (`Engine.add_request`, the CLI's check of a prompts file
  before it loads the model), so they refuse the same prompts with the same message:
  `text` (when the prompt was text) and the ids must be non-empty (a tokenizer that adds
  BOS turns "" into one token, still an empty prompt); every id is in the vocabulary;
  the prompt leaves room for at least one output token within `max_model_len`.
  """
  ids = [int(t) for t in token_ids]
  if not ids or (text is not None and not text):
    raise ValueError("prompt is empty")
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"prompt_token_ids: token id {bad[0]} is outside the vocabulary "
                     f"[0, {vocab_size})")
  if len(ids) >= max_model_len:
    raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={max_model_len} leaves "
                     "no room for an output token")
  return ids

def check_sampling(params, *, vocab_size: int, has_tokenizer: bool, max_num_seqs: int,
                   prompt_len: int, device_tokens: int) -> None:
  """ValueError naming the field when an engine cannot run `params` (a SamplingParams)
  for a prompt of `prompt_len` tokens: stop ids outside the vocabulary, stop strings
  without a tokenizer, more sequences (n) than seats, or n > 1 for a prompt longer than
  the device pool (HiSparse streams lone sequences only; n forks on the device)."""
  if bad := [t for t in params.stop_token_ids if not 0 <= t < vocab_size]:
    raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary "
                     f"[0, {vocab_size})")
  if params.stop and not has_tokenizer:
    raise ValueError("stop: stop strings match the output's text, and this engine has no "
                     "tokenizer; use stop_token_ids")
  n = params.n
  if n > max_num_seqs:
    raise ValueError(f"n={n} exceeds max_num_seqs={max_num_seqs} (the n "
                     "sequences of a request run together)")
  if n > 1 and prompt_len > device_tokens:
    raise ValueError(f"n={n}: the {n} sequences fork the prompt's blocks on the device, "
                     f"which holds {device_tokens:,} tokens, and the prompt has "
                     f"{prompt_len:,}; use n=1 for prompts longer than the device pool")



class RequestStatus(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  SWAPPED = "swapped"
  FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # compared by identity (queues hold them)
class Request:
  """Engine-side state of one sequence. Invariant: 0 <= num_computed_tokens <= num_tokens.

  A request with SamplingParams.n > 1 is n sequences under one `SequenceGroup`: the
  first (index 0) carries the user's request_id and computes the prompt; the others
  (`pending_children` until then) fork its blocks when its final prefill chunk is
  scheduled and sample from the same logits in that step.
  """

  request_id: str
  prompt_token_ids: list[int]
  sampling_params: SamplingParams
  seed: int
  arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
  output_token_ids: list[int] = dataclasses.field(default_factory=list)
  status: RequestStatus = RequestStatus.WAITING
  num_computed_tokens: int = 0
  prefill_len: int = 0  # tokens allocated at admission: the prompt, or all (recomputation)
  # HiSparse: the prompt's blocks are allocated chunk by chunk (its KV is longer than the
  # device pool holds), and its earlier chunks may move to the host pool (Scheduler).
  streamed: bool = False
  prompt: str | None = None  # the prompt's text, when it came as text
  num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
  finish_reason: str | None = None
  stop_reason: str | int | None = None  # the stop string or stop token id that ended it
  error: str | None = None
  first_token_time: float | None = None
  last_token_time: float | None = None
  num_preemptions: int = 0
  blocks_selected: dict[str, int] = dataclasses.field(
      default_factory=lambda: {"device": 0, "hot": 0, "host": 0})
  num_swapped_in_blocks: int = 0  # blocks brought back from host, counted once as "host"
  num_output_tokens_reported: int = 0  # for DELTA outputs
  num_text_reported: int = 0
  # SamplingParams.logprobs: one {token id: Logprob} per output token, and their sum.
  logprobs: list = dataclasses.field(default_factory=list)
  cumulative_logprob: float = 0.0
  # Incremental detokenization (models.tokenizer.DecodeStream): the output's text so far,
  # extended by each new token's piece (no whole-output decode per step).
  detokenizer: object | None = None
  output_text: str = ""
  num_inflight: int = 0  # sampled by a dispatched step, not read back yet
  inflight_row: int = -1  # the row of that step that samples it
  # Whether the block manager holds that token as PENDING_TOKEN (a decode was planned
  # with it before it was read back); the engine fills it in when it arrives.
  pending_in_blocks: bool = False
  index: int = 0  # the completion's index among the request's n
  group: SequenceGroup | None = None  # None: n == 1
  pending_children: list[Request] = dataclasses.field(default_factory=list)
  # SamplingParams.prompt_logprobs: None, then one {token id: Logprob} per prompt token
  # from the second on, as the prefill computes them.
  prompt_logprobs: list = dataclasses.field(default_factory=list)
  prompt_logprobs_reported: bool = False  # (DELTA: in the first output only)
  # Chained prefix-cache hashes of the first full blocks of prompt + output, extended as
  # admission needs them (Scheduler._prefix_hashes): a request that waits for blocks is
  # hashed once, not every step. Valid because tokens are only ever appended.
  block_hashes: list = dataclasses.field(default_factory=list)
  # vLLM's cache_salt: mixed into the first block's hash and tier key (so into every
  # later one's), so only requests of the same salt share cached blocks. None: unsalted.
  cache_salt: str | None = None
  # The third KV tier (engine/tier_connector.py): the tier keys of the same blocks, whether
  # the tiers were asked for this request's prompt, its loads in flight and the blocks they
  # brought into the host pool.
  tier_keys: list = dataclasses.field(default_factory=list)
  tier_checked: bool = False
  num_tier_loads: int = 0
  num_tier_loaded_blocks: int = 0

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_token_ids)

  @property
  def all_token_ids(self) -> list[int]:
    """A new list of prompt + output tokens (O(context): not for the per-step path)."""
    return self.prompt_token_ids + self.output_token_ids

  def token_slice(self, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, copying only those (O(end - start))."""
    num_prompt = len(self.prompt_token_ids)
    if end <= num_prompt:
      return self.prompt_token_ids[start:end]
    if start >= num_prompt:
      return self.output_token_ids[start - num_prompt:end - num_prompt]
    return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

  @property
  def num_tokens(self) -> int:
    """Prompt + output tokens, the one in flight included."""
    return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

  def reaches_length(self, max_model_len: int) -> bool:
    """Whether the tokens sampled so far (in flight included) end it by length."""
    max_tokens = self.sampling_params.max_tokens
    return ((max_tokens is not None
             and len(self.output_token_ids) + self.num_inflight >= max_tokens)
            or self.num_tokens >= max_model_len)

  @property
  def is_prefilling(self) -> bool:
    return self.num_computed_tokens < self.prefill_len

  @property
  def is_finished(self) -> bool:
    return self.status == RequestStatus.FINISHED


@dataclasses.dataclass(eq=False)
class SequenceGroup:
  """The n sequences of one request (SamplingParams.n > 1), reported together under
  the user's request_id; finished once all of them are."""

  request_id: str
  seqs: list[Request]

  @property
  def finished(self) -> bool:
    return all(s.is_finished for s in self.seqs)


@dataclasses.dataclass(slots=True)
class Logprob:
  """A token's log-probability at one output position (vLLM's `Logprob`): `rank` 1 is
  the most likely token; `decoded_token` its text (None without a tokenizer)."""

  logprob: float
  rank: int
  decoded_token: str | None = None


@dataclasses.dataclass(slots=True)
class CompletionOutput:
  """One completion of a request (vLLM's `CompletionOutput`).

  Under `RequestOutputKind.DELTA`, `text` and `token_ids` are what is new since the
  request's previous output; otherwise the whole completion so far. While the request
  runs, `text` leaves out the last characters that could still start a stop string
  (`SamplingParams.stop_hold_back`), so a streamed text only ever grows. With
  `SamplingParams.logprobs` = N, `logprobs` holds one dict per token of `token_ids`
  ({token id: Logprob} of the top N and the sampled token) and `cumulative_logprob`
  the sum over the whole completion; both None otherwise.
  """

  index: int
  text: str
  token_ids: list[int]
  cumulative_logprob: float | None
  logprobs: list[dict[int, Logprob]] | None
  finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while running
  stop_reason: str | int | None = None  # the stop string or stop token id that ended it

  def finished(self) -> bool:
    return self.finish_reason is not None


@dataclasses.dataclass(slots=True)
class RequestMetrics:
  """A request's timings (vLLM's fields) and this engine's own figures for it."""

  arrival_time: float  # time.perf_counter() clock, as every time below
  first_token_time: float | None
  last_token_time: float | None
  time_to_first_token_s: float | None
  decode_tokens_per_s: float | None  # output tokens after the first, per second
  # Blocks attention read for this request, by tier: device (resident), hot (HiSparse
  # hot buffer hits), host (loaded from the pinned_host pool, or swapped back in).
  blocks_selected: dict[str, int]
  num_preemptions: int


@dataclasses.dataclass(slots=True)
class RequestOutput:
  """What a request produced (vLLM's `RequestOutput`), as `Engine.step()` streams it
  and `LLM.generate` returns it.

  `outputs` holds the request's `CompletionOutput`s by index (SamplingParams.n of them;
  under DELTA only those with something new). `prompt` is the text the request was
  given (None when it came as token ids). `error` (this engine's addition) says why a
  request whose finish_reason is "error" failed. `finished` is set exactly once. As
  vLLM's cumulative outputs, a running request's `prompt_token_ids`, CUMULATIVE
  `token_ids` and `metrics.blocks_selected` are the request's own objects (no copy per
  step): they grow while it runs; copy them to keep a snapshot.
  """

  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  finished: bool
  metrics: RequestMetrics
  num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
  error: str | None = None
  # SamplingParams.prompt_logprobs: per prompt token, None for the first, then
  # {token id: Logprob} (the token itself and the top prompt_logprobs); once the prompt
  # is computed (under DELTA in the first output only).
  prompt_logprobs: list[dict[int, Logprob] | None] | None = None

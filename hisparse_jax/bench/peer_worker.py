"""One engine in its own process, serving generate calls for `engine_vs_vllm`.

Run as a script (not `-m`), by either virtual environment's Python:

    .venv/bin/python hisparse_jax/bench/peer_worker.py --engine=hisparse --model=DIR ...
    .venv-vllm/bin/python hisparse_jax/bench/peer_worker.py --engine=vllm --model=DIR ...

The vLLM peer's environment has no jax and no hisparse_jax, so this file imports only
the standard library at the top and the engine it drives inside its function.

Protocol (JSON lines): after the engine is built the worker prints `{"ready": ...}`;
each line on stdin is `{"prompts": [[token ids], ...], "max_tokens": N}`; each answer is
`{"seconds": S, "token_ids": [[...], ...], "ttft_s": [...], "itl_s": [...]}`: the wall
time from the first request added to the last token out, the greedy tokens of each
request, each request's time to first token, and the gap before every later token. An
empty line (or EOF) ends the worker. Engine logs go to stderr; stdout carries only the
protocol.

Both engines are driven the same way: every request added at once, then `step()` until
none is unfinished, each new token timestamped when its step returns it (`output_kind=DELTA`
in both, as their servers stream).

This engine's answer also carries (hisparse_throughput's long rows read them):
`max_running` and `max_decoding`, the most requests one step ran and the most of them past
their prefill; `counters`, every counter of the engine's metrics (`*_total` series)
counted over the call (so a warm-up call's host selections are not in the timed call's);
`step_shapes`, the step shapes run so far; and the capacity line for requests of the
call's longest prompt + max_tokens (`capacity_line`), with its "HiSparse runs N at once"
as a number (`hisparse_runs_at_once`, None without HiSparse or with admission "wait").

Decode-only steps (the answer's `decode_s`, `decode_tokens`, `decode_steps`): the
`step()` calls whose engine step scheduled no prompt token, nor did the step before it
(both engines overlap a step with the next: a call's wall time may hold either). Each
engine says what it scheduled: this engine's `last_step_prefill_tokens`, vLLM's
per-iteration scheduler details (`enable_logging_iteration_details`: context tokens of
the iteration, through a stat logger). Decode tokens/s = decode_tokens / decode_s: the
rate of the steps that only decode, whatever else the run scheduled around them.
Greedy, `ignore_eos`, prefix caching off in both.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def _drive(add, step, has_unfinished, prompts, max_tokens, prefill_tokens):
  """Adds every prompt, steps to the end; `step()` yields (index, new token ids) per
  request that advanced; `prefill_tokens()` after it: the prompt tokens that engine step
  scheduled (None: not known)."""
  start = time.perf_counter()
  for i, prompt in enumerate(prompts):
    add(i, prompt, max_tokens)
  token_ids = [[] for _ in prompts]
  last = [None] * len(prompts)
  ttft, itl = [None] * len(prompts), []
  decode_s, decode_tokens, decode_steps, previous = 0.0, 0, 0, None
  while has_unfinished():
    before = time.perf_counter()
    events = list(step())
    now = time.perf_counter()
    prefill = prefill_tokens()
    if prefill == 0 and previous == 0:
      decode_s += now - before
      decode_tokens += sum(len(new) for _, new in events)
      decode_steps += 1
    previous = prefill
    for i, new in events:
      if not new:
        continue
      if last[i] is None:
        ttft[i] = now - start
        itl.extend([0.0] * (len(new) - 1))  # tokens that came with the first one
      else:
        itl.extend([(now - last[i]) / len(new)] * len(new))
      last[i] = now
      token_ids[i].extend(new)
  return {"seconds": time.perf_counter() - start, "token_ids": token_ids, "ttft_s": ttft,
          "itl_s": itl, "decode_s": decode_s, "decode_tokens": decode_tokens,
          "decode_steps": decode_steps}


def _hisparse(args):
  from hisparse_jax.engine.engine import Engine, EngineConfig
  from hisparse_jax.engine.sampling import RequestOutputKind, SamplingParams

  kv = {} if args.kv_cache_gib is None else {"device_kv_gib": float(args.kv_cache_gib)}
  if args.device_kv_gib is not None:
    kv["device_kv_gib"] = args.device_kv_gib
  if args.host_pool_gib is not None:
    kv["host_pool_gib"] = args.host_pool_gib
  if args.max_num_seqs is not None:
    kv["max_num_seqs"] = args.max_num_seqs
  if args.block_size is not None:
    kv["block_size"] = args.block_size
  if args.top_k_tokens is not None:  # HiSparse: the settings not given at their defaults
    from hisparse_jax.sparse.config import HiSparseConfig

    given = {"hot_buffer_tokens": args.hot_buffer_tokens, "admission": args.admission}
    kv["hisparse"] = HiSparseConfig(top_k_tokens=args.top_k_tokens,
                                    **{k: v for k, v in given.items() if v is not None})
  engine = Engine(EngineConfig(model=args.model, dtype="float32",
                               max_model_len=args.max_model_len, enable_prefix_caching=False,
                               **kv))
  ids: dict[str, int] = {}
  running = [0, 0]  # the most requests one step ran, and the most past their prefill

  def add(i, prompt, max_tokens):
    rid = engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
        output_kind=RequestOutputKind.DELTA))
    ids[rid] = i

  def step():
    outs = engine.step()
    running[0] = max(running[0], len(engine.scheduler.running))
    running[1] = max(running[1], sum(not r.is_prefilling for r in engine.scheduler.running))
    for out in outs:
      yield ids[out.request_id], list(out.outputs[0].token_ids)

  def counters() -> dict[str, float]:
    return {k: v for k, v in engine.metrics().items() if "_total" in k}

  def generate(prompts, n):
    running[:] = [0, 0]
    before = counters()
    answer = _drive(add, step, engine.has_unfinished_requests, prompts, n,
                    lambda: engine.last_step_prefill_tokens)
    after = counters()
    tokens = max(len(p) for p in prompts) + n
    return {**answer, "max_running": running[0], "max_decoding": running[1],
            "counters": {k: v - before.get(k, 0.0) for k, v in after.items()},
            "step_shapes": len(engine.runner.shapes_compiled),
            "capacity_line": engine.capacity.log_lines(tokens)[-1],
            "hisparse_runs_at_once": engine.capacity.hisparse_concurrency(tokens)}

  hisparse = engine.config.hisparse
  info = {"engine": "hisparse_jax", "max_num_seqs": engine.config.max_num_seqs,
          "max_num_batched_tokens": engine.config.max_num_batched_tokens,
          "device_kv_gib": engine.config.device_kv_gib,
          "host_pool_gib": engine.config.host_pool_gib,
          "device_blocks": engine.device_pool.num_blocks,
          "block_size": engine.config.block_size,
          "hisparse": None if hisparse is None else {
              f: getattr(hisparse, f) for f in ("top_k_tokens", "hot_buffer_tokens",
                                                "sparse_threshold_tokens", "selection",
                                                "sink_tokens", "local_tokens",
                                                "admission")},
          "package": os.path.dirname(sys.modules["hisparse_jax"].__file__)}
  return info, generate


def _vllm(args):
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib or 4))
  import vllm
  from vllm import SamplingParams
  from vllm.engine.arg_utils import EngineArgs
  from vllm.inputs import TokensPrompt
  from vllm.sampling_params import RequestOutputKind
  from vllm.usage.usage_lib import UsageContext
  from vllm.v1.engine.llm_engine import LLMEngine
  from vllm.v1.metrics.loggers import StatLoggerBase

  iteration = {"prefill": None}  # the context (prompt) tokens of the last iteration

  class IterationLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index=0):
      pass

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
      details = getattr(scheduler_stats, "iteration_details", None)
      if details is not None and not details.is_dummy:
        iteration["prefill"] = details.num_ctx_tokens

    def log_engine_initialized(self):
      pass

  # LLM's settings (as `LLM(...)` builds its engine), with stats on for the iteration
  # details; vLLM's own logger of them is quieted (a line per iteration).
  engine = LLMEngine.from_engine_args(
      EngineArgs(model=args.model, dtype="float32", max_model_len=args.max_model_len,
                 enable_prefix_caching=False, seed=0, disable_log_stats=False,
                 enable_logging_iteration_details=True),
      usage_context=UsageContext.LLM_CLASS, stat_loggers=[IterationLogger])
  logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)
  ids: dict[str, int] = {}
  counter = iter(range(1 << 62))

  def add(i, prompt, max_tokens):
    rid = str(next(counter))
    ids[rid] = i
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
        output_kind=RequestOutputKind.DELTA))

  def step():
    iteration["prefill"] = None
    for out in engine.step():
      yield ids[out.request_id], list(out.outputs[0].token_ids)

  config = engine.vllm_config.scheduler_config
  info = {"engine": "vllm", "vllm_version": vllm.__version__,
          "max_num_seqs": config.max_num_seqs,
          "max_num_batched_tokens": config.max_num_batched_tokens,
          "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
          # Its CPU threads: by default ("auto", reserved unset) vLLM keeps one core for
          # its front end and binds its compute threads to the others (1 of 2 cores here).
          "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
          "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU",
                                                         "default")}
  return info, lambda prompts, n: _drive(add, step, engine.has_unfinished_requests, prompts, n,
                                         lambda: iteration["prefill"])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--engine", choices=("hisparse", "vllm"), required=True)
  parser.add_argument("--model", required=True)
  parser.add_argument("--max_model_len", type=int, required=True)
  # KV cache GiB: vLLM's VLLM_CPU_KVCACHE_SPACE (whole GiB; default 4), this engine's
  # device_kv_gib (default: EngineConfig's)
  parser.add_argument("--kv_cache_gib", type=int, default=None)
  # this engine only (suite hisparse_throughput): the host pool, the batch cap, HiSparse
  parser.add_argument("--device_kv_gib", type=float, default=None)  # under a GiB (smoke)
  parser.add_argument("--host_pool_gib", type=float, default=None)
  parser.add_argument("--max_num_seqs", type=int, default=None)
  parser.add_argument("--top_k_tokens", type=int, default=None)
  parser.add_argument("--block_size", type=int, default=None)
  parser.add_argument("--hot_buffer_tokens", type=int, default=None)  # with --top_k_tokens
  parser.add_argument("--admission", choices=("offload", "wait"), default=None)  # the same
  args = parser.parse_args()
  # The protocol gets its own copy of stdout; fd 1 becomes stderr, so nothing the engine
  # or its child processes print reaches the protocol stream.
  protocol = os.fdopen(os.dup(1), "w")
  sys.stdout.flush()
  os.dup2(2, 1)
  info, generate = (_hisparse if args.engine == "hisparse" else _vllm)(args)
  protocol.write(json.dumps({"ready": info}) + "\n")
  protocol.flush()
  for line in sys.stdin:
    if not line.strip():
      break
    call = json.loads(line)
    protocol.write(json.dumps(generate(call["prompts"], call["max_tokens"])) + "\n")
    protocol.flush()


if __name__ == "__main__":  # vLLM starts worker processes: the guard it requires
  main()

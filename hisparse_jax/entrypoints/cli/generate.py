"""`hisparse-jax generate`: prompts in, answers and a metrics summary out.

Usage::

  hisparse-jax generate --prompt='bafu: bapo\\n? bafu:' [--prompt=...] [--prompts_file=F]
      [--model=DIR] [--device_kv_gib=G] [--host_pool_gib=G] [--max_model_len=N]
      [--max_num_seqs=N] [--max_num_batched_tokens=N] [--max_new_tokens=N]
      [--temperature=T] [--top_p=P] [--top_k=K] [--stop=S] [--n=N] [--logprobs=N]
      [--seed=S] [--metrics_json=F]
      [--prometheus_port=P] [--log_every_steps=N]

(`--prompt` decodes the escapes `\\n`, `\\t` and `\\\\`: absl passes a flag's text as
is, and a shell's '...' keeps a backslash.) `--prompts_file` is JSONL, one object a line
(blank lines skipped)::

  {"prompt": "bafu: bapo\\n? bafu:", "expected": "bapo", "max_tokens": 4}
  {"prompt_token_ids": [1, 520, 13, 4, 5, 520]}

Prints (stdout) one line per prompt in input order (one per completion with --n > 1):
the output text, or, when an expected answer is given, RIGHT when the first line of the
output starts with it (whole words), else WRONG; then "N/M right" and a metrics summary.
The capacity lines, the status line and the progress bar go to stderr. Bad input (a bad
JSONL line, a file that is not UTF-8, a bad flag value, a prompt the engine would
refuse) exits 2 with one line naming the flag, or the file and line, before the weights
load: the flags are checked as an `EngineConfig` and the prompts by the engine's rule
(`request.check_prompt`) against the checkpoint's config and tokenizer. Prompt words
outside the tokenizer's vocabulary (they become its unk token) get one warning line on
stderr: how many, and the first few. `hisparse-jax demo` runs its prompts through `run`
below, the same path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from absl import flags, logging

FLAGS = flags.FLAGS
_FIELDS = ("prompt", "prompt_token_ids", "expected", "max_tokens")
MAX_ANSWER_CHARS = 80  # a longer (wrong) answer line is shown cut, with "..."


@dataclasses.dataclass(frozen=True)
class PromptSpec:
  """One prompt and what it is checked against. Invariant: exactly one of `prompt` and
  `prompt_token_ids` is set; `source` says where it came from, for error messages."""

  source: str
  prompt: str | None = None
  prompt_token_ids: tuple[int, ...] | None = None
  expected: str | None = None
  max_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class RunResult:
  """What `run` produced: the outputs in input order and the figures it printed."""

  outputs: list[Any]  # RequestOutput, one per prompt
  metrics: dict[str, float]
  num_right: int
  num_expected: int
  wall_s: float


def _spec_from_json(obj: Any, where: str) -> PromptSpec:
  if not isinstance(obj, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
  unknown = sorted(set(obj) - set(_FIELDS))
  if unknown:
    raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(_FIELDS)})")
  if ("prompt" in obj) == ("prompt_token_ids" in obj):
    raise ValueError(f"{where}: give exactly one of \"prompt\" and \"prompt_token_ids\"")
  prompt, ids = obj.get("prompt"), obj.get("prompt_token_ids")
  if prompt is not None and not isinstance(prompt, str):
    raise ValueError(f"{where}: \"prompt\" must be a string")
  if ids is not None:
    if not (isinstance(ids, list) and ids
            and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
      raise ValueError(f"{where}: \"prompt_token_ids\" must be a non-empty list of integers")
    ids = tuple(ids)
  expected = obj.get("expected")
  if expected is not None and not isinstance(expected, str):
    raise ValueError(f"{where}: \"expected\" must be a string")
  max_tokens = obj.get("max_tokens")
  if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                 or max_tokens < 1):
    raise ValueError(f"{where}: \"max_tokens\" must be an integer >= 1, got {max_tokens!r}")
  return PromptSpec(source=where, prompt=prompt, prompt_token_ids=ids, expected=expected,
                    max_tokens=max_tokens)


def read_prompts_file(path: str) -> list[PromptSpec]:
  """The prompts of a JSONL file; ValueError naming the file and line on bad input."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except FileNotFoundError:
    raise ValueError(f"--prompts_file={path}: no such file") from None
  except UnicodeDecodeError as e:
    line = e.object[:e.start].count(b"\n") + 1
    raise ValueError(f"--prompts_file={path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} "
                     f"on line {line})") from None
  except OSError as e:
    raise ValueError(f"--prompts_file={path}: {e.strerror}") from None
  specs = []
  for lineno, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    where = f"{path} line {lineno}"
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    specs.append(_spec_from_json(obj, where))
  if not specs:
    raise ValueError(f"--prompts_file={path}: no prompts in the file")
  return specs


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
_ESCAPE = re.compile(r"\\([nt\\])")


def decode_escapes(text: str) -> str:
  """`--prompt` text with the backslash escapes `\\n` (newline), `\\t` (tab) and `\\\\` (one
  backslash) decoded, as a shell's $'...' would; any other backslash stays as it is."""
  return _ESCAPE.sub(lambda m: _ESCAPES[m.group(1)], text)


def prompts_from_flags() -> list[PromptSpec]:
  specs = [PromptSpec(source=f"--prompt #{i + 1}", prompt=decode_escapes(p))
           for i, p in enumerate(FLAGS.prompt)]
  if FLAGS.prompts_file:
    specs += read_prompts_file(FLAGS.prompts_file)
  if not specs:
    raise ValueError("no prompts: give --prompt (repeatable) or --prompts_file")
  return specs


def answer_of(text: str) -> str:
  """The answer a generation gives: its first line, without surrounding spaces."""
  return text.split("\n", 1)[0].strip()


def matches_expected(text: str, expected: str) -> bool:
  """Whether the output's first line starts with the expected answer, as whole words (a
  model may go on after the answer; stopping it is the caller's choice of stop tokens)."""
  want = expected.split()
  return bool(want) and answer_of(text).split()[:len(want)] == want


def engine_kwargs_from_flags(compile_in_background: bool = False) -> dict[str, Any]:
  """The `LLM` arguments the shared and engine flags give, checked as an `EngineConfig`
  before any model loads (its fields are the flags' names, so errors name the flag);
  then turns on the persistent compilation cache (--compilation_cache_dir).
  `compile_in_background`: the command's default for that flag."""
  from hisparse_jax.engine.engine import EngineConfig  # noqa: PLC0415 (imports jax)

  kwargs = dict(model=FLAGS.model, dtype=FLAGS.dtype, kv_cache_dtype=FLAGS.kv_cache_dtype,
                index_cache_dtype=FLAGS.index_cache_dtype, block_size=FLAGS.block_size,
                device_kv_gib=FLAGS.device_kv_gib, host_pool_gib=FLAGS.host_pool_gib,
                max_model_len=FLAGS.max_model_len, max_num_seqs=FLAGS.max_num_seqs,
                max_num_batched_tokens=FLAGS.max_num_batched_tokens, seed=FLAGS.seed,
                async_scheduling=FLAGS.async_scheduling, hisparse=hisparse_from_flags(),
                compile_in_background=(compile_in_background
                                       if FLAGS.compile_in_background is None
                                       else FLAGS.compile_in_background),
                max_step_programs=FLAGS.max_step_programs,
                tensor_parallel_size=FLAGS.tensor_parallel_size,
                **tier_kwargs_from_flags())
  try:
    EngineConfig(**kwargs)
  except ValueError as e:
    raise ValueError(f"--{e}") from None
  # The persistent compilation cache, once the flags are known good; its log line waits
  # until the engine is built (log_pending), never before the one-line error of a bad
  # checkpoint or device count, which only the engine's build finds.
  from hisparse_jax.engine import compilation_cache  # noqa: PLC0415

  compilation_cache.enable(compilation_cache.default_dir()
                           if FLAGS.compilation_cache_dir is None
                           else FLAGS.compilation_cache_dir, announce=False)
  return kwargs


def tier_kwargs_from_flags() -> dict[str, Any]:
  """The third KV tier's `EngineConfig` fields from their flags (same names)."""
  for name in ("disk_cache_gib",):
    value = FLAGS[name].value
    if not (math.isfinite(value) and value > 0):
      raise ValueError(f"--{name} must be a positive number, got {value}")
  if FLAGS.disk_cache_dir == "":
    raise ValueError("--disk_cache_dir is empty; give a directory or leave the flag out")
  if FLAGS.remote_cache_url == "":
    raise ValueError("--remote_cache_url is empty; give redis://HOST:PORT[/DB] or leave the "
                     "flag out")
  return dict(disk_cache_dir=FLAGS.disk_cache_dir, disk_cache_gib=FLAGS.disk_cache_gib,
              remote_cache_url=FLAGS.remote_cache_url,
              remote_cache_ttl_s=FLAGS.remote_cache_ttl_s,
              kv_tier_write_policy=FLAGS.kv_tier_write_policy)


def block_size_from_flags() -> int:
  """--block_size, or the engine's default for this platform and --hisparse."""
  from hisparse_jax.engine.engine import default_block_size  # noqa: PLC0415 (imports jax)

  size = FLAGS.block_size
  if size is not None and (size <= 0 or size & (size - 1)):
    raise ValueError(f"--block_size must be a power of two, got {size}")
  return size if size is not None else default_block_size(FLAGS.hisparse)


def check_output_flags() -> None:
  """--log_every_steps, --prometheus_port and --metrics_json, checked before the model
  loads (a bad path must not cost the whole run)."""
  if FLAGS.log_every_steps < 0:
    raise ValueError(f"--log_every_steps must be >= 0, got {FLAGS.log_every_steps}")
  port = FLAGS.prometheus_port
  if port is not None and not 1 <= port <= 65535:
    raise ValueError(f"--prometheus_port must be in [1, 65535], got {port}")
  if not 0 <= FLAGS.dashboard_port <= 65535:
    raise ValueError(f"--dashboard_port must be in [0, 65535], got {FLAGS.dashboard_port}")
  linger = FLAGS.dashboard_linger_s
  if not (math.isfinite(linger) and 0 <= linger <= 86400):
    raise ValueError(f"--dashboard_linger_s must be in [0, 86400], got {linger}")
  if FLAGS.metrics_json:
    folder = os.path.dirname(os.path.abspath(FLAGS.metrics_json))
    if not os.path.isdir(folder):
      raise ValueError(f"--metrics_json={FLAGS.metrics_json}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
      raise ValueError(f"--metrics_json={FLAGS.metrics_json}: directory {folder} is not "
                       "writable")


HISPARSE_FLAGS = ("top_k_tokens", "hot_buffer_tokens", "sink_tokens", "local_tokens",
                  "sparse_threshold_tokens", "resident_sparse_min_tokens", "bounds_dtype",
                  "selection", "streamed_prefill")


# The HiSparse flags a DSA model reads (the others tune the block indexer of llama models).
DSA_HISPARSE_FLAGS = ("hot_buffer_tokens", "sparse_threshold_tokens")


def hisparse_from_flags():
  """The HiSparseConfig of --hisparse and its flags (None without --hisparse), the flags
  not given derived from --max_model_len and the block size
  (`HiSparseConfig.for_max_model_len`); for a DSA model (--model's config.json), its
  learned indexer ("lightning") with the model's index_topk, refusing the flags of the
  block indexer; errors name the flag."""
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415

  if not FLAGS.hisparse:
    given = [name for name in HISPARSE_FLAGS if FLAGS[name].present]
    if given:
      raise ValueError(f"--{given[0]} is a HiSparse setting; add --hisparse to use it")
    return None
  from models.loader import is_dsa_config, load_config  # noqa: PLC0415

  config = load_config(FLAGS.model)
  try:
    if is_dsa_config(config):  # its learned indexer picks index_topk tokens per query
      given = [name for name in HISPARSE_FLAGS
               if FLAGS[name].present and name not in DSA_HISPARSE_FLAGS]
      if given:
        raise ValueError(f"--{given[0]} is not a setting of DSA models ({config.model_type}: "
                         f"the learned indexer attends index_topk={config.index_topk} "
                         f"tokens); their HiSparse flags: --"
                         + ", --".join(DSA_HISPARSE_FLAGS))
      return HiSparseConfig(
          indexer="lightning", top_k_tokens=config.index_topk,
          **{name: FLAGS[name].value for name in DSA_HISPARSE_FLAGS
             if FLAGS[name].value is not None})
    return HiSparseConfig.for_max_model_len(
        FLAGS.max_model_len, block_size_from_flags(),
        **{name: FLAGS[name].value for name in HISPARSE_FLAGS})
  except ValueError as e:
    raise ValueError(str(e).replace("HiSparseConfig.", "--")) from None


def sampling_from_flags():
  from hisparse_jax.engine.sampling import SamplingParams  # noqa: PLC0415 (imports jax)

  try:
    params = SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                            top_k=FLAGS.top_k, max_tokens=FLAGS.max_new_tokens,
                            stop=FLAGS.stop, logprobs=FLAGS.logprobs, n=FLAGS.n)
  except ValueError as e:  # name the flag: max_tokens comes from --max_new_tokens
    raise ValueError(f"--{str(e).replace('max_tokens', 'max_new_tokens')}") from None
  if FLAGS.n > FLAGS.max_num_seqs:
    raise ValueError(f"--n={FLAGS.n} exceeds --max_num_seqs={FLAGS.max_num_seqs} (the n "
                     "completions of a prompt run together)")
  return params


def _fmt_seconds(x: float) -> str:
  return "-" if not math.isfinite(x) else (f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s")


def _key(name: str, label: str, value: str) -> str:
  return f'{name}{{{label}="{value}"}}'


def metrics_summary(metrics: dict[str, float], wall_s: float) -> list[str]:
  """A few key lines of the metrics: throughput, TTFT, preemptions, blocks, transfers."""
  g = lambda key: float(metrics.get(key, 0.0))
  prompt_tokens = g("hisparse_prompt_tokens_total")
  generated = g("hisparse_generation_tokens_total")
  per_s = lambda n: n / wall_s if wall_s > 0 else 0.0
  finished = {k.split('"')[1]: int(v) for k, v in metrics.items()
              if k.startswith("hisparse_requests_total{")}
  reasons = ", ".join(f"{k} {v}" for k, v in sorted(finished.items())) or "none"
  queries = g("hisparse_prefix_cache_queries_total")
  hits = sum(g(_key("hisparse_prefix_cache_hits_total", "memory_kind", kind))
             for kind in ("device", "pinned_host"))
  blocks = ", ".join(f"{s} {g(_key('hisparse_blocks_selected_total', 'source', s)):,.0f}"
                     for s in ("device", "hot", "host"))
  mib = {d: g(_key("hisparse_transfer_bytes_total", "direction", d)) / 2**20
         for d in ("h2d", "d2h")}
  ttft = lambda q: _fmt_seconds(metrics.get(f"hisparse_time_to_first_token_seconds_{q}",
                                            math.nan))
  itl = _fmt_seconds(metrics.get("hisparse_inter_token_seconds_p50", math.nan))
  return [
      f"requests: {sum(finished.values())} finished ({reasons})",
      f"tokens: {prompt_tokens:,.0f} prompt, {generated:,.0f} generated in {wall_s:.2f} s: "
      f"{per_s(generated):.1f} generated tokens/s, {per_s(prompt_tokens + generated):.1f} "
      "tokens/s in all",
      f"time to first token: p50 {ttft('p50')}, p99 {ttft('p99')}; inter-token p50 {itl}",
      f"preemptions (swap-out to the host pool): {g('hisparse_preemptions_total'):.0f}",
      f"blocks selected: {blocks}",
      f"transfers: h2d {mib['h2d']:.2f} MiB, d2h {mib['d2h']:.2f} MiB",
      f"prefix cache: {hits:,.0f} hits / {queries:,.0f} block lookups",
  ]


def _output_line(index: int, spec: PromptSpec, output, completion=None
                 ) -> tuple[str, bool | None]:
  """The printed line of one completion of a prompt (`[index]`, or `[index.k]` with
  --n > 1), and whether it was right (None: no expected answer)."""
  if completion is None:
    completion = output.outputs[0]
  if len(output.outputs) > 1:
    index = f"{index}.{completion.index}"
  figures = (f"{len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} "
             f"generated, finish {completion.finish_reason}")
  if output.metrics.num_preemptions:
    figures += f", preempted {output.metrics.num_preemptions}x"
  if completion.finish_reason == "error":
    return f"[{index}] ERROR {output.error} ({figures})", False if spec.expected else None
  if spec.expected is None:
    return f"[{index}] {json.dumps(completion.text, ensure_ascii=False)} ({figures})", None
  answer = answer_of(completion.text)
  right = matches_expected(completion.text, spec.expected)
  shown = answer if len(answer) <= MAX_ANSWER_CHARS else answer[:MAX_ANSWER_CHARS] + "..."
  return (f"[{index}] {'RIGHT' if right else 'WRONG'} {shown!r} (expected "
          f"{spec.expected.strip()!r}; {figures})", right)


def _logprobs_line(completion) -> str:
  """`    logprobs (sum S): TOKEN LP [ALT LP, ...] | ...`: each generated token's
  log-probability, then the most likely tokens at its position (--logprobs=N)."""
  parts = []
  for token, position in zip(completion.token_ids, completion.logprobs):
    own = position[token]
    alternatives = sorted((lp for lp in position.values() if lp is not own),
                          key=lambda lp: lp.rank)
    part = f"{own.decoded_token!r} {own.logprob:.3f}"
    if alternatives:
      part += " [" + ", ".join(f"{a.decoded_token!r} {a.logprob:.3f}"
                               for a in alternatives) + "]"
    parts.append(part)
  return f"    logprobs (sum {completion.cumulative_logprob:.3f}): " + " | ".join(parts)


def checked_prompt_ids(specs: Sequence[PromptSpec], model: str | None,
                       max_model_len: int, chat: bool = False) -> list[list[int]]:
  """The token ids of every prompt, checked by the engine's rule (`request.check_prompt`)
  with only the checkpoint's config and tokenizer read: a bad prompt fails, naming its
  source, before the weights load and the KV pools are allocated. `chat`: a text prompt is
  one user message, rendered by the model's chat template (LLM.chat's rendering)."""
  from hisparse_jax.engine.request import check_prompt  # noqa: PLC0415 (imports jax)
  from models.loader import load_config, load_tokenizer  # noqa: PLC0415

  vocab_size = load_config(model).vocab_size
  tokenizer = load_tokenizer(model) if any(s.prompt is not None for s in specs) else None
  if chat and tokenizer is not None and tokenizer.chat_template is None:
    raise ValueError("--chat: the model has no chat template")
  out = []
  for spec in specs:
    if spec.prompt is not None and chat:
      text = tokenizer.apply_chat_template([{"role": "user", "content": spec.prompt}],
                                           add_generation_prompt=True)
      ids = tokenizer.encode(text, add_special_tokens=False)
    else:
      ids = tokenizer.encode(spec.prompt) if spec.prompt is not None else spec.prompt_token_ids
    try:
      out.append(check_prompt(ids, vocab_size=vocab_size, max_model_len=max_model_len,
                              text=spec.prompt))
    except ValueError as e:
      raise ValueError(f"{spec.source}: {e}") from None
  if tokenizer is not None:
    warning = unknown_words_warning(tokenizer, [s.prompt for s in specs if s.prompt],
                                    default_model=model is None)
    if warning:
      print(warning, file=sys.stderr, flush=True)
  return out


NUM_UNKNOWN_SHOWN = 5  # the first unknown words the warning names


def unknown_words_warning(tokenizer, prompts: Sequence[str], *,
                          default_model: bool) -> str | None:
  """One line when the prompts hold words the tokenizer's vocabulary does not (they
  become its unk token and the model reads nothing there): how many and the first few;
  None when every word is known."""
  unknown = [w for prompt in prompts for w in tokenizer.unknown_words(prompt)]
  if not unknown:
    return None
  shown = ", ".join(repr(w) for w in unknown[:NUM_UNKNOWN_SHOWN])
  more = f" (first {NUM_UNKNOWN_SHOWN} shown)" if len(unknown) > NUM_UNKNOWN_SHOWN else ""
  unk = tokenizer.id_to_token(tokenizer.unk_token_id)
  line = (f"hisparse-jax: warning: {len(unknown)} word(s) of the prompts are not in the "
          f"model's vocabulary and become {unk}: {shown}{more}")
  if default_model:  # the embedded model knows only its synthetic retrieval vocabulary
    line += ("; the default model answers 'key: value' lines and a '? key:' query in its "
             f"own words, e.g. {example_prompt_flag()}")
  return line


def example_prompt_flag() -> str:
  """`--prompt='...' (answer: WORD)`: a prompt the default model answers, as typed."""
  from models import data  # noqa: PLC0415

  typed = data.EXAMPLE_PROMPT.replace("\n", "\\n")  # --prompt decodes it back
  return f"--prompt='{typed}' (answer: {data.EXAMPLE_ANSWER})"


def _finite(metrics: dict[str, float]) -> dict[str, float | None]:
  """Strict JSON has no NaN: an undefined figure (no observation yet) is written as null."""
  return {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}


def run(specs: Sequence[PromptSpec], llm_kwargs: dict[str, Any], sampling_params, *,
        log_every_steps: int = 0, metrics_json: str | None = None,
        prometheus_port: int | None = None, out: TextIO | None = None,
        chat: bool = False, dashboard_port: int | None = None,
        dashboard_linger_s: float = 0.0) -> RunResult:
  """Builds an `LLM`, generates for `specs`, prints each answer and the summaries."""
  from hisparse_jax.engine.engine import EngineConfig  # noqa: PLC0415 (imports jax)
  from hisparse_jax.entrypoints.llm import LLM, PromptError  # noqa: PLC0415

  out = out if out is not None else sys.stdout
  params = [dataclasses.replace(sampling_params, max_tokens=s.max_tokens)
            if s.max_tokens is not None else sampling_params for s in specs]
  prompt_ids = checked_prompt_ids(specs, llm_kwargs.get("model"),
                                  llm_kwargs.get("max_model_len", EngineConfig.max_model_len),
                                  chat=chat)
  llm = LLM(log_every_steps=log_every_steps, **llm_kwargs)
  from hisparse_jax.engine import compilation_cache  # noqa: PLC0415

  compilation_cache.log_pending()  # (engine_kwargs_from_flags' cache line)
  registry = llm.engine.metrics_registry
  if prometheus_port is not None:
    try:
      registry.serve(prometheus_port, addr="127.0.0.1")  # loopback only
    except OSError as e:
      raise ValueError(f"--prometheus_port={prometheus_port}: {e.strerror or e}") from None
    logging.info("serving Prometheus metrics on http://127.0.0.1:%d/metrics", prometheus_port)
  board = None
  if dashboard_port is not None:  # (--serve_dashboard)
    from hisparse_jax.observability.dashboard import DashboardServer  # noqa: PLC0415

    try:
      board = DashboardServer(llm.engine, dashboard_port)
    except ValueError:
      registry.close()
      llm.close()
      raise
    print(f"dashboard: {board.url} (live while this runs)", file=out, flush=True)
  prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
  try:
    start = time.perf_counter()
    try:
      outputs = llm.generate(prompts, params)
    except PromptError as e:
      raise ValueError(f"{specs[e.index].source}: {e.reason}") from None
    wall_s = time.perf_counter() - start
    metrics = llm.metrics()
  finally:
    registry.close()
    llm.close()  # the third tier's stores finish before the command exits
    if board is not None:
      if dashboard_linger_s > 0:
        print(f"dashboard: {board.url} stays up {dashboard_linger_s:g} s", file=out,
              flush=True)
        time.sleep(dashboard_linger_s)
      board.close()
  num_right = num_expected = 0
  for i, (spec, output) in enumerate(zip(specs, outputs)):
    for completion in output.outputs:
      line, right = _output_line(i, spec, output, completion)
      print(line, file=out)
      if completion.logprobs is not None:
        print(_logprobs_line(completion), file=out)
      if right is not None:
        num_expected += 1
        num_right += int(right)
  if num_expected:
    print(f"{num_right}/{num_expected} right", file=out)
  print("metrics:", file=out)
  for line in metrics_summary(metrics, wall_s):
    print(f"  {line}", file=out)
  if metrics_json:
    with open(metrics_json, "w") as f:
      json.dump(_finite(metrics), f, indent=2, sort_keys=True)
      f.write("\n")
  return RunResult(outputs=outputs, metrics=metrics, num_right=num_right,
                   num_expected=num_expected, wall_s=wall_s)


def main(argv: list[str]) -> int:
  del argv  # all input comes from flags
  specs = prompts_from_flags()  # bad input fails here, before the model loads
  sampling_params = sampling_from_flags()
  llm_kwargs = engine_kwargs_from_flags()
  check_output_flags()
  if logging.get_verbosity() < logging.INFO:
    logging.set_verbosity(logging.INFO)  # capacity lines and status lines
  run(specs, llm_kwargs, sampling_params,
      log_every_steps=FLAGS.log_every_steps, metrics_json=FLAGS.metrics_json,
      prometheus_port=FLAGS.prometheus_port, chat=FLAGS.chat, **dashboard_from_flags())
  return 0


def dashboard_from_flags() -> dict[str, Any]:
  """`run`'s dashboard arguments from --serve_dashboard / --dashboard_port /
  --dashboard_linger_s (none without --serve_dashboard)."""
  if not FLAGS.serve_dashboard:
    return {}
  return dict(dashboard_port=FLAGS.dashboard_port, dashboard_linger_s=FLAGS.dashboard_linger_s)

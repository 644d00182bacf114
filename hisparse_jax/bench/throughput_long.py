"""`hisparse_throughput --bench_size=long`: HiSparse's admission by offload, measured (#53).

At each length (~2k, ~6k and the model's longest context: a row's max_model_len, its
prompts built to at most that less `new_tokens` (128), so that every output fits),
`num_prompts` (8) passkey prompts (models/passkey.py, needle depths spread from 10% to
90%, a key each, as the passkey suite builds them) are added at once to three engines at
ONE device KV budget, each engine in its own process (peer_worker.py, as
hisparse_throughput's), greedy, `ignore_eos`, prefix caching off (the prompts share their
filler), blocks of 16 tokens:

    device-only       no HiSparse: `device_prompts` (3) run, the others wait for blocks
    HiSparse offload  top-k `top_k_tokens` (1,024), a hot buffer as large (what an
                      offloaded request keeps on the device), admission "offload": running
                      sparse decoders are offloaded to admit the next request, which
                      streams in when its whole prompt does not fit beside them
    HiSparse wait     the same, admission "wait": a waiting request waits for free blocks

The budget: `device_prompts` requests' KV (the longest prompt + the new tokens, in
blocks, and a spare block each: what admission keeps per running request) for every
engine, plus, for the HiSparse two, what HiSparse reserves on the device beside the blocks
(key bounds, hot-buffer state: engine.hisparse_capacity_for, as the passkey suite's
_engine computes it), so all three have the same device blocks (checked from each
worker's report before anything runs); the HiSparse engines' host pool holds every
request.

Each engine runs the call once untimed (it compiles the step programs of these shapes),
then the timed call. Per engine: decode tokens/s over the steps that only decode
(hisparse_throughput's measure: neither the step nor the one before it scheduled a prompt
token), end-to-end tokens/s, the most requests decoding at once (past their prefill in one
step), the passkey answers (models.passkey.answer_of on each output's text) right or
wrong, host block selections (hisparse_blocks_selected_total{source="host"}), offloads
(hisparse_offloads_total) and host block-layer loads over the timed call, step shapes
first met in the timed call (0: the warm-up compiled them all), and the capacity line's
"HiSparse runs N at once" for these requests.

Ratios per length: offload / device-only and offload / wait, decode and end-to-end
tokens/s. The issue's must-show, at MUST_SHOW_LENGTH: HiSparse offload's answers equal
device-only's, host selections > 0, decode tokens/s >= GOAL_DECODE_VS_DEVICE_ONLY x
device-only's. A HiSparse answer that differs from device-only's is printed loudly and
recorded (`answers_differ`), never raised: sparse attention may change a token, and the
passkey suite is the accuracy yardstick. Nothing is asserted on speed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile

import numpy as np

from hisparse_jax.bench import common
from hisparse_jax.bench import engine_vs_vllm as evv

GIB = 2**30
ENGINES = ("device-only", "HiSparse offload", "HiSparse wait")
ADMISSION = {"HiSparse offload": "offload", "HiSparse wait": "wait"}
MUST_SHOW_LENGTH = 6144
GOAL_DECODE_VS_DEVICE_ONLY = 1.5


@dataclasses.dataclass(frozen=True)
class LongSize:
  model: str
  # max_model_len of each row (prompt + new tokens); None: the model's longest context
  # (its max_position_embeddings). Rows run in this order.
  lengths: tuple[int | None, ...]
  num_prompts: int = 8
  device_prompts: int = 3  # requests of a row's longest request the device pool holds
  new_tokens: int = 128  # decode-only steps with every request decoding, then the tail
  top_k_tokens: int = 1024
  block_size: int = 16
  max_num_seqs: int = 16
  call_timeout_s: float = 3600.0  # one call: 8 prompts of 8k prefill in ~10 min alone
  seed: int = 53  # keys: seed + length


SIZES = {
    "long": LongSize(model=evv.REAL_MODEL, lengths=(2048, 6144, None)),
    "long_6k": LongSize(model=evv.REAL_MODEL, lengths=(MUST_SHOW_LENGTH,)),  # the must-show
    # long's other rows (~2 h on 2 shared cores), after long_6k: the ~2k and the longest.
    "long_2k_8k": LongSize(model=evv.REAL_MODEL, lengths=(2048, None)),
    # The unit test's: a tiny random GGUF (its byte-level tokenizer; random answers: only
    # the fields are tested), 4 prompts of ~500 tokens over a device pool of 2.
    "long_smoke": LongSize(model=evv.SMOKE_GGUF, lengths=(512,), num_prompts=4,
                           device_prompts=2, new_tokens=8, top_k_tokens=64,
                           call_timeout_s=600.0),
}


def resolve_lengths(size: LongSize, max_position_embeddings: int) -> list[int]:
  """The rows' max_model_len, None read as the model's longest context; each must leave a
  prompt beside the new tokens and be within the model's context."""
  lengths = [max_position_embeddings if n is None else n for n in size.lengths]
  for n in lengths:
    if not size.new_tokens < n <= max_position_embeddings:
      raise ValueError(f"length {n}: must be in ({size.new_tokens}, "
                       f"{max_position_embeddings}] (new tokens, the model's context)")
  return lengths


def depths(num_prompts: int) -> list[float]:
  """Needle depths spread from 10% to 90% of the filler."""
  if num_prompts == 1:
    return [0.5]
  return [round(0.1 + 0.8 * i / (num_prompts - 1), 4) for i in range(num_prompts)]


def budget(size: LongSize, checkpoint: str, spec, length: int, request_tokens: int) -> dict:
  """The row's pools: device blocks for `device_prompts` requests of `request_tokens` and
  a spare block each (the scheduler admits a request when its prompt and a spare block per
  running request fit: without them device-only would run one fewer) + the null block,
  host blocks for every request and two more (+ null), and each
  engine's device_kv_gib: the blocks' bytes, plus HiSparse's reserved bytes for the
  HiSparse engines (+ 512 bytes, under a block: the engine's plan keeps exactly these
  blocks)."""
  from hisparse_jax.engine.config import EngineConfig  # noqa: PLC0415 (jax: on use)
  from hisparse_jax.engine.engine import hisparse_capacity_for  # noqa: PLC0415

  request_blocks = math.ceil(request_tokens / size.block_size)
  device_blocks = size.device_prompts * (request_blocks + 1) + 1
  host_blocks = (size.num_prompts + 2) * request_blocks + 1
  config = EngineConfig(model=checkpoint, block_size=size.block_size, max_model_len=length,
                        max_num_seqs=size.max_num_seqs, enable_prefix_caching=False,
                        hisparse=_hisparse(size, "offload"))
  reserved = hisparse_capacity_for(config, spec, device_blocks, host_blocks).reserved_bytes
  blocks_bytes = device_blocks * spec.bytes_per_block
  return {"request_blocks": request_blocks, "device_blocks": device_blocks,
          "host_blocks": host_blocks, "reserved_bytes": reserved,
          "bytes_per_block": spec.bytes_per_block,
          "device_kv_gib": {"device-only": (blocks_bytes + 512) / GIB,
                            **{name: (blocks_bytes + reserved + 512) / GIB
                               for name in ADMISSION}},
          "host_pool_gib": (host_blocks * spec.bytes_per_block + 512) / GIB}


def _hisparse(size: LongSize, admission: str):
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415

  return HiSparseConfig(top_k_tokens=size.top_k_tokens, hot_buffer_tokens=size.top_k_tokens,
                        admission=admission)


def worker_args(size: LongSize, name: str, pools: dict) -> tuple[str, ...]:
  """peer_worker.py's flags of engine `name` at this row's pools."""
  args = (f"--device_kv_gib={pools['device_kv_gib'][name]!r}",
          f"--max_num_seqs={size.max_num_seqs}", f"--block_size={size.block_size}")
  if name in ADMISSION:
    args += (f"--host_pool_gib={pools['host_pool_gib']!r}",
             f"--top_k_tokens={size.top_k_tokens}",
             f"--hot_buffer_tokens={size.top_k_tokens}", f"--admission={ADMISSION[name]}")
  return args


def _pct(xs: list[float], q: float) -> float:
  return 1e3 * float(np.percentile(xs, q)) if xs else float("nan")


def engine_row(warm: dict, timed: dict, prompts, tokenizer, new_tokens: int) -> dict:
  """One engine's figures from its warm-up and timed answers (peer_worker's protocol)."""
  from models import passkey  # noqa: PLC0415

  prompt_tokens = sum(len(p.token_ids) for p in prompts)
  answers = []
  for p, tokens in zip(prompts, timed["token_ids"]):
    text = tokenizer.decode(tokens)
    answer = passkey.answer_of(text)
    answers.append({"depth": p.depth, "key": p.key, "answer": answer,
                    "right": answer == p.key, "text": text})
  counters = timed["counters"]
  seconds = timed["seconds"]
  return {
      "decode_tokens_per_s": (timed["decode_tokens"] / timed["decode_s"]
                              if timed["decode_s"] else float("nan")),
      "decode_steps": timed["decode_steps"], "decode_tokens": timed["decode_tokens"],
      "decode_share": timed["decode_s"] / seconds,
      "e2e_tokens_per_s": (prompt_tokens + len(prompts) * new_tokens) / seconds,
      "seconds": seconds, "warm_up_seconds": warm["seconds"],
      "ttft_p50_ms": _pct(timed["ttft_s"], 50), "ttft_p99_ms": _pct(timed["ttft_s"], 99),
      "itl_p50_ms": _pct(timed["itl_s"], 50), "itl_p99_ms": _pct(timed["itl_s"], 99),
      "max_running": timed["max_running"], "max_decoding": timed["max_decoding"],
      "num_right": sum(a["right"] for a in answers), "answers": answers,
      "host_blocks_selected": counters.get('hisparse_blocks_selected_total{source="host"}',
                                           0.0),
      "offloads": counters.get("hisparse_offloads_total", 0.0),
      "host_loads": counters.get("hisparse_hot_buffer_loads_total", 0.0),
      "preemptions": counters.get("hisparse_preemptions_total", 0.0),
      "new_step_shapes": timed["step_shapes"] - warm["step_shapes"],
      "hisparse_runs_at_once": timed["hisparse_runs_at_once"],
      "capacity_line": timed["capacity_line"], "cpu_s": timed["cpu_s"],
      "load_avg_1": os.getloadavg()[0], "token_ids": timed["token_ids"]}


def compare(rows: dict[str, dict]) -> tuple[dict, dict]:
  """(ratios, answers): offload / device-only and offload / wait tokens/s, and per
  HiSparse engine whether its answers and tokens equal device-only's."""
  dense, offload, wait = (rows[n] for n in ENGINES)
  ratio = lambda a, b, key: a[key] / b[key] if b[key] else float("nan")  # noqa: E731
  ratios = {"offload_vs_device_only_decode": ratio(offload, dense, "decode_tokens_per_s"),
            "offload_vs_wait_decode": ratio(offload, wait, "decode_tokens_per_s"),
            "wait_vs_device_only_decode": ratio(wait, dense, "decode_tokens_per_s"),
            "offload_vs_device_only_e2e": ratio(offload, dense, "e2e_tokens_per_s"),
            "offload_vs_wait_e2e": ratio(offload, wait, "e2e_tokens_per_s")}
  answers = {}
  for name in ADMISSION:
    differ = [{"request": i, "device_only": d["answer"], "hisparse": s["answer"],
               "key": d["key"]}
              for i, (d, s) in enumerate(zip(dense["answers"], rows[name]["answers"]))
              if d["answer"] != s["answer"]]
    answers[name] = {"answers_equal_device_only": not differ, "answers_differ": differ,
                     "tokens_identical_to_device_only": sum(
                         a == b for a, b in zip(dense["token_ids"], rows[name]["token_ids"]))}
  return ratios, answers


def _length_result(size: LongSize, length: int, checkpoint: str, tokenizer, spec,
                   log_dir: str) -> dict:
  from models import passkey  # noqa: PLC0415

  prompts = passkey.make_passkey_prompts(tokenizer, length - size.new_tokens,
                                         depths(size.num_prompts), seed=size.seed + length)
  ids = [list(p.token_ids) for p in prompts]
  request_tokens = max(map(len, ids)) + size.new_tokens
  if request_tokens > length:
    raise ValueError(f"length {length}: a prompt of {request_tokens - size.new_tokens} "
                     f"tokens leaves no room for {size.new_tokens} new tokens")
  pools = budget(size, checkpoint, spec, length, request_tokens)
  rows, infos = {}, {}
  for name in ENGINES:
    slug = f"{name.split()[-1]}_{length}"
    worker = evv.Worker(slug, sys.executable, "hisparse", checkpoint, log_dir, None, length,
                        worker_args(size, name, pools))
    try:
      infos[name] = worker.info
      if worker.info["device_blocks"] != pools["device_blocks"]:  # before an hour of calls
        raise AssertionError(f"{name} at {length}: {worker.info['device_blocks']} device "
                             f"blocks, the budget is {pools['device_blocks']}")
      warm = worker.generate(ids, size.new_tokens, size.call_timeout_s)
      timed = worker.generate(ids, size.new_tokens, size.call_timeout_s)
    finally:
      worker.close()
    rows[name] = engine_row(warm, timed, prompts, tokenizer, size.new_tokens)
    r = rows[name]
    print(f"hisparse_throughput long {length} {name}: decode {r['decode_tokens_per_s']:.1f} "
          f"tok/s, e2e {r['e2e_tokens_per_s']:.0f} tok/s, {r['max_decoding']} decoding at "
          f"once, {r['num_right']}/{len(prompts)} right, host selections "
          f"{r['host_blocks_selected']:,.0f}, offloads {r['offloads']:,.0f} "
          f"({r['warm_up_seconds']:.0f} + {r['seconds']:.0f} s, load "
          f"{r['load_avg_1']:.1f})", file=sys.stderr, flush=True)
  ratios, answers = compare(rows)
  for name, a in answers.items():
    if not a["answers_equal_device_only"]:  # reported, not raised (module docstring)
      print(f"!!! hisparse_throughput long {length}: {name}'s passkey answers DIFFER from "
            f"device-only's: {a['answers_differ']}", file=sys.stderr, flush=True)
  for r in rows.values():
    r.pop("token_ids")
  return {"length": length, "max_model_len": length, "request_tokens": request_tokens,
          "prompt_tokens": [len(p) for p in ids], "pools": pools, "rows": rows,
          "ratios": ratios, "answers": answers, "engines": infos}


def must_show(lengths: list[dict]) -> dict | None:
  """The issue's must-show at MUST_SHOW_LENGTH (None when that row did not run)."""
  row = next((r for r in lengths if r["length"] == MUST_SHOW_LENGTH), None)
  if row is None:
    return None
  offload = row["rows"]["HiSparse offload"]
  out = {"length": MUST_SHOW_LENGTH,
         "answers_equal_device_only":
             row["answers"]["HiSparse offload"]["answers_equal_device_only"],
         "host_blocks_selected": offload["host_blocks_selected"],
         "decode_vs_device_only": row["ratios"]["offload_vs_device_only_decode"],
         "goal_decode_vs_device_only": GOAL_DECODE_VS_DEVICE_ONLY}
  out["holds"] = bool(out["answers_equal_device_only"] and out["host_blocks_selected"] > 0
                      and out["decode_vs_device_only"] >= GOAL_DECODE_VS_DEVICE_ONLY)
  return out


def run(size_name: str = "long") -> dict:
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec  # noqa: PLC0415
  from models import loader  # noqa: PLC0415

  size = SIZES[size_name]
  log_dir = tempfile.mkdtemp(prefix="hisparse_throughput_long_")
  checkpoint = evv.checkpoint_for(size.model, log_dir)
  tokenizer = loader.load_tokenizer(checkpoint)
  model_config = loader.load_config(checkpoint)
  spec = KVCacheSpec.from_model_config(model_config, "float32", size.block_size)
  results = [_length_result(size, length, checkpoint, tokenizer, spec, log_dir)
             for length in resolve_lengths(size, model_config.max_position_embeddings)]
  return {"size": {**dataclasses.asdict(size), "name": size_name}, "lengths": results,
          "must_show": must_show(results),
          "max_position_embeddings": model_config.max_position_embeddings,
          "settings": {"greedy": True, "ignore_eos": True, "prefix_caching": False,
                       "hot_buffer_tokens": size.top_k_tokens,
                       "depths": depths(size.num_prompts)},
          "log_dir": log_dir, "machine": common.machine()}


def format_table(result: dict) -> str:
  lines = []
  for row in result["lengths"]:
    table = []
    for name, r in row["rows"].items():
      runs = r["hisparse_runs_at_once"]
      table.append([name, f"{r['decode_tokens_per_s']:.1f}",
                    f"{100 * r['decode_share']:.0f}%", f"{r['e2e_tokens_per_s']:.0f}",
                    r["max_decoding"], "-" if runs is None else runs,
                    f"{r['num_right']}/{len(r['answers'])}",
                    f"{r['host_blocks_selected']:,.0f}", f"{r['offloads']:,.0f}"])
    low, high = min(row["prompt_tokens"]), max(row["prompt_tokens"])
    ratios = row["ratios"]
    lines += [f"{len(row['prompt_tokens'])} passkey prompts of {low:,}-{high:,} tokens "
              f"(max_model_len {row['max_model_len']:,}), device pool "
              f"{row['pools']['device_blocks'] - 1:,} blocks "
              f"({(row['pools']['device_blocks'] - 1) / row['pools']['request_blocks']:.2f} "
              "requests):",
              common.format_table(["engine", "decode tok/s", "time decoding", "e2e tok/s",
                                   "decoding at once", "capacity: runs", "right",
                                   "host selections", "offloads"], table),
              f"offload decode vs device-only {ratios['offload_vs_device_only_decode']:.2f}x, "
              f"vs wait {ratios['offload_vs_wait_decode']:.2f}x; e2e vs device-only "
              f"{ratios['offload_vs_device_only_e2e']:.2f}x, vs wait "
              f"{ratios['offload_vs_wait_e2e']:.2f}x"]
    for name, a in row["answers"].items():
      if not a["answers_equal_device_only"]:
        lines.append(f"!!! {name}: passkey answers DIFFER from device-only's: "
                     f"{a['answers_differ']}")
    lines.append("")
  shown = result["must_show"]
  if shown is not None:
    lines.append(f"must-show at {shown['length']:,}: answers equal device-only's "
                 f"{shown['answers_equal_device_only']}, host selections "
                 f"{shown['host_blocks_selected']:,.0f}, decode vs device-only "
                 f"{shown['decode_vs_device_only']:.2f}x (goal >= "
                 f"{shown['goal_decode_vs_device_only']}): "
                 f"{'HOLDS' if shown['holds'] else 'DOES NOT HOLD'}")
  return "\n".join(lines).rstrip()


def plot(result: dict, path: str) -> None:
  """PNG: decode tokens/s of each engine against the row's length."""
  import matplotlib  # optional dependency (the test extra): imported on use

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4.5))
  styles = {"device-only": ("k", "o"), "HiSparse offload": ("tab:red", "s"),
            "HiSparse wait": ("tab:orange", "^")}
  lengths = [row["length"] for row in result["lengths"]]
  for name, (color, marker) in styles.items():
    ax.plot(lengths, [row["rows"][name]["decode_tokens_per_s"] for row in result["lengths"]],
            "-", marker=marker, color=color, label=name)
  size = result["size"]
  ax.set_xlabel("max_model_len (passkey prompt + new tokens)")
  ax.set_ylabel("decode tokens/s (steps without prefill)")
  ax.set_title(f"hisparse_throughput long: {size['num_prompts']} prompts, device pool of "
               f"{size['device_prompts']}, top-k {size['top_k_tokens']:,}", fontsize=10)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)

"""Suite `passkey`: passkey retrieval on a real model, dense against HiSparse top-k (#30).

The accuracy yardstick of every selection change: Quest's passkey prompts
(models/passkey.py: a 5-digit key hidden at a depth of repeated filler, then "What is the
pass key? The pass key is") at 1k / 2k / 4k / 8k tokens on `smollm2-135m-instruct`
(30 layers, 9 q / 3 KV heads of 64, float32), greedy. A length L is the whole sequence:
the prompt is built to at most L - NEW_TOKENS tokens, so prompt and answer fit in
max_model_len = L. Each row is one Engine: dense (block 16; dense attention reads every
block, the block size changes only the layout), then HiSparse at each top-k and block
size of the grid. A top-k >= L covers the whole sequence (every block selected at every
step: dense by construction) and is reported as such, not run.

Where the answer comes from. The engine prefills a prompt with dense attention, so the
token sampled right after a prompt is a dense answer whatever HiSparse does. Here each
request is the prompt without its last FORCED_TAIL tokens (" The pass key is", 4 tokens
with SmolLM2's tokenizer); when the engine samples a token in their place, the bench
overwrites it with the next tail token before the next step (teacher forcing through the
Engine API, as sparse_accuracy.py does with one token; async scheduling off, so no step
has taken the sampled token yet). So the tail and every generated token (the key's digits:
one token each) are computed by DECODE steps, and with HiSparse each of those steps is a
sparse row: every request is longer than `sparse_threshold_tokens` (= top_k_tokens here;
checked, a grid that breaks it is refused), so the query of " is" and of each digit
attends only to the sink, local and top-scored blocks its indexer selected, resolved
through the hot buffer and loaded from the host pool where the device copy was dropped.
The answer is the first number in the NEW_TOKENS generated tokens (models.passkey).

Host loads. All depths of a length run in one batch (added together), and the device pool
holds `device_requests` (1.5) requests of L tokens in blocks, with what HiSparse reserves
(key bounds of every device and host block, hot-buffer state) added on top; the host pool
holds every request. Where a hot buffer is over a quarter of a request (top-k > L / 4)
1.5 requests are too few for an offload to admit the next request (the scheduler offloads
nobody when the running request's net gain, its dropped blocks less its hot buffer and the
prefix blocks it shares, cannot make room for a whole request), so the requests would run
one after another with no host load; there the pool holds one request plus a hot buffer
plus OFFLOAD_SLACK (a quarter) of a request, the least that forces the offload. Dense
rows (1.5 requests) run the requests about one at a time. HiSparse admits the next request by
offloading sparse decoders (their written-through blocks dropped from the device, a hot
buffer of top_k_tokens given instead: the smallest allowed, so an offload frees the most
and every later selection of a dropped block is a host load); the selected blocks of an
offloaded request come back from the host pool into its hot buffer inside the step. Per
row: block-layers loaded from the host pool (`hisparse_hot_buffer_loads_total`),
offloads, hot-buffer hit ratio, host-to-device bytes. Prefix caching is on (the engine's
default): the prompts of a length share their first filler sentences (up to the shallower
needle), so a later request may reuse an earlier one's blocks; answers do not depend on it.

Streamed rows (Size.streamed_lengths): the HiSparse row again with a device pool of
STREAMED_DEVICE_FRACTION of one request, under half of each prompt's KV (dense refuses to
start at that budget): every prompt is longer than the device pool and streams, its
computed blocks written through to the host pool and dropped, each later prefill chunk
attending over all its earlier blocks, loaded back in groups through its hot buffer
(streamed_prefill="exact": the dense prefill's keys), or over their top-k ("sparse": its
prefill is itself sparse). One row per mode of Size.streamed_prefills.

Smallest top-k keeping dense accuracy (per length and block size): the smallest top-k T
of the grid such that T and every larger top-k of the grid are at least as accurate as
dense at that length (a covering top-k counts as dense); None when not even the largest
one that was run is (only a covering top-k keeps it).

Greedy agreement: AGREEMENT_PROMPTS (16 ordinary English requests) in the model's chat
template (35-45 tokens), 32 greedy tokens, dense against HiSparse at small top-k with
sparse_threshold_tokens = top_k_tokens (block 4: top-k 16 and 32 tokens, the block size
that makes small top-k meaningful on prompts this short; sink and local at their defaults),
so that every decode step is sparse (reported: `sparse_step_fraction`); the prompt's last
token is fed as a decode step as above, so all 32 tokens come from decode steps. Per row:
tokens equal to dense's (same block size) position by position, the mean common prefix,
identical sequences, and the mean fraction of the context a step attended to.

Smoke size: the embedded toy model (its word vocabulary turns the English into <unk>, so
its answers are wrong: only the fields are tested), one 256-token prompt.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from hisparse_jax.bench import common
from hisparse_jax.bench.passkey_engine import (
    OFFLOAD_SLACK,
    capacity_figures,
    checkpoint_figures,
    drop_programs,
    forced_generate,
    host_figures,
    make_engine,
    num_mappings,
)

NEW_TOKENS = 8  # " 52586." is 7 tokens (a space, one token per digit, the period)
FORCED_TAIL = " The pass key is"  # the query's end, fed as decode steps

# Ordinary requests for the greedy-agreement rows (chat template), varied on purpose.
AGREEMENT_PROMPTS = (
    "Write a short poem about the ocean.",
    "What is the capital of France, and why is it famous?",
    "Explain photosynthesis in simple terms.",
    "Give me three tips for learning a new language.",
    "Describe how a bicycle works.",
    "What are the health benefits of drinking water?",
    "Tell me a short story about a dog who finds a treasure.",
    "How do I make a good cup of tea?",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "List some good habits for a productive morning.",
    "What does the memory of a computer do?",
    "Explain gravity to a ten-year-old.",
    "Suggest a name for a small bakery and explain your choice.",
    "How can I save money when I buy groceries?",
)


@dataclasses.dataclass(frozen=True)
class Size:
  model: str  # a preset of configs/models.py
  lengths: tuple[int, ...]  # tokens of prompt + answer (= max_model_len)
  depths: tuple[float, ...]
  top_ks: tuple[int, ...]
  block_sizes: tuple[int, ...]
  device_requests: float  # requests of a length the device pool holds (in blocks)
  agreement_prompts: int
  agreement_tokens: int
  agreement_rows: tuple[tuple[int, int], ...]  # (block_size, top_k_tokens)
  # Lengths measured at fewer depths / block sizes than the grid's (time):
  # ((length, depths), ...), ((length, block sizes), ...).
  depths_by_length: tuple[tuple[int, tuple[float, ...]], ...] = ()
  block_sizes_by_length: tuple[tuple[int, tuple[int, ...]], ...] = ()
  dense_block_size: int = 16
  seed: int = 30  # keys: seed + length
  # Lengths whose HiSparse rows run a second time with a device pool of
  # STREAMED_DEVICE_FRACTION of one request: each prompt streams through it (module doc).
  streamed_lengths: tuple[int, ...] = ()
  # HiSparseConfig.streamed_prefill of the streamed rows: one row per mode.
  streamed_prefills: tuple[str, ...] = ("exact",)
  bounds_dtype: str = "bfloat16"  # HiSparseConfig.bounds_dtype of the HiSparse rows

  def depths_of(self, length: int) -> tuple[float, ...]:
    return dict(self.depths_by_length).get(length, self.depths)

  def block_sizes_of(self, length: int) -> tuple[int, ...]:
    return dict(self.block_sizes_by_length).get(length, self.block_sizes)


SIZES = {
    # 8k at 3 depths: on the shared 2-core machine an 8k prompt prefills in ~1-2 min and
    # each HiSparse engine compiles ~3 step programs of ~40 s (30 layers); the whole grid
    # is ~1.5-2 h there. Block 32 at 8k too: one engine row of it (union, top-k 1,024,
    # run alone in session 14) answered 3/3 where block 16 gave 2/3.
    "full": Size(model="smollm2-135m-instruct", lengths=(1024, 2048, 4096, 8192),
                 depths=(0.1, 0.3, 0.5, 0.7, 0.9), top_ks=(256, 512, 1024, 2048),
                 block_sizes=(16, 32), device_requests=1.5, agreement_prompts=16,
                 agreement_tokens=32, agreement_rows=((4, 16), (4, 32)),
                 depths_by_length=((8192, (0.1, 0.5, 0.9)),), streamed_lengths=(8192,)),
    # The 8k rows alone at top-k 1,024, all-resident and streamed (~40 min on 2 cores).
    "streamed": Size(model="smollm2-135m-instruct", lengths=(8192,), depths=(0.1, 0.5, 0.9),
                     top_ks=(1024,), block_sizes=(16, 32), device_requests=1.5,
                     agreement_prompts=0, agreement_tokens=0, agreement_rows=(),
                     streamed_lengths=(8192,), streamed_prefills=("exact", "sparse")),
    # The full grid's 8k column at block 32 alone (dense + 4 HiSparse rows, ~15 min on 2
    # cores): the column the recorded grid ran at block 16 only.
    "8k_b32": Size(model="smollm2-135m-instruct", lengths=(8192,), depths=(0.1, 0.5, 0.9),
                   top_ks=(256, 512, 1024, 2048), block_sizes=(32,), device_requests=1.5,
                   agreement_prompts=0, agreement_tokens=0, agreement_rows=()),
    # 8k_b32 with int8 key bounds (HiSparseConfig.bounds_dtype="int8"): the same answers?
    "8k_b32_int8": Size(model="smollm2-135m-instruct", lengths=(8192,),
                        depths=(0.1, 0.5, 0.9), top_ks=(256, 512, 1024, 2048),
                        block_sizes=(32,), device_requests=1.5, agreement_prompts=0,
                        agreement_tokens=0, agreement_rows=(), bounds_dtype="int8"),
    # Two prompts: the second one's admission offloads the first (host loads).
    "smoke": Size(model="hisparse-tiny", lengths=(256,), depths=(0.25, 0.75), top_ks=(64, 256),
                  block_sizes=(16,), device_requests=1.5, agreement_prompts=2,
                  agreement_tokens=8, agreement_rows=((4, 8),), streamed_lengths=(256,)),
}


def run(size_name: str = "full") -> dict:
  size = SIZES[size_name]
  from models.loader import load_pretrained  # noqa: PLC0415 (heavy, on use)

  start = time.perf_counter()
  bundle = load_pretrained(size.model)  # (model, config, tokenizer), shared by every engine
  load_s = time.perf_counter() - start
  rows = []
  for length in size.lengths:
    rows += _length_rows(bundle, size, length)
  result = {
      "model": size.model, "checkpoint": checkpoint_figures(size.model),
      "load_s": round(load_s, 1),
      "config": {**dataclasses.asdict(size), "new_tokens": NEW_TOKENS,
                 "forced_tail": FORCED_TAIL, "greedy": True, "hot_buffer_tokens": "top_k",
                 "sparse_threshold_tokens": "top_k", "resident_sparse_min_tokens": 0,
                 "prefix_caching": True,
                 "offload_slack": OFFLOAD_SLACK},
      "rows": rows,
      "dense_accuracy": {str(r["length"]): r["accuracy"] for r in rows if r["config"] == "dense"},
      "smallest_top_k": smallest_top_k(rows, size),
      "agreement": _agreement(bundle, size),
  }
  result["seconds"] = round(time.perf_counter() - start, 1)
  return result


# --- Passkey rows --------------------------------------------------------------------


def _length_rows(bundle, size: Size, length: int) -> list[dict]:
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415
  from models import passkey  # noqa: PLC0415

  tokenizer = bundle[2]
  prompts = passkey.make_passkey_prompts(tokenizer, length - NEW_TOKENS, size.depths_of(length),
                                         seed=size.seed + length)
  tail = tokenizer.encode(FORCED_TAIL, add_special_tokens=False)
  for p in prompts:  # the tail is the prompt's own tokens (no merge across the boundary)
    if list(p.token_ids[-len(tail):]) != tail:
      raise ValueError(f"the passkey prompt does not end in the tokens of {FORCED_TAIL!r}")
  rows = [_passkey_row(bundle, size, length, prompts, len(tail), size.dense_block_size, None)]
  dense = rows[0]
  drop_programs()
  for top_k in size.top_ks:
    for block_size in size.block_sizes_of(length):
      if top_k >= length:
        row = _row_head(length, prompts, block_size, top_k)
        row.update(status="covers", note="top-k covers the whole sequence: dense by "
                   "construction (not run)")
      else:
        # resident_sparse_min_tokens=0: every decode row past top-k is selected, resident
        # or not (the suite measures the selection, not the engine's cost choice).
        hisparse = HiSparseConfig(top_k_tokens=top_k, hot_buffer_tokens=top_k,
                                  sparse_threshold_tokens=top_k, resident_sparse_min_tokens=0,
                                  bounds_dtype=size.bounds_dtype)
        try:
          row = _passkey_row(bundle, size, length, prompts, len(tail), block_size, hisparse)
        except Exception as e:  # noqa: BLE001 (an engine error is a finding of this row)
          row = _row_head(length, prompts, block_size, top_k)
          row.update(status="error", error=f"{type(e).__name__}: {e}")
          print(f"passkey {length:>5} {row['config']}: {row['error']}", flush=True)
        else:
          row["same_answer_as_dense"] = sum(
              a["answer"] == d["answer"] for a, d in zip(row["answers"], dense["answers"]))
      rows.append(row)
      drop_programs()
      if row["status"] == "run" and length in size.streamed_lengths:
        for mode in size.streamed_prefills:
          rows.append(_streamed_row(bundle, size, length, prompts, len(tail), block_size,
                                    dataclasses.replace(hisparse, streamed_prefill=mode),
                                    dense))
          drop_programs()
  return rows


def _streamed_row(bundle, size: Size, length: int, prompts, num_forced: int, block_size: int,
                  hisparse, dense: dict) -> dict:
  """The HiSparse row again with a device pool of STREAMED_DEVICE_FRACTION of a request:
  every prompt is longer than the device pool, so it streams (module doc)."""
  try:
    row = _passkey_row(bundle, size, length, prompts, num_forced, block_size, hisparse,
                       streamed=hisparse.streamed_prefill)
  except Exception as e:  # noqa: BLE001 (an engine error is a finding of this row)
    row = _row_head(length, prompts, block_size, hisparse.top_k_tokens,
                    streamed=hisparse.streamed_prefill)
    row.update(status="error", error=f"{type(e).__name__}: {e}")
    print(f"passkey {length:>5} {row['config']}: {row['error']}", flush=True)
    return row
  row["same_answer_as_dense"] = sum(
      a["answer"] == d["answer"] for a, d in zip(row["answers"], dense["answers"]))
  return row


def _row_head(length: int, prompts, block_size: int, top_k: int | None,
              streamed: str | None = None) -> dict:
  """`streamed`: None, or the streamed row's HiSparseConfig.streamed_prefill."""
  lengths = [len(p.token_ids) for p in prompts]
  config = "dense" if top_k is None else f"top-k {top_k} block {block_size}"
  if streamed:
    config += f" streamed ({STREAMED_DEVICE_FRACTION:.0%}, {streamed} prefill)"
  return {"length": length, "config": config, "block_size": block_size,
          "top_k_tokens": top_k, "num_prompts": len(prompts),
          "prompt_tokens": [min(lengths), max(lengths)], "streamed": bool(streamed),
          "streamed_prefill": streamed}


def _passkey_row(bundle, size: Size, length: int, prompts, num_forced: int, block_size: int,
                 hisparse, streamed: str | None = None) -> dict:
  from models import passkey  # noqa: PLC0415

  row = _row_head(length, prompts, block_size,
                  None if hisparse is None else hisparse.top_k_tokens, streamed)
  if hisparse is not None:
    first_kv = min(len(p.token_ids) for p in prompts) - num_forced + 1
    if not hisparse.is_sparse(first_kv):
      raise ValueError(f"length {length}, top-k {hisparse.top_k_tokens}: the first forced "
                       f"step ({first_kv} tokens) would not be sparse")
  t0 = time.perf_counter()
  engine = make_engine(bundle, size.model, max_model_len=length, block_size=block_size,
                       hisparse=hisparse, num_requests=len(prompts),
                       device_requests=STREAMED_DEVICE_FRACTION if streamed
                       else size.device_requests, streamed=bool(streamed))
  if streamed:  # every prompt longer than the device pool: each one streams
    device_tokens = engine.capacity.tiers[0].num_tokens
    if min(len(p.token_ids) for p in prompts) - num_forced <= device_tokens:
      raise AssertionError(f"a prompt fits the {device_tokens} device tokens")
  t1 = time.perf_counter()
  outs = forced_generate(engine, [p.token_ids for p in prompts], num_forced, NEW_TOKENS)
  t2 = time.perf_counter()
  answers = []
  for p, (tokens, _) in zip(prompts, outs):
    text = engine.tokenizer.decode(tokens)
    answer = passkey.answer_of(text)
    answers.append({"depth": p.depth, "key": p.key, "answer": answer,
                    "right": answer == p.key, "text": text})
  right = sum(a["right"] for a in answers)
  row.update(status="run", num_right=right, accuracy=right / len(prompts), answers=answers,
             host=host_figures(engine), capacity=capacity_figures(engine),
             engine_s=round(t1 - t0, 1), run_s=round(t2 - t1, 1),
             load_avg_1=os.getloadavg()[0],
             hisparse=None if hisparse is None else _hisparse_fields(hisparse))
  print(f"passkey {length:>5} {row['config']:<22} {right}/{len(prompts)} "
        f"{' '.join(str(a['answer']) for a in answers)}  host loads "
        f"{row['host']['host_loads']:,.0f}, offloads {row['host']['offloads']:,.0f} "
        f"({row['engine_s'] + row['run_s']:.0f} s, {num_mappings()} mappings)", flush=True)
  return row


def _hisparse_fields(hisparse) -> dict:
  return {f: getattr(hisparse, f) for f in ("top_k_tokens", "hot_buffer_tokens", "sink_tokens",
                                            "local_tokens", "sparse_threshold_tokens",
                                            "selection", "bounds_dtype",
                                            "streamed_prefill")}


# Streamed rows: the device pool holds this fraction of one request (in blocks), less than
# half of each prompt's KV; the rest of the engine's settings as the row's. One row per
# Size.streamed_prefills (HiSparseConfig.streamed_prefill: each chunk over all its earlier
# blocks, "exact", or over their top-k, "sparse").
STREAMED_DEVICE_FRACTION = 0.45


def smallest_top_k(rows: list[dict], size: Size) -> dict:
  """{length: {block_size: top-k or None}}: the smallest top-k of the grid from which on
  (it and every larger one) accuracy is at least dense's at that length (module doc)."""
  out = {}
  for length in size.lengths:
    dense = next(r for r in rows if r["length"] == length and r["config"] == "dense")
    by_block = {}
    for block_size in size.block_sizes_of(length):
      best = None
      for top_k in sorted(size.top_ks, reverse=True):
        row = next(r for r in rows if r["length"] == length and r["top_k_tokens"] == top_k
                   and r["block_size"] == block_size and not r.get("streamed"))
        if row["status"] == "covers" or (row["status"] == "run"
                                         and row["accuracy"] >= dense["accuracy"]):
          best = top_k
        else:
          break
      # Only a top-k covering the sequence: none of the grid's sparse ones keeps it.
      by_block[str(block_size)] = None if best is not None and best >= length else best
    out[str(length)] = by_block
  return out


# --- Greedy agreement ----------------------------------------------------------------


def _agreement(bundle, size: Size) -> dict:
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415

  if not size.agreement_rows:
    return None
  tokenizer = bundle[2]
  texts = AGREEMENT_PROMPTS[:size.agreement_prompts]
  prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True)
             for t in texts]
  n = size.agreement_tokens
  max_model_len = 16 * math.ceil((max(map(len, prompts)) + n) / 16)
  dense_by_block, rows = {}, []
  for block_size, top_k in size.agreement_rows:
    if block_size not in dense_by_block:
      engine = make_engine(bundle, size.model, max_model_len=max_model_len,
                           block_size=block_size, hisparse=None, num_requests=len(prompts),
                           device_requests=len(prompts))
      dense_by_block[block_size] = [t for t, _ in forced_generate(engine, prompts, 1, n)]
      del engine
      drop_programs()
    hisparse = HiSparseConfig(top_k_tokens=top_k, sparse_threshold_tokens=top_k,
                              resident_sparse_min_tokens=0)
    engine = make_engine(bundle, size.model, max_model_len=max_model_len,
                         block_size=block_size, hisparse=hisparse, num_requests=len(prompts),
                         device_requests=len(prompts))
    sparse = [t for t, _ in forced_generate(engine, prompts, 1, n)]
    del engine
    drop_programs()
    dense = dense_by_block[block_size]
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
              for x, y in zip(sparse, dense)]
    # Decode step i (0: the prompt's last token) attends over len(prompt) + i tokens.
    kv_lens = [len(p) + i for p in prompts for i in range(n)]
    attended = [min(len(p) + i, hisparse.blocks(block_size).top_k_blocks * block_size)
                / (len(p) + i) if hisparse.is_sparse(len(p) + i) else 1.0
                for p in prompts for i in range(n)]
    row = {"config": f"top-k {top_k} block {block_size}", "block_size": block_size,
           "top_k_tokens": top_k, "hisparse": _hisparse_fields(hisparse),
           "tokens_equal": sum(a == b for x, y in zip(sparse, dense) for a, b in zip(x, y)),
           "tokens_compared": sum(map(len, dense)),
           "identical": sum(x == y for x, y in zip(sparse, dense)),
           "common_prefix_mean": sum(prefix) / len(prefix), "common_prefix": prefix,
           "sparse_step_fraction": sum(map(hisparse.is_sparse, kv_lens)) / len(kv_lens),
           "context_attended_mean": sum(attended) / len(attended),
           "texts": [tokenizer.decode(t) for t in sparse]}
    rows.append(row)
    print(f"agreement {row['config']:<20} {row['tokens_equal']}/{row['tokens_compared']} "
          f"prefix {row['common_prefix_mean']:.1f}", flush=True)
  return {"prompts": list(texts), "prompt_tokens": [len(p) for p in prompts],
          "new_tokens": n, "max_model_len": max_model_len, "rows": rows,
          "dense_texts": {str(b): [tokenizer.decode(t) for t in ts]
                          for b, ts in dense_by_block.items()}}


# --- Output --------------------------------------------------------------------------


def answers_cell(row: dict) -> str:
  """The answers of a row, a wrong one marked with '*' ('-': no number)."""
  return " ".join(f"{a['answer'] or '-'}{'' if a['right'] else '*'}" for a in row["answers"])


def format_table(result: dict) -> str:
  rows = []
  for r in result["rows"]:
    if r["status"] != "run":  # covers (not run) or error
      rows.append((f"{r['length']:,}", r["config"], r["status"], "-", "-", "-", "-", "-", "-",
                   "-"))
      continue
    h = r["host"]
    rows.append((f"{r['length']:,}", r["config"], f"{r['num_right']}/{r['num_prompts']}",
                 r["accuracy"], answers_cell(r), f"{h['host_loads']:,.0f}",
                 f"{h['offloads']:,.0f}", h["hot_buffer_hit_ratio"],
                 f"{h['h2d_bytes'] / 2**20:,.1f}", f"{r['engine_s'] + r['run_s']:.0f}"))
  lines = [f"passkey: {result['model']}, answer from sparse decode steps "
           f"({FORCED_TAIL!r} fed as decode steps), greedy; * = wrong",
           common.format_table(("length", "config", "right", "accuracy", "answers",
                                "host loads", "offloads", "hit ratio", "h2d MiB", "s"), rows),
           "", "smallest top-k keeping dense accuracy (block size: top-k)"]
  for length, by_block in result["smallest_top_k"].items():
    cells = ", ".join(f"block {b}: {'none' if k is None else f'{k:,}'}"
                      for b, k in by_block.items())
    lines.append(f"  {int(length):,} (dense {result['dense_accuracy'][length]:.0%}): {cells}")
  a = result["agreement"]
  if a is None:
    return "\n".join(lines)
  lines += ["", f"greedy agreement with dense, {len(a['prompts'])} chat prompts x "
            f"{a['new_tokens']} tokens",
            common.format_table(("config", "tokens equal", "identical", "common prefix",
                                 "sparse steps", "context attended"),
                                [(r["config"], f"{r['tokens_equal']}/{r['tokens_compared']}",
                                  f"{r['identical']}/{len(a['prompts'])}",
                                  r["common_prefix_mean"], r["sparse_step_fraction"],
                                  r["context_attended_mean"]) for r in a["rows"]])]
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  """PNG: accuracy against length; dense, and one line per top-k and block size (the
  lengths where that top-k was run: below it, it covers the whole sequence)."""
  import matplotlib  # optional dependency (the test extra): imported on use

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  lengths = result["config"]["lengths"]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  dense = [r for r in result["rows"] if r["config"] == "dense"]
  ax.plot([r["length"] for r in dense], [r["accuracy"] for r in dense], "k-o", lw=2.5,
          label="dense", zorder=3)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, top_k in enumerate(result["config"]["top_ks"]):
    for j, block_size in enumerate(result["config"]["block_sizes"]):
      run = [r for r in result["rows"] if r["top_k_tokens"] == top_k
             and r["block_size"] == block_size and r["status"] == "run"
             and not r.get("streamed")]
      if run:
        ax.plot([r["length"] for r in run], [r["accuracy"] for r in run],
                ("-", "--", ":")[j % 3], marker="os^"[j % 3], color=colors[i % len(colors)],
                label=f"top-k {top_k:,}, block {block_size}")
      for k, mode in enumerate(("exact", "sparse")):
        streamed = [r for r in result["rows"] if r["top_k_tokens"] == top_k
                    and r["block_size"] == block_size and r["status"] == "run"
                    and r.get("streamed") and r.get("streamed_prefill", "sparse") == mode]
        if streamed:  # points only: one length
          ax.plot([r["length"] for r in streamed],
                  [r["accuracy"] for r in streamed], linestyle="none", marker="*P"[k],
                  markersize=11, color=colors[(i + j) % len(colors)],
                  label=f"top-k {top_k:,}, block {block_size}, streamed, {mode} prefill")
  ax.set_xscale("log", base=2)
  ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
  ax.minorticks_off()
  ax.set_ylim(-0.05, 1.05)
  ax.set_xlabel("sequence length (tokens)")
  ax.set_ylabel("passkey accuracy")
  ax.set_title(f"passkey retrieval, {result['model']}, answer from sparse decode steps",
               fontsize=10)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7, ncol=2, loc="lower left")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)

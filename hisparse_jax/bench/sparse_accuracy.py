"""Retrieval accuracy of the default model through the engine: dense vs HiSparse top-k.

Fresh retrieval prompts of ~1k tokens (models.data.make_retrieval_prompts, a seed the
trainer does not use), greedy; an answer is right when the first word of the output is
the expected word (a weak model may go on without a newline). Each row of the table is
one engine (dense, then top_k_tokens 256 = a quarter of the context, 512,
and 2048 = all blocks, which must equal dense). Prints a table and writes JSON.

  python -m hisparse_jax.bench.sparse_accuracy [--num_prompts=24] [--context_len=1024]
      [--out=results/sparse_accuracy_cpu.json]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_prompts", 24, "Retrieval prompts per configuration.")
flags.DEFINE_integer("context_len", 1024, "Tokens each prompt fills (at most; whole lines).")
flags.DEFINE_integer("prompt_seed", 4243, "Seed of the prompts (not a training seed).")
flags.DEFINE_list("top_k_tokens", ["256", "512", "2048"], "HiSparse budgets to measure.")
flags.DEFINE_integer("sink_tokens", 16, "HiSparse sink tokens (part of the budget).")
flags.DEFINE_integer("local_tokens", 64, "HiSparse local tokens (part of the budget).")
flags.DEFINE_integer("sparse_threshold_tokens", 256, "Sequences longer than this decode "
                     "sparsely.")
flags.DEFINE_string("out", "results/sparse_accuracy_cpu.json", "JSON output path.")

BLOCK_SIZE = 16


def answer_of(text: str) -> str:
  """The first word of a generation (the retrieved value)."""
  words = text.split()
  return words[0] if words else ""
MAX_NEW_TOKENS = 2  # the answer word and its newline


def checkpoint_info() -> dict:
  """Which default-model checkpoint was measured (it is retrained now and then)."""
  import models  # noqa: PLC0415

  path = models.DEFAULT_MODEL_DIR
  info = {"path": path}
  weights = os.path.join(path, "model.safetensors")
  with open(weights, "rb") as f:
    info["model_sha256_12"] = hashlib.sha256(f.read()).hexdigest()[:12]
  info["model_mtime"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(os.path.getmtime(weights)))
  try:
    with open(os.path.join(path, "training_info.json")) as f:
      training = json.load(f)
    last = (training.get("history") or [{}])[-1]
    info["training"] = {k: training.get(k) for k in ("completed_phase", "stopped_early",
                                                     "elapsed_s", "num_params")}
    info["training"]["last_logged"] = {k: last.get(k) for k in ("phase", "step", "loss",
                                                                "kv_acc")}
  except (OSError, ValueError):
    info["training"] = None
  return info


def measure(prompts, hisparse) -> dict:
  from hisparse_jax.llm import LLM  # noqa: PLC0415
  from hisparse_jax.sampling import SamplingParams  # noqa: PLC0415

  llm = LLM(block_size=BLOCK_SIZE, max_model_len=FLAGS.context_len + 128, max_num_seqs=8,
            max_num_batched_tokens=1024, device_kv_gib=0.05, host_pool_gib=0.05,
            hisparse=hisparse)
  start = time.perf_counter()
  outputs = llm.generate([p.text for p in prompts],
                         SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
  wall_s = time.perf_counter() - start
  right = [answer_of(o.text) == p.answer for o, p in zip(outputs, prompts)]
  metrics = llm.metrics()
  return dict(num_right=sum(right), num_prompts=len(prompts),
              accuracy=sum(right) / len(prompts), wall_s=round(wall_s, 2),
              blocks_selected_device=metrics['hisparse_blocks_selected_total{source="device"}'],
              answers=[answer_of(o.text) for o in outputs])


def main(argv):
  del argv
  from hisparse_jax.hisparse_config import HiSparseConfig  # noqa: PLC0415
  from models import data  # noqa: PLC0415

  prompts = data.make_retrieval_prompts(FLAGS.num_prompts, FLAGS.context_len,
                                        seed=FLAGS.prompt_seed)
  lengths = [len(p.token_ids) for p in prompts]
  rows = [("dense", None)]
  for k in map(int, FLAGS.top_k_tokens):
    rows.append((f"top_k_tokens={k}", HiSparseConfig(
        top_k_tokens=k, sink_tokens=FLAGS.sink_tokens, local_tokens=FLAGS.local_tokens,
        sparse_threshold_tokens=FLAGS.sparse_threshold_tokens)))
  results = []
  dense_answers = None
  print(f"{'config':<20} {'right':>7} {'acc':>6} {'= dense':>8} {'blocks read':>12} "
        f"{'wall s':>7}")
  for name, hisparse in rows:
    r = measure(prompts, hisparse)
    dense_answers = dense_answers if dense_answers is not None else r["answers"]
    r["same_answer_as_dense"] = sum(a == b for a, b in zip(r["answers"], dense_answers))
    r["config"] = name
    r["hisparse"] = None if hisparse is None else {
        f: getattr(hisparse, f) for f in ("top_k_tokens", "hot_buffer_tokens", "sink_tokens",
                                          "local_tokens", "sparse_threshold_tokens")}
    results.append(r)
    print(f"{name:<20} {r['num_right']:>3}/{r['num_prompts']:<3} {r['accuracy']:>6.1%} "
          f"{r['same_answer_as_dense']:>4}/{r['num_prompts']:<3} "
          f"{r['blocks_selected_device']:>12,.0f} {r['wall_s']:>7.1f}")
  report = dict(checkpoint=checkpoint_info(), block_size=BLOCK_SIZE,
                context_len=FLAGS.context_len, prompt_tokens=[min(lengths), max(lengths)],
                prompt_seed=FLAGS.prompt_seed, max_new_tokens=MAX_NEW_TOKENS, greedy=True,
                results=results)
  print(f"checkpoint: {json.dumps(report['checkpoint'])}")
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")
  print(f"wrote {FLAGS.out}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)

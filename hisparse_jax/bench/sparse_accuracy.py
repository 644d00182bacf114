"""Retrieval accuracy through the engine, dense vs HiSparse top-k, the answer decoded.

The engine computes prompts with dense (prefill) attention, so an answer sampled from the
prompt's last token would be the dense answer by construction. With `--answer_from=decode`
(default) each request is the prompt without its last token (the queried key); when its
first token is sampled, the bench replaces it with that key (teacher forcing through the
Engine API), so the key is computed by a DECODE step and the answer is sampled there: a
sparse row with HiSparse, over the blocks the indexer selected, resolved through the hot
buffer and the host pool. `--answer_from=prefill` measures the plain serving path.

Fresh retrieval prompts of ~1k tokens (models.data.make_retrieval_prompts, a seed the
trainer does not use), greedy; an answer is right when the first word of the output is
the expected word (a weak model may go on without a newline). Each row of the table is
one engine (dense, then top_k_tokens 256 = a quarter of the context, 512,
and 2048 = all blocks, which must equal dense). The device pool holds the KV of
`--device_prompts` prompts (plus HiSparse's indexer and hot-buffer bytes), so with
HiSparse the requests are offloaded and their selected blocks are loaded from the host
pool into hot buffers (the table shows the loads). Prints a table and writes JSON.

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
flags.DEFINE_integer("device_prompts", 3, "The device KV pool holds this many prompts.")
flags.DEFINE_enum("answer_from", "decode", ["decode", "prefill"],
                  "decode: the queried key is fed as a decode step and the answer is sampled "
                  "from it; prefill: the answer is the first token after the whole prompt.")
flags.DEFINE_integer("block_size", 16, "Tokens per KV block (also the selection unit).")
flags.DEFINE_string("out", "results/sparse_accuracy_cpu.json", "JSON output path.")
flags.DEFINE_list("kv_cache_dtypes", ["auto"], "KV cache dtypes to measure (auto, int8): "
                  "each configuration runs once per dtype.")
flags.DEFINE_integer("agreement_tokens", 0, "When > 0: also generate this many greedy "
                     "tokens after each whole prompt and report, per configuration, how "
                     "many agree position by position with the first dtype's.")



def answer_of(text: str) -> str:
  """The first word of a generation (the retrieved value)."""
  words = text.split()
  return words[0] if words else ""
MAX_NEW_TOKENS = 2  # the answer word and its newline


def machine_info() -> dict:
  import platform  # noqa: PLC0415

  import jax  # noqa: PLC0415

  return dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
              jax=jax.__version__, backend=jax.default_backend(),
              load_average=os.getloadavg()[0])


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
    info["training"] = {k: training.get(k) for k in ("recipe", "eval", "num_params")}
  except (OSError, ValueError):
    info["training"] = None
  return info


def engine_budgets(hisparse, max_model_len: int, num_prompts: int,
                   kv_cache_dtype: str = "auto") -> dict:
  """device_kv_gib and host_pool_gib: the device holds `--device_prompts` prompts of KV
  plus what HiSparse reserves (indexer and hot-buffer bytes); the host holds them all."""
  from hisparse_jax.kv_cache.capacity import hisparse_capacity  # noqa: PLC0415
  from hisparse_jax.kv_cache.kv_pool import KVCacheSpec  # noqa: PLC0415
  from models.loader import load_config  # noqa: PLC0415

  spec = KVCacheSpec.from_model_config(load_config(None), "float32", FLAGS.block_size,
                                       kv_cache_dtype)
  blocks_per_prompt = -(-max_model_len // FLAGS.block_size)
  device_blocks = FLAGS.device_prompts * blocks_per_prompt + 1
  host_blocks = (num_prompts + 2) * blocks_per_prompt + 1
  reserved = 0
  if hisparse is not None:
    reserved = hisparse_capacity(spec, hisparse, num_device_blocks=device_blocks,
                                 num_host_blocks=host_blocks, max_num_seqs=MAX_NUM_SEQS,
                                 max_model_len=max_model_len).reserved_bytes
  gib = 2**30
  return dict(device_kv_gib=(device_blocks * spec.bytes_per_block + reserved + 512) / gib,
              host_pool_gib=(host_blocks * spec.bytes_per_block + 512) / gib)


MAX_NUM_SEQS = 8


def measure(prompts, hisparse, kv_cache_dtype: str = "auto") -> dict:
  from hisparse_jax.engine.sampling import SamplingParams  # noqa: PLC0415
  from hisparse_jax.entrypoints.llm import LLM  # noqa: PLC0415

  max_model_len = FLAGS.context_len + 128
  llm = LLM(block_size=FLAGS.block_size, max_model_len=max_model_len, max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=4096, hisparse=hisparse, kv_cache_dtype=kv_cache_dtype,
            # Teacher forcing (decode_answers) replaces a sampled token on the host before
            # the next step: with async scheduling that step already took it on the device.
            async_scheduling=False,
            **engine_budgets(hisparse, max_model_len, len(prompts), kv_cache_dtype))
  start = time.perf_counter()
  if FLAGS.answer_from == "prefill":
    outputs = llm.generate([p.text for p in prompts],
                           SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0,
                                          ignore_eos=True))
    answers = [answer_of(o.outputs[0].text) for o in outputs]
  else:
    answers = [answer_of(llm.engine.tokenizer.decode([t]))
               for t in decode_answers(llm.engine, prompts)]
  wall_s = time.perf_counter() - start
  continuations = []
  if FLAGS.agreement_tokens:
    outputs = llm.generate([p.text for p in prompts],
                           SamplingParams(max_tokens=FLAGS.agreement_tokens, temperature=0.0,
                                          ignore_eos=True))
    continuations = [list(o.outputs[0].token_ids) for o in outputs]
  right = [a == p.answer for a, p in zip(answers, prompts)]
  m = llm.metrics()
  selected = {s: m[f'hisparse_blocks_selected_total{{source="{s}"}}']
              for s in ("device", "hot", "host")}
  return dict(num_right=sum(right), num_prompts=len(prompts),
              accuracy=sum(right) / len(prompts), wall_s=round(wall_s, 2),
              blocks_selected=selected, blocks_read=sum(selected.values()),
              hot_buffer_loads=m["hisparse_hot_buffer_loads_total"],
              hot_buffer_hit_rate=m["hisparse_hot_buffer_hit_rate"],
              offloads=m["hisparse_offloads_total"],
              preemptions=m["hisparse_preemptions_total"],
              answers=answers, continuations=continuations)


def decode_answers(engine, prompts) -> list[int]:
  """The answer token of each prompt, sampled from a decode step that computes the
  prompt's last token (module docstring)."""
  from hisparse_jax.engine.sampling import SamplingParams  # noqa: PLC0415

  params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
  ids = [engine.add_request(prompt_token_ids=p.token_ids[:-1], sampling_params=params)
         for p in prompts]
  forced = {rid: p.token_ids[-1] for rid, p in zip(ids, prompts)}
  tokens = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        tokens[out.request_id] = out.outputs[0].token_ids
    for rid, key in list(forced.items()):
      request = engine.requests.get(rid)
      if request is not None and len(request.output_token_ids) == 1:
        request.output_token_ids[0] = key  # fed to the next (decode) step
        del forced[rid]
  assert not forced and all(tokens[rid][0] == p.token_ids[-1] for rid, p in zip(ids, prompts))
  return [tokens[rid][1] for rid in ids]


def main(argv):
  del argv
  from hisparse_jax.sparse.config import HiSparseConfig  # noqa: PLC0415
  from models import data  # noqa: PLC0415

  prompts = data.make_retrieval_prompts(FLAGS.num_prompts, FLAGS.context_len,
                                        seed=FLAGS.prompt_seed)
  lengths = [len(p.token_ids) for p in prompts]
  configs = [("dense", None)]
  for k in map(int, FLAGS.top_k_tokens):
    configs.append((f"top_k_tokens={k}", HiSparseConfig(
        top_k_tokens=k, sink_tokens=FLAGS.sink_tokens, local_tokens=FLAGS.local_tokens,
        sparse_threshold_tokens=FLAGS.sparse_threshold_tokens,
        resident_sparse_min_tokens=0)))  # every long row selected: accuracy of the selection
  rows = [(name if dtype == "auto" else f"{name} {dtype}", hisparse, dtype)
          for name, hisparse in configs for dtype in FLAGS.kv_cache_dtypes]
  results = []
  dense_answers = None
  first_dtype = {}  # config -> the continuations of the first dtype measured
  print(f"{'config':<26} {'right':>7} {'acc':>6} {'= dense':>8} {'blocks read':>12} "
        f"{'host loads':>10} {'offloads':>8} {'wall s':>7}"
        + (f" {'tokens = ' + FLAGS.kv_cache_dtypes[0]:>16}" if FLAGS.agreement_tokens else ""))
  for name, hisparse, dtype in rows:
    r = measure(prompts, hisparse, dtype)
    dense_answers = dense_answers if dense_answers is not None else r["answers"]
    r["same_answer_as_dense"] = sum(a == b for a, b in zip(r["answers"], dense_answers))
    r["config"] = name
    r["kv_cache_dtype"] = dtype
    agreement = ""
    if FLAGS.agreement_tokens:
      base = first_dtype.setdefault(hisparse, r["continuations"])
      same = sum(a == b for x, y in zip(r["continuations"], base) for a, b in zip(x, y))
      total = sum(len(x) for x in base)
      r["tokens_same_as_first_dtype"] = same
      r["tokens_compared"] = total
      r["continuations_identical"] = sum(x == y for x, y in zip(r["continuations"], base))
      prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
                for x, y in zip(r["continuations"], base)]
      r["common_prefix_tokens_mean"] = sum(prefix) / max(1, len(prefix))
      agreement = f" {same:>7}/{total:<8} prefix {r['common_prefix_tokens_mean']:.1f}"
    r["hisparse"] = None if hisparse is None else {
        f: getattr(hisparse, f) for f in ("top_k_tokens", "hot_buffer_tokens", "sink_tokens",
                                          "local_tokens", "sparse_threshold_tokens")}
    results.append(r)
    print(f"{name:<26} {r['num_right']:>3}/{r['num_prompts']:<3} {r['accuracy']:>6.1%} "
          f"{r['same_answer_as_dense']:>4}/{r['num_prompts']:<3} "
          f"{r['blocks_read']:>12,.0f} {r['hot_buffer_loads']:>10,.0f} "
          f"{r['offloads']:>8,.0f} {r['wall_s']:>7.1f}" + agreement)
  report = dict(checkpoint=checkpoint_info(), block_size=FLAGS.block_size,
                device_prompts=FLAGS.device_prompts, machine=machine_info(),
                context_len=FLAGS.context_len, prompt_tokens=[min(lengths), max(lengths)],
                prompt_seed=FLAGS.prompt_seed, max_new_tokens=MAX_NEW_TOKENS, greedy=True,
                answer_from=FLAGS.answer_from, agreement_tokens=FLAGS.agreement_tokens,
                results=results)
  print(f"checkpoint: {json.dumps(report['checkpoint'])}")
  os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")
  print(f"wrote {FLAGS.out}", file=sys.stderr)


if __name__ == "__main__":
  app.run(main)

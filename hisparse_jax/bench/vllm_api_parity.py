"""Sampling features against vLLM's CPU build on the same checkpoint: penalties,
min_tokens, logprobs, prompt logprobs, n > 1 and stop strings give the same tokens, text
and finish reasons.

    make peers                                             # once: .venv-vllm
    .venv/bin/python -m hisparse_jax.bench.vllm_api_parity --out results/vllm_api_parity_cpu.json

This engine runs in this process; vLLM runs this same file with `--engine=vllm` under
`.venv-vllm/bin/python` (its environment has no jax: only the standard library is imported
at the top), reading the cases as JSON on stdin and writing its outputs as JSON on stdout.
Both get the same token-id prompts (the default model's `key: value` text) with the same
`SamplingParams` keywords, float32, prefix caching off. Per case the table says whether
the tokens (of every completion, with n > 1), the text, the finish reason and the stop
reason are identical, and the largest |logprob difference| over the tokens both engines
report, prompt logprobs included (the goal is 1e-4).
Without `.venv-vllm` the script says so and writes a JSON that says "skipped". The exit
status is 1 when any case differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_PYTHON = os.path.join(REPO_ROOT, ".venv-vllm", "bin", "python")
MAX_MODEL_LEN = 512
LOGPROB_GOAL = 1e-4

# name -> SamplingParams keywords (vLLM's names; every case greedy unless it says).
GREEDY = {"temperature": 0.0, "max_tokens": 24}
CASES = {
    "greedy": dict(GREEDY, ignore_eos=True),
    "presence+frequency": dict(GREEDY, ignore_eos=True, presence_penalty=1.5,
                               frequency_penalty=0.5),
    "repetition 1.3": dict(GREEDY, ignore_eos=True, repetition_penalty=1.3),
    "repetition 0.8": dict(GREEDY, ignore_eos=True, repetition_penalty=0.8),
    "all penalties": dict(GREEDY, ignore_eos=True, presence_penalty=-0.5,
                          frequency_penalty=1.0, repetition_penalty=1.2),
    "logprobs 5": dict(GREEDY, ignore_eos=True, logprobs=5),
    "logprobs 0 + penalties": dict(GREEDY, ignore_eos=True, logprobs=0,
                                   frequency_penalty=0.7),
    "prompt_logprobs 3": dict(GREEDY, max_tokens=4, ignore_eos=True, prompt_logprobs=3),
    # (vLLM refuses n > 1 when greedy; top_k 1 samples the most likely token all the same)
    "n 3, top_k 1": dict(GREEDY, temperature=1.0, top_k=1, ignore_eos=True, n=3, logprobs=2),
    "stop ' '": dict(GREEDY, stop=[" "]),
    "min_tokens 6, stop ' '": dict(GREEDY, stop=[" "], min_tokens=6),
}
# The greedy outputs' second tokens become stop tokens (min_tokens must hold them back),
# and their fourth words stop strings (each within one output, across a token boundary
# with the space before it).
STOP_TOKEN_CASES = {
    "stop token": dict(GREEDY),
    "stop token, min_tokens 5": dict(GREEDY, min_tokens=5),
}
STOP_WORD_CASES = {
    "stop word": dict(GREEDY),
    "stop word, kept": dict(GREEDY, include_stop_str_in_output=True),
    "stop word, min_tokens 6": dict(GREEDY, min_tokens=6),
}


def _prompts():
  from models import data  # noqa: PLC0415 (this engine's side only)

  return [p.token_ids for p in data.make_retrieval_prompts(3, 120, seed=17)]


def _vllm_worker() -> None:
  """The peer side: cases on stdin, outputs on stdout (run by .venv-vllm's Python)."""
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
  protocol = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # whatever vLLM prints goes to stderr
  from vllm import LLM, SamplingParams  # noqa: PLC0415

  call = json.load(sys.stdin)
  llm = LLM(model=call["model"], dtype="float32", max_model_len=call["max_model_len"],
            enable_prefix_caching=False, seed=0)
  results = {}
  for name, case in call["cases"].items():
    outputs = llm.generate([{"prompt_token_ids": p} for p in call["prompts"]],
                           SamplingParams(**case), use_tqdm=False)
    results[name] = [_record(o) for o in outputs]
  protocol.write(json.dumps(results))
  protocol.flush()


def _logprobs(positions) -> list | None:
  if positions is None:
    return None
  return [None if p is None else {str(t): lp.logprob for t, lp in p.items()}
          for p in positions]


def _record(output) -> dict:
  """A request's output as JSON: its first completion's fields, every completion's
  tokens and logprobs (n > 1), and the prompt logprobs."""
  c = output.outputs[0]
  return {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
          "stop_reason": c.stop_reason, "logprobs": _logprobs(c.logprobs),
          "completions": [list(x.token_ids) for x in output.outputs],
          "completion_logprobs": [_logprobs(x.logprobs) for x in output.outputs],
          "prompt_logprobs": _logprobs(output.prompt_logprobs)}


def _ours(model, prompts, cases) -> dict:
  from hisparse_jax import LLM, SamplingParams  # noqa: PLC0415

  llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, device_kv_gib=0.05,
            host_pool_gib=0.05, enable_prefix_caching=False)
  return {name: [_record(o) for o in llm.generate(
              [{"prompt_token_ids": p} for p in prompts], SamplingParams(**case),
              use_tqdm=False)]
          for name, case in cases.items()}


def _peer(model, prompts, cases) -> dict:
  call = {"model": model, "max_model_len": MAX_MODEL_LEN, "prompts": prompts, "cases": cases}
  proc = subprocess.run([PEER_PYTHON, os.path.abspath(__file__), "--engine=vllm"],
                        input=json.dumps(call), capture_output=True, text=True, timeout=1800,
                        cwd=REPO_ROOT)
  if proc.returncode:
    raise RuntimeError(f"the vLLM worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout)


def compare(ours: dict, theirs: dict) -> dict:
  rows = {}
  for name in ours:
    a, b = ours[name], theirs[name]
    row = {"tokens_identical": all(x["completions"] == y["completions"] for x, y in zip(a, b)),
           "text_identical": all(x["text"] == y["text"] for x, y in zip(a, b)),
           "finish_identical": all(x["finish_reason"] == y["finish_reason"]
                                   and x["stop_reason"] == y["stop_reason"]
                                   for x, y in zip(a, b)),
           "finish_reasons": sorted({x["finish_reason"] for x in a}),
           "num_tokens": [len(x["token_ids"]) for x in a]}
    diffs = []
    for x, y in zip(a, b):
      pairs = [(x["prompt_logprobs"] or [], y["prompt_logprobs"] or [])]
      pairs += zip(x["completion_logprobs"], y["completion_logprobs"])
      for ours_lp, theirs_lp in pairs:
        for px, py in zip(ours_lp or [], theirs_lp or []):
          if px is not None and py is not None:
            diffs += [abs(px[t] - py[t]) for t in set(px) & set(py)]
    row["max_logprob_diff"] = max(diffs) if diffs else None
    row["same"] = (row["tokens_identical"] and row["text_identical"]
                   and row["finish_identical"]
                   and (row["max_logprob_diff"] is None
                        or row["max_logprob_diff"] <= LOGPROB_GOAL))
    rows[name] = row
  return rows


def format_table(result: dict) -> str:
  if result.get("skipped"):
    return f"vllm_api_parity skipped: {result['skipped']}"
  lines = [f"{'case':28s} {'tokens':>7s} {'text':>6s} {'finish':>7s} {'max |dlogprob|':>15s}"]
  for name, row in result["cases"].items():
    lp = row["max_logprob_diff"]
    lines.append(f"{name:28s} {_yes(row['tokens_identical']):>7s} "
                 f"{_yes(row['text_identical']):>6s} {_yes(row['finish_identical']):>7s} "
                 f"{'-' if lp is None else f'{lp:.2e}':>15s}")
  lines.append(f"all cases identical (logprobs within {LOGPROB_GOAL:g}): "
               f"{_yes(result['all_same'])}")
  return "\n".join(lines)


def _yes(x: bool) -> str:
  return "yes" if x else "NO"


def run(model: str | None = None) -> dict:
  import models  # noqa: PLC0415
  from hisparse_jax.bench import common  # noqa: PLC0415

  model = model or models.DEFAULT_MODEL_DIR
  if not os.path.exists(PEER_PYTHON):
    return {"skipped": f"{PEER_PYTHON} is absent (make peers builds it)"}
  prompts = _prompts()
  greedy = _ours(model, prompts, {"greedy": CASES["greedy"]})["greedy"]
  cases = dict(CASES)
  stop_tokens = sorted({g["token_ids"][1] for g in greedy})
  for name, case in STOP_TOKEN_CASES.items():
    cases[name] = dict(case, stop_token_ids=stop_tokens)
  stop_words = sorted({" " + g["text"].split()[3] for g in greedy})
  for name, case in STOP_WORD_CASES.items():
    cases[name] = dict(case, stop=stop_words)
  ours, theirs = _ours(model, prompts, cases), _peer(model, prompts, cases)
  rows = compare(ours, theirs)
  return {"machine": common.machine(), "model": model, "prompts": prompts,
          "cases_params": cases, "cases": rows, "all_same": all(r["same"] for r in rows.values()),
          "outputs": {"hisparse_jax": ours, "vllm": theirs}}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--engine", choices=("hisparse", "vllm"), default="hisparse")
  parser.add_argument("--model", default=None)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  if args.engine == "vllm":
    _vllm_worker()
    return
  result = run(args.model)
  print(format_table(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  sys.exit(0 if result.get("skipped") or result["all_same"] else 1)


if __name__ == "__main__":  # vLLM starts worker processes: the guard it requires
  main()

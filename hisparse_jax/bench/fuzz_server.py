"""Fuzzing `hisparse-jax serve` against its own OpenAPI schema (schemathesis).

    python -m hisparse_jax.bench.fuzz_server [--examples=N] [--seed=S] [--workers=W]
        [--slow_s=S] [--out=results/fuzz_serve.json] [serve's engine flags]

For every operation in the server's /openapi.json, schemathesis generates up to N cases
of each mode: positive (bodies that fit the schema, any values in it: huge seeds, odd
floats, unicode prompts, lists of prompts) and negative (bodies that do not: wrong types,
missing fields, the key left out); a route without a body gets a third as many (its
cases differ in their auth only; /health and /metrics, without any input, one). The
cases are drawn first, from `--seed`
(Hypothesis' generation is deterministic given it), then sent by `--workers` threads at
once (the engine batches the ones it runs) with the API key's header. Each response goes
through schemathesis' checks: no 5xx (`not_a_server_error`), a status the schema lists
for the route (`status_code_conformance`), its content type (`content_type_conformance`),
its body against that status' schema (`response_schema_conformance`). A request slower
than `--slow_s` (a server that hangs on what it was sent) or that gets no answer counts
as a failure too. Last, a normal completion must still answer 200.

The JSON summary: requests by operation and by mode, status counts (by operation too),
5xx count, failures (check, operation, status, title, message and a curl line to repeat
it), the slowest requests, seconds. Exit status 1 when anything failed.
`tests/hisparse_jax/entrypoints/test_fuzz.py` runs the same with a bounded N in
`make test`; this command is the larger run.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import sys
import threading
import time

# The engine flags of the fuzzed server: a short max_model_len, so whatever max_tokens a
# case asks for, a request ends soon; small pools (the host pool and preemption in play).
ENGINE_FLAGS = ("--max_model_len=256", "--device_kv_gib=0.0015", "--host_pool_gib=0.05",
                "--block_size=16", "--max_num_seqs=16")
API_KEY = "fuzz-key"
MODEL_NAME = "tiny"


def _checks() -> list:
  from schemathesis.checks import not_a_server_error  # noqa: PLC0415
  from schemathesis.specs.openapi.checks import (  # noqa: PLC0415
      content_type_conformance,
      response_schema_conformance,
      status_code_conformance,
  )

  return [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def generate_cases(schema, examples: int, seed: int) -> list:
  """[(operation label, mode, case)]: up to `examples` cases of each operation with a
  body and mode (a third as many for one without), drawn with Hypothesis from `seed` (no
  HTTP yet). A mode an operation has no case of (negative for a route without inputs) is
  left out."""
  import hypothesis  # noqa: PLC0415
  from schemathesis import GenerationMode  # noqa: PLC0415

  out = []
  for result in schema.get_all_operations():
    operation = result.ok()
    # (a route without a body varies only in its auth: a third as many)
    num = examples if operation.body else max(1, examples // 3)
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
      cases: list = []

      @hypothesis.seed(seed)
      @hypothesis.settings(max_examples=num, database=None, deadline=None,
                           phases=[hypothesis.Phase.generate],
                           suppress_health_check=list(hypothesis.HealthCheck))
      @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
      def collect(case):
        cases.append(case)  # noqa: B023 (run at once, below)

      try:
        collect()
      except hypothesis.errors.Unsatisfiable:
        pass  # (nothing to negate)
      except Exception as e:  # noqa: BLE001 (schemathesis' "cannot generate" errors)
        if mode is GenerationMode.POSITIVE:
          raise
        print(f"{operation.label} {mode.value}: no cases ({type(e).__name__})", file=sys.stderr)
      out.extend((operation.label, mode.value, case) for case in cases)
  return out


def fuzz(url: str, *, examples: int, seed: int = 0, api_key: str | None = None,
         workers: int = 8, timeout_s: float = 300.0, slow_s: float = 120.0) -> dict:
  """Fuzzes the server at `url` (see the module's docstring); returns the summary."""
  import requests  # noqa: PLC0415 (schemathesis' transport)
  import schemathesis  # noqa: PLC0415

  start = time.perf_counter()
  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  # (the curl lines in failures show every field but the key: schemathesis would hide
  # max_tokens and the like, their names hold "token")
  config = schemathesis.Config.from_dict({"output": {"sanitization": {
      "keys-to-sanitize": ["authorization"], "sensitive-markers": ["authorization"]}}})
  schema = schemathesis.openapi.from_url(url + "/openapi.json", config=config, headers=headers)
  cases = generate_cases(schema, examples, seed)
  generated_s = time.perf_counter() - start
  checks = _checks()
  local = threading.local()

  def send(item):
    label, mode, case = item
    session = getattr(local, "session", None)
    if session is None:
      session = local.session = requests.Session()
    t0 = time.perf_counter()
    record = {"operation": label, "mode": mode, "status": None, "seconds": None,
              "failures": [], "case": case}
    try:
      response = case.call(base_url=url, session=session, headers=headers, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 (no answer: a hang or a dropped connection)
      record["seconds"] = time.perf_counter() - t0
      record["failures"].append({"check": "no_response", "title": type(e).__name__,
                                 "message": str(e)[:500]})
      record["curl"] = case.as_curl_command(headers=headers)
      return record
    record["seconds"] = time.perf_counter() - t0
    record["status"] = response.status_code
    try:
      case.validate_response(response, checks=checks, headers=headers)
    except BaseException as e:  # noqa: BLE001 (FailureGroup: each failed check)
      for failure in getattr(e, "exceptions", (e,)):
        names = getattr(failure, "checks", ()) or (type(failure).__name__,)
        record["failures"].append({
            "check": names[0], "title": getattr(failure, "title", type(failure).__name__),
            "message": str(getattr(failure, "message", failure))[:1000]})
    if record["seconds"] > slow_s:
      record["failures"].append({"check": "slow", "title": "slower than slow_s",
                                 "message": f"{record['seconds']:.1f} s > {slow_s} s"})
    if record["failures"]:
      record["curl"] = case.as_curl_command(headers=headers)
      record["body"] = response.text[:500]
    return record

  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    records = list(pool.map(send, cases))

  by_operation = collections.Counter(r["operation"] for r in records)
  by_mode = collections.Counter(f"{r['operation']} {r['mode']}" for r in records)
  statuses = collections.Counter(str(r["status"]) for r in records)
  statuses_by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for r in records:
    statuses_by_op[r["operation"]][str(r["status"])] += 1
  failures = [{"operation": r["operation"], "mode": r["mode"], "status": r["status"],
               **f, "curl": r.get("curl"), "body": r.get("body")}
              for r in records for f in r["failures"]]
  slowest = sorted(records, key=lambda r: -r["seconds"])[:10]
  return {
      "url": url, "examples_per_operation_and_mode": examples, "seed": seed,
      "workers": workers, "schemathesis": schemathesis.__version__,
      "checks": [c.__name__ for c in checks] + ["no_response", "slow"],
      "operations": sorted(by_operation), "requests": len(records),
      "requests_by_operation": dict(sorted(by_operation.items())),
      "requests_by_operation_and_mode": dict(sorted(by_mode.items())),
      "status_counts": dict(sorted(statuses.items())),
      "status_counts_by_operation": {k: dict(sorted(v.items()))
                                     for k, v in sorted(statuses_by_op.items())},
      "responses_5xx": sum(1 for r in records if r["status"] and r["status"] >= 500),
      "failures": failures, "num_failures": len(failures),
      "slowest": [{**{k: r[k] for k in ("operation", "mode", "status", "seconds")},
                   "curl": r["case"].as_curl_command(headers=headers)} for r in slowest],
      "generate_seconds": generated_s, "seconds": time.perf_counter() - start,
  }


def normal_completion(url: str, api_key: str | None, model: str) -> int:
  """The status of a plain completion (after the fuzzing: the server still answers)."""
  import httpx  # noqa: PLC0415

  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  r = httpx.post(url + "/v1/completions", headers=headers, timeout=120,
                 json={"model": model, "prompt": "baki:", "max_tokens": 4})
  ok = r.status_code == 200 and len(r.json()["choices"]) == 1
  return r.status_code if ok else -r.status_code


def server_metrics(server) -> dict[str, float]:
  """What the engine did meanwhile: tokens, steps, compiles (where the time went)."""
  names = ("hisparse_generation_tokens_total", "hisparse_prompt_tokens_total",
           "hisparse_step_seconds_count", "hisparse_step_seconds_sum", "hisparse_step_compiles",
           "hisparse_preemptions_total", "hisparse_requests_total")
  return {k: v for k, v in server.metrics().items() if k.startswith(names)}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--examples", type=int, default=400,
                      help="cases per operation with a body and mode (default 400)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workers", type=int, default=8, help="requests in flight at once")
  parser.add_argument("--slow_s", type=float, default=120.0,
                      help="a request slower than this counts as a failure (default 120)")
  parser.add_argument("--out", default="results/fuzz_serve.json")
  parser.epilog = (f"Any other flag is serve's (its engine flags); without any: "
                   f"{' '.join(ENGINE_FLAGS)}")
  args, serve_flags = parser.parse_known_args(argv)

  import httpx  # noqa: PLC0415

  from hisparse_jax.bench.serve_load import ServerProcess  # noqa: PLC0415

  flags = tuple(serve_flags) or ENGINE_FLAGS
  server = ServerProcess(f"--api_key={API_KEY}", f"--served_model_name={MODEL_NAME}", *flags)
  summary: dict = {"engine_flags": list(flags)}
  try:
    summary.update(fuzz(server.url, examples=args.examples, seed=args.seed, api_key=API_KEY,
                        workers=args.workers, slow_s=args.slow_s))
    try:
      summary["normal_completion_status"] = normal_completion(server.url, API_KEY, MODEL_NAME)
      summary["server_metrics"] = server_metrics(server)
    except httpx.HTTPError as e:  # (the server is gone: its log below says why)
      summary["normal_completion_status"] = f"{type(e).__name__}: {e}"
  finally:
    summary["server_died"] = server.proc.poll()  # (None: still up, stopped next)
    rc = server.stop()
  summary["server_exit_status"] = rc
  # (all of a crash's dump: every thread's stack)
  summary["server_log_tail"] = server.log[-400 if summary["server_died"] else -40:]
  if os.path.dirname(args.out):
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(summary, f, indent=1)
  print(json.dumps({k: summary.get(k) for k in (
      "requests", "requests_by_operation", "status_counts", "responses_5xx", "num_failures",
      "normal_completion_status", "server_died", "seconds", "server_metrics")}, indent=1))
  for failure in summary["failures"][:20]:
    print(f"FAILED {failure['operation']} ({failure['mode']}) -> {failure['status']}: "
          f"{failure['check']}: {failure['title']}\n  {failure['message'][:300]}\n"
          f"  {failure['curl']}", file=sys.stderr)
  ok = (summary["num_failures"] == 0 and summary["normal_completion_status"] == 200
        and rc == 0)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())

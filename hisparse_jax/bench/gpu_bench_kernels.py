"""`make gpu-bench`, kernel part: each attention kernel of the engine at its real shapes,
beside its peers on the same shapes, each output checked against the kernel's reference
in the same run.

  python -m hisparse_jax.bench.gpu_bench_kernels --size=smoke|full --out FILE.json \\
      [--budget_s N] [--only paged,paged_8bit,ragged,prefill,sparse_mla,select] \\
      [--torch_python PATH]

Kernels (gpu_bench_cases: FULL sizes, SMOKE the same structure at tiny shapes):

  paged       decode, GQA 32:8, head_dim 128, block 16, bf16, batch 1/32/128 x 4k-128k:
              ours (Triton; Mosaic GPU on sm_90), our jnp reference, jax's Pallas
              paged_attention and decode_attention, XLA and cuDNN dot_product_attention,
              torch SDPA flash / cuDNN (gpu_bench_torch.py in a subprocess: the python
              that imports torch, this one or --torch_python), tokamax's
              dot_product_attention (Mosaic GPU, Triton, xla) on a 1-token query
  paged_8bit  the same over int8 and fp8_e4m3 pages (bytes as stored, scales included;
              ours: Triton, Mosaic GPU on sm_90; `speedup_vs_bf16` against ours at the
              same batch and context)
  ragged      a mixed step (prefill chunks of 1,024 beside decode rows)
  prefill     8k causal: ours (the ragged kernel over pages) vs cuDNN, attention_mgpu, XLA,
              tokamax (Mosaic GPU, Triton, xla) and jax-linear-attention (gpu_bench_peers.py)
  sparse_mla  DeepSeek-V3.2 sparse MLA decode (32 x 128 heads x 512+64, top-k 2,048);
              jax-linear-attention's DSA kernel refuses these shapes (a skip, its words)
  select      HiSparse's block selection at 64k context (bounds scoring + top-k): ours
              (the bounds scored in place by kernels_pallas.block_scores; and the jnp
              path over gathered bounds); `select_over_attention` against ours' paged
              decode at the same batch over its top-k tokens (ours-triton-int8: over
              int8 bounds); and DSA's select at DeepSeek-V3.2's indexer
              (kernels_pallas.index_scores + top-k; ours-triton-fp8 / -int8: the same keys
              stored 8-bit, read in place) against our sparse MLA decode

Each row: median and min ms, bytes, FLOPs, GB/s, TFLOP/s, their shares of the device's
peaks (kernels_pallas.bench.DEVICE_PEAKS), the roofline fraction (max(bytes / HBM,
FLOPs / peak) / time; None on CPU) and the correctness against the reference (max abs
error, ok by the dtype's tolerance relative to the reference's largest value). Peers that
need contiguous K/V get it, gathered out of the same pool before timing (their note says
so). GPU times are CUPTI kernel times (jax's Mosaic GPU profiler), wall clock where it is
unavailable. `--budget_s` is checked before each case and impl: what the budget leaves out
is listed in `skipped`. Exit status 1 if any row is incorrect or one of ours fails.
On a CPU (`--size=smoke`, its default) the Pallas kernels run in interpret mode and the
GPU-only peers are skipped with the reason: a check of this script, not of speed.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TORCH_SCRIPT = Path(__file__).with_name("gpu_bench_torch.py")
DEFAULT_BUDGET_S = {"full": 190.0, "smoke": 120.0}
REPS = {"full": 10, "smoke": 2}
# Largest |out - ref| / max |ref| accepted, by the output's dtype.
TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-4}
MARGIN_S = 3.0  # an impl is not started with less than this left of the budget


def _jax():
  import jax  # noqa: PLC0415  (after the environment is set: see main)

  return jax


class Bench:
  """Runs cases within one budget and collects rows and skipped entries."""

  def __init__(self, size: str, budget_s: float, reps: int):
    from hisparse_jax.bench import gpu_bench_cases as cases  # noqa: PLC0415
    from hisparse_jax.bench import gpu_bench_select  # noqa: PLC0415
    from kernels_pallas import bench as kbench  # noqa: PLC0415

    self.cases, self.kbench = cases, kbench
    self.builders = {**cases.BUILDERS, "select": gpu_bench_select.all_select_cases}
    self.size, self.budget_s, self.reps = size, budget_s, reps
    self.t0 = time.monotonic()
    self.cfg = cases.FULL if size == "full" else cases.SMOKE
    self.env = cases.environment()
    jax = _jax()
    self.peaks = kbench.device_peaks(jax.devices()[0].device_kind) if self.env.on_gpu \
        else None
    self.rows: list[dict] = []
    self.skipped: list[dict] = []
    self.failures: list[str] = []
    self.timer_note = ""
    self._cupti = self.env.on_gpu

  def left_s(self) -> float:
    return self.budget_s - (time.monotonic() - self.t0)

  def skip(self, kernel: str, impl: str, shape, reason: str) -> None:
    self.skipped.append({"kernel": kernel, "impl": impl, "shape": shape, "reason": reason})

  def out_of_budget(self) -> str:
    return (f"budget: {time.monotonic() - self.t0:.0f} s spent of --budget_s "
            f"{self.budget_s:.0f}")

  # -- timing ----------------------------------------------------------------------
  def measure(self, fn, args) -> tuple[list[float], str]:
    """Milliseconds per call, and the timer used."""
    jax = _jax()
    if self._cupti:
      try:
        from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415

        _, t = profiler.measure(fn, iterations=self.reps)(*args)
        if t is not None:
          return (list(t) if isinstance(t, list) else [t]), "cupti"
      except Exception as e:  # noqa: BLE001 (CUPTI absent or busy: wall clock instead)
        self._cupti = False
        self.timer_note = f"CUPTI unavailable ({type(e).__name__}: {str(e)[:200]}): wall clock"
    inner = 5 if self.env.on_gpu else 1  # calls per sample (GPU: hides the dispatch)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(self.reps):
      t0 = time.perf_counter()
      for _ in range(inner):
        out = fn(*args)
      jax.block_until_ready(out)
      times.append((time.perf_counter() - t0) * 1e3 / inner)
    return times, "wall"

  # -- rows ------------------------------------------------------------------------
  def row(self, kernel, impl, shape, times, timer, nbytes, flops, err, ref_max, ok, note):
    med = statistics.median(times) if times else None
    sec = None if med is None else med / 1e3
    hbm, peak = (self.peaks or (None, None))
    roof = self.cases.roofline_s(nbytes, flops, self.peaks)
    self.rows.append({
        "kernel": kernel, "impl": impl, "shape": shape, "median_ms": med,
        "min_ms": min(times) if times else None, "bytes": int(nbytes), "flops": int(flops),
        "gb_per_s": None if not sec else nbytes / sec / 1e9,
        "tflop_per_s": None if not sec else flops / sec / 1e12,
        "hbm_fraction": None if not (sec and hbm) else nbytes / sec / hbm,
        "flop_fraction": None if not (sec and peak) else flops / sec / peak,
        "roofline_fraction": None if not (sec and roof) else roof / sec,
        "max_abs_err": err, "ref_max_abs": ref_max, "ok": bool(ok), "timer": timer,
        "note": note})
    if not ok:
      self.failures.append(f"{kernel} {impl} {shape}: " + (
          note if err is None else f"max_abs_err {err} (ref max {ref_max})"))

  def _compare(self, case, out, check=None) -> tuple[float, float, bool, str]:
    jax, jnp = _jax(), _jax().numpy
    check = check or case.check  # (an impl's own check first)
    if check is not None:
      return check(out, self._ref)
    a, b = (jnp.asarray(x, jnp.float32) for x in (out, self._ref))
    if a.shape != b.shape:
      return math.inf, math.nan, False, f"shape {a.shape} != reference {b.shape}"
    err, scale = (float(jax.device_get(x)) for x in (jnp.max(jnp.abs(a - b)),
                                                       jnp.max(jnp.abs(b))))
    ok = math.isfinite(err) and err <= TOLERANCE[case.dtype] * max(scale, 1e-6)
    return err, scale, ok, ""

  def run_case(self, case) -> None:
    jax = _jax()
    ref = case.reference
    try:
      ref_fn = ref.fn if isinstance(ref.fn, jax.stages.Wrapped) else jax.jit(ref.fn)
      if case.reference_impl:  # the same callable then times it: compiled once
        case.impls[case.reference_impl].fn = ref_fn
      self._ref = jax.block_until_ready(ref_fn(*(ref.args() if callable(ref.args) else
                                                 ref.args)))
    except Exception as e:  # noqa: BLE001
      self.failures.append(f"{case.kernel} reference {case.shape}: {type(e).__name__}: {e}")
      for impl in case.impls:
        self.skip(case.kernel, impl, case.shape, f"the reference failed: {type(e).__name__}")
      return
    for impl, reason in case.skipped.items():
      self.skip(case.kernel, impl, case.shape, reason)
    order = sorted(case.impls, key=lambda n: n != case.reference_impl)  # the reference first
    for impl in order:
      spec = case.impls[impl]
      if self.left_s() < MARGIN_S:
        self.skip(case.kernel, impl, case.shape, self.out_of_budget())
        continue
      # One jitted callable for the check and the timing (the profiler would jit a partial
      # again, compiling it twice).
      fn = spec.fn if isinstance(spec.fn, jax.stages.Wrapped) else jax.jit(spec.fn)
      try:
        args = spec.args() if callable(spec.args) else spec.args
        out = self._ref if impl == case.reference_impl else jax.block_until_ready(fn(*args))
        err, scale, ok, extra = self._compare(case, out, spec.check)
        del out
        times, timer = self.measure(fn, args)
      except Exception as e:  # noqa: BLE001 (one impl's failure never stops the run)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if impl.startswith("ours"):  # (the row, not ok, counts as the failure)
          self.row(case.kernel, impl, case.shape, [], "-", spec.bytes or case.bytes,
                   case.flops, None, None, False, f"FAILED: {reason}")
        else:
          self.skip(case.kernel, impl, case.shape, f"failed here: {reason}")
        continue
      finally:
        args = None
      note = "; ".join(x for x in (spec.note, extra, "the correctness reference"
                                   if impl == case.reference_impl else "") if x)
      self.row(case.kernel, impl, case.shape, times, timer, spec.bytes or case.bytes,
               case.flops, err, scale, ok, note)
    self._ref = None

  def run_kernels(self, kernels) -> None:
    """Round robin: each kernel's first case, then each one's second, ...: a budget that
    runs out cuts the long tails (more paged shapes), not whole kernels."""
    gens = {k: self.builders[k](self.cfg, self.env) for k in kernels}
    planned = {k: self.cases.planned_shapes(self.cfg, k) for k in kernels}
    done = dict.fromkeys(kernels, 0)
    while gens:
      for kernel in list(gens):
        i = done[kernel]
        if i >= len(planned[kernel]) or self.left_s() < MARGIN_S:
          for rest in planned[kernel][i:]:
            self.skip(kernel, "all", rest, self.out_of_budget())
          gens.pop(kernel).close()
          continue
        try:
          case = next(gens[kernel])
        except StopIteration:
          gens.pop(kernel)
          continue
        except Exception as e:  # noqa: BLE001 (e.g. out of memory building the inputs)
          reason = f"inputs failed: {type(e).__name__}: {e}"[:400]
          for rest in planned[kernel][i:]:
            self.skip(kernel, "all", rest, reason)
          self.failures.append(f"{kernel}: building {planned[kernel][i]}: {reason}")
          gens.pop(kernel)
          continue
        done[kernel] = i + 1
        print(f"-- {kernel} {case.shape} ({self.left_s():.0f} s left)", flush=True)
        self.run_case(case)
        del case

  # -- torch -------------------------------------------------------------------------
  def run_torch(self, kernels, torch_python: str | None) -> None:
    specs = self.cases.torch_specs(self.cfg, kernels)
    if not specs:
      return
    impls = ("torch-flash", "torch-cudnn")

    def skip_all(reason):
      for s in specs:
        for impl in impls:
          self.skip(s["kernel"], impl, s["shape"], reason)

    python, why = find_torch_python(torch_python)
    if python is None:
      skip_all(why)
      return
    timeout = max(self.left_s() * (0.3 if self.env.on_gpu else 0.5), 1.0)
    payload = [{k: s[k] for k in ("kernel", "shape", "torch")} for s in specs]
    argv = [python, str(TORCH_SCRIPT), "--shapes", json.dumps(payload), "--reps",
            str(self.reps)]
    try:
      out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
      text, code, late = out.stdout, out.returncode, ""
    except subprocess.TimeoutExpired as e:
      text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (
          e.stdout or "")
      code, late = None, f"the torch peer ran past its {timeout:.0f} s share of the budget"
    lines = [ln for ln in text.strip().splitlines() if ln.startswith("{")]
    if not lines:
      skip_all(late or f"the torch peer failed (exit {code}): {out.stderr.strip()[-300:]}")
      return
    result = json.loads(lines[-1])  # everything it finished
    done = {(r["kernel"], r["impl"], json.dumps(r["shape"], sort_keys=True))
            for r in result["rows"] + result["skipped"]}
    if late:
      for s in specs:
        for impl in impls:
          if (s["kernel"], impl, json.dumps(s["shape"], sort_keys=True)) not in done:
            self.skip(s["kernel"], impl, s["shape"], late)
    cost = {(s["kernel"], json.dumps(s["shape"], sort_keys=True)): s["cost"] for s in specs}
    for r in result["rows"]:
      nbytes, flops = cost[(r["kernel"], json.dumps(r["shape"], sort_keys=True))]
      ok = math.isfinite(r["max_abs_err"]) and r["max_abs_err"] <= TOLERANCE[
          r["shape"]["dtype"]] * max(r["ref_max_abs"], 1e-6)
      self.row(r["kernel"], r["impl"], r["shape"], [r["median_ms"]], r["timer"], nbytes, flops,
               r["max_abs_err"], r["ref_max_abs"], ok, f"{r['note']} ({python})")
      self.rows[-1]["min_ms"] = r["min_ms"]
    self.skipped += result["skipped"]


def find_torch_python(explicit: str | None) -> tuple[str | None, str]:
  """A python that imports torch: this one, --torch_python, $HISPARSE_TORCH_PYTHON, then
  the pythons of /opt/*/bin, /opt/*/*/bin, ~/*/bin and /usr/bin (GPU images keep venvs
  there); (None, why) if none does."""
  tried = []
  # then pythons of the usual venv places (a GPU image may keep torch in one of its own)
  found = [p for pattern in ("/opt/*/bin/python3", "/opt/*/*/bin/python3",
                             os.path.expanduser("~/*/bin/python3"), "/usr/bin/python3")
           for p in sorted(glob.glob(pattern))][:8]
  for python in (sys.executable, explicit, os.environ.get("HISPARSE_TORCH_PYTHON"), *found):
    if not python or python in tried:
      continue
    tried.append(python)
    try:
      code = subprocess.run([python, "-c", "import torch"], capture_output=True,
                            timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
      continue
    if code == 0:
      return python, ""
  return None, (f"no python that imports torch (tried {', '.join(tried)}; give "
                "--torch_python)")


def summarize(rows: list[dict]) -> dict:
  """Per kernel and shape: best ours vs best peer (time ratio: < 1 means ours is faster;
  peers are every impl not ours, our jitted jnp reference included) and ours' shares of
  the roofline, HBM and FLOP peaks; per kernel the geometric mean of the ratios and the
  median roofline share. Incorrect rows take no part. paged_8bit: `speedup_vs_bf16`, the
  best bf16 paged time of ours at the same batch and context over the 8-bit one. select:
  `select_over_attention`, its best time of ours over our best paged decode at the same
  batch and a context of its top-k tokens (DSA's: over our sparse MLA decode at its batch
  and top-k), the sparse step's attention over what it selected: is the select a small
  part of the step?"""
  groups: dict[tuple, dict] = {}
  for r in rows:
    if r["median_ms"] is None or not r["ok"]:
      continue
    key = (r["kernel"], json.dumps(r["shape"], sort_keys=True))
    side = "ours" if r["impl"].startswith("ours") else "peers"
    groups.setdefault(key, {"ours": [], "peers": []})[side].append(r)
  bf16, mla = {}, {}  # our best paged decode by (batch, context), sparse MLA by (batch, topk)
  for (kernel, _), g in groups.items():
    if kernel in ("paged", "sparse_mla") and g["ours"]:
      best = min(g["ours"], key=lambda r: r["median_ms"])
      shape = best["shape"]
      if kernel == "paged":
        bf16[(shape["batch"], shape["context"])] = best
      else:
        mla[(shape["batch"], shape["topk"])] = best
  out: dict[str, dict] = {}
  for (kernel, _), g in groups.items():
    entry = out.setdefault(kernel, {"shapes": []})
    ours = min(g["ours"], key=lambda r: r["median_ms"], default=None)
    peer = min(g["peers"], key=lambda r: r["median_ms"], default=None)
    s = {"shape": (ours or peer)["shape"],
         "best_ours": ours and ours["impl"], "ours_ms": ours and ours["median_ms"],
         "best_peer": peer and peer["impl"], "peer_ms": peer and peer["median_ms"],
         "ours_over_peer": ours["median_ms"] / peer["median_ms"] if ours and peer else None,
         "ours_roofline_fraction": ours and ours["roofline_fraction"],
         "ours_hbm_fraction": ours and ours["hbm_fraction"],
         "ours_flop_fraction": ours and ours["flop_fraction"]}
    if kernel == "paged_8bit" and ours:
      base = bf16.get((ours["shape"]["batch"], ours["shape"]["context"]))
      s["speedup_vs_bf16"] = base["median_ms"] / ours["median_ms"] if base else None
    if kernel == "select" and ours:
      shape = ours["shape"]
      attend = (mla.get((shape["batch"], shape["topk"])) if shape["selection"] == "lightning"
                else bf16.get((shape["batch"], shape["top_k_blocks"] * shape["block_size"])))
      s["sparse_attention_ms"] = attend and attend["median_ms"]
      s["select_over_attention"] = ours["median_ms"] / attend["median_ms"] if attend else None
    entry["shapes"].append(s)
  for entry in out.values():
    ratios = [s["ours_over_peer"] for s in entry["shapes"] if s["ours_over_peer"]]
    entry["geomean_ours_over_peer"] = (math.exp(sum(map(math.log, ratios)) / len(ratios))
                                       if ratios else None)
    roofs = [s["ours_roofline_fraction"] for s in entry["shapes"]
             if s["ours_roofline_fraction"] is not None]
    entry["median_ours_roofline_fraction"] = statistics.median(roofs) if roofs else None
  return out


def format_table(result: dict) -> str:
  def f(x, fmt):
    return "-" if x is None else format(x, fmt)

  lines = [f"{'kernel':<11}{'impl':<26}{'shape':<34}{'med ms':>9}{'GB/s':>8}{'TF/s':>7}"
           f"{'roof%':>7}{'err':>9} ok"]
  order = {k: i for i, k in enumerate(result["kernels"])}
  for r in sorted(result["rows"], key=lambda r: (order.get(r["kernel"], 99),
                                                 json.dumps(r["shape"], sort_keys=True))):
    shape = ",".join(f"{v}" for k, v in r["shape"].items() if k in (
        "batch", "context", "kv_dtype", "seq", "q_lens", "heads", "topk"))
    lines.append(
        f"{r['kernel']:<11}{r['impl'][:25]:<26}{shape[:33]:<34}{f(r['median_ms'], '.3f'):>9}"
        f"{f(r['gb_per_s'], '.1f'):>8}{f(r['tflop_per_s'], '.2f'):>7}"
        f"{f(r['roofline_fraction'] and 100 * r['roofline_fraction'], '.1f'):>7}"
        f"{f(r['max_abs_err'], '.1e'):>9} {'yes' if r['ok'] else 'NO'}")
  lines.append(f"skipped: {len(result['skipped'])} (see JSON for reasons)")
  for kernel, s in result["summary"].items():
    lines.append(f"summary {kernel}: geomean ours/peer time "
                 f"{f(s['geomean_ours_over_peer'], '.2f')}, median roofline "
                 f"{f(s['median_ours_roofline_fraction'], '.3f')}")
  for s in result["summary"].get("select", {}).get("shapes", []):
    lines.append(f"summary select: {f(s['ours_ms'], '.3f')} ms, the sparse attention over "
                 f"its top-k {f(s['sparse_attention_ms'], '.3f')} ms: select / attention "
                 f"{f(s['select_over_attention'], '.2f')}")
  m = result["machine"]
  lines.append(f"machine: {m['platform']} / {m['device_kind']} ({m['cpu_cores']} cores), "
               f"jax {m['jax_version']}, size={result['size']}, {result['wall_s']:.1f} s")
  return "\n".join(lines)


def run(size: str, budget_s: float, only, torch_python: str | None = None) -> dict:
  bench = Bench(size, budget_s, REPS[size])
  kernels = [k for k in bench.cases.KERNELS if k in only]
  print(f"gpu_bench_kernels: size={size}, budget {budget_s:.0f} s, kernels {kernels}, "
        f"device {_jax().devices()[0].device_kind}", flush=True)
  bench.run_torch(kernels, torch_python)  # first: before jax holds the GPU's memory
  bench.run_kernels(kernels)
  seen = {(r["kernel"], r["impl"]) for r in bench.rows}
  seen |= {(s["kernel"], s["impl"]) for s in bench.skipped}
  for kernel in kernels:  # the safety net: every expected impl is accounted for
    for impl in bench.cases.EXPECTED_IMPLS[kernel]:
      if (kernel, impl) not in seen and (kernel, "all") not in seen:
        bench.skip(kernel, impl, None, "not run (no case reached it)")
  peaks = bench.peaks
  return {
      "machine": bench.kbench._machine(), "size": size, "budget_s": budget_s,
      "wall_s": time.monotonic() - bench.t0, "kernels": kernels,
      "peaks": {"hbm_bytes_per_s": peaks and peaks[0], "bf16_flop_per_s": peaks and peaks[1],
                "table": bench.kbench.DEVICE_PEAKS},
      "tolerance": TOLERANCE, "timer_note": bench.timer_note, "rows": bench.rows,
      "skipped": bench.skipped, "failures": bench.failures,
      "summary": summarize(bench.rows)}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="gpu_bench_kernels",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=("smoke", "full"), default=None,
                      help="full (default on a GPU) or smoke (default otherwise)")
  parser.add_argument("--out", required=True, help="the JSON result")
  parser.add_argument("--budget_s", type=float, default=None,
                      help=f"seconds for everything (default {DEFAULT_BUDGET_S})")
  parser.add_argument("--only", default=None, help="comma-separated kernels (default all)")
  parser.add_argument("--torch_python", default=None,
                      help="a python that imports torch, if this one does not")
  args = parser.parse_args(argv)
  # Before jax starts a GPU client: no preallocation (the torch peer runs beside it, and
  # the cases' own arrays come and go), unless the caller chose otherwise.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  from hisparse_jax.bench import gpu_bench_cases as cases  # noqa: PLC0415

  only = cases.KERNELS if args.only is None else tuple(
      k.strip() for k in args.only.split(",") if k.strip())
  unknown = set(only) - set(cases.KERNELS)
  if unknown:
    parser.error(f"--only: unknown kernel(s) {', '.join(sorted(unknown))}; choose from "
                 f"{', '.join(cases.KERNELS)}")
  size = args.size or ("full" if _jax().default_backend() == "gpu" else "smoke")
  budget = args.budget_s if args.budget_s is not None else DEFAULT_BUDGET_S[size]
  result = run(size, budget, only, args.torch_python)
  print(format_table(result))
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1, default=str) + "\n")
  print(f"wrote {out}; {len(result['failures'])} failure(s)", flush=True)
  for failure in result["failures"]:
    print(f"FAILED: {failure}", flush=True)
  return 1 if result["failures"] else 0


if __name__ == "__main__":
  sys.exit(main())

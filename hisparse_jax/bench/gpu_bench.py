"""`make gpu-bench`: one prepared command that measures the GPU path on a lent GPU.

Usage (from the repository root; only the standard library is imported here, so any
python3 runs it)::

  python3 -m hisparse_jax.bench.gpu_bench [--out FILE.json] [--budget_s 360] [--only a,b]

Steps, each in a subprocess of its own, timed, and reported even when another fails or
runs out of time (the runner of `make gpu-check`, hisparse_jax/bench/gpu_check.py):

  environment  the interpreter the steps use (the machine's own jax[cuda] if it imports,
               else .venv-gpu), the device, its memory kinds and its XLA GpuTargetConfig
               (written beside the JSON as gpu_target_<device>.textproto)
  kernels      hisparse_jax/bench/gpu_bench_kernels.py: each attention kernel at the
               engine's shapes (8B-class GQA 32:8 D=128 paged decode, 8-bit pages, ragged
               mixed steps, prefill, DeepSeek-V3.2 sparse MLA decode, the HiSparse select)
               with its GB/s, TFLOP/s and share of the device's peak, the peers on the same
               shapes in the same run (jax's Pallas GPU ops, cuDNN, torch's SDPA, the XLA
               reference), and each kernel checked against its jnp reference
  hisparse     hisparse_jax/bench/gpu_bench_hisparse.py: host <-> device block moves by
               block size and count (share of PCIe), the decode step with 0% / 10% / 30% of
               its selected blocks loaded from the host, and an 8B-class model with random
               weights made on the device: device-only vs HiSparse throughput at one KV
               budget, batch 1 at 32k, a request twice the device pool

With a GPU the steps run at their `full` sizes within --budget_s (default 360 s: a lent
GPU's 15 minutes hold the bench and a rerun) and the JSON goes to
results/gpu_bench_<device>.json. Without one (this project's CI machine) the same steps
run on the CPU at `smoke` sizes, Pallas kernels in interpret mode, so the command itself
is exercised before a GPU minute is spent; the GPU-only figures are reported as skipped
with the reason, and the JSON goes to results/gpu_bench_cpu.json, never standing in for a
GPU record. Exit status: 1 if any step failed (a kernel or an engine off its reference
included), else 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import time
from pathlib import Path

from hisparse_jax.bench.gpu_check import (
    ROOT,
    Runner,
    _environment,
    device_slug,
    has_gpu,
    write_target_config,
)

BUDGET_S = 360  # on one H200: the "at most 6 minutes"
CPU_BUDGET_S = 900

# Step name -> (timeout in seconds, what it measures). Order is run order.
STEPS = {
    "environment": (120, "the interpreter, the device, its memory kinds and its XLA "
                         "GpuTargetConfig"),
    "kernels": (210, "attention kernels at the engine's shapes vs jax's Pallas GPU ops, "
                     "cuDNN, torch SDPA and the XLA reference; each against its jnp "
                     "reference"),
    "hisparse": (170, "host <-> device block moves (share of PCIe), decode steps with 0 / 10 "
                      "/ 30% host loads, an 8B-class random-weights model dense vs HiSparse"),
}
PARTS = {"kernels": "hisparse_jax.bench.gpu_bench_kernels",
         "hisparse": "hisparse_jax.bench.gpu_bench_hisparse"}


def _summary(data: dict) -> dict:
  """A part's summary, kept in its step record (the rows go to the result's `parts`)."""
  return data.get("summary", {})


def _read_part(path: Path) -> dict:
  """A part's whole JSON (rows, skipped, summary, machine), or what kept it from being read."""
  if not path.exists():
    return {"error": f"{path.name} was not written"}
  try:
    return json.loads(path.read_text())
  except ValueError as e:
    return {"error": f"could not read {path.name}: {e!r}"}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="gpu_bench", description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", help="JSON path (default: results/gpu_bench_<device>.json "
                      "with a GPU, results/gpu_bench_cpu.json without)")
  parser.add_argument("--budget_s", type=float, default=None,
                      help=f"time for all steps together in seconds (default {BUDGET_S} "
                      f"with a GPU, {CPU_BUDGET_S} without)")
  parser.add_argument("--only", default=None,
                      help=f"comma-separated steps to run, in this order (of "
                      f"{', '.join(PARTS)}); environment always runs first")
  parser.add_argument("--size", choices=("smoke", "full"), default=None,
                      help="the parts' sizes (default: full with a GPU, smoke without)")
  args = parser.parse_args(argv)
  order = list(PARTS) if args.only is None else [s for s in args.only.split(",") if s]
  unknown = set(order) - set(PARTS)
  if unknown:
    parser.error(f"--only: unknown step(s) {', '.join(sorted(unknown))}; "
                 f"choose from {', '.join(PARTS)}")
  gpu, gpu_reason = has_gpu()
  if args.budget_s is None:
    args.budget_s = BUDGET_S if gpu else CPU_BUDGET_S
  size = args.size or ("full" if gpu else "smoke")
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  t_start = time.monotonic()
  runner = Runner(gpu, args.budget_s, STEPS)
  print(f"gpu-bench: {'GPU found' if gpu else gpu_reason}; budget {args.budget_s:.0f} s, "
        f"size {size}", flush=True)

  python, device = _environment(runner, gpu_reason)
  slug = device_slug(device) if gpu else "cpu"
  out = Path(args.out) if args.out else ROOT / "results" / f"gpu_bench_{slug}.json"
  tmp = out.parent / f".{out.stem}_tmp"  # the parts' JSON, removed at the end
  tmp.mkdir(parents=True, exist_ok=True)
  if gpu:
    write_target_config(device, out.parent, "make gpu-bench", started)
  no_gpu = [] if gpu else [f"compiled kernels and the device's peaks: {gpu_reason}"]

  parts = {}
  for name in order:
    if python is None:
      runner.record(name, "skip", reason="the environment step failed")
      continue
    path = tmp / f"{name}.json"
    path.unlink(missing_ok=True)
    # Each part stops itself when its share of the budget is spent (what it left out
    # named in its JSON); the runner's timeout is the backstop.
    left = runner.deadline - time.monotonic()
    part_budget = max(min(STEPS[name][0], left) - 15, 5)
    rec = runner.run(name, [python, "-m", PARTS[name], f"--size={size}", f"--out={path}",
                            f"--budget_s={part_budget:.0f}"],
                     figures_from=path, summarize=_summary, skipped_parts=no_gpu)
    parts[name] = _read_part(path)
    print(rec["output_tail"][-3000:], flush=True)  # the part's own table

  shutil.rmtree(tmp, ignore_errors=True)
  return runner.finish(out, {
      "command": "make gpu-bench", "started": started, "gpu": gpu,
      "gpu_absent_reason": gpu_reason or None, "device": device, "size": size,
      "budget_s": args.budget_s, "total_seconds": round(time.monotonic() - t_start, 2),
      "parts": parts}, device, "gpu-bench")


if __name__ == "__main__":
  sys.exit(main())

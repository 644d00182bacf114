"""`make gpu-check`: one command that checks the GPU path on a GPU machine.

Usage (from the repository root; only the standard library is imported here, so any
python3 runs it)::

  python3 -m hisparse_jax.bench.gpu_check [--out FILE.json] [--budget_s 480] [--only a,b]

Each step runs in a subprocess of its own, timed, and is reported even when another
fails or runs out of time:

  environment     installs `.[cuda,test]` into .venv-gpu (a venv that also sees the
                  machine's own packages, so a machine without network but with jax[cuda]
                  installed works), and make gpu-bench's library peers from wheelhouse/
                  (make gpu-wheels) into .gpu-peers/ if they do not import; says jax's
                  version, platform, device and memory kinds;
                  on a GPU writes the device's XLA GpuTargetConfig beside the JSON
                  (gpu_target_<device>.textproto: `hisparse-jax compile --target=FILE`)
  matrix          the compile matrix's engines (tests/hisparse_jax/engine/test_gpu_matrix.py:
                  dense bfloat16, HiSparse int8 (KV and key bounds), streamed prefill,
                  Mosaic GPU decode, DSA offload; smallest first) on the device, greedy
                  tokens vs the CPU engine's
  selfcheck       kernels_pallas.selfcheck: every compiled kernel against its reference
  kernel_bench    `bench --suite=kernel`: GB/s and % of the device's HBM peak
  transfer        `bench --suite=transfer`: host<->device over pinned_host, GB/s and % of
                  the PCIe peak, each direction
  hisparse_engine KV round trips device -> pinned_host -> device bit for bit (every cache
                  dtype; swap, third tier, HiSparse loads, write-through:
                  test_round_trips.py), the HiSparse engine tests (in-step host loads,
                  offload, write-through) and the engine on the Pallas kernels against
                  xla, on the device
  hf_parity       the engine's tokens against HF transformers on the same checkpoint
  decode          `bench --suite=decode_sparse_vs_dense`: HiSparse vs dense decode step

With a GPU the steps run on it (JAX_PLATFORMS=cuda, the compiled Pallas kernels, the
`full` bench sizes) and the JSON goes to results/gpu_check.json. Without one (this
project's CI machine) the same steps run on the CPU with the Pallas kernels in interpret
mode and the `smoke` bench sizes, so the script itself is exercised; the GPU-only parts
are reported as skipped with the reason (the CUDA install, the compiled kernels, the HBM
and PCIe figures), and the JSON goes to results/gpu_check_cpu.json so that a CPU run
never stands in for a GPU record. Exit status: 1 if any step failed, else 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_VENV = ROOT / ".venv-gpu"
CPU_VENV = ROOT / ".venv"  # `make setup`'s
# make gpu-bench's library peers (tokamax, jax-linear-attention): requirements-gpu-peers.txt,
# installed with --no-deps; on a machine without network from WHEELHOUSE (`make gpu-wheels`,
# carried there) into PEERS_SITE, which the steps then have on PYTHONPATH.
PEERS_REQ = ROOT / "requirements-gpu-peers.txt"
WHEELHOUSE = ROOT / "wheelhouse"
PEERS_SITE = ROOT / ".gpu-peers"
_PEERS_IMPORT = "import tokamax, jla.ops.mosaic_gpu.attention"
BUDGET_S = 480  # on one H200: the whole check in under 8 minutes
CPU_BUDGET_S = 1800  # the CPU fallback's steps (interpret mode) are slower
TAIL_CHARS = 12000  # (3,000 lost the failing tests' names on the first GPU runs)

# Step name -> (timeout in seconds, what it checks). Order is run order.
STEPS = {
    "environment": (240, "install .[cuda,test] and describe the device (with its XLA "
                         "GpuTargetConfig: the compile target `hisparse-jax compile` takes)"),
    # First: the compile matrix's configs (test_aot_h200.py compiles them without a GPU)
    # run on the device, smallest first, tokens against the CPU engine's: a short loan
    # answers "does each program kind run" before anything slow.
    "matrix": (240, "the compile matrix's engines (dense bfloat16, HiSparse int8, streamed "
                    "prefill, Mosaic GPU decode, DSA offload) on the device, greedy tokens "
                    "vs the same config on the CPU"),
    # (on an H200 with jax 0.11.2 every case up to bs=32 d=128 float32 passed in 150 s:
    # the compiles dominate)
    "selfcheck": (240, "compiled kernels vs their jnp references (float and 8-bit pages)"),
    "kernel_bench": (120, "kernel GB/s and % of HBM peak"),
    "transfer": (120, "host<->device GB/s over pinned_host and % of PCIe peak"),
    # (run 2 on an H200: 126 s before this step gained the round trips, ~45 s on 2 CPUs)
    "hisparse_engine": (300, "KV round trips device -> pinned_host -> device bit for bit "
                            "(float32, bfloat16, int8, fp8 with scales: swap, third tier, "
                            "HiSparse loads, write-through), HiSparse engine tests and "
                            "Pallas-vs-xla engine tokens (float and int8 KV)"),
    "hf_parity": (240, "engine tokens vs HF transformers (llama and DSA models: the sparse "
                       "MLA kernel, every indexer selection, offloaded DSA decoding)"),
    "decode": (240, "HiSparse vs dense decode step time"),
}

# Whether the packages the steps need import, with jax on a GPU (exit 0) or not.
_IMPORTS = """
import absl, chex, flax, optax, safetensors, tokenizers, pytest, hypothesis, jax
assert jax.devices()[0].platform == "gpu", jax.devices()
"""

# Printed by the environment step's probe, one JSON line.
_PROBE = """
import json, jax
d = jax.devices()[0]
try:
  kinds = sorted(m.kind for m in d.addressable_memories())
except Exception as e:  # older runtimes
  kinds = [f"unknown: {e}"]
try:  # the real device's compile target (hisparse-jax compile --target=FILE takes it)
  from jax.lib import xla_client
  target = xla_client.get_topology_for_devices(jax.devices()).target_config
  target = target if isinstance(target, str) else str(target)
except Exception as e:
  target = f"unavailable: {type(e).__name__}: {e}"
print(json.dumps({"jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None)
                  or __import__("jaxlib").__version__, "platform": d.platform,
                  "device_kind": d.device_kind, "device_count": jax.device_count(),
                  "memory_kinds": kinds, "target_config": target}))
"""


def has_gpu() -> tuple[bool, str]:
  """(whether an NVIDIA GPU is visible, why not)."""
  smi = shutil.which("nvidia-smi")
  if smi is None and not Path("/dev/nvidia0").exists():
    return False, "no NVIDIA GPU on this machine (no nvidia-smi, no /dev/nvidia0)"
  if smi is not None:
    try:
      out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
      return False, f"nvidia-smi -L failed: {e}"
    if out.returncode != 0 or "GPU" not in out.stdout:
      return False, f"nvidia-smi -L lists no GPU (exit {out.returncode})"
  return True, ""


class Runner:
  """Runs the steps within one time budget and collects their records."""

  def __init__(self, gpu: bool, budget_s: float, steps: dict | None = None):
    self.gpu = gpu
    self.budget_s = budget_s
    self.step_specs = STEPS if steps is None else steps  # name -> (timeout s, what it checks)
    self.deadline = time.monotonic() + budget_s
    self.steps: list[dict] = []

  def env(self) -> dict[str, str]:
    env = dict(os.environ)
    # cuda,cpu: a jax.debug.callback inside a jitted step needs a local CPU device to
    # place its operands (jax 0.11.2 on the H200: "failed to find a local CPU device").
    env["JAX_PLATFORMS"] = "cuda,cpu" if self.gpu else "cpu"
    paths = [str(ROOT)] + ([str(PEERS_SITE)] if PEERS_SITE.is_dir() else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env

  def call(self, name: str, argv: list[str], timeout: float) -> tuple[int | None, str, float]:
    """(exit status or None on timeout, stdout+stderr tail, seconds)."""
    left = self.deadline - time.monotonic()
    timeout = min(timeout, max(left, 0.0))
    if timeout < 5:
      raise TimeoutError(f"no time left in the {self.budget_s:.0f} s budget")
    print(f"-- {name}: {_shown(argv)}", flush=True)
    t0 = time.monotonic()
    try:
      out = subprocess.run(argv, cwd=ROOT, env=self.env(), capture_output=True, text=True,
                           timeout=timeout)
      code, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
      code = None
      text = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
              else (e.stdout or "")) + f"\n[timed out after {timeout:.0f} s]"
    return code, text, time.monotonic() - t0

  def record(self, name: str, status: str, seconds: float = 0.0, reason: str = "",
             command: list[str] | None = None, figures: dict | None = None,
             output: str = "", skipped_parts: list[str] | None = None) -> dict:
    rec = {"name": name, "checks": self.step_specs[name][1], "status": status,
           "seconds": round(seconds, 2), "reason": reason,
           "command": _shown(command) if command else None, "figures": figures or {},
           "skipped_parts": skipped_parts or [], "output_tail": output[-TAIL_CHARS:]}
    self.steps.append(rec)
    mark = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP"}[status]
    print(f"{mark} {name} ({seconds:.1f} s){': ' + reason if reason else ''}", flush=True)
    for part in rec["skipped_parts"]:
      print(f"     skipped: {part}", flush=True)
    return rec

  def run(self, name: str, argv: list[str], *, figures_from: Path | None = None,
          summarize=None, skipped_parts: list[str] | None = None) -> dict:
    try:
      code, text, seconds = self.call(name, argv, self.step_specs[name][0])
    except TimeoutError as e:
      return self.record(name, "skip", reason=str(e), command=argv)
    figures = {}
    if figures_from is not None and figures_from.exists():
      try:
        data = json.loads(figures_from.read_text())
        figures = summarize(data) if summarize else data
      except (ValueError, KeyError, TypeError) as e:
        figures = {"error": f"could not read {figures_from.name}: {e!r}"}
    if code == 0 and _pytest_all_skipped(text):
      why = re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", text)
      return self.record(name, "skip", seconds, "every test skipped: " + "; ".join(
          sorted(set(why))) if why else "every test skipped", argv, output=text,
                         skipped_parts=skipped_parts)
    if code == 0:
      return self.record(name, "pass", seconds, command=argv, figures=figures, output=text,
                         skipped_parts=skipped_parts)
    reason = "timed out" if code is None else f"exit status {code}"
    return self.record(name, "fail", seconds, reason, argv, figures, text, skipped_parts)

  def finish(self, out: Path, result: dict, device: dict, command: str) -> int:
    """Writes `result` (the run's own fields) + the steps' outcome to `out` as JSON, prints
    the one-line verdict; the exit status: 1 if any step failed, else 0."""
    failed = [s["name"] for s in self.steps if s["status"] == "fail"]
    result = {**result, "passed": [s["name"] for s in self.steps if s["status"] == "pass"],
              "failed": failed,
              "skipped": [s["name"] for s in self.steps if s["status"] == "skip"],
              "steps": self.steps}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{command}: {len(result['passed'])} passed, {len(failed)} failed, "
          f"{len(result['skipped'])} skipped in {result['total_seconds']:.0f} s "
          f"(device: {device.get('device_kind', '?')}); wrote {out}", flush=True)
    return 1 if failed else 0


def _shown(argv: list[str]) -> str:
  """A command line as printed: an inline `-c` program as `-c <program>`."""
  return " ".join("<program>" if i and argv[i - 1] == "-c" else a for i, a in enumerate(argv))


def _pytest_all_skipped(text: str) -> bool:
  """Whether a pytest run's summary line counts skips and no passes."""
  summary = text.strip().splitlines()[-1] if text.strip() else ""
  return " skipped" in summary and " passed" not in summary


def _bench_suite(data: dict, suite: str) -> dict:
  return data["suites"][suite]


def _kernel_figures(data: dict) -> dict:
  suite = _bench_suite(data, "kernel")
  return {"hbm_peak_bytes_per_s": suite.get("hbm_peak_bytes_per_s"),
          "summary": suite.get("summary"),
          "rows": [{k: r[k] for k in ("kernel", "impl", "shape", "median_ms", "gb_per_s",
                                      "hbm_fraction") if k in r} for r in suite["rows"]]}


def _transfer_figures(data: dict) -> dict:
  suite = _bench_suite(data, "transfer")
  return {k: v for k, v in suite.items() if k != "config"}


def _decode_figures(data: dict) -> dict:
  suite = _bench_suite(data, "decode_sparse_vs_dense")
  keep = ("context", "dense_ms", "sparse_ms", "dense_over_sparse")
  return {"rows": [{k: r.get(k) for k in keep} for r in suite["rows"]]}


def device_slug(device: dict) -> str:
  """`NVIDIA H200` -> `nvidia_h200` (file names of a device's records)."""
  return re.sub(r"[^a-z0-9]+", "_", device.get("device_kind", "gpu").lower()).strip("_")


def write_target_config(device: dict, out_dir: Path, command: str, started: str) -> None:
  """Writes the device's XLA GpuTargetConfig (the environment step's probe) to
  out_dir/gpu_target_<device>.textproto, when the probe got one."""
  target = device.get("target_config")
  if not target or target.startswith("unavailable"):
    return
  path = out_dir / f"gpu_target_{device_slug(device)}.textproto"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(f"# captured by {command} on {device.get('device_kind')}, jax "
                  f"{device.get('jax')}, {started}\n{target}\n")
  print(f"{command}: wrote the device's target config to {path}", flush=True)


def _library_peers(runner: Runner, python: str, log: list[str], skipped: list[str]) -> None:
  """make gpu-bench's library peers: if they do not import in `python`, installs them from
  wheelhouse/ (no network needed) into .gpu-peers/ (the steps' PYTHONPATH, so neither the
  machine's packages nor a venv change). Never fails the step: a peer that does not
  import is a skipped row in the bench, with the reason."""
  name = "environment"
  try:
    code, text, _ = runner.call(name, [python, "-c", _PEERS_IMPORT], 120)
  except TimeoutError as e:
    skipped.append(f"the library peers' check (tokamax, jax-linear-attention): {e}")
    return
  if code == 0:
    log.append("the library peers (tokamax, jax-linear-attention) import")
    return
  if not WHEELHOUSE.is_dir():
    skipped.append("the library peers (tokamax, jax-linear-attention) do not import and "
                   f"there is no {WHEELHOUSE.name}/ to install them from (make gpu-wheels): "
                   f"{text.strip().splitlines()[-1:]}")
    return
  argv = [python, "-m", "pip", "install", "-q", "--no-index", "--find-links",
          str(WHEELHOUSE), "--no-deps", "--upgrade", "--target", str(PEERS_SITE), "-r",
          str(PEERS_REQ)]
  try:
    code, text, _ = runner.call(name, argv, 120)
    if code == 0:
      code, text, _ = runner.call(name, [python, "-c", _PEERS_IMPORT], 120)
  except TimeoutError as e:
    code, text = None, str(e)
  log.append(text)
  if code == 0:
    log.append(f"the library peers installed from {WHEELHOUSE.name}/ into {PEERS_SITE.name}/")
  else:
    skipped.append(f"the library peers from {WHEELHOUSE.name}/ (exit {code}): "
                   f"{text.strip().splitlines()[-1:]}")


def _environment(runner: Runner, gpu_reason: str) -> tuple[str | None, dict]:
  """Sets up the interpreter the other steps use; returns (python or None, device)."""
  name = "environment"
  t0 = time.monotonic()
  log = []
  skipped = []
  if runner.gpu:
    # The interpreter running this script first: a machine image with jax[cuda] and the
    # rest installed (often itself a venv, whose packages a venv made from it with
    # --system-site-packages would NOT see: that sees the base interpreter's).
    code, text, _ = runner.call(name, [sys.executable, "-c", _IMPORTS], 120)
    if code == 0:
      log.append(f"every package of .[cuda,test] imports in {sys.executable} and jax sees a "
                 "GPU: no venv, no install")
      python = sys.executable
    elif not (GPU_VENV / "bin" / "python").exists():
      subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(GPU_VENV)],
                     check=False)
    if code != 0:
      python = str(GPU_VENV / "bin" / "python")
      code, text, _ = runner.call(name, [python, "-c", _IMPORTS], 120)
      if code == 0:
        log.append("every package of .[cuda,test] imports and jax sees a GPU: no install")
    if code != 0:
      argv = [python, "-m", "pip", "install", "-q", "--retries", "1", "--timeout", "20", "-e",
              ".[cuda,test]"]
      try:
        code, text, _ = runner.call(name, argv, runner.step_specs[name][0] - 60)
      except TimeoutError as e:
        code, text = None, str(e)
      log.append(text)
    if code != 0:
      # No network (a lent machine reaches nothing outside): the machine's own jax[cuda]
      # and this checkout on PYTHONPATH may still do.
      status = "timed out" if code is None else f"exit {code}"
      skipped.append(f"pip install -e .[cuda,test] failed ({status}); using the packages "
                     f"the machine has ({sys.executable}), this checkout on PYTHONPATH")
      python = sys.executable
  else:
    python = str(CPU_VENV / "bin" / "python") if (CPU_VENV / "bin" / "python").exists() \
        else sys.executable
    skipped.append(f"the CUDA install (.[cuda] into .venv-gpu): {gpu_reason}; the steps run "
                   f"on the CPU with {python} (make setup's venv)")
  _library_peers(runner, python, log, skipped)
  try:
    code, text, _ = runner.call(name, [python, "-c", _PROBE], 120)
  except TimeoutError as e:
    code, text = None, str(e)
  log.append(text)
  device = {}
  if code == 0:
    device = json.loads(text.strip().splitlines()[-1])
  ok = code == 0 and (device.get("platform") == "gpu") == runner.gpu
  reason = "" if ok else (
      "jax does not import" if code != 0 else
      f"jax sees platform {device.get('platform')!r} where a GPU was expected")
  runner.record(name, "pass" if ok else "fail", time.monotonic() - t0, reason,
                figures=device, output="\n".join(log), skipped_parts=skipped)
  return (python if ok else None), device


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", help="JSON path (default: results/gpu_check.json with a GPU, "
                      "results/gpu_check_cpu.json without)")
  parser.add_argument("--budget_s", type=float, default=None,
                      help=f"time for all steps together in seconds (default {BUDGET_S} "
                      f"with a GPU, {CPU_BUDGET_S} without)")
  parser.add_argument("--only", default=None,
                      help=f"comma-separated steps to run, in this order (of "
                      f"{', '.join(STEPS)}); environment always runs first")
  args = parser.parse_args(argv)
  only = set(STEPS) if args.only is None else {"environment", *args.only.split(",")}
  unknown = only - set(STEPS)
  if unknown:
    parser.error(f"--only: unknown step(s) {', '.join(sorted(unknown))}; "
                 f"choose from {', '.join(STEPS)}")
  gpu, gpu_reason = has_gpu()
  if args.budget_s is None:
    args.budget_s = BUDGET_S if gpu else CPU_BUDGET_S
  out = Path(args.out) if args.out else ROOT / "results" / (
      "gpu_check.json" if gpu else "gpu_check_cpu.json")
  tmp = out.parent / f".{out.stem}_tmp"  # the benches' JSON, removed at the end
  tmp.mkdir(parents=True, exist_ok=True)
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  t_start = time.monotonic()
  runner = Runner(gpu, args.budget_s)
  print(f"gpu-check: {'GPU found' if gpu else gpu_reason}; budget {args.budget_s:.0f} s",
        flush=True)

  python, device = _environment(runner, gpu_reason)
  size = "full" if gpu else "smoke"
  no_gpu = [] if gpu else [f"compiled (not interpret) kernels: {gpu_reason}"]
  # No --durations table (it pushed the failures out of the kept tail); -rfEs: the
  # failed, errored and skipped tests' names at the end.
  pytest = [python, "-m", "pytest", "-o",
            "addopts=-q -p no:cacheprovider --import-mode=importlib", "-rfEs"]

  def bench(step: str, suite: str, summarize, extra_skips: list[str],
            kernels: bool = True) -> None:
    path = tmp / f"{suite}.json"
    path.unlink(missing_ok=True)
    runner.run(step, [python, "-m", "hisparse_jax", "bench", f"--suite={suite}",
                      f"--bench_size={size}", f"--out={path}"],
               figures_from=path, summarize=summarize,
               skipped_parts=(no_gpu if kernels else []) + extra_skips)

  def hf_parity() -> None:
    probe = [python, "-c", "import torch, transformers"]
    try:
      code, text, seconds = runner.call("hf_parity", probe, 120)
    except TimeoutError as e:
      runner.record("hf_parity", "skip", reason=str(e))
      return
    if code != 0:
      runner.record("hf_parity", "skip", seconds, "torch or transformers does not import "
                    f"in {python} (install .[parity]): {text.strip().splitlines()[-1:]}",
                    probe, output=text)
      return
    runner.run("hf_parity", pytest + ["tests/hisparse_jax/engine/test_engine_hf_parity.py",
                                      "tests/hisparse_jax/engine/test_engine_dsa.py"],
               skipped_parts=no_gpu)

  if gpu:
    write_target_config(device, out.parent, "make gpu-check", started)

  plan = {
      "matrix": lambda: runner.run("matrix", pytest + [
          "tests/hisparse_jax/engine/test_gpu_matrix.py"], skipped_parts=no_gpu),
      "selfcheck": lambda: runner.run("selfcheck", [python, "-m", "kernels_pallas.selfcheck"],
                                      skipped_parts=no_gpu),
      "kernel_bench": lambda: bench("kernel_bench", "kernel", _kernel_figures, [] if gpu else [
          "GB/s as % of HBM peak: the CPU has no HBM (bench size smoke)"]),
      "transfer": lambda: bench("transfer", "transfer", _transfer_figures, [] if gpu else [
          "GB/s as % of PCIe peak: on the CPU device and pinned_host are one DRAM"],
                                kernels=False),
      "hisparse_engine": lambda: runner.run("hisparse_engine", pytest + [
          # first: over real pinned host memory (issue #35; bf16 through unpinned_host is
          # silently corrupted, SGLang-JAX warns)
          "tests/hisparse_jax/kv_cache/test_round_trips.py",
          "tests/hisparse_jax/sparse/test_hisparse_engine.py",
          "tests/hisparse_jax/sparse/test_hisparse_engine_resources.py",
          "tests/hisparse_jax/engine/test_engine_pallas.py",
          "tests/hisparse_jax/kv_cache/test_kv_quant_engine.py::"
          "test_int8_hisparse_engine_on_the_pallas_kernels_equals_xla"],
          skipped_parts=no_gpu),
      "hf_parity": lambda: hf_parity(),
      "decode": lambda: bench("decode", "decode_sparse_vs_dense", _decode_figures, []),
  }
  # --only's order when given (the most wanted steps first within the budget)
  order = list(plan) if args.only is None else [n for n in args.only.split(",") if n in plan]
  for name in order:
    step = plan[name]
    if name not in only:
      continue
    if python is None:
      runner.record(name, "skip", reason="the environment step failed")
      continue
    step()

  shutil.rmtree(tmp, ignore_errors=True)
  return runner.finish(out, {
      "command": "make gpu-check", "started": started, "gpu": gpu,
      "gpu_absent_reason": gpu_reason or None, "device": device, "budget_s": args.budget_s,
      "total_seconds": round(time.monotonic() - t_start, 2)}, device, "gpu-check")


if __name__ == "__main__":
  sys.exit(main())

"""torch's scaled_dot_product_attention on the shapes of `gpu_bench_kernels`, as a peer.

Run by gpu_bench_kernels in a subprocess (the GPU image keeps torch in its own venv, and a
torch beside jax in one process would share the GPU's memory badly); imports nothing of
this project, so any python that imports torch runs it::

  python gpu_bench_torch.py --shapes '[{"kernel": "paged", "shape": {...}, "torch":
      {"batch": 1, "q_len": 1, "kv_len": 8192, "num_q_heads": 32, "num_kv_heads": 8,
       "head_dim": 128, "causal": false, "dtype": "bfloat16"}}]' --reps 10

prints one JSON object: {"torch": version, "device": name, "rows": [...], "skipped":
[...]}. Each row times one backend (torch.nn.attention.sdpa_kernel: flash, cudnn; on a
machine without CUDA only the math backend runs, so the plumbing is exercised and the
GPU backends are skipped with the reason) over contiguous K/V [batch, kv_heads, kv_len,
head_dim] (no page table), with GQA through enable_gqa (the K/V heads are not repeated,
so the bytes read are the model's). Correctness: the max abs error against torch's math
backend in float32 on the same inputs (tolerance: the caller's, by dtype).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

BACKENDS = ("flash", "cudnn")


def _time(fn, reps: int, cuda: bool) -> list[float]:
  """Milliseconds per call: CUDA events on a GPU, wall clock otherwise."""
  import torch  # noqa: PLC0415

  fn()  # warm up (and pick the kernel)
  times = []
  for _ in range(reps):
    if cuda:
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      fn()
      end.record()
      torch.cuda.synchronize()
      times.append(start.elapsed_time(end))
    else:
      t0 = time.perf_counter()
      fn()
      times.append((time.perf_counter() - t0) * 1e3)
  return times


def run(shapes: list[dict], reps: int) -> dict:
  import torch  # noqa: PLC0415
  from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
  from torch.nn.functional import scaled_dot_product_attention as sdpa  # noqa: PLC0415

  cuda = torch.cuda.is_available()
  device = "cuda" if cuda else "cpu"
  backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "math": SDPBackend.MATH}
  result = {"torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": [],
            "skipped": []}
  names = BACKENDS if cuda else ("math",)
  gen = torch.Generator(device=device).manual_seed(0)
  for spec in shapes:
    kernel, shape = spec["kernel"], spec["shape"]  # `shape`: the caller's, echoed back
    t = spec["torch"]
    if not cuda:
      result["skipped"] += [{"kernel": kernel, "impl": f"torch-{b}", "shape": shape,
                             "reason": "torch sees no CUDA device (flash / cuDNN SDPA are "
                                       "GPU-only)"} for b in BACKENDS]
    dtype = getattr(torch, t["dtype"])
    b, hq, hkv, d = t["batch"], t["num_q_heads"], t["num_kv_heads"], t["head_dim"]
    q = torch.randn(b, hq, t["q_len"], d, generator=gen, device=device, dtype=dtype)
    k = torch.randn(b, hkv, t["kv_len"], d, generator=gen, device=device, dtype=dtype)
    v = torch.randn(b, hkv, t["kv_len"], d, generator=gen, device=device, dtype=dtype)
    causal = bool(t["causal"])
    with sdpa_kernel(backends["math"]):
      ref = sdpa(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=hq != hkv)
    for name in names:
      impl = f"torch-{name}"

      def call(name=name, q=q, k=k, v=v, causal=causal, gqa=hq != hkv):
        with sdpa_kernel(backends[name]):
          return sdpa(q, k, v, is_causal=causal, enable_gqa=gqa)

      try:
        err = float((call().float() - ref).abs().max())
        times = _time(call, reps, cuda)
      except Exception as e:  # noqa: BLE001 (a backend that refuses the shape: a skip)
        result["skipped"].append({"kernel": kernel, "impl": impl, "shape": shape,
                                  "reason": f"{type(e).__name__}: {str(e)[:300]}"})
        continue
      result["rows"].append({
          "kernel": kernel, "impl": impl, "shape": shape,
          "median_ms": statistics.median(times), "min_ms": min(times),
          "max_abs_err": err, "ref_max_abs": float(ref.abs().max()),
          "timer": "cuda-events" if cuda else "wall",
          "note": f"torch {torch.__version__} SDPA {name} backend; contiguous KV [B, Hkv, T, D],"
                  " no page table; error vs torch's float32 math SDPA on its own inputs"})
    del q, k, v, ref
    if cuda:
      torch.cuda.empty_cache()
  return result


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", required=True, help="JSON list of shape dicts")
  parser.add_argument("--reps", type=int, default=10)
  args = parser.parse_args(argv)
  print(json.dumps(run(json.loads(args.shapes), args.reps)))
  return 0


if __name__ == "__main__":
  sys.exit(main())

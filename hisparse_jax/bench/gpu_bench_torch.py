"""torch's scaled_dot_product_attention on the shapes of `gpu_bench_kernels`, as a peer.

Run by gpu_bench_kernels in a subprocess (the GPU image keeps torch in its own venv, and a
torch beside jax in one process would share the GPU's memory badly); imports nothing of
this project, so any python that imports torch runs it::

  python gpu_bench_torch.py --shapes '[{"kernel": "paged", "shape": {...}, "torch":
      {"batch": 1, "q_len": 1, "kv_len": 8192, "num_q_heads": 32, "num_kv_heads": 8,
       "head_dim": 128, "causal": false, "dtype": "bfloat16"}}]' --reps 10

prints JSON objects {"torch": version, "device": name, "rows": [...], "skipped":
[...]}. Each row times one backend (torch.nn.attention.sdpa_kernel: flash, cudnn; on a
machine without CUDA only the math backend runs, so the plumbing is exercised and the
GPU backends are skipped with the reason) over contiguous K/V [batch, kv_heads, kv_len,
head_dim] (no page table), with GQA through enable_gqa (the K/V heads are not repeated,
so the bytes read are the model's). Correctness: the max abs error against a float32
einsum attention on the same inputs (tolerance: the caller's, by dtype). One JSON line
is printed after each shape, each holding everything so far (the last line is the
result; a run cut short by the caller's timeout still reports what it finished).
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


def _reference(q, k, v, causal: bool):
  """float32 attention with the GQA groups as an axis (no repeated K/V): [B, Hq, Tq, D]."""
  import torch  # noqa: PLC0415

  b, hq, tq, d = q.shape
  hkv, tk = k.shape[1], k.shape[2]
  qf = q.float().reshape(b, hkv, hq // hkv, tq, d)
  s = torch.einsum("bhgqd,bhkd->bhgqk", qf, k.float()) * d**-0.5
  if causal:  # query i sits at position tk - tq + i
    pos = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
    s = s.masked_fill(pos < torch.arange(tk, device=q.device)[None, :], float("-inf"))
  o = torch.einsum("bhgqk,bhkd->bhgqd", s.softmax(-1), v.float())
  return o.reshape(b, hq, tq, d)


def run(shapes: list[dict], reps: int, emit=None) -> dict:
  """Times every shape; `emit(result_so_far)` after each (the caller prints it, so a
  run cut short by a timeout still reports the shapes it finished)."""
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
    ref = _reference(q, k, v, causal)
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
                  " no page table; error vs a float32 einsum reference on its own inputs"})
    del q, k, v, ref
    if cuda:
      torch.cuda.empty_cache()
    if emit is not None:
      emit(result)
  return result


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", required=True, help="JSON list of shape dicts")
  parser.add_argument("--reps", type=int, default=10)
  args = parser.parse_args(argv)
  run(json.loads(args.shapes), args.reps,
      emit=lambda result: print(json.dumps(result), flush=True))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Micro-benchmark: each Pallas kernel against its jitted XLA reference, on this backend.

``python -m kernels_pallas.bench --out results/kernel_bench_cpu.json`` prints a table and
writes JSON naming the machine. On CPU the Pallas column is **interpret mode** (a
correctness tool, expected to be far slower) and the XLA column is the jitted pure-jnp
reference, which is what the engine uses on CPU. On a GPU the Pallas column is the
compiled Triton kernel, and each row also reports achieved bandwidth (bytes the kernel
must move / median time) as a fraction of the device's HBM peak. The two attention kernels
also run over an int8 cache (rows "... int8"), bytes counted at 8 bits + scales; DSA
models' sparse_mla_decode runs at DeepSeek-V3.2's sizes on a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform as py_platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import backend
from kernels_pallas.block_key_bounds import block_key_bounds, block_key_bounds_reference
from kernels_pallas.paged_attention import paged_attention, paged_attention_reference
from kernels_pallas.quant import QuantizedPages, quantize
from kernels_pallas.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from kernels_pallas.sparse_mla import sparse_mla_decode, sparse_mla_decode_reference
from kernels_pallas.write_kv import write_kv, write_kv_reference

# The one table of peaks: (HBM bytes/s, dense bfloat16 tensor-core FLOP/s, no sparsity) by
# jax device_kind prefix (the longest matching prefix wins); vendor datasheet figures.
DEVICE_PEAKS = {
    "NVIDIA H200": (4.8e12, 989e12),
    "NVIDIA H100 80GB HBM3": (3.35e12, 989e12),  # SXM
    "NVIDIA H100 NVL": (3.9e12, 835e12),
    "NVIDIA H100 PCIe": (2.0e12, 756e12),
    "NVIDIA H100": (3.35e12, 989e12),
    "NVIDIA A100-SXM4-80GB": (2.039e12, 312e12),
    "NVIDIA A100": (1.555e12, 312e12),
    "NVIDIA L4": (0.3e12, 121e12),
}
HBM_PEAK_BYTES_PER_S = {kind: hbm for kind, (hbm, _) in DEVICE_PEAKS.items()}
SCALE_BYTES = 4  # the float32 scale per token and KV head of an 8-bit cache


@dataclass(frozen=True)
class Size:
  batch: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  max_blocks: int  # per sequence
  prefill_len: int
  dtype: str


SIZES = {
    "small": Size(8, 8, 2, 64, 16, 32, 128, "float32"),  # CPU: interpret mode is slow
    "large": Size(32, 32, 8, 128, 16, 256, 1024, "bfloat16"),  # GPU
}


@dataclass
class Row:
  kernel: str
  impl: str
  shape: str
  median_ms: float
  min_ms: float
  bytes_moved: int
  gb_per_s: float
  hbm_fraction: float | None


def _time(fn: Callable[[], object], reps: int) -> list[float]:
  jax.block_until_ready(fn())  # compile + warm up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return times


def _machine() -> dict:
  cpu_model = py_platform.processor() or py_platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu_model = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  device = jax.devices()[0]
  return {
      "platform": backend.platform(),
      "device_kind": device.device_kind,
      "num_devices": jax.device_count(),
      "cpu_model": cpu_model,
      "cpu_cores": os.cpu_count(),
      "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,  # noisy host?
      "jax_version": jax.__version__,
      "jaxlib_version": _package_version("jaxlib"),
      "python": sys.version.split()[0],
      "hostname": py_platform.node(),
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }


def _package_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


def device_peaks(device_kind: str) -> tuple[float, float] | None:
  """(HBM bytes/s, dense bf16 FLOP/s) of a jax device_kind (DEVICE_PEAKS' longest matching
  prefix), None for a device the table lacks."""
  matches = [prefix for prefix in DEVICE_PEAKS if device_kind.startswith(prefix)]
  return DEVICE_PEAKS[max(matches, key=len)] if matches else None


def _hbm_peak() -> float | None:
  if backend.platform() != "gpu":
    return None
  peaks = device_peaks(jax.devices()[0].device_kind)
  return None if peaks is None else peaks[0]


def _cases(size: Size, rng: np.random.Generator):
  """Yields (kernel name, shape string, bytes moved, pallas fn, reference fn)."""
  dtype = jnp.dtype(size.dtype)
  item = dtype.itemsize
  num_blocks = size.batch * size.max_blocks + 1
  page_shape = (num_blocks, size.block_size, size.num_kv_heads, size.head_dim)
  k_pages = jnp.asarray(rng.standard_normal(page_shape), dtype)
  v_pages = jnp.asarray(rng.standard_normal(page_shape), dtype)
  perm = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
  tables = jnp.asarray(perm.reshape(size.batch, size.max_blocks))
  token_bytes = size.num_kv_heads * size.head_dim * item  # one token's K (or V)

  # Decode: KV lengths spread over the table; bytes = the K and V of the attended tokens.
  max_len = size.max_blocks * size.block_size
  decode_kv_lens = np.linspace(max_len // 4, max_len, size.batch).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((size.batch, size.num_q_heads, size.head_dim)), dtype)
  args = (q, k_pages, v_pages, tables, jnp.asarray(decode_kv_lens))
  yield ("paged_attention", f"B={size.batch} Hq={size.num_q_heads} Hkv={size.num_kv_heads} "
         f"D={size.head_dim} bs={size.block_size} len<={max_len}",
         int(2 * decode_kv_lens.sum() * token_bytes + 2 * q.size * item),
         lambda: paged_attention(*args), lambda: paged_attention_reference(*args))

  # Ragged: two chunked prefills of prefill_len new tokens plus decode rows.
  num_seqs = min(size.batch, 4)
  q_lens = np.array([size.prefill_len, size.prefill_len] + [1] * (num_seqs - 2), np.int32)
  kv_lens = np.minimum(q_lens + max_len // 2, max_len).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  rq = jnp.asarray(rng.standard_normal((int(cu[-1]), size.num_q_heads, size.head_dim)), dtype)
  rargs = (rq, k_pages, v_pages, tables[:num_seqs], jnp.asarray(kv_lens), jnp.asarray(cu))
  yield ("ragged_paged_attention", f"q_lens={q_lens.tolist()} kv_lens={kv_lens.tolist()}",
         int(2 * kv_lens.sum() * token_bytes + 2 * rq.size * item),
         lambda: ragged_paged_attention(*rargs), lambda: ragged_paged_attention_reference(*rargs))

  # The same two calls over an int8 cache (QuantizedPages: int8 values + a float32 scale per
  # token and KV head): bytes = the 8-bit values and scales of the attended tokens.
  k8, v8 = (QuantizedPages(*quantize(p, "int8"), dtype=dtype) for p in (k_pages, v_pages))
  token_bytes_8 = size.num_kv_heads * (size.head_dim + SCALE_BYTES)
  args8 = (q, k8, v8, *args[3:])
  yield ("paged_attention int8", "as paged_attention, int8 KV",
         int(2 * decode_kv_lens.sum() * token_bytes_8 + 2 * q.size * item),
         lambda: paged_attention(*args8), lambda: paged_attention_reference(*args8))
  rargs8 = (rq, k8, v8, *rargs[3:])
  yield ("ragged_paged_attention int8", "as ragged_paged_attention, int8 KV",
         int(2 * kv_lens.sum() * token_bytes_8 + 2 * rq.size * item),
         lambda: ragged_paged_attention(*rargs8),
         lambda: ragged_paged_attention_reference(*rargs8))

  # write_kv / block_key_bounds donate their inputs: each call consumes the previous
  # call's output (in place), so no copy of the pool is timed.
  num_new = size.batch * 8
  slots = jnp.asarray(rng.choice(num_blocks * size.block_size, num_new, replace=False), jnp.int32)
  new = jnp.asarray(rng.standard_normal((num_new, size.num_kv_heads, size.head_dim)), dtype)
  yield ("write_kv", f"tokens={num_new} pool={page_shape}", int(2 * num_new * token_bytes * 2),
         _chained(write_kv, (k_pages.copy(), v_pages.copy()), new, new, slots),
         _chained(write_kv_reference, (k_pages.copy(), v_pages.copy()), new, new, slots))
  bounds = jnp.zeros((num_blocks, 2, size.num_kv_heads, size.head_dim), dtype)
  yield ("block_key_bounds", f"tokens={num_new} bounds={bounds.shape}",
         int(num_new * (size.block_size + 2) * token_bytes),
         _chained(block_key_bounds, (bounds.copy(),), k_pages, slots),
         _chained(block_key_bounds_reference, (bounds.copy(),), k_pages, slots))


  # DSA models' sparse MLA decode: each query over its listed tokens of the latent pool
  # (on a GPU, DeepSeek-V3.2's: 128 heads, latent 512 + rope 64, top-k 2,048); bytes = the
  # listed entries gathered + the queries.
  large = size == SIZES["large"]
  heads, rank, rope, topk = (128, 512, 64, 2048) if large else (16, 64, 16, 256)
  num_tokens = size.batch * size.max_blocks * size.block_size
  latent = jnp.asarray(rng.standard_normal((num_blocks, size.block_size, 1, rank + rope)),
                       dtype)
  mq = jnp.asarray(rng.standard_normal((size.batch, heads, rank + rope)), dtype)
  idx = jnp.asarray(rng.integers(size.block_size, num_tokens, (size.batch, topk)), jnp.int32)
  margs, mkw = (mq, latent, idx), dict(sm_scale=(rank + rope) ** -0.5, kv_lora_rank=rank)
  yield ("sparse_mla_decode", f"B={size.batch} H={heads} latent={rank}+{rope} topk={topk} "
         f"bs={size.block_size}",
         int(size.batch * topk * (rank + rope) * item + 2 * mq.size * item),
         lambda: sparse_mla_decode(*margs, **mkw),
         lambda: sparse_mla_decode_reference(*margs, **mkw))


def _chained(fn, state: tuple, *args) -> Callable[[], object]:
  """A thunk calling fn(*state, *args) and keeping its (donated, in-place) result as state."""
  holder = [state]

  def call():
    out = fn(*holder[0], *args)
    holder[0] = out if isinstance(out, tuple) else (out,)
    return out

  return call


def run(size_name: str | None = None, reps: int = 5, seed: int = 0) -> dict:
  """Runs every case on the default backend; returns the JSON-ready result."""
  on_gpu = backend.platform() == "gpu"
  size_name = size_name or ("large" if on_gpu else "small")
  size = SIZES[size_name]
  peak = _hbm_peak()
  pallas_impl = "pallas-interpret" if backend.resolve_interpret(None) else "pallas-compiled"
  rows = []
  for name, shape, nbytes, pallas_fn, ref_fn in _cases(size, np.random.default_rng(seed)):
    for impl, fn in ((pallas_impl, pallas_fn), ("xla-reference", ref_fn)):
      times = _time(fn, reps)
      med = statistics.median(times)
      rows.append(Row(name, impl, shape, med * 1e3, min(times) * 1e3, nbytes, nbytes / med / 1e9,
                      None if peak is None else nbytes / med / peak))
  impls = {pallas_impl: ("Pallas kernel, interpret mode (CPU correctness path, not a speed path)"
                         if pallas_impl == "pallas-interpret" else "Pallas kernel, compiled"),
           "xla-reference": "the kernel's pure-jnp reference, jax.jit-compiled (the xla backend)"}
  return {"machine": _machine(), "impls": impls, "size": size_name, "config": asdict(size),
          "reps": reps, "hbm_peak_bytes_per_s": peak, "rows": [asdict(r) for r in rows]}


def format_table(result: dict) -> str:
  lines = [f"{'kernel':<29}{'impl':<18}{'median ms':>11}{'min ms':>10}{'GB/s':>9}{'HBM %':>8}"]
  for r in result["rows"]:
    frac = "-" if r["hbm_fraction"] is None else f"{100 * r['hbm_fraction']:.1f}"
    lines.append(f"{r['kernel']:<29}{r['impl']:<18}{r['median_ms']:>11.3f}{r['min_ms']:>10.3f}"
                 f"{r['gb_per_s']:>9.2f}{frac:>8}")
  m = result["machine"]
  lines.append(f"machine: {m['platform']} / {m['device_kind']} / {m['cpu_model']} "
               f"({m['cpu_cores']} cores), jax {m['jax_version']}, size={result['size']}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="write the JSON result here")
  parser.add_argument("--size", choices=sorted(SIZES), default=None,
                      help="problem size (default: small on CPU, large on GPU)")
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args(argv)
  result = run(args.size, args.reps)
  print(format_table(result))
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
      f.write("\n")
    print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

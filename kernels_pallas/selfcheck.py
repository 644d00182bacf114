"""Device self-check: every Pallas kernel against its reference on the default backend.

``python -m kernels_pallas.selfcheck`` compiles each kernel for the current platform
(Triton on GPU; interpret mode on CPU, where the pytest suite is the real check) and
compares it with the jitted reference over a pairwise grid of GQA ratio, block size,
head_dim and dtype, and over 8-bit pages (int8 and fp8_e4m3 alternating over the grid;
fp8 skipped on GPUs below compute capability 8.9) against the references over the same
pages dequantized. It prints one line per case and exits 1 on any mismatch. This is
the GPU verification the CPU-only test suite cannot do (tests/conftest.py pins CPU).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import backend
from kernels_pallas.block_key_bounds import block_key_bounds, block_key_bounds_reference
from kernels_pallas.block_scores import block_scores, block_scores_reference
from kernels_pallas.paged_attention import paged_attention, paged_attention_reference
from kernels_pallas.quant import QuantizedPages, quantize
from kernels_pallas.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from kernels_pallas.sparse_mla import sparse_mla_decode, sparse_mla_decode_reference
from kernels_pallas.write_kv import write_kv, write_kv_reference

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
# (GQA ratio, block_size, head_dim, dtype): every pair of values of two axes appears.
GRID = ((1, 8, 64, "float32"), (1, 16, 128, "bfloat16"), (1, 32, 64, "bfloat16"),
        (4, 8, 128, "bfloat16"), (4, 16, 64, "float32"), (4, 32, 128, "float32"),
        (8, 8, 64, "bfloat16"), (8, 16, 128, "float32"), (8, 32, 64, "float32"))
NUM_BLOCKS, MAX_BLOCKS = 64, 24


def _err(a, b) -> float:
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _pool(rng, block_size, num_kv_heads, head_dim, dtype):
  # Scaled so |v| stays below 2, where one bfloat16 ulp (2**-7) is well inside 2e-2.
  shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
  return (jnp.asarray(0.5 * rng.standard_normal(shape), dtype),
          jnp.asarray(0.5 * rng.standard_normal(shape), dtype))


def _tables(rng, batch):
  return jnp.asarray(np.stack([rng.choice(np.arange(1, NUM_BLOCKS), MAX_BLOCKS, replace=False)
                               for _ in range(batch)]).astype(np.int32))


def check_attention(rng, ratio, block_size, head_dim, dtype_name) -> list[tuple[str, float]]:
  dtype = jnp.dtype(dtype_name)
  num_kv_heads = 2 if ratio < 8 else 1
  k_pages, v_pages = _pool(rng, block_size, num_kv_heads, head_dim, dtype)
  bs, long = block_size, MAX_BLOCKS * block_size
  decode_kv_lens = jnp.asarray([0, 1, bs - 1, bs, bs + 1, 5 * bs + 3, long - 1, long], jnp.int32)
  tables = _tables(rng, decode_kv_lens.shape[0])
  q = jnp.asarray(rng.standard_normal((decode_kv_lens.shape[0], ratio * num_kv_heads,
                                       head_dim)), dtype)
  args = (q, k_pages, v_pages, tables, decode_kv_lens)
  out = [("paged", _err(paged_attention(*args), paged_attention_reference(*args))),
         ("paged+split4", _err(paged_attention(*args, num_splits=4),
                               paged_attention_reference(*args)))]
  seqs = [(1, 1), (bs - 1, bs - 1), (1, bs), (3, bs + 1), (0, 5), (bs + 5, 5 * bs + 3),
          (40, long)]
  q_lens, kv_lens = zip(*seqs)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
  rq = jnp.asarray(rng.standard_normal((int(cu[-1]) + 3, ratio * num_kv_heads, head_dim)), dtype)
  rargs = (rq, k_pages, v_pages, _tables(rng, len(seqs)), jnp.asarray(kv_lens, jnp.int32), cu)
  for kw in ({}, {"sliding_window": bs + 3, "soft_cap": 10.0}):
    out.append((f"ragged{kw or ''}", _err(ragged_paged_attention(*rargs, **kw),
                                          ragged_paged_attention_reference(*rargs, **kw))))
  return out


def check_write_and_bounds(rng, block_size, head_dim, dtype_name) -> list[tuple[str, float]]:
  dtype = jnp.dtype(dtype_name)
  slots = np.concatenate([rng.choice(NUM_BLOCKS * block_size, 40, replace=False), [-1, -5]])
  slots = jnp.asarray(slots.astype(np.int32))
  new = jnp.asarray(rng.standard_normal((slots.shape[0], 2, head_dim)), dtype)
  pages = _pool(rng, block_size, 2, head_dim, dtype)
  got = write_kv(pages[0].copy(), pages[1].copy(), new, -new, slots)
  want = write_kv_reference(pages[0].copy(), pages[1].copy(), new, -new, slots)
  bounds = jnp.zeros((NUM_BLOCKS, 2, 2, head_dim), jnp.float32)
  got_b = block_key_bounds(bounds.copy(), want[0], slots)
  want_b = block_key_bounds_reference(bounds.copy(), want[0], slots)
  # HiSparse's block scores over those bounds (4 query heads a KV head), relative to the
  # scores' size (sums of head_dim products).
  q = jnp.asarray(rng.standard_normal((3, 8, head_dim)), dtype)
  rows = jnp.asarray(rng.integers(0, NUM_BLOCKS, (3, MAX_BLOCKS)).astype(np.int32))
  want_s = block_scores_reference(q, want_b, rows, per_query_head=True)
  scores_err = _err(block_scores(q, want_b, rows, per_query_head=True), want_s) / max(
      _err(want_s, jnp.zeros_like(want_s)), 1.0)
  return [("write_kv", max(_err(got[0], want[0]), _err(got[1], want[1]))),
          ("block_key_bounds", _err(got_b, want_b)),
          ("block_scores (relative)", scores_err)]


def _fp8_convertible() -> bool:
  """Whether this device's kernels can convert float8_e4m3fn (CPU; NVIDIA sm_89+)."""
  device = jax.devices()[0]
  cc = str(getattr(device, "compute_capability", "") or "")
  if device.platform != "gpu" or not cc.replace(".", "").isdigit():
    return True
  major, minor = (int(x) for x in cc.split("."))
  return (major, minor) >= (8, 9)


def check_8bit(rng, ratio, block_size, head_dim, dtype_name, kind) -> list[tuple[str, float]]:
  """The attention kernels and the bounds over 8-bit pages (`kind`: int8 / fp8_e4m3)
  against the references over the same pages dequantized first."""
  dtype = jnp.dtype(dtype_name)
  num_kv_heads = 2 if ratio < 8 else 1
  k_f, v_f = _pool(rng, block_size, num_kv_heads, head_dim, jnp.float32)
  k_q, v_q = (QuantizedPages(*quantize(x, kind), dtype=dtype) for x in (k_f, v_f))
  k_d, v_d = k_q.dequantize(), v_q.dequantize()
  bs, long = block_size, MAX_BLOCKS * block_size
  kv_lens = jnp.asarray([0, 1, bs + 1, 5 * bs + 3, long], jnp.int32)
  tables = _tables(rng, kv_lens.shape[0])
  q = jnp.asarray(rng.standard_normal((5, ratio * num_kv_heads, head_dim)), dtype)
  out = [(f"paged {kind}", _err(paged_attention(q, k_q, v_q, tables, kv_lens),
                                paged_attention_reference(q, k_d, v_d, tables, kv_lens)))]
  seqs = [(1, 1), (3, bs + 1), (bs + 5, 5 * bs + 3), (40, long)]
  q_lens, lens = zip(*seqs)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
  rq = jnp.asarray(rng.standard_normal((int(cu[-1]), ratio * num_kv_heads, head_dim)), dtype)
  rargs = (_tables(rng, len(seqs)), jnp.asarray(lens, jnp.int32), cu)
  out.append((f"ragged {kind}", _err(ragged_paged_attention(rq, k_q, v_q, *rargs),
                                     ragged_paged_attention_reference(rq, k_d, v_d, *rargs))))
  slots = jnp.asarray(rng.choice(NUM_BLOCKS * block_size, 40, replace=False).astype(np.int32))
  bounds = jnp.zeros((NUM_BLOCKS, 2, num_kv_heads, head_dim), jnp.float32)
  out.append((f"block_key_bounds {kind}",
              _err(block_key_bounds(bounds.copy(), k_q, slots),
                   block_key_bounds_reference(bounds.copy(), k_d, slots))))
  return out


def check_sparse_mla(rng, block_size, dtype_name) -> list[tuple[str, float]]:
  """DSA models' sparse MLA decode (kernels_pallas.sparse_mla): 16 heads, latent 64 + rope
  16 (512 + 64 on a GPU: DeepSeek's), 8 queries over 256 listed tokens with padding."""
  compiled = not backend.resolve_interpret(None)
  rank, rope, topk = (512, 64, 2048) if compiled else (64, 16, 256)
  dtype = jnp.dtype(dtype_name)
  num_blocks = max(8, 2 * topk // block_size)
  pages = jnp.asarray(rng.standard_normal((num_blocks, block_size, 1, rank + rope)), dtype)
  q = jnp.asarray(rng.standard_normal((8, 16, rank + rope)), dtype)
  idx = rng.integers(block_size, num_blocks * block_size, size=(8, topk)).astype(np.int32)
  idx[rng.random(idx.shape) < 0.1] = -1
  args = (q, pages, jnp.asarray(idx))
  kw = dict(sm_scale=(rank + rope) ** -0.5, kv_lora_rank=rank)
  return [("sparse_mla_decode", _err(sparse_mla_decode(*args, **kw),
                                     sparse_mla_decode_reference(*args, **kw)))]


def main() -> int:
  rng = np.random.default_rng(0)
  mode = "interpret" if backend.resolve_interpret(None) else "compiled"
  print(f"platform={backend.platform()} device={jax.devices()[0].device_kind} pallas={mode} "
        f"jax={jax.__version__}")
  failures = 0
  fp8 = _fp8_convertible()
  for i, (ratio, block_size, head_dim, dtype) in enumerate(GRID):
    rows = check_attention(rng, ratio, block_size, head_dim, dtype)
    rows += check_write_and_bounds(rng, block_size, head_dim, dtype)
    kind = "int8" if i % 2 or not fp8 else "fp8_e4m3"  # both kinds over the grid
    rows += check_8bit(rng, ratio, block_size, head_dim, dtype, kind)
    if head_dim == 64:  # five rows: every block size, both dtypes
      rows += check_sparse_mla(rng, block_size, dtype)
    for name, err in rows:
      # write_kv and block_key_bounds move bytes: they must match exactly.
      tol = 0.0 if name.startswith(("write_kv", "block_key_bounds")) else TOL[dtype]
      ok = err <= tol
      failures += not ok
      print(f"{'PASS' if ok else 'FAIL'} ratio={ratio} bs={block_size} d={head_dim} {dtype:<8} "
            f"{name:<45} max_abs_err={err:.2e} (tol {tol:g})")
  if not fp8:
    print("SKIP fp8_e4m3: this GPU converts no float8_e4m3fn (compute capability < 8.9)")
  print(f"{failures} failure(s)")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())

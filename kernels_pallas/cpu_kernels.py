"""C++ kernels for XLA:CPU (XLA FFI custom calls), built on first use.

Pallas does not compile for CPU, and XLA:CPU runs a paged decode as a gather of each row's
blocks followed by many tiny batched matmuls (a group of query heads against a chunk of
keys), and a prefill as matmuls whose scores go through memory between the two products.
`cpu_attention.cc` reads the blocks in place instead, on XLA's intra-op thread pool
(vLLM's CPU backend runs C++ attention kernels the same way): `paged_decode` (one task
per row) is what xla_attention's decode rows call when `available()`, `ragged_prefill`
(one task per 32 queries of a row and KV head, flash attention over 16-key tiles) its
prefill rows. `cpu_matmul.cc`: the matmul over packed weights (`kernels_pallas.packed`),
what the engine's step multiplies float32 weights with on CPU. `cpu_select.cc`: HiSparse's
"union" block selection (`union_select` from scores; `union_select_bounds` scores the key
bounds in place too, float32, bfloat16 or int8 `QuantizedBounds`: what the engine's
sparse rows call on CPU). `cpu_resolve.cc`: the hot-buffer resolve (`resolve`, what
`resolver.resolve` calls on CPU).

Build: the sources are compiled (into one library) once per source / jaxlib / compiler into
$HISPARSE_CACHE_DIR (default ~/.cache/hisparse_jax) with the system C++ compiler ($CXX,
else c++ / g++ / clang++) against jaxlib's FFI headers (`jax.ffi.include_dir()`), then
loaded and registered as an FFI target. Without a compiler, or with
HISPARSE_CPU_KERNELS=0, `available()` is False and the jnp path runs (warned once when a
build fails). Only float32 pages: other dtypes take the jnp path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.block_key_bounds import QuantizedBounds

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(_HERE, f"cpu_{name}.cc")
                for name in ("attention", "matmul", "select", "resolve"))
HEADERS = (os.path.join(_HERE, "cpu_tasks.h"),)  # in the cache key, not compiled alone
TARGET = "hisparse_paged_decode_f32"
PREFILL_TARGET = "hisparse_ragged_prefill_f32"
MATMUL_TARGET = "hisparse_packed_matmul_f32"
UNION_SELECT_TARGET = "hisparse_union_select_f32"
RESOLVE_TARGET = "hisparse_resolve"
# uint16: bfloat16 bounds in their storage bits (the engine's on CPU), read as bfloat16.
UNION_SELECT_BOUNDS_TARGETS = {"float32": "hisparse_union_select_bounds_f32",
                               "bfloat16": "hisparse_union_select_bounds_bf16",
                               "uint16": "hisparse_union_select_bounds_u16"}
# int8 bounds (block_key_bounds.QuantizedBounds): the values and their scales.
UNION_SELECT_BOUNDS_INT8_TARGET = "hisparse_union_select_bounds_i8"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++17", "-w")


def _compiler() -> str | None:
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cache_dir() -> str:
  return os.environ.get("HISPARSE_CACHE_DIR",
                        os.path.join(os.path.expanduser("~"), ".cache", "hisparse_jax"))


def _cpu_signature() -> bytes:
  """What -march=native compiles for: the CPU's model and flags (a cache shared by
  machines with different CPUs must not hand one the other's instructions)."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    return "".join(lines).encode()
  except OSError:
    return platform.processor().encode()


def build() -> str:
  """Compiles the kernel (or finds it compiled); returns the shared library's path.
  Raises RuntimeError when there is no compiler or the compile fails."""
  import jaxlib

  cxx = _compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler (set CXX, or install g++)")
  source = b""
  for file in SOURCES + HEADERS:
    with open(file, "rb") as f:
      source += f.read()
  key = hashlib.sha256(source + jaxlib.__version__.encode() + cxx.encode()
                       + " ".join(FLAGS).encode() + _cpu_signature()).hexdigest()[:16]
  path = os.path.join(_cache_dir(), f"cpu_attention_{key}.so")
  if os.path.exists(path):
    return path
  os.makedirs(_cache_dir(), exist_ok=True)
  # Built beside its final name and renamed: processes building at once each write their
  # own file, and the rename is atomic.
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
  os.close(fd)
  cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *SOURCES, "-o", tmp]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  if r.returncode != 0:
    os.unlink(tmp)
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
  os.replace(tmp, path)
  return path


@functools.cache
def available() -> bool:
  """Whether the C++ kernels are built and registered (HISPARSE_CPU_KERNELS=0: never)."""
  if os.environ.get("HISPARSE_CPU_KERNELS", "1") == "0":
    return False
  try:
    lib = ctypes.cdll.LoadLibrary(build())
  except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
    warnings.warn(f"hisparse_jax: the C++ CPU kernels are not available ({e}); the jnp "
                  "attention runs instead", RuntimeWarning, stacklevel=2)
    return False
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.HisparsePagedDecodeF32),
                              platform="cpu")
  jax.ffi.register_ffi_target(PREFILL_TARGET,
                              jax.ffi.pycapsule(lib.HisparseRaggedPrefillF32), platform="cpu")
  jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(lib.HisparsePackedMatmulF32),
                              platform="cpu")
  jax.ffi.register_ffi_target(UNION_SELECT_TARGET,
                              jax.ffi.pycapsule(lib.HisparseUnionSelectF32), platform="cpu")
  jax.ffi.register_ffi_target(RESOLVE_TARGET, jax.ffi.pycapsule(lib.HisparseResolve),
                              platform="cpu")
  for dtype, symbol in (("float32", "HisparseUnionSelectBoundsF32"),
                        ("bfloat16", "HisparseUnionSelectBoundsBF16"),
                        ("uint16", "HisparseUnionSelectBoundsU16")):
    jax.ffi.register_ffi_target(UNION_SELECT_BOUNDS_TARGETS[dtype],
                                jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
  jax.ffi.register_ffi_target(UNION_SELECT_BOUNDS_INT8_TARGET,
                              jax.ffi.pycapsule(lib.HisparseUnionSelectBoundsI8),
                              platform="cpu")
  return True


def supports(q: jax.Array, k_pages: jax.Array) -> bool:
  """Whether `paged_decode` takes these operands (float32 pages and queries, the kernels
  built)."""
  return (isinstance(k_pages, jax.Array | jax.core.Tracer) and k_pages.dtype == jnp.float32
          and q.shape[1] % k_pages.shape[2] == 0 and available())


def paged_decode(q, k_pages, v_pages, block_tables, kv_lens, starts=None, *, sm_scale: float,
                 soft_cap: float | None = None) -> jax.Array:
  """float32 [B, Hq, D]: each row's query over its keys [starts, kv_lens) (starts None:
  from 0); the contract of xla_attention's decode rows."""
  if starts is None:
    starts = jnp.zeros_like(kv_lens)
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                          vmap_method="sequential")
  return call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
              kv_lens.astype(jnp.int32), starts.astype(jnp.int32),
              scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0))


def ragged_prefill(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, sm_scale: float,
                   soft_cap: float | None = None, sliding_window: int | None = None
                   ) -> jax.Array:
  """float32 [T, Hq, D]: the rows of a ragged batch with more than one query, causal over
  their keys (and a sliding window); every other token's output is 0. The contract of
  `ragged_paged_attention` for those rows."""
  call = jax.ffi.ffi_call(PREFILL_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                          vmap_method="sequential")
  return call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
              kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32),
              scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
              window=np.int64(sliding_window or 0))


def _require() -> None:
  if not available():
    raise RuntimeError("the C++ CPU kernels are not built (no C++ compiler, or "
                       "HISPARSE_CPU_KERNELS=0)")


def union_select(scores, kv_lens, *, k: int, block_size: int, sink_blocks: int,
                 local_blocks: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The "union" selection of `indexer.select` from per-query-head scores [B, H, NB]:
  (logical_ids int32 [B, k] ascending, padded with -1; num_selected int32 [B]; the
  selected blocks' kv_lens int32 [B]), equal to `indexer.select_blocks(
  indexer.union_priority(...))` (cpu_select.cc). k <= NB."""
  batch, _, max_blocks = scores.shape
  if not 1 <= k <= max_blocks:
    raise ValueError(f"union_select: k={k} must be in [1, {max_blocks}]")
  _require()
  out = (jax.ShapeDtypeStruct((batch, k), jnp.int32),
         jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32))
  call = jax.ffi.ffi_call(UNION_SELECT_TARGET, out, vmap_method="sequential")
  return call(scores.astype(jnp.float32), kv_lens.astype(jnp.int32),
              block_size=np.int64(block_size), sink_blocks=np.int64(sink_blocks),
              local_blocks=np.int64(local_blocks))


def union_select_bounds_target(bounds) -> str | None:
  """The FFI target `union_select_bounds` scores `bounds` with: by dtype name for an
  array (float32, bfloat16, uint16: bfloat16 bits), the int8 target for a
  `QuantizedBounds` (int8 values, float32 scales); None for any other bounds."""
  if isinstance(bounds, QuantizedBounds):
    ok = (jnp.dtype(bounds.values.dtype) == jnp.int8
          and jnp.dtype(bounds.scales.dtype) == jnp.float32)
    return UNION_SELECT_BOUNDS_INT8_TARGET if ok else None
  return UNION_SELECT_BOUNDS_TARGETS.get(jnp.dtype(bounds.dtype).name)


def union_select_bounds(q, bounds, bounds_rows, kv_lens, *, k: int, block_size: int,
                        sink_blocks: int, local_blocks: int
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`union_select` with the scores computed from the key bounds where they lie: q [B, Hq,
  D], bounds [R, 2, Hkv, D] (float32, bfloat16, uint16: bfloat16 bits, or int8: a
  `QuantizedBounds`, values [R, 2, Hkv, D] and float32 scales [R, 2, Hkv, 1]),
  bounds_rows int32 [B, NB] (each logical block's row of `bounds`), kv_lens [B]. The
  selection `indexer.select(q, bounds[bounds_rows], kv_lens, blocks, "union")` makes
  (int8: of `bounds.rows(bounds_rows).dequantize()`), without the gathered copy (scores
  equal up to float32 rounding: the sums run in another order, and int8's scale
  multiplies each side's sum instead of each value). k <= NB."""
  batch, max_blocks = bounds_rows.shape
  if not 1 <= k <= max_blocks:
    raise ValueError(f"union_select_bounds: k={k} must be in [1, {max_blocks}]")
  _require()
  target = union_select_bounds_target(bounds)
  if target is None:
    raise ValueError("union_select_bounds: bounds must be float32, bfloat16, uint16 "
                     "(bfloat16 bits) or QuantizedBounds (int8 values, float32 scales), "
                     f"got {jax.tree.map(lambda x: x.dtype, bounds)}")
  operands = tuple(bounds) if isinstance(bounds, QuantizedBounds) else (bounds,)
  out = (jax.ShapeDtypeStruct((batch, k), jnp.int32),
         jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32))
  call = jax.ffi.ffi_call(target, out, vmap_method="sequential")
  return call(q.astype(jnp.float32), *operands, bounds_rows.astype(jnp.int32),
              kv_lens.astype(jnp.int32), block_size=np.int64(block_size),
              sink_blocks=np.int64(sink_blocks), local_blocks=np.int64(local_blocks))


def resolve(sel, valid, slot_block, slot_last_used, evicted_at, resident_ids, slot_device_ids,
            host_ids, step, *, num_device_blocks: int, thrash_window_steps: int):
  """`resolver._resolve_row` for every row (cpu_resolve.cc): (table [B, K], load host ids
  [B, K], load device ids [B, K], new slot_block [B, S], new slot_last_used [B, S], new
  evicted_at [B, M], counts [B, 5]), all int32."""
  _require()
  batch, k = sel.shape
  num_slots, max_blocks = slot_block.shape[1], evicted_at.shape[1]
  i32 = jnp.int32
  out = tuple(jax.ShapeDtypeStruct(shape, i32) for shape in (
      (batch, k), (batch, k), (batch, k), (batch, num_slots), (batch, num_slots),
      (batch, max_blocks), (batch, 5)))
  call = jax.ffi.ffi_call(RESOLVE_TARGET, out, vmap_method="sequential")
  return call(*(x.astype(i32) for x in (sel, valid, slot_block, slot_last_used, evicted_at,
                                        resident_ids, slot_device_ids, host_ids)),
              jnp.asarray(step, i32), num_device_blocks=np.int64(num_device_blocks),
              thrash_window_steps=np.int64(thrash_window_steps))


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25


@functools.cache
def _madvise():
  if platform.system() != "Linux":
    return None
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
  except (OSError, AttributeError):
    return None
  fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  fn.restype = ctypes.c_int
  return fn


def advise_huge_pages(arrays) -> int:
  """Asks Linux to back the memory of these CPU arrays with transparent huge pages
  (madvise MADV_HUGEPAGE, then MADV_COLLAPSE to move what is already there): a decode
  step reads its weights and KV blocks in long strides over hundreds of MB, and with
  4 KiB pages a few rows apart is a TLB miss each (measured: the decode attention over 8
  x 600 tokens x 30 layers 26% faster). A hint: memory it cannot advise (another OS, a
  kernel without THP, a buffer under 2 MiB) stays as it is. Returns the bytes advised."""
  madvise = _madvise()
  if madvise is None or os.environ.get("HISPARSE_HUGE_PAGES", "1") == "0":
    return 0
  done = 0
  for a in arrays:
    if not isinstance(a, jax.Array) or a.is_deleted():
      continue
    for shard in a.addressable_shards:
      if shard.device.platform != "cpu":
        continue
      try:
        ptr = shard.data.unsafe_buffer_pointer()
      except Exception:  # noqa: BLE001 (a buffer that exposes no pointer)
        continue
      lo = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
      hi = (ptr + shard.data.nbytes) // _HUGE_PAGE * _HUGE_PAGE
      if hi <= lo or madvise(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        continue
      madvise(lo, hi - lo, _MADV_COLLAPSE)  # (kernels before 6.1: khugepaged later)
      done += hi - lo
  return done

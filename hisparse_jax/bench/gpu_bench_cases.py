"""The cases of `gpu_bench_kernels`: each kernel of the engine at its real shapes, its peers
on the same shapes, and the reference its output is checked against.

A case is one (kernel, shape): its bytes and FLOPs (what the roofline is computed from),
the impls to time (ours and peers, each a function and its arguments, or a thunk giving
them, so a peer's contiguous copy of the KV exists only while it runs), the impls skipped
with their reasons, and the reference. Builders are generators: a kernel's pool is made
once, and each shape's arrays live only while its case runs. Inputs are random on the
device (jax.random), never built on the host: a full-size pool is gigabytes.

Sizes: FULL (the engine's: an 8B-class GQA 32:8 model, head_dim 128, block 16, bf16;
DeepSeek-V3.2's MLA) and SMOKE (the same structure, tiny: interpret mode on a CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.bench import gpu_bench_peers as peers
from hisparse_jax.bench.common import Impl  # (gpu_bench_select, tests: cases.Impl)
from kernels_pallas.paged_attention import paged_attention, paged_attention_reference
from kernels_pallas.quant import QuantizedPages, quantize
from kernels_pallas.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from kernels_pallas.sparse_mla import sparse_mla_decode, sparse_mla_decode_reference
from kernels_pallas.sparse_mla_mgpu import sparse_mla_decode_mgpu

KERNELS = ("paged", "paged_8bit", "ragged", "prefill", "sparse_mla", "select")
# Every impl each kernel reports, as a row or as a skipped entry with its reason.
EXPECTED_IMPLS = {
    "paged": ("ours-triton", "ours-mgpu", "xla-reference", "xla-sdpa", "jax-pallas-paged",
              "jax-pallas-decode", "jax-mgpu-attention", "cudnn", "torch-flash",
              "torch-cudnn", "tokamax-mosaic", "tokamax-triton", "tokamax-xla",
              "jla-mgpu-attention"),
    "paged_8bit": ("ours-triton", "ours-mgpu", "xla-reference", "jax-pallas-paged"),
    "ragged": ("ours-triton", "ours-mgpu", "xla-reference"),
    "prefill": ("ours-triton", "xla-sdpa", "cudnn", "jax-mgpu-attention", "torch-flash",
                "torch-cudnn", "tokamax-mosaic", "tokamax-triton", "tokamax-xla",
                "jla-mgpu-attention"),
    "sparse_mla": ("ours-triton", "ours-mgpu", "xla-reference", "jla-dsa"),
    "select": ("ours-triton", "ours-triton-int8", "ours-triton-fp8", "ours-jnp", "cpp-cpu"),
}
FULL = {
    "model": dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                  dtype="bfloat16"),
    # (batch, context) in priority order: the budget cuts from the end.
    "paged": ((32, 8192), (32, 32768), (1, 8192), (1, 32768), (128, 8192), (1, 131072),
              (32, 4096), (1, 4096), (32, 2048)),  # (32, 2048): select's top-k, below
    "paged_8bit": ((32, 8192), (32, 32768), (1, 32768)),
    "ragged": dict(q_lens=(1024, 1024) + (1,) * 30, kv_lens=(4096, 8192) + (8192,) * 30),
    "prefill": dict(seq=8192),
    "sparse_mla": dict(batch=32, heads=128, rank=512, rope=64, topk=2048, block_size=64,
                       context=32768),
    "select": dict(batch=32, context=65536, top_k_tokens=2048),
    # DeepSeek-V3.2's indexer (64 heads of 128), the sparse_mla case's batch and top-k
    "dsa_select": dict(batch=32, context=65536, heads=64, dim=128, block_size=64, topk=2048),
}
SMOKE = {
    "model": dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                  dtype="bfloat16"),
    "paged": ((2, 256),),
    "paged_8bit": ((2, 256),),
    "ragged": dict(q_lens=(32, 32, 1, 1), kv_lens=(64, 128, 128, 128)),
    "prefill": dict(seq=128),
    "sparse_mla": dict(batch=2, heads=16, rank=64, rope=64, topk=64, block_size=16,
                       context=256),
    "select": dict(batch=2, context=1024, top_k_tokens=256),
    "dsa_select": dict(batch=2, context=1024, heads=16, dim=64, block_size=16, topk=64),
}
CONTIGUOUS = "contiguous KV, no page table"
# The Triton paged decode's knobs timed beside its defaults at the paged case's first
# shape (rows "ours-triton <name>"; the summary's best ours is the fastest of them): more
# keys per loop step (bytes in flight per program), more warps, a deeper pipeline.
TRITON_TUNING = {"bps=4": dict(blocks_per_step=4), "bps=8": dict(blocks_per_step=8),
                 "bps=8 warps=8": dict(blocks_per_step=8, num_warps=8),
                 "bps=8 stages=3": dict(blocks_per_step=8, num_stages=3)}
# The Mosaic GPU decode's: 128 keys a pipeline step, 3 or 4 SMEM slots in its K/V pipeline.
MGPU_TUNING = {"tps=128": dict(tokens_per_step=128), "slots=3": dict(num_slots=3),
               "slots=4": dict(num_slots=4)}


@dataclasses.dataclass
class Case:
  kernel: str
  shape: dict
  bytes: int  # what the kernel must move (8-bit pages: as stored, scales included)
  flops: int  # the useful matmul FLOPs (2 per multiply-add)
  dtype: str  # the output's (tolerance)
  reference: Impl  # the output the impls are checked against
  impls: dict[str, Impl]
  skipped: dict[str, str] = dataclasses.field(default_factory=dict)
  reference_impl: str | None = None  # the impl whose output IS the reference (not rerun)
  # check(out, ref) -> (max_abs_err, ref_max_abs, ok, note); None: the dtype's tolerance
  check: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Env:
  on_gpu: bool
  sm90: bool  # a Hopper-class GPU (Mosaic GPU's WGMMA kernels)
  why_not_gpu: str  # why the GPU-only impls are skipped ("" on a GPU)
  why_not_sm90: str


def environment() -> Env:
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  cc = getattr(device, "compute_capability", None) if on_gpu else None
  try:
    sm90 = on_gpu and float(cc) >= 9.0
  except (TypeError, ValueError):
    sm90 = False
  why = "" if on_gpu else f"GPU-only, and jax's platform is {device.platform}"
  return Env(on_gpu, sm90, why, "" if sm90 else (
      why or f"needs a Hopper-class GPU (sm_90), this is compute capability {cc}"))


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _randn(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _keys(seed: int, n: int):
  return jax.random.split(jax.random.key(seed), n)


def _tables(rng, num_blocks: int, batch: int, per_row: int) -> jax.Array:
  """Each row's blocks: distinct, scattered over the pool (block 0 is the null block)."""
  ids = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))[:batch * per_row]
  return jnp.asarray(ids.reshape(batch, per_row))


def _contiguous(k_pages, v_pages, tables, batch: int, ctx: int, layout: str):
  """The rows' K and V gathered out of the pool: BTKD [B, T, Hkv, D] or BKTD."""
  out = []
  for pages in (k_pages, v_pages):
    x = pages[tables].reshape(batch, ctx, *pages.shape[2:])
    out.append(x.transpose(0, 2, 1, 3) if layout == "BKTD" else x)
  return tuple(jax.block_until_ready(out))


@functools.partial(jax.jit, static_argnames=("interpret",))
def _jax_decode(q, k, v, kv_lens, *, interpret: bool):
  """jax's Pallas decode attention (ops.gpu.decode_attention.gqa) over K/V already laid
  out [B, Hkv, T, D] (gqa itself would transpose a BTKD copy inside the timed call)."""
  from jax.experimental.pallas.ops.gpu import decode_attention  # noqa: PLC0415

  batch, hq, d = q.shape
  hkv = k.shape[1]
  inner = functools.partial(
      decode_attention.decode_attn_unbatched, sm_scale=d**-0.5, block_h=16, block_k=128,
      k_splits=16, num_warps=None, num_stages=2, grid=None, interpret=interpret,
      debug=False, return_residuals=False, normalize_output=True)
  lens = jnp.broadcast_to(kv_lens[:, None], (batch, hkv))
  out = jax.vmap(jax.vmap(inner))(q.reshape(batch, hkv, hq // hkv, d), k, v, None, lens)
  return out.reshape(batch, hq, d)


@functools.partial(jax.jit, static_argnames=("implementation", "causal"))
def _sdpa(q, k, v, *, implementation: str, causal: bool = False):
  """jax.nn.dot_product_attention over contiguous BTKD K/V; q [B, Tq, Hq, D]."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                      implementation=implementation)


@functools.partial(jax.jit, static_argnames=("implementation",))
def _sdpa_decode(q, k, v, *, implementation: str):
  """`_sdpa` of one query token per row: q [B, Hq, D] -> [B, Hq, D]."""
  return _sdpa(q[:, None], k, v, implementation=implementation)[:, 0]


def _jax_paged(q, k_pages, v_pages, tables, lens, k_scales=None, v_scales=None, *,
               interpret: bool):
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged  # noqa: PLC0415

  # It applies no softmax scale: q comes scaled by 1/sqrt(head_dim) (one tiny multiply).
  q = (q.astype(jnp.float32) * q.shape[-1]**-0.5).astype(q.dtype)
  return jax_paged.paged_attention(q, k_pages, v_pages, tables, lens, k_scales, v_scales,
                                   interpret=interpret)


def decode_cost(batch: int, ctx: int, hq: int, hkv: int, d: int, kv_bytes_per_value: float,
                item: int, scale_bytes: int = 0) -> tuple[int, int]:
  """(bytes, flops) of a decode step: every row's K and V once (+ 8-bit scales), q, out."""
  kv = 2 * batch * ctx * hkv * (d * kv_bytes_per_value + scale_bytes)
  return int(kv + 2 * batch * hq * d * item), 4 * batch * hq * ctx * d


def prefill_cost(seq: int, hq: int, hkv: int, d: int, item: int) -> tuple[int, int]:
  """(bytes, flops) of causal self-attention of one sequence: q, k, v and out once."""
  return (2 * seq * (hq + hkv) * d * item, 4 * hq * d * seq * (seq + 1) // 2)


def _dims(cfg: dict) -> tuple[int, int, int, int, jnp.dtype]:
  """(query heads, KV heads, head_dim, block size, dtype) of a size's model."""
  m = cfg["model"]
  return (m["num_q_heads"], m["num_kv_heads"], m["head_dim"], m["block_size"],
          jnp.dtype(m["dtype"]))


def paged_cases(cfg: dict, env: Env, seed: int = 0):
  hq, hkv, d, bs, dtype = _dims(cfg)
  interp = not env.on_gpu
  num_blocks = max(b * t for b, t in cfg["paged"]) // bs + 1
  kk, kv, kq = _keys(seed, 3)
  k_pages = _randn(kk, (num_blocks, bs, hkv, d), dtype)
  v_pages = _randn(kv, (num_blocks, bs, hkv, d), dtype)
  by_head = functools.cache(lambda: jax.block_until_ready(  # jax's paged layout
      (k_pages.transpose(2, 0, 1, 3), v_pages.transpose(2, 0, 1, 3))))
  rng = np.random.default_rng(seed)
  for i, (batch, ctx) in enumerate(cfg["paged"]):
    tables = _tables(rng, num_blocks, batch, ctx // bs)
    lens = jnp.full((batch,), ctx, jnp.int32)
    q = _randn(jax.random.fold_in(kq, i), (batch, hq, d), dtype)
    shape = dict(batch=batch, context=ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                 block_size=bs, dtype=dtype.name)
    nbytes, flops = decode_cost(batch, ctx, hq, hkv, d, dtype.itemsize, dtype.itemsize)
    btkd = functools.cache(lambda t=tables, b=batch, c=ctx: _contiguous(
        k_pages, v_pages, t, b, c, "BTKD"))
    bktd = functools.cache(lambda t=tables, b=batch, c=ctx: _contiguous(
        k_pages, v_pages, t, b, c, "BKTD"))
    paged_args = (q, k_pages, v_pages, tables, lens)
    impls = {
        "xla-reference": Impl(paged_attention_reference, paged_args,
                              "our jnp reference (gather, float32 softmax), jit"),
        "ours-triton": Impl(functools.partial(paged_attention, interpret=interp), paged_args,
                            "Pallas Triton" + (", interpret mode" if interp else "")),
        "xla-sdpa": Impl(functools.partial(_sdpa_decode, implementation="xla"),
                         lambda q=q, f=btkd: (q, *f()),
                         f"jax.nn.dot_product_attention xla; {CONTIGUOUS}"),
        "jax-pallas-paged": Impl(
            functools.partial(_jax_paged, interpret=interp),
            lambda q=q, t=tables, ln=lens: (q, *by_head(), t, ln),
            "jax.experimental.pallas.ops.gpu.paged_attention (pages [Hkv, N, bs, D]; q "
            "pre-scaled: it applies no softmax scale)"
            + (", interpret mode" if interp else "")),
        "jax-pallas-decode": Impl(
            functools.partial(_jax_decode, interpret=interp),
            lambda q=q, f=bktd, ln=lens: (q, *f(), ln),
            f"jax.experimental.pallas.ops.gpu.decode_attention; {CONTIGUOUS} [B, Hkv, T, D]"
            + (", interpret mode" if interp else "")),
    }
    skipped = {"jax-mgpu-attention": "ops.gpu.attention_mgpu tiles 128 query rows "
                                     "(2 x block_q 64); a decode step has 1"}
    if i == 0:  # the first shape: our kernels' tuning knobs beside their defaults
      impls.update({f"ours-triton {name}": Impl(
          functools.partial(paged_attention, interpret=interp, **knobs), paged_args,
          f"Pallas Triton, {knobs} (defaults: 2 blocks a step at block 16, 4 warps, 2 "
          "stages)" + (", interpret mode" if interp else ""))
          for name, knobs in TRITON_TUNING.items()})
    if env.sm90:
      from kernels_pallas.paged_attention_mgpu import paged_attention_mgpu  # noqa: PLC0415
      impls["ours-mgpu"] = Impl(paged_attention_mgpu, paged_args, "Pallas Mosaic GPU (sm_90)")
      if i == 0:
        impls.update({f"ours-mgpu {name}": Impl(
            functools.partial(paged_attention_mgpu, **knobs), paged_args,
            f"Pallas Mosaic GPU (sm_90), {knobs} (defaults: 64 keys a step, 2 slots)")
            for name, knobs in MGPU_TUNING.items()})
    else:
      skipped["ours-mgpu"] = f"Mosaic GPU kernel: {env.why_not_sm90}"
    if env.on_gpu:
      impls["cudnn"] = Impl(functools.partial(_sdpa_decode, implementation="cudnn"),
                            lambda q=q, f=btkd: (q, *f()),
                            f"jax.nn.dot_product_attention cudnn; {CONTIGUOUS}")
    else:
      skipped["cudnn"] = f"cuDNN: {env.why_not_gpu}"
    lib_impls, lib_skipped = peers.decode_peers(env, q, btkd, hkv, ctx, CONTIGUOUS)
    impls.update(lib_impls)
    skipped.update(lib_skipped)
    yield Case("paged", shape, nbytes, flops, dtype.name, impls["xla-reference"], impls,
               skipped, reference_impl="xla-reference")


def paged_8bit_cases(cfg: dict, env: Env, seed: int = 1):
  hq, hkv, d, bs, dtype = _dims(cfg)
  interp = not env.on_gpu
  num_blocks = max(b * t for b, t in cfg["paged_8bit"]) // bs + 1
  kk, kv, kq = _keys(seed, 3)
  rng = np.random.default_rng(seed)
  pools = {}
  for kind in ("int8", "fp8_e4m3"):  # the same K/V, quantized each way
    k8, v8 = (QuantizedPages(*jax.jit(quantize, static_argnums=1)(
        _randn(key, (num_blocks, bs, hkv, d), dtype), kind), dtype=dtype) for key in (kk, kv))
    # jax's paged attention: [Hkv, N, bs, D] values (fp8 as float8), [Hkv, N, bs] scales.
    by_head = functools.cache(lambda k8=k8, v8=v8, kind=kind: jax.block_until_ready(tuple(
        x for p in (k8, v8) for x in (
            (p.values if kind == "int8" else jax.lax.bitcast_convert_type(
                p.values, jnp.float8_e4m3fn)).transpose(2, 0, 1, 3),
            p.scales[..., 0].transpose(2, 0, 1)))))
    pools[kind] = (k8, v8, by_head)
  for i, (batch, ctx) in enumerate(cfg["paged_8bit"]):
    tables = _tables(rng, num_blocks, batch, ctx // bs)
    lens = jnp.full((batch,), ctx, jnp.int32)
    q = _randn(jax.random.fold_in(kq, i), (batch, hq, d), dtype)
    nbytes, flops = decode_cost(batch, ctx, hq, hkv, d, 1, dtype.itemsize, scale_bytes=4)
    for kind, (k8, v8, by_head) in pools.items():
      shape = dict(batch=batch, context=ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                   block_size=bs, dtype=dtype.name, kv_dtype=kind)
      args = (q, k8, v8, tables, lens)

      def jax_args(q=q, t=tables, ln=lens, f=by_head):
        kv_, ks, vv, vs = f()
        return q, kv_, vv, t, ln, ks, vs

      impls = {
          "xla-reference": Impl(paged_attention_reference, args,
                                "our jnp reference over the dequantized blocks, jit"),
          "ours-triton": Impl(functools.partial(paged_attention, interpret=interp), args,
                              "Pallas Triton, 8-bit blocks dequantized in registers"
                              + (", interpret mode" if interp else "")),
          "jax-pallas-paged": Impl(functools.partial(_jax_paged, interpret=interp), jax_args,
                                   "ops.gpu.paged_attention with k/v scales"
                                   + (", interpret mode" if interp else "")),
      }
      skipped = {}
      if env.sm90:
        from kernels_pallas.paged_attention_mgpu import paged_attention_mgpu  # noqa: PLC0415
        impls["ours-mgpu"] = Impl(paged_attention_mgpu, args,
                                  "Pallas Mosaic GPU (sm_90), 8-bit blocks by TMA, "
                                  "dequantized in SMEM")
      else:
        skipped["ours-mgpu"] = f"Mosaic GPU kernel: {env.why_not_sm90}"
      yield Case("paged_8bit", shape, nbytes, flops, dtype.name, impls["xla-reference"],
                 impls, skipped, reference_impl="xla-reference")


def ragged_cases(cfg: dict, env: Env, seed: int = 2):
  hq, hkv, d, bs, dtype = _dims(cfg)
  q_lens = np.asarray(cfg["ragged"]["q_lens"], np.int32)
  kv_lens = np.asarray(cfg["ragged"]["kv_lens"], np.int32)
  per_row = int(-(-kv_lens.max() // bs))
  num_blocks = len(kv_lens) * per_row + 1
  kk, kv, kq = _keys(seed, 3)
  k_pages = _randn(kk, (num_blocks, bs, hkv, d), dtype)
  v_pages = _randn(kv, (num_blocks, bs, hkv, d), dtype)
  tables = _tables(np.random.default_rng(seed), num_blocks, len(kv_lens), per_row)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
  q = _randn(kq, (int(q_lens.sum()), hq, d), dtype)
  args = (q, k_pages, v_pages, tables, jnp.asarray(kv_lens), cu)
  keys = int((q_lens * (kv_lens - q_lens) + q_lens * (q_lens + 1) // 2).sum())
  nbytes = int(2 * kv_lens.sum() * hkv * d * dtype.itemsize + 2 * q.size * dtype.itemsize)
  shape = dict(q_lens=_runs(q_lens), kv_lens=_runs(kv_lens), num_q_heads=hq,
               num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=dtype.name)
  interp = not env.on_gpu
  impls = {"xla-reference": Impl(ragged_paged_attention_reference, args,
                                 "our jnp reference (query tiles of 16), jit"),
           "ours-triton": Impl(functools.partial(ragged_paged_attention, interpret=interp),
                               args, "Pallas Triton" + (", interpret mode" if interp else ""))}
  skipped = {}
  if env.sm90:
    from kernels_pallas.ragged_paged_attention_mgpu import (  # noqa: PLC0415
      ragged_paged_attention_mgpu,
    )
    impls["ours-mgpu"] = Impl(ragged_paged_attention_mgpu, args,
                              "Pallas Mosaic GPU (sm_90), 64-row q tiles")
  else:
    skipped["ours-mgpu"] = f"Mosaic GPU kernel: {env.why_not_sm90}"
  yield Case("ragged", shape, nbytes, 4 * hq * d * keys, dtype.name, impls["xla-reference"],
             impls, skipped, reference_impl="xla-reference")


def _runs(x: np.ndarray) -> str:
  """[1024, 1024, 1, 1, 1] -> '1024x2,1x3' (a shape dict stays short)."""
  out, i = [], 0
  while i < len(x):
    j = i
    while j < len(x) and x[j] == x[i]:
      j += 1
    out.append(f"{int(x[i])}x{j - i}")
    i = j
  return ",".join(out)


@jax.jit
def _f32_causal(q, k, v):
  return _sdpa(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
               implementation="xla", causal=True)


def prefill_cases(cfg: dict, env: Env, seed: int = 3):
  hq, hkv, d, bs, dtype = _dims(cfg)
  seq = cfg["prefill"]["seq"]
  kq, kk, kv = _keys(seed, 3)
  q = _randn(kq, (1, seq, hq, d), dtype)
  k = _randn(kk, (1, seq, hkv, d), dtype)
  v = _randn(kv, (1, seq, hkv, d), dtype)
  # Our path reads pages: the same K/V as blocks 1..n of a pool, in order.
  pool = [jnp.concatenate([jnp.zeros((1, bs, hkv, d), dtype), x.reshape(-1, bs, hkv, d)])
          for x in (k, v)]
  tables = jnp.arange(1, seq // bs + 1, dtype=jnp.int32)[None]
  interp = not env.on_gpu
  ours = functools.partial(ragged_paged_attention, interpret=interp)
  impls = {
      "ours-triton": Impl(jax.jit(lambda q, kp, vp, t, ln, cu: ours(q[0], kp, vp, t, ln, cu)[None]),
                          (q, *pool, tables, jnp.asarray([seq], jnp.int32),
                           jnp.asarray([0, seq], jnp.int32)),
                          "Pallas Triton ragged kernel over pages (one sequence)"
                          + (", interpret mode" if interp else "")),
      "xla-sdpa": Impl(functools.partial(_sdpa, implementation="xla", causal=True), (q, k, v),
                       f"jax.nn.dot_product_attention xla, bf16; {CONTIGUOUS}"),
  }
  skipped = {}
  if env.on_gpu:
    impls["cudnn"] = Impl(functools.partial(_sdpa, implementation="cudnn", causal=True),
                          (q, k, v), f"jax.nn.dot_product_attention cudnn; {CONTIGUOUS}")
  else:
    skipped["cudnn"] = f"cuDNN: {env.why_not_gpu}"
  if env.sm90 and seq % 128 == 0:
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: PLC0415

    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                         causal=True)
    # float16 copies: jax 0.11.2's attention_mgpu stages bf16 through float16 SMEM and
    # refuses it ("Expected dtypes to match": lowered for an H200 here); same bytes.
    impls["jax-mgpu-attention"] = Impl(
        functools.partial(attention_mgpu.attention, config=config),
        lambda: tuple(x.astype(jnp.float16) for x in (q, k, v)),
        f"ops.gpu.attention_mgpu (Mosaic GPU) on float16 copies (it refuses bf16); "
        f"{CONTIGUOUS}")
  else:
    skipped["jax-mgpu-attention"] = (f"Mosaic GPU kernel: {env.why_not_sm90}" if not env.sm90
                                     else f"needs seq a multiple of 128, got {seq}")
  lib_impls, lib_skipped = peers.prefill_peers(env, q, k, v, CONTIGUOUS)
  impls.update(lib_impls)
  skipped.update(lib_skipped)
  nbytes, flops = prefill_cost(seq, hq, hkv, d, dtype.itemsize)
  shape = dict(batch=1, seq=seq, causal=True, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
               block_size=bs, dtype=dtype.name)
  yield Case("prefill", shape, nbytes, flops, dtype.name,
             Impl(_f32_causal, (q, k, v), "float32 jax.nn.dot_product_attention xla"),
             impls, skipped)


def sparse_mla_cases(cfg: dict, env: Env, seed: int = 4):
  c = cfg["sparse_mla"]
  dtype = jnp.dtype(cfg["model"]["dtype"])
  batch, heads, rank, rope, topk, bs = (c["batch"], c["heads"], c["rank"], c["rope"],
                                        c["topk"], c["block_size"])
  width = rank + rope
  num_blocks = batch * c["context"] // bs + 1
  kp, kq = _keys(seed, 2)
  latent = _randn(kp, (num_blocks, bs, 1, width), dtype)
  q = _randn(kq, (batch, heads, width), dtype)
  rng = np.random.default_rng(seed)  # each row: topk distinct tokens of its own context
  idx = np.stack([bs + b * c["context"] + rng.choice(c["context"], topk, replace=False)
                  for b in range(batch)]).astype(np.int32)
  args = (q, latent, jnp.asarray(idx))
  kw = dict(sm_scale=width**-0.5, kv_lora_rank=rank)
  interp = not env.on_gpu
  impls = {"xla-reference": Impl(functools.partial(sparse_mla_decode_reference, **kw), args,
                                 "our jnp reference (gather, float32 softmax), jit"),
           "ours-triton": Impl(functools.partial(sparse_mla_decode, interpret=interp, **kw),
                               args, "Pallas Triton" + (", interpret mode" if interp else ""))}
  skipped = {}
  if env.sm90:
    impls["ours-mgpu"] = Impl(functools.partial(sparse_mla_decode_mgpu, **kw), args,
                              "Pallas Mosaic GPU (sm_90), XLA gather of the listed rows, "
                              "64-head WGMMA tiles")
  else:
    skipped["ours-mgpu"] = f"Mosaic GPU kernel: {env.why_not_sm90}"
  skipped.update(peers.sparse_mla_skips(batch, heads, rank, rope, topk, dtype))
  item = dtype.itemsize
  nbytes = batch * topk * width * item + q.size * item + batch * heads * rank * item
  shape = dict(batch=batch, heads=heads, latent=f"{rank}+{rope}", topk=topk, block_size=bs,
               dtype=dtype.name)
  yield Case("sparse_mla", shape, nbytes, 2 * batch * heads * topk * (width + rank),
             dtype.name, impls["xla-reference"], impls, skipped,
             reference_impl="xla-reference")


# ("select": gpu_bench_select.select_cases, which builds on this module's helpers.)
BUILDERS = {"paged": paged_cases, "paged_8bit": paged_8bit_cases, "ragged": ragged_cases,
            "prefill": prefill_cases, "sparse_mla": sparse_mla_cases}


def planned_shapes(cfg: dict, kernel: str) -> list[dict]:
  """Each case's shape summary before it is built (what a budget cut leaves out)."""
  if kernel == "paged":
    return [dict(batch=b, context=t) for b, t in cfg["paged"]]
  if kernel == "paged_8bit":
    return [dict(batch=b, context=t, kv_dtype=k) for b, t in cfg["paged_8bit"]
            for k in ("int8", "fp8_e4m3")]
  if kernel == "select":  # llama's block select, then DSA's (gpu_bench_select)
    return [dict(cfg["select"], selection="union"),
            dict(cfg["dsa_select"], selection="lightning")]
  return [dict(cfg[kernel])]


def torch_specs(cfg: dict, kernels) -> list[dict]:
  """The torch peer's shapes (gpu_bench_torch's --shapes): paged decode and prefill,
  with the case's own shape dict to file the rows under. (bytes, flops) beside them."""
  hq, hkv, d, bs, _ = _dims(cfg)
  dtype = cfg["model"]["dtype"]  # (a name: it goes into the rows' shapes)
  item = jnp.dtype(dtype).itemsize
  base = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype)
  specs = []
  if "paged" in kernels:
    for batch, ctx in cfg["paged"]:
      shape = dict(batch=batch, context=ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                   block_size=bs, dtype=dtype)
      specs.append(dict(kernel="paged", shape=shape,
                        cost=decode_cost(batch, ctx, hq, hkv, d, item, item),
                        torch=dict(base, batch=batch, q_len=1, kv_len=ctx, causal=False)))
  if "prefill" in kernels:
    seq = cfg["prefill"]["seq"]
    shape = dict(batch=1, seq=seq, causal=True, num_q_heads=hq, num_kv_heads=hkv,
                 head_dim=d, block_size=bs, dtype=dtype)
    specs.append(dict(kernel="prefill", shape=shape, cost=prefill_cost(seq, hq, hkv, d, item),
                      torch=dict(base, batch=1, q_len=seq, kv_len=seq, causal=True)))
  return specs


def roofline_s(nbytes: int, flops: int, peaks) -> float | None:
  """max(bytes / HBM bandwidth, flops / peak FLOP/s); None without peaks."""
  return None if peaks is None else max(nbytes / peaks[0], flops / peaks[1])


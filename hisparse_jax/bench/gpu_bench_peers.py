"""`make gpu-bench`'s library peers (#54): two Pallas GPU kernel libraries where they meet the
engine's layout, as impls of gpu_bench_cases' cases.

- tokamax (openxla; `tokamax.dot_product_attention`): dense attention over contiguous
  [B, T, H, D] K/V with GQA, bf16; implementations `mosaic_gpu` (Pallas Mosaic GPU: sm80 /
  sm90 / sm100 kernels), `triton` (Pallas Triton), `cudnn` (jax.nn.dot_product_attention's
  cuDNN: the same call as the bench's `cudnn` row, so no row of its own) and `xla` (jnp, runs
  on any backend). No page table on this API (its Mosaic GPU and Triton kernels raise
  "Paged attention not supported" for paging_info): the engine's pages are gathered to
  contiguous K/V first, as for jax's decode peers. Peer of `prefill` (causal) and of `paged`
  (a 1-token query per row, non-causal).
- jax-linear-attention (`jla`; Hopper only): `jla.ops.mosaic_gpu.attention.flash_attention`,
  FA3-style causal GQA self-attention (q and k of one length T; bf16 / fp16; head dims
  64 / 128 / MLA's 192+128): a peer of `prefill`. It has no decode form (q must be as long
  as k), and its DeepSeek sparse attention (`jla.ops.mosaic_gpu.dsa.dsa_attention`) is a
  training kernel over one T x T sequence with head dims 64 / 128 and v as wide as k: it
  refuses MLA's absorbed decode (q/k 576, v 512, one query over the pool). Both refusals
  are the library's own answers (its `supported` checks), reported as skips.

Each library is imported only when a case is built; one that is not installed (the
`gpu-peers` extra: requirements-gpu-peers.txt, `make gpu-wheels` for a machine without
network) is a skip naming the import error.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from hisparse_jax.bench.common import Impl

INSTALL_HINT = ("install the gpu-peers wheels: pip install --no-deps -r "
                "requirements-gpu-peers.txt (make setup does; make gpu-wheels for a machine "
                "without network)")
# Peer impl names (the rows' `impl`), by kernel.
TOKAMAX_IMPLS = {"tokamax-mosaic": "mosaic_gpu", "tokamax-triton": "triton",
                 "tokamax-xla": "xla"}
TOKAMAX_GPU_ONLY = ("tokamax-mosaic", "tokamax-triton")


@functools.cache
def library(name: str):
  """(module, "") for `tokamax` or `jla` (jax-linear-attention's package), or (None, why)."""
  module = {"tokamax": "tokamax", "jla": "jla.ops.mosaic_gpu.attention"}[name]
  try:
    return importlib.import_module(module), ""
  except Exception as e:  # noqa: BLE001 (not installed, or a dependency missing)
    return None, f"{name} does not import ({type(e).__name__}: {e}); {INSTALL_HINT}"


@functools.partial(jax.jit, static_argnames=("implementation", "causal"))
def tokamax_sdpa(q, k, v, *, implementation: str, causal: bool = False):
  """tokamax.dot_product_attention over contiguous BTKD K/V; q [B, Tq, Hq, D]."""
  import tokamax  # noqa: PLC0415

  return tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                       implementation=implementation)


@functools.partial(jax.jit, static_argnames=("implementation",))
def tokamax_decode(q, k, v, *, implementation: str):
  """`tokamax_sdpa` of one query token per row: q [B, Hq, D] -> [B, Hq, D]."""
  return tokamax_sdpa(q[:, None], k, v, implementation=implementation)[:, 0]


@jax.jit
def jla_flash(q, k, v):
  """jax-linear-attention's FA3-style Mosaic GPU attention (causal): q [B, T, Hq, D]."""
  from jla.ops.mosaic_gpu import attention  # noqa: PLC0415

  return attention.flash_attention(q, k, v)


def _tokamax_impls(env, fn, args, what: str, contiguous: str) -> tuple[dict, dict]:
  impls, skipped = {}, {}
  _, why = library("tokamax")
  for name, implementation in TOKAMAX_IMPLS.items():
    if why:
      skipped[name] = why
    elif name in TOKAMAX_GPU_ONLY and not env.on_gpu:
      skipped[name] = f"tokamax's {implementation} implementation: {env.why_not_gpu}"
    else:
      kernel = {"mosaic_gpu": "Pallas Mosaic GPU, its heuristic config",
                "triton": "Pallas Triton, its heuristic config",
                "xla": "its jnp implementation"}[implementation]
      impls[name] = Impl(functools.partial(fn, implementation=implementation), args,
                         f"tokamax.dot_product_attention implementation={implementation!r} "
                         f"({kernel}), {what}; {contiguous}")
  return impls, skipped


def prefill_peers(env, q, k, v, contiguous: str) -> tuple[dict, dict]:
  """(impls, skipped) of the libraries for causal prefill: q [1, T, Hq, D], k/v [1, T, Hkv, D]."""
  impls, skipped = _tokamax_impls(env, functools.partial(tokamax_sdpa, causal=True),
                                  (q, k, v), "causal", contiguous)
  _, why = library("jla")
  if why:
    skipped["jla-mgpu-attention"] = why
  elif not env.sm90:
    skipped["jla-mgpu-attention"] = f"jax-linear-attention's Mosaic GPU kernel: {env.why_not_sm90}"
  else:  # (a shape it refuses raises its ValueError when run: a skip with the reason)
    impls["jla-mgpu-attention"] = Impl(
        jla_flash, (q, k, v), "jla.ops.mosaic_gpu.attention.flash_attention (jax-linear-"
        f"attention, FA3-style Mosaic GPU, sm_90; its persistent forward on one CTA per SM), "
        f"causal; {contiguous}")
  return impls, skipped


def decode_peers(env, q, kv_thunk, num_kv_heads: int, ctx: int,
                 contiguous: str) -> tuple[dict, dict]:
  """(impls, skipped) of the libraries for a decode step: q [B, Hq, D], K/V from
  `kv_thunk()` as contiguous [B, T, Hkv, D] (built only when a peer runs)."""
  impls, skipped = _tokamax_impls(env, tokamax_decode, lambda: (q, *kv_thunk()),
                                  "1-token query per row", contiguous)
  module, why = library("jla")
  if why:
    skipped["jla-mgpu-attention"] = why
  else:
    b, hq, d = q.shape
    kv = jax.ShapeDtypeStruct((b, ctx, num_kv_heads, d), q.dtype)
    refused = module.supported(jax.ShapeDtypeStruct((b, 1, hq, d), q.dtype), kv, kv)
    skipped["jla-mgpu-attention"] = (
        "jax-linear-attention's flash_attention is causal self-attention (q as long as k); "
        f"a decode step is 1 query over {ctx} keys: it refuses ({refused})")
  return impls, skipped


def sparse_mla_skips(batch: int, heads: int, rank: int, rope: int, topk: int,
                     dtype) -> dict[str, str]:
  """Why jax-linear-attention's DSA kernel is no peer of the sparse MLA decode, in its own
  `supported_attention` words (decode form, then the most lenient self-attention form)."""
  _, why = library("jla")
  if why:
    return {"jla-dsa": why}
  from jla.ops.mosaic_gpu import dsa  # noqa: PLC0415

  width, s = rank + rope, jax.ShapeDtypeStruct
  decode = dsa.supported_attention(s((batch, 1, heads, width), dtype),
                                   s((batch, topk, 1, width), dtype),
                                   s((batch, topk, 1, rank), dtype))
  same_t = dsa.supported_attention(s((batch, topk, heads, width), dtype),
                                   s((batch, topk, 1, width), dtype),
                                   s((batch, topk, 1, width), jnp.dtype(dtype)))
  same_t = (f"even as self-attention with v = k: {same_t}" if same_t else
            "as self-attention with v = k it takes these head dims, but over T queries, "
            "not one")
  return {"jla-dsa": (
      "jla.ops.mosaic_gpu.dsa.dsa_attention (masked-dense DSA over one T x T sequence, "
      f"a training kernel) refuses MLA's absorbed decode (q/k {rank}+{rope}, v {rank}, "
      f"{heads} heads, top-k {topk}): {decode}; {same_t}")}

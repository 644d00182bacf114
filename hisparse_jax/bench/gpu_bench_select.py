"""The `select` cases of `gpu_bench_kernels`: HiSparse's block selection (the engine's
"union" of each query head's best blocks, scored from the per-block key bounds) at a long
context, checked against a plain reference: the elementwise bound (not the engine's single
matmul) and the union rule written in numpy. Ok when the scores agree to float32 rounding
and at least 99% of the selected blocks are the reference's (a near tie may swap a
boundary block: the sums run in another order). The select over int8 bounds
(`ours-triton-int8`: block_scores over `QuantizedBounds` of the same keys, then the same
top-k) is checked against the elementwise bound of its dequantized bounds (the bytes it
reads: int8 values and float32 scales), its agreement with the bfloat16 bounds' selection
in its note. And DSA's select (`dsa_select_cases`):
the lightning indexer's scores of every key and their top-k, at DeepSeek-V3.2's indexer,
over bfloat16 keys and over the same keys stored 8-bit (`ours-triton-fp8` /
`ours-triton-int8`: index_scores over QuantizedPages, a float32 scale per token), each
checked against the scores of its dequantized keys and against the bfloat16 keys' within
the bound their quantization error allows, its top-k agreement with the bfloat16 keys'
in its note. (The block bounds have no fp8 form: the union select skips fp8.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.bench.gpu_bench_cases import Case, Env, Impl, _keys, _randn, _tables
from hisparse_jax.sparse import indexer
from hisparse_jax.sparse.config import HiSparseConfig
from kernels_pallas import cpu_kernels
from kernels_pallas.block_key_bounds import QuantizedBounds, quantize_bounds
from kernels_pallas.block_scores import block_scores
from kernels_pallas.index_scores import index_scores, index_scores_reference
from kernels_pallas.quant import QuantizedPages, quantize


def _union_reference(scores: np.ndarray, kv_lens: np.ndarray, blocks) -> list[set]:
  """The "union" selection (indexer.union_priority's rule), written plainly in numpy:
  sink and local blocks, then the others by (best rank in any head, highest score in any
  head, lower block) until top-k."""
  out = []
  for b in range(scores.shape[0]):
    n = -(-int(kv_lens[b]) // blocks.block_size)
    k = min(blocks.top_k_blocks, scores.shape[-1])
    if n <= k:
      out.append(set(range(n)))
      continue
    s = scores[b, :, :n]
    order = np.argsort(-s, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(n)[None].repeat(s.shape[0], 0), axis=1)
    best, highest = rank.min(0), s.max(0)
    forced = set(range(min(blocks.sink_blocks, n))) | set(range(n - blocks.local_blocks, n))
    free = [i for i in np.lexsort((np.arange(n), -highest, best)) if i not in forced]
    out.append(forced | set(int(i) for i in free[:k - len(forced)]))
  return out


@jax.jit
def _naive_scores(q, bounds, rows):
  """[B, Hq, M]: sum_d max(q_d min_d, q_d max_d) of each query head's own KV head, one
  sequence at a time (the elementwise bound, not the engine's single matmul; int8
  `QuantizedBounds`: of the sequence's rows dequantized)."""
  hq, hkv = q.shape[1], bounds.shape[2]

  def one(args):
    qb, r = args  # [Hq, D], [M]
    quantized = isinstance(bounds, QuantizedBounds)
    g = bounds.rows(r).dequantize() if quantized else bounds[r].astype(jnp.float32)
    lo = g[:, 0][:, jnp.arange(hq) * hkv // hq]  # [M, Hq, D]
    hi = g[:, 1][:, jnp.arange(hq) * hkv // hq]
    qf = qb.astype(jnp.float32)[None]
    return jnp.maximum(qf * lo, qf * hi).sum(-1).T  # [Hq, M]

  return jax.lax.map(one, (q, rows))


def select_cases(cfg: dict, env: Env, seed: int = 5):
  m, c = cfg["model"], cfg["select"]
  hq, hkv, d, bs = m["num_q_heads"], m["num_kv_heads"], m["head_dim"], m["block_size"]
  batch, ctx = c["batch"], c["context"]
  blocks = HiSparseConfig(top_k_tokens=c["top_k_tokens"]).blocks(bs)
  per_row = ctx // bs
  kq, kb = _keys(seed, 2)
  q = _randn(kq, (batch, hq, d), jnp.bfloat16)
  raw = _randn(kb, (batch * per_row + 1, 2, hkv, d), jnp.float32)
  bounds = jnp.stack([raw.min(1), raw.max(1)], axis=1).astype(jnp.bfloat16)  # min <= max
  qbounds = quantize_bounds(raw.min(1), raw.max(1))  # the same keys' int8 bounds
  del raw
  rows = _tables(np.random.default_rng(seed), batch * per_row + 1, batch, per_row)
  lens = jnp.full((batch,), ctx, jnp.int32)
  args = (q, bounds, rows, lens)
  nbounds = batch * per_row * 2 * hkv * d * 2  # the bounds read: bfloat16
  nbounds8 = batch * per_row * 2 * hkv * (d + 4)  # int8 values and float32 scales

  @jax.jit
  def ours(q, bounds, rows, lens):
    return indexer.select_rows(q, bounds, rows, lens, blocks, "union").logical_ids

  @jax.jit
  def ours_kernel(q, bounds, rows, lens):
    return indexer.select_rows(q, bounds, rows, lens, blocks, "union",
                               scores_kernel=block_scores).logical_ids

  @jax.jit
  def ours_scores(q, bounds, rows):
    return indexer.block_scores(q, bounds[rows], per_query_head=True)

  @jax.jit
  def kernel_scores(q, bounds, rows):
    return block_scores(q, bounds, rows, per_query_head=True)

  def agreement(out, want_scores) -> float:
    """The share of the union reference's blocks (of `want_scores`) that `out` selected."""
    want = _union_reference(np.asarray(want_scores), np.asarray(lens), blocks)
    got = [set(int(i) for i in row if i >= 0) for row in np.asarray(out)]
    return float(np.mean([len(g & w) / max(len(w), 1) for g, w in zip(got, want,
                                                                      strict=True)]))

  def check(out, ref):
    ref = np.asarray(ref)
    # (both scoring paths' error: the jnp one over gathered bounds, the kernel in place)
    err = max(float(np.abs(np.asarray(fn(q, bounds, rows)) - ref).max())
              for fn in (ours_scores, kernel_scores))
    agree, scale = agreement(out, ref), float(np.abs(ref).max())
    ok = err <= 1e-4 * scale and agree >= 0.99
    return err, scale, ok, f"selection agreement {agree:.4f} (ok >= 0.99)"

  def check_int8(out, ref):
    """Against the elementwise bound of the int8 bounds dequantized (what it scores)."""
    ref8 = np.asarray(_naive_scores(q, qbounds, rows))
    err = float(np.abs(np.asarray(kernel_scores(q, qbounds, rows)) - ref8).max())
    agree, scale = agreement(out, ref8), float(np.abs(ref8).max())
    ok = err <= 1e-4 * scale and agree >= 0.99
    return err, scale, ok, (f"selection agreement {agree:.4f} (ok >= 0.99) with the int8 "
                            f"bounds' reference; {agreement(out, ref):.4f} with the bfloat16 "
                            "bounds' (the int8 bound is looser)")

  args8 = (q, qbounds, rows, lens)
  impls = {"ours-triton": Impl(ours_kernel, args, "indexer.select_rows 'union' with "
                              "kernels_pallas.block_scores (the engine's GPU path: the bounds "
                              "scored in place by a Triton kernel; interpret mode on CPU), "
                              "then XLA's top-k ranking, jit"),
           "ours-jnp": Impl(ours, args, "indexer.select_rows 'union' over gathered bounds "
                            "(bounds gather, one float32 matmul, lax.top_k: the engine's "
                            "GPU path before block_scores), jit"),
           "ours-triton-int8": Impl(ours_kernel, args8, "indexer.select_rows 'union' with "
                                    "kernels_pallas.block_scores over int8 bounds "
                                    "(QuantizedBounds of the same keys: int8 values, a float32 "
                                    "scale per block, side and KV head; ~0.52x the bfloat16 "
                                    "bounds' bytes), then the same top-k, jit",
                                    bytes=nbounds8 + q.size * 2, check=check_int8)}
  skipped = {}
  if not env.on_gpu and cpu_kernels.available():
    def cpp(q, bounds, rows, lens):
      return cpu_kernels.union_select_bounds(
          q, bounds, rows, lens, k=blocks.top_k_blocks, block_size=bs,
          sink_blocks=blocks.sink_blocks, local_blocks=blocks.local_blocks)[0]
    impls["cpp-cpu"] = Impl(jax.jit(cpp), args, "cpu_select.cc (XLA:CPU FFI), bounds in place")
  else:
    skipped["cpp-cpu"] = ("the C++ select is an XLA:CPU custom call (the GPU runs "
                          "block_scores)" if env.on_gpu else "the C++ CPU kernels did not build")
  skipped["ours-triton-fp8"] = ("the block bounds are stored int8 only (QuantizedBounds); "
                                "fp8 is the DSA indexer keys' (dsa_select_cases)")
  shape = dict(batch=batch, context=ctx, blocks=per_row, top_k_blocks=blocks.top_k_blocks,
               num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
               bounds_dtype="bfloat16", selection="union")
  yield Case("select", shape, nbounds + q.size * 2, 2 * batch * hq * per_row * 2 * d,
             "float32", Impl(_naive_scores, (q, bounds, rows), "elementwise bound + numpy "
                             "union"), impls, skipped, check=check)


@jax.jit
def _quantization_bound(q, w, pages, qpages, tables):
  """float32 [tokens, keys]: how far storing the keys 8-bit can move each score. relu is
  1-Lipschitz, so |score8 - score| <= dim**-0.5 * sum_h |w_h| |q_h| . |k8 - k|
  = dim**-0.5 * (sum_h |w_h| |q_h|) . |k8 - k|, k8 the dequantized key (float32)."""
  tokens, _, dim = q.shape
  a = jnp.einsum("th,thd->td", jnp.abs(w), jnp.abs(q.astype(jnp.float32)))
  exact = QuantizedPages(qpages.values, qpages.scales, jnp.float32)
  dk = jnp.abs(exact[tables] - pages[tables].astype(jnp.float32)).reshape(tokens, -1, dim)
  return jnp.einsum("td,tkd->tk", a, dk) * dim**-0.5


def dsa_select_cases(cfg: dict, env: Env, seed: int = 6):
  """DSA's select of one decode token per row: the indexer's score of every key of the
  row (its paged keys read in place by kernels_pallas.index_scores, or gathered and scored
  in jnp, as the CPU engine does) and the top `topk` keys. Ok when the scores agree to
  float32 rounding and >= 99% of the selected keys are the reference's. The 8-bit rows
  (the same keys quantized, scored in place): ok when their scores agree to float32
  rounding with the reference over their dequantized keys, >= 99% of their top-k is that
  reference's, and they stay within the quantization error's bound of the bfloat16 keys'
  scores (`_quantization_bound`); their top-k agreement with the bfloat16 keys' is noted."""
  c = cfg["dsa_select"]
  batch, ctx, heads, dim, bs, k = (c["batch"], c["context"], c["heads"], c["dim"],
                                   c["block_size"], c["topk"])
  per_row = ctx // bs
  kq, kw, kk = _keys(seed, 3)
  q = _randn(kq, (batch, heads, dim), jnp.bfloat16)
  w = _randn(kw, (batch, heads), jnp.float32)
  pages = _randn(kk, (batch * per_row + 1, bs, 1, dim), jnp.bfloat16)
  tables = _tables(np.random.default_rng(seed), batch * per_row + 1, batch, per_row)
  args = (q, w, pages, tables)

  def topk(scores):
    return jax.lax.top_k(scores, k)[1]

  ours = jax.jit(lambda *a: topk(index_scores(*a)))
  gathered = jax.jit(lambda *a: topk(index_scores_reference(*a)))
  reference = jax.jit(index_scores_reference)

  def agreement(out, scores) -> float:
    """The share of `scores`' top-k keys that `out` selected."""
    want = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return float(np.mean([len(set(g) & set(r)) / k for g, r in zip(np.asarray(out), want,
                                                                    strict=True)]))

  def check(out, ref):
    ref = np.asarray(ref)
    err = float(np.abs(np.asarray(jax.jit(index_scores)(*args)) - ref).max())
    agree, scale = agreement(out, ref), float(np.abs(ref).max())
    ok = err <= 1e-4 * scale and agree >= 0.99
    return err, scale, ok, f"top-k agreement {agree:.4f} (ok >= 0.99)"

  def check_8bit(qpages):
    def check8(out, ref):
      """Against the reference over the dequantized keys (what it scores), and the
      bfloat16 keys' scores within the bound of the keys' quantization error."""
      ref = np.asarray(ref)
      ref8 = np.asarray(reference(q, w, qpages, tables))
      got = np.asarray(jax.jit(index_scores)(q, w, qpages, tables))
      err, scale = float(np.abs(got - ref8).max()), float(np.abs(ref8).max())
      drift = np.abs(got - ref)
      slack = drift - np.asarray(_quantization_bound(q, w, pages, qpages, tables))
      within = float(slack.max()) <= 1e-4 * scale
      agree8 = agreement(out, ref8)
      ok = err <= 1e-4 * scale and within and agree8 >= 0.99
      return err, scale, ok, (
          f"top-k agreement {agree8:.4f} (ok >= 0.99) with its dequantized keys' reference; "
          f"{agreement(out, ref):.4f} with the bfloat16 keys'; scores off the bfloat16 keys' "
          f"by <= {float(drift.max()):.3g} (ref max {float(np.abs(ref).max()):.3g}), "
          f"{'within' if within else 'PAST'} the quantization error's bound")
    return check8

  impls = {"ours-triton": Impl(ours, args, "kernels_pallas.index_scores (the engine's GPU "
                                           "path: the keys read in place; interpret mode on "
                                           "CPU) + lax.top_k, jit"),
           "ours-jnp": Impl(gathered, args, "keys gathered, float32 einsums, lax.top_k (the "
                                            "CPU engine's path; the GPU's before "
                                            "index_scores), jit")}
  # The same keys stored 8-bit (the engine's index_cache_dtype): values + a float32 scale a
  # token, 132 B a token at dim 128 against bfloat16's 256.
  nbytes8 = batch * ctx * (dim + 4) + q.size * 2 + w.size * 4
  for kind, name in (("fp8_e4m3", "fp8"), ("int8", "int8")):
    qpages = QuantizedPages(*quantize(pages, kind), jnp.bfloat16)
    impls[f"ours-triton-{name}"] = Impl(
        ours, (q, w, qpages, tables),
        f"kernels_pallas.index_scores over the same keys stored {kind} (QuantizedPages: "
        f"{'uint8 bits' if name == 'fp8' else 'int8'} values, a float32 scale per token; "
        "(dim + 4) / (2 dim) of the bfloat16 keys' bytes, 0.52x at dim 128) + lax.top_k, "
        "jit",
        bytes=nbytes8, check=check_8bit(qpages))
  skipped = {"cpp-cpu": "the lightning indexer has no C++ select (the CPU engine scores in "
                        "jnp)"}
  nbytes = batch * ctx * dim * 2 + q.size * 2 + w.size * 4
  shape = dict(batch=batch, context=ctx, topk=k, index_heads=heads, index_dim=dim,
               block_size=bs, keys_dtype="bfloat16", selection="lightning")
  yield Case("select", shape, nbytes, 2 * batch * heads * ctx * dim, "float32",
             Impl(reference, args, "gathered keys, float32 (models' index_scores order)"),
             impls, skipped, check=check)


def all_select_cases(cfg: dict, env: Env):
  """gpu_bench_kernels' `select` kernel: llama's block select, then DSA's."""
  yield from select_cases(cfg, env)
  yield from dsa_select_cases(cfg, env)

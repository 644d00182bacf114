"""The C++ attention kernels for XLA:CPU (kernels_pallas/cpu_attention.cc): the paged decode against
`paged_attention_reference` and naive numpy attention: GQA 1:1 to 9:1 (query heads in one
pass or several), block sizes 4 to 128, head_dim 32 / 64 / 128 (the vectorized path) or
others, key ranges that start past 0 (sliding windows), soft
caps, empty rows, and pages poisoned with NaN / inf outside every range."""

import os
import subprocess
import sys

import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

from kernels_pallas import cpu_kernels, paged_attention_reference

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="the C++ CPU kernels are not built (no C++ compiler)")


def _case(rng, group, block_size, head_dim, lengths, num_kv_heads=2, num_blocks=64):
  pool = lib.make_pool(rng, num_blocks, block_size, num_kv_heads, head_dim, jnp.float32)
  width = max(-(-max(lengths) // block_size), 1) + 1
  tables = jnp.asarray(lib.make_tables(rng, lengths, block_size, width, num_blocks))
  q = jnp.asarray(rng.standard_normal((len(lengths), group * num_kv_heads, head_dim)),
                  jnp.float32)
  return q, pool, tables, jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("group,block_size,head_dim", [
    (1, 4, 8), (2, 16, 32), (4, 128, 32), (8, 16, 64), (3, 8, 80), (5, 4, 40),
    (3, 128, 64), (6, 16, 128), (9, 32, 32)])
def test_matches_the_reference(rng, group, block_size, head_dim):
  lengths = [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, 0]
  q, pool, tables, lens = _case(rng, group, block_size, head_dim, lengths)
  out = cpu_kernels.paged_decode(q, pool.k_pages, pool.v_pages, tables, lens,
                                 sm_scale=head_dim**-0.5)
  ref = paged_attention_reference(q, pool.k_pages, pool.v_pages, tables, lens)
  assert lib.max_abs_err(out, ref) <= lib.TOL["float32"]
  np.testing.assert_array_equal(np.asarray(out[-1]), 0.0)  # kv_len 0: zeros


def test_key_ranges_and_soft_cap_match_naive_attention(rng):
  bs, group, head_dim = 8, 4, 32
  lengths = [37, 9, 64, 1]
  starts = [20, 0, 63, 0]  # keys [start, length): a sliding window's range
  q, pool, tables, lens = _case(rng, group, bs, head_dim, lengths)
  for cap in (None, 3.0):
    out = np.asarray(cpu_kernels.paged_decode(
        q, pool.k_pages, pool.v_pages, tables, lens, jnp.asarray(starts, jnp.int32),
        sm_scale=0.2, soft_cap=cap))
    for b, (n, start) in enumerate(zip(lengths, starts)):
      k = lib.gather_tokens(pool.k_np, np.asarray(tables[b]), n)[start:]
      v = lib.gather_tokens(pool.v_np, np.asarray(tables[b]), n)[start:]
      qb = np.asarray(q[b]).reshape(2, group, head_dim)  # [kv head, group, dim]
      s = np.einsum("hgd,thd->hgt", qb, k) * 0.2
      if cap is not None:
        s = cap * np.tanh(s / cap)
      p = np.exp(s - s.max(-1, keepdims=True))
      want = np.einsum("hgt,thd->hgd", p / p.sum(-1, keepdims=True), v).reshape(-1, head_dim)
      assert np.abs(out[b] - want).max() <= 1e-5, (b, cap)


def test_slots_outside_every_range_never_contribute(rng):
  bs = 8
  lengths = [13, 1, 2 * bs + 1, 0, 5]
  starts = jnp.asarray([4, 0, 9, 0, 0], jnp.int32)
  q, pool, tables, lens = _case(rng, 2, bs, 32, lengths, num_blocks=24)
  clean = cpu_kernels.paged_decode(q, pool.k_pages, pool.v_pages, tables, lens, starts,
                                   sm_scale=0.1)
  k, v = np.array(pool.k_np), np.array(pool.v_np)
  used = np.zeros(k.shape[:2], bool)
  for table, n, start in zip(np.asarray(tables), lengths, np.asarray(starts)):
    for t in range(start, n):
      used[table[t // bs], t % bs] = True
  k[~used], v[~used] = np.nan, np.inf
  out = cpu_kernels.paged_decode(q, jnp.asarray(k), jnp.asarray(v), tables, lens, starts,
                                 sm_scale=0.1)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


def test_without_a_compiler_the_jnp_path_runs():
  # A fresh process whose compiler is missing (and whose cache is empty): one warning,
  # available() is False, and the xla backend still computes the decode rows.
  code = ("import warnings, jax.numpy as jnp\n"
          "from kernels_pallas import cpu_kernels, paged_attention_xla\n"
          "with warnings.catch_warnings(record=True) as w:\n"
          "  warnings.simplefilter('always')\n"
          "  assert not cpu_kernels.available()\n"
          "assert 'not available (no C++ compiler' in str(w[0].message), w\n"
          "q = jnp.ones((1, 2, 8)); k = jnp.ones((3, 4, 1, 8))\n"
          "out = paged_attention_xla(q, k, k, jnp.asarray([[1]]), jnp.asarray([3]))\n"
          "assert float(out.sum()) == 16.0\n")
  env = dict(os.environ, CXX="/nonexistent/c++", PATH="/nonexistent",
             HISPARSE_CACHE_DIR=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                             f"hisparse-empty-cache-{os.getpid()}"),
             JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]


def _ragged(rng, group, block_size, head_dim, seqs, num_kv_heads=2, num_blocks=96, pad=3):
  q_lens, kv_lens = zip(*seqs)
  pool = lib.make_pool(rng, num_blocks, block_size, num_kv_heads, head_dim, jnp.float32)
  width = -(-max(kv_lens) // block_size) + 1
  tables = jnp.asarray(lib.make_tables(rng, kv_lens, block_size, width, num_blocks))
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((cu[-1] + pad, group * num_kv_heads, head_dim)),
                  jnp.float32)
  return q, pool, tables, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu), q_lens


@pytest.mark.parametrize("group,block_size,head_dim", [
    (1, 4, 32), (2, 8, 64), (4, 16, 128), (3, 128, 32), (8, 32, 80), (2, 16, 40)])
def test_prefill_matches_the_reference(rng, group, block_size, head_dim):
  from kernels_pallas import ragged_paged_attention_reference
  bs = block_size
  # Whole prompts, chunks that continue a prompt (q_len < kv_len), decode rows and an
  # empty row (zeros from this kernel), long rows over many 16-key tiles and blocks.
  seqs = [(37, 37), (1, 9 * bs + 5), (70, 12 * bs + 72), (0, 5), (3, bs + 1), (2, 2),
          (bs + 5, 5 * bs + 3), (1, bs)]
  q, pool, tables, lens, cu, q_lens = _ragged(rng, group, bs, head_dim, seqs)
  for kw in ({}, {"sliding_window": 21}, {"soft_cap": 5.0}, {"sliding_window": 1}):
    out = np.asarray(cpu_kernels.ragged_prefill(q, pool.k_pages, pool.v_pages, tables, lens,
                                                cu, sm_scale=head_dim**-0.5, **kw))
    ref = np.asarray(ragged_paged_attention_reference(q, pool.k_pages, pool.v_pages, tables,
                                                      lens, cu, **kw))
    for b, n in enumerate(q_lens):
      if n == 0:
        continue
      rows = slice(int(cu[b]), int(cu[b + 1]))
      want = ref[rows] if n > 1 else 0.0  # only rows with more than one query
      assert np.abs(out[rows] - want).max() <= lib.TOL["float32"], (b, kw)
    np.testing.assert_array_equal(out[int(cu[-1]):], 0.0)  # padding tokens


def test_prefill_never_reads_past_the_context(rng):
  bs = 8
  seqs = [(13, 13), (5, 2 * bs + 1), (9, 20)]
  q, pool, tables, lens, cu, _ = _ragged(rng, 2, bs, 32, seqs, num_blocks=24)
  clean = cpu_kernels.ragged_prefill(q, pool.k_pages, pool.v_pages, tables, lens, cu,
                                     sm_scale=0.1)
  k, v = np.array(pool.k_np), np.array(pool.v_np)
  used = np.zeros(k.shape[:2], bool)
  for table, n in zip(np.asarray(tables), np.asarray(lens)):
    for t in range(n):
      used[table[t // bs], t % bs] = True
  k[~used], v[~used] = np.nan, np.inf
  out = cpu_kernels.ragged_prefill(q, jnp.asarray(k), jnp.asarray(v), tables, lens, cu,
                                   sm_scale=0.1)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


def test_huge_page_advice_keeps_every_value(monkeypatch):
  """advise_huge_pages is a hint to Linux: the arrays read the same afterwards, only whole
  2 MiB pages inside each buffer are advised, and HISPARSE_HUGE_PAGES=0 turns it off."""
  big = jnp.arange(3 << 20, dtype=jnp.float32)  # 12 MiB: at least 4 whole huge pages
  small = jnp.ones((16,), jnp.float32)
  before = np.asarray(big).copy()
  advised = cpu_kernels.advise_huge_pages([big, small, "not an array"])
  assert 0 <= advised <= big.nbytes and advised % (2 << 20) == 0
  np.testing.assert_array_equal(np.asarray(big), before)
  np.testing.assert_array_equal(np.asarray(small), 1.0)
  monkeypatch.setenv("HISPARSE_HUGE_PAGES", "0")
  assert cpu_kernels.advise_huge_pages([big]) == 0

"""The xla backend's attention (what the engine runs on CPU) against the references.

Its decode rows and prefill rows run the C++ kernels (cpu_kernels) on float32 pages where
they are built, and the jnp loops elsewhere: the `decode_path` fixture runs the tests on
both ("jnp": as if no kernel were built). bfloat16 pages take the jnp loops on either
path, so the grids' bfloat16 rows run once ("any": as the backend runs here), their
float32 rows on both paths (the jnp path on a subset, JNP_GRID), and the backends other
than xla once (the path is the xla backend's).

Also: masked KV never contributes, whatever an unused slot holds (NaN or inf), in every
attention path: the Pallas kernels (interpret mode), the references and the xla backend.
"""

import chex
import jax
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import (
  cpu_kernels,
  paged_attention,
  paged_attention_reference,
  paged_attention_xla,
  ragged_paged_attention,
  ragged_paged_attention_reference,
  ragged_paged_attention_xla,
)
from kernels_pallas.xla_attention import (
    KERNEL_TILE,
    decode_rows_bucket,
    hints_cover,
    kernel_hints,
    prefill_plan,
    ragged_hints,
)

NUM_BLOCKS = 96


# float32 rows of the pairwise grid that still hold every GQA ratio, block size and
# head_dim with float32 (the bfloat16 rows run the jnp path as "any", see above).
JNP_GRID = tuple(r for r in lib.PAIRWISE_GRID
                 if r in ((1, 8, 64, "float32"), (4, 32, 128, "float32"),
                          (8, 16, 128, "float32")))
GRID_PATHS = ([("any" if r[3] == "bfloat16" else "cpp", *r) for r in lib.PAIRWISE_GRID]
              + [("jnp", *r) for r in JNP_GRID])


@pytest.fixture(params=["cpp", "jnp"])
def decode_path(request, monkeypatch):
  """The xla backend's decode rows through the C++ kernel, or the jnp loop ("any":
  whichever the backend takes here; for operands the C++ kernels do not take, and for
  the backends other than xla).

  The choice is made when a call is traced: a "jnp" test starts and ends with no
  compiled program (so another one never meets a jnp trace, and keeps the reference
  programs of the tests before it)."""
  if request.param == "cpp" and not cpu_kernels.available():
    pytest.skip("the C++ CPU kernels are not built here (no C++ compiler)")
  if request.param == "jnp":
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    jax.clear_caches()
  yield request.param
  if request.param == "jnp":
    jax.clear_caches()


def test_grid_paths_cover_both_paths_on_every_value():
  assert len(JNP_GRID) == 3
  for i, values in enumerate(lib.GRID_VALUES[:3]):
    assert {r[i] for r in JNP_GRID} == set(values)  # float32 through the jnp loop
  # Every grid row runs once outside "jnp"; with bfloat16 that is the jnp loop too.
  assert sorted(r[1:] for r in GRID_PATHS if r[0] != "jnp") == sorted(lib.PAIRWISE_GRID)
  assert {r[0] for r in GRID_PATHS if r[4] == "bfloat16"} == {"any"}


def _batch(rng, ratio, block_size, head_dim, dtype, seqs, pad_rows=3, num_blocks=NUM_BLOCKS):
  num_kv_heads = 2 if ratio < 8 else 1
  q_lens, kv_lens = zip(*seqs)
  pool = lib.make_pool(rng, num_blocks, block_size, num_kv_heads, head_dim, lib.DTYPES[dtype])
  max_blocks = -(-max(kv_lens) // block_size) + 2  # wider than needed: padding columns
  tables = lib.make_tables(rng, kv_lens, block_size, max_blocks, num_blocks)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((cu[-1] + pad_rows, ratio * num_kv_heads, head_dim)),
                  lib.DTYPES[dtype])
  return pool, (q, pool.k_pages, pool.v_pages, jnp.asarray(tables),
                jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu))


def _mixed(block_size):
  """(q_len, kv_len): decode rows, whole and chunked prefills (several query tiles and key
  chunks), a one-token chunk, an empty query, in one batch."""
  bs = block_size
  return [(1, 1), (1, 9 * bs + 5), (37, 37), (3, bs + 1), (0, 5), (70, 12 * bs + 2),
          (1, bs), (bs + 5, 5 * bs + 3)]


@pytest.mark.parametrize("decode_path,ratio,block_size,head_dim,dtype", GRID_PATHS,
                         indirect=["decode_path"])
def test_ragged_xla_matches_reference_on_grid(rng, decode_path, ratio, block_size, head_dim, dtype):
  _, args = _batch(rng, ratio, block_size, head_dim, dtype, _mixed(block_size))
  q_lens = np.diff(np.asarray(args[5]))
  ref = ragged_paged_attention_reference(*args)
  # The engine's sizes (ragged_hints), small tiles (many per row), and the None default.
  # (and more decode rows than needed).
  for hints in (ragged_hints(q_lens), {"prefill_tile": 16, "num_prefill_tiles": 16,
                                       "num_decode_rows": 16}, {}):
    out = ragged_paged_attention_xla(*args, **hints)
    chex.assert_shape(out, args[0].shape)
    chex.assert_type(out, args[0].dtype)
    assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= lib.TOL[dtype]
    np.testing.assert_array_equal(np.asarray(out[int(args[5][-1]):], np.float32), 0.0)


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 21}, {"soft_cap": 5.0}])
def test_kernel_hints_run_every_prefill_row_in_the_cpp_kernel(rng, kw):
  # kernel_hints: one static size for any prefill (the C++ kernel tiles the rows itself);
  # the same outputs as the reference and as the engine's tiles.
  if not cpu_kernels.available():
    pytest.skip("the C++ CPU kernels are not built here (no C++ compiler)")
  _, args = _batch(rng, 4, 16, 64, "float32", _mixed(16))
  q_lens = np.diff(np.asarray(args[5]))
  hints = kernel_hints(q_lens)
  assert hints == {"prefill_tile": KERNEL_TILE, "num_prefill_tiles": 1, "num_decode_rows": 8}
  out = ragged_paged_attention_xla(*args, **hints, **kw)
  ref = ragged_paged_attention_reference(*args, **kw)
  assert lib.max_abs_err(out, ref) <= lib.TOL["float32"]
  np.testing.assert_array_equal(np.asarray(out[int(args[5][-1]):]), 0.0)
  # Prompts of other lengths: the same static sizes, so the same program.
  assert kernel_hints([1, 2048, 1]) == kernel_hints([700, 1, 5])
  assert kernel_hints([1, 1])["num_prefill_tiles"] == 0  # no prefill work compiled


def test_kernel_hints_need_float32_pages_and_the_kernels(rng):
  if not cpu_kernels.available():
    pytest.skip("the C++ CPU kernels are not built here (no C++ compiler)")
  _, args = _batch(rng, 4, 16, 64, "bfloat16", _mixed(16))
  with pytest.raises(ValueError, match="KERNEL_TILE"):
    ragged_paged_attention_xla(*args, **kernel_hints(np.diff(np.asarray(args[5]))))


def test_hints_cover_kernel_hints():
  # Any prefill rows are covered by a kernel program with prefill; decode rows as before.
  with_prefill = kernel_hints([2048, 1])
  assert hints_cover(with_prefill, [5000, 3, 1, 1])
  assert hints_cover(with_prefill, [1] * 8) and not hints_cover(with_prefill, [1] * 9)
  assert not hints_cover(kernel_hints([1, 1]), [2, 1])
  assert hints_cover(kernel_hints([1, 1]), [1, 1])
  # The tile plan's hints are still counted in tiles.
  assert not hints_cover(ragged_hints([128]), [129])


def test_engine_ops_take_kernel_hints_for_float32_pages_on_cpu():
  xla = kernels_pallas.ops("xla", pages_dtype="float32")
  want = kernel_hints if cpu_kernels.available() else ragged_hints
  assert xla.ragged_hints is want
  # bf16 pages, quantized ones (None) and other targets keep the tile plan.
  assert kernels_pallas.ops("xla", pages_dtype="bfloat16").ragged_hints is ragged_hints
  assert kernels_pallas.ops("xla", pages_dtype=None).ragged_hints is ragged_hints
  assert kernels_pallas.ops("xla", platform="tpu",
                            pages_dtype="float32").ragged_hints is ragged_hints


@pytest.mark.parametrize("kw", [{"sliding_window": 21}, {"soft_cap": 5.0},
                                {"sm_scale": 0.3, "sliding_window": 1}])
def test_ragged_xla_window_cap_scale(rng, decode_path, kw):
  _, args = _batch(rng, 4, 8, 64, "float32", _mixed(8))
  out = ragged_paged_attention_xla(*args, **ragged_hints(np.diff(np.asarray(args[5]))), **kw)
  ref = ragged_paged_attention_reference(*args, **kw)
  assert lib.max_abs_err(out, ref) <= lib.TOL["float32"]


def test_ragged_xla_equals_naive_attention_per_sequence(rng):
  # Independent of the references: numpy softmax over each sequence's gathered tokens.
  pool, args = _batch(rng, 2, 16, 64, "float32", _mixed(16))
  q, _, _, tables, kv_lens, cu = (np.asarray(a) for a in args)
  out = np.asarray(ragged_paged_attention_xla(*args, **ragged_hints(np.diff(cu))))
  for b, kv_len in enumerate(kv_lens):
    rows = slice(cu[b], cu[b + 1])
    k = lib.gather_tokens(pool.k_np, tables[b], kv_len)
    v = lib.gather_tokens(pool.v_np, tables[b], kv_len)
    want = lib.naive_attention(q[rows], k, v, mask=lib.causal_mask(cu[b + 1] - cu[b], kv_len))
    assert lib.max_abs_err(out[rows], want) <= 1e-5


@pytest.mark.parametrize("decode_path,ratio,block_size,head_dim,dtype", GRID_PATHS,
                         indirect=["decode_path"])
def test_paged_xla_matches_reference_on_grid(rng, decode_path, ratio, block_size, head_dim, dtype):
  lengths = lib.grid_lengths(block_size) + [17 * block_size + 1]
  num_kv_heads = 2 if ratio < 8 else 1
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, num_kv_heads, head_dim, lib.DTYPES[dtype])
  tables = lib.make_tables(rng, lengths, block_size, 20, NUM_BLOCKS)
  q = jnp.asarray(rng.standard_normal((len(lengths), ratio * num_kv_heads, head_dim)),
                  lib.DTYPES[dtype])
  args = (q, pool.k_pages, pool.v_pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))
  out = paged_attention_xla(*args)
  ref = paged_attention_reference(*args)
  assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= lib.TOL[dtype]
  np.testing.assert_array_equal(np.asarray(out[lengths.index(0)], np.float32), 0.0)


def test_decode_rows_bucket():
  assert [decode_rows_bucket(n) for n in (0, 1, 8, 9, 64, 65, 100, 256)] == [
      0, 8, 8, 16, 64, 96, 128, 256]


def test_prefill_plan_sizes():
  assert prefill_plan([1, 1, 0]) == (16, 0)  # decode rows only: no prefill work compiled
  assert prefill_plan([1, 5]) == (16, 1)
  assert prefill_plan([300, 1, 37], max_tile=256) == (256, 4)  # 2 + 1 tiles, rounded up
  assert prefill_plan([1024, 1024], max_tile=256) == (256, 8)
  assert prefill_plan([1024, 1024]) == (128, 16)  # the default tile, PREFILL_TILE
  assert prefill_plan([2, 3, 4], max_tile=256) == (16, 4)


def _poisoned(pool_k, pool_v, tables, lengths, block_size):
  """Copies of the pages with NaN / inf in every slot no sequence reads (unused tails of
  partial blocks, unlisted blocks, the null block)."""
  used = np.zeros(pool_k.shape[:2], bool)
  for table, n in zip(tables, lengths):
    for t in range(n):
      used[table[t // block_size], t % block_size] = True
  k, v = np.array(pool_k, np.float32), np.array(pool_v, np.float32)
  k[~used], v[~used] = np.nan, np.inf
  v[0] = -np.inf  # the null block
  return jnp.asarray(k, pool_k.dtype), jnp.asarray(v, pool_v.dtype)


RAGGED = {"pallas": ragged_paged_attention, "reference": ragged_paged_attention_reference,
          "xla": ragged_paged_attention_xla}
PAGED = {"pallas": paged_attention, "reference": paged_attention_reference,
         "xla": paged_attention_xla}
# The decode path is the xla backend's: the others run once.
BACKEND_PATHS = [("pallas", "any"), ("reference", "any"), ("xla", "cpp"), ("xla", "jnp")]


@pytest.mark.parametrize("backend,decode_path", BACKEND_PATHS, indirect=["decode_path"])
def test_masked_kv_never_contributes_ragged(rng, backend, decode_path):
  bs = 8
  seqs = [(1, 13), (5, 5), (3, 2 * bs + 1), (1, bs)]
  _, args = _batch(rng, 2, bs, 32, "float32", seqs, num_blocks=24)
  q, k, v, tables, kv_lens, cu = args
  clean = RAGGED[backend](*args)
  k_bad, v_bad = _poisoned(k, v, np.asarray(tables), np.asarray(kv_lens), bs)
  out = RAGGED[backend](q, k_bad, v_bad, tables, kv_lens, cu)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


@pytest.mark.parametrize("backend,decode_path", BACKEND_PATHS, indirect=["decode_path"])
def test_masked_kv_never_contributes_paged(rng, backend, decode_path):
  bs = 8
  lengths = [13, 1, 2 * bs + 1, 0]
  pool = lib.make_pool(rng, 24, bs, 2, 32, jnp.float32)
  tables = jnp.asarray(lib.make_tables(rng, lengths, bs, 4, 24))
  q = jnp.asarray(rng.standard_normal((len(lengths), 4, 32)), jnp.float32)
  lens = jnp.asarray(lengths, jnp.int32)
  clean = PAGED[backend](q, pool.k_pages, pool.v_pages, tables, lens)
  k_bad, v_bad = _poisoned(pool.k_pages, pool.v_pages, np.asarray(tables), lengths, bs)
  out = PAGED[backend](q, k_bad, v_bad, tables, lens)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))

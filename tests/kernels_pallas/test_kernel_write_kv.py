"""write_kv and block_key_bounds: exact bytes, skipped slots, in-place updates."""

import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest

from kernels_pallas import (
  block_key_bounds,
  block_key_bounds_reference,
  write_kv,
  write_kv_reference,
)
from kernels_pallas.block_key_bounds import round_bounds

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 10, 8, 2, 64
WRITE = {"pallas": write_kv, "xla": write_kv_reference}
BOUNDS = {"pallas": block_key_bounds, "xla": block_key_bounds_reference}


def _pool(rng, dtype=jnp.float32):
  return lib.make_pool(rng, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_writes_slots_skips_negative_in_place(rng, impl, dtype):
  pool = _pool(rng, lib.DTYPES[dtype])
  slots = np.array([13, -1, 0, 79, -7, 14, 80], np.int32)  # 80 is past the pool: skipped
  k_new = jnp.asarray(rng.standard_normal((len(slots), NUM_KV_HEADS, HEAD_DIM)), lib.DTYPES[dtype])
  v_new = -k_new
  k_ptr, v_ptr = pool.k_pages.unsafe_buffer_pointer(), pool.v_pages.unsafe_buffer_pointer()
  k_pages, v_pages = WRITE[impl](pool.k_pages, pool.v_pages, k_new, v_new, jnp.asarray(slots))
  assert pool.k_pages.is_deleted() and pool.v_pages.is_deleted()  # donated
  assert k_pages.unsafe_buffer_pointer() == k_ptr and v_pages.unsafe_buffer_pointer() == v_ptr
  want_k = pool.k_np.reshape(-1, NUM_KV_HEADS, HEAD_DIM).copy()
  want_v = pool.v_np.reshape(-1, NUM_KV_HEADS, HEAD_DIM).copy()
  k_new_np = np.array(k_new.astype(jnp.float32))
  for t, slot in enumerate(slots):
    if 0 <= slot < NUM_BLOCKS * BLOCK_SIZE:
      want_k[slot], want_v[slot] = k_new_np[t], -k_new_np[t]
  got_k = np.asarray(k_pages.astype(jnp.float32)).reshape(want_k.shape)
  got_v = np.asarray(v_pages.astype(jnp.float32)).reshape(want_v.shape)
  np.testing.assert_array_equal(got_k, want_k)
  np.testing.assert_array_equal(got_v, want_v)
  assert (got_k != pool.k_np.reshape(want_k.shape)).any(axis=(1, 2)).sum() == 4  # 4 slots


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_write_kv_moves_bitcast_storage_dtype(rng, impl):
  """CPU pools store bfloat16 as uint16; write_kv moves those bits unchanged."""
  pool = _pool(rng, jnp.bfloat16)
  to_u16 = lambda x: jnp.asarray(x).view(jnp.uint16)
  new = jnp.asarray(rng.standard_normal((2, NUM_KV_HEADS, HEAD_DIM)), jnp.bfloat16)
  k_pages, v_pages = WRITE[impl](to_u16(pool.k_pages), to_u16(pool.v_pages), to_u16(new),
                                 to_u16(new), jnp.asarray([5, -1], jnp.int32))
  assert k_pages.dtype == jnp.uint16
  np.testing.assert_array_equal(np.asarray(k_pages.view(jnp.bfloat16)[0, 5]), np.asarray(new[0]))
  np.testing.assert_array_equal(np.asarray(v_pages.view(jnp.bfloat16)[1:]),
                                np.asarray(pool.v_pages[1:]))


def test_write_kv_bad_shapes_raise(rng):
  pool = _pool(rng)
  k_new = jnp.zeros((3, NUM_KV_HEADS, 32), jnp.float32)
  with pytest.raises(ValueError, match=r"\(3, 2, 32\)"):
    write_kv(pool.k_pages, pool.v_pages, k_new, k_new, jnp.zeros((3,), jnp.int32))
  k_new = jnp.zeros((3, NUM_KV_HEADS, HEAD_DIM), jnp.float32)
  with pytest.raises(ValueError, match=r"slot_ids"):
    write_kv(pool.k_pages, pool.v_pages, k_new, k_new, jnp.zeros((4,), jnp.int32))


def _want_bounds(k_np, block_id, num_valid):
  keys = k_np[block_id, :num_valid]  # [num_valid, num_kv_heads, head_dim]
  return np.stack([keys.min(axis=0), keys.max(axis=0)])


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_block_key_bounds_tracks_written_blocks(rng, impl):
  pool = _pool(rng)
  k_pages, v_pages = pool.k_pages, pool.v_pages
  bounds = jnp.full((NUM_BLOCKS, 2, NUM_KV_HEADS, HEAD_DIM), 7.0, jnp.float32)  # sentinel
  ptr = bounds.unsafe_buffer_pointer()

  def step(k_pages, v_pages, bounds, slots):
    new = jnp.asarray(rng.standard_normal((17, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    slots = jnp.asarray(slots + [-1] * (17 - len(slots)), jnp.int32)  # one shape: one compile
    k_pages, v_pages = WRITE[impl](k_pages, v_pages, new, new, slots)
    return k_pages, v_pages, BOUNDS[impl](bounds, k_pages, slots)

  # Prefill: seq A fills block 3 and 5 tokens of block 6; seq B 2 tokens of block 2; padding.
  prefill = [3 * 8 + i for i in range(8)] + [6 * 8 + i for i in range(5)] + [16, 17, -1, -1]
  k_pages, v_pages, bounds = step(k_pages, v_pages, bounds, prefill)
  assert bounds.unsafe_buffer_pointer() == ptr  # in place
  k_np, b_np = np.asarray(k_pages), np.asarray(bounds)
  for block_id, num_valid in [(3, 8), (6, 5), (2, 2)]:
    np.testing.assert_array_equal(b_np[block_id], _want_bounds(k_np, block_id, num_valid))
  untouched = [b for b in range(NUM_BLOCKS) if b not in (2, 3, 6)]
  np.testing.assert_array_equal(b_np[untouched], 7.0)

  # Decode: A appends offset 5 of block 6; B's block 2 gets offset 2. Min/max widen to them.
  k_pages, v_pages, bounds = step(k_pages, v_pages, bounds, [6 * 8 + 5, 2 * 8 + 2])
  k_np, b_np = np.asarray(k_pages), np.asarray(bounds)
  np.testing.assert_array_equal(b_np[6], _want_bounds(k_np, 6, 6))
  np.testing.assert_array_equal(b_np[2], _want_bounds(k_np, 2, 3))
  # Stale tokens of block 6 past offset 5 (from the random pool) are not counted.
  assert not np.array_equal(_want_bounds(k_np, 6, 6), _want_bounds(k_np, 6, 8))

  # Block 3 freed and reused by a new sequence: only its 1 new token counts.
  k_pages, v_pages, bounds = step(k_pages, v_pages, bounds, [3 * 8])
  k_np, b_np = np.asarray(k_pages), np.asarray(bounds)
  np.testing.assert_array_equal(b_np[3, 0], k_np[3, 0])
  np.testing.assert_array_equal(b_np[3, 1], k_np[3, 0])


def test_block_key_bounds_bad_layout_raises(rng):
  pool = _pool(rng)
  bad = jnp.zeros((NUM_BLOCKS, 2, HEAD_DIM, NUM_KV_HEADS), jnp.float32)
  with pytest.raises(ValueError, match=r"\(10, 2, 64, 2\)"):
    block_key_bounds(bad, pool.k_pages, jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_block_key_bounds_leaves_rows_past_the_pages_untouched(rng, impl):
  # The engine keeps its host blocks' bounds in the rows past the device blocks'.
  pool = _pool(rng)
  num_blocks = pool.k_pages.shape[0]
  extra = rng.standard_normal((num_blocks + 5, 2, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
  slots = jnp.asarray([3 * BLOCK_SIZE + 1, -1], jnp.int32)  # block 3, two valid tokens
  out = np.asarray(BOUNDS[impl](jnp.asarray(extra), pool.k_pages, slots))
  np.testing.assert_array_equal(out[3], _want_bounds(pool.k_np, 3, 2))
  untouched = [i for i in range(num_blocks + 5) if i != 3]
  np.testing.assert_array_equal(out[untouched], extra[untouched])
  with pytest.raises(ValueError, match="or more rows"):
    BOUNDS[impl](jnp.asarray(extra[:num_blocks - 1]), pool.k_pages, slots)


@pytest.mark.parametrize("head_dim", [80, 112])
def test_write_kv_and_bounds_at_a_head_dim_that_is_not_a_power_of_2(rng, head_dim):
  # The kernels tile head_dim at the next power of 2 and mask the padding columns off
  # every page load and store (that the Triton stores are masked is test_lowering_cuda's).
  pool = lib.make_pool(rng, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim, jnp.bfloat16)
  slots = np.array([3 * 8 + 0, 3 * 8 + 1, -1, 79, 9], np.int32)
  new = jnp.asarray(rng.standard_normal((len(slots), NUM_KV_HEADS, head_dim)), jnp.bfloat16)
  k_pages, v_pages = write_kv(pool.k_pages, pool.v_pages, new, -new, jnp.asarray(slots))
  assert k_pages.shape == (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
  want_k = pool.k_np.reshape(-1, NUM_KV_HEADS, head_dim).copy()
  want_v = pool.v_np.reshape(-1, NUM_KV_HEADS, head_dim).copy()
  new_np = np.array(new.astype(jnp.float32))
  for t, slot in enumerate(slots):
    if slot >= 0:
      want_k[slot], want_v[slot] = new_np[t], -new_np[t]
  k_np = np.asarray(k_pages.astype(jnp.float32))
  np.testing.assert_array_equal(k_np.reshape(want_k.shape), want_k)
  np.testing.assert_array_equal(np.asarray(v_pages.astype(jnp.float32)).reshape(want_v.shape),
                                want_v)
  bounds = jnp.full((NUM_BLOCKS, 2, NUM_KV_HEADS, head_dim), 7.0, jnp.float32)  # sentinel
  b_np = np.asarray(block_key_bounds(bounds, k_pages, jnp.asarray(slots)))
  for block_id, num_valid in [(3, 2), (9, 8), (1, 2)]:
    np.testing.assert_array_equal(b_np[block_id], _want_bounds(k_np, block_id, num_valid))
  np.testing.assert_array_equal(b_np[[0, 2, 4, 5, 6, 7, 8]], 7.0)


def test_round_bounds_rounds_outward_to_the_nearest_bfloat16():
  # Values across signs and magnitudes, exact bf16 values, subnormals and zeros.
  scale = 10.0 ** np.repeat(np.arange(-20, 20, 10), 1024)  # 4 decades, 1,024 values each
  special = [0.0, -0.0, 1.0, -1.0, 1.5, 3e-39, -3e-39, 1e-45, -1e-45]
  x = np.concatenate([np.random.default_rng(0).standard_normal(4096) * scale,
                      special]).astype(np.float32)
  lo, hi = round_bounds(jnp.asarray(x), jnp.asarray(x), jnp.bfloat16)
  assert lo.dtype == hi.dtype == jnp.bfloat16
  lo64, hi64 = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
  assert (lo64 <= x).all() and (hi64 >= x).all()  # still bounds
  near = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)  # round to nearest
  exact = near == x
  np.testing.assert_array_equal(lo64[exact], x[exact])  # bf16 values stay as they are
  np.testing.assert_array_equal(hi64[exact], x[exact])
  # Otherwise the two neighbours of x in bf16: one of them is the nearest.
  assert ((lo64 == near) | (hi64 == near)).all()
  assert (lo64[~exact] < hi64[~exact]).all()
  up = np.asarray(jnp.nextafter(lo.astype(jnp.bfloat16), jnp.bfloat16(np.inf)), np.float64)
  np.testing.assert_array_equal(up[~exact], hi64[~exact])
  # float32 and the keys' own dtype are exact.
  lo32, _ = round_bounds(jnp.asarray(x), jnp.asarray(x), jnp.float32)
  np.testing.assert_array_equal(np.asarray(lo32), x)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_bfloat16_bounds_of_float32_keys_bound_them_outward_in_place(rng, impl, block_size):
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM, jnp.float32)
  extra = jnp.full((NUM_BLOCKS + 3, 2, NUM_KV_HEADS, HEAD_DIM), 7.0, jnp.bfloat16)
  ptr = extra.unsafe_buffer_pointer()
  # Block 3 full, 2 tokens of block 5, padding.
  slots = [3 * block_size + i for i in range(block_size)] + [5 * block_size,
                                                             5 * block_size + 1, -1]
  out = BOUNDS[impl](extra, pool.k_pages, jnp.asarray(slots, jnp.int32))
  assert out.dtype == jnp.bfloat16 and out.unsafe_buffer_pointer() == ptr  # in place
  got = np.asarray(out, np.float32)
  for block_id, num_valid in [(3, block_size), (5, 2)]:
    want = _want_bounds(pool.k_np, block_id, num_valid)
    assert (got[block_id, 0] <= want[0]).all() and (got[block_id, 1] >= want[1]).all()
    lo, hi = round_bounds(jnp.asarray(want[0]), jnp.asarray(want[1]), jnp.bfloat16)
    np.testing.assert_array_equal(got[block_id, 0], np.asarray(lo, np.float32))
    np.testing.assert_array_equal(got[block_id, 1], np.asarray(hi, np.float32))
    assert (got[block_id] != want).any()  # float32 keys are not all bf16 values
  untouched = [i for i in range(NUM_BLOCKS + 3) if i not in (3, 5)]
  np.testing.assert_array_equal(got[untouched], 7.0)


def test_bounds_of_another_dtype_are_refused(rng):
  pool = _pool(rng)
  bad = jnp.zeros((NUM_BLOCKS, 2, NUM_KV_HEADS, HEAD_DIM), jnp.float16)
  with pytest.raises(ValueError, match="bounds dtype must be float32, bfloat16"):
    block_key_bounds(bad, pool.k_pages, jnp.zeros((1,), jnp.int32))


def _ragged_slots(rng, q_lens, num_blocks, block_size, start=None):
  """Slots of a ragged step: each row's q tokens are consecutive positions from a random
  start (or `start`), mapped through its own random block table (distinct blocks across
  rows), with padding (-1) after."""
  free = list(rng.permutation(np.arange(1, num_blocks)))
  slots = []
  for q in q_lens:
    start = int(rng.integers(0, 3 * block_size)) if start is None else start
    table = [free.pop() for _ in range((start + q + block_size - 1) // block_size)]
    slots += [table[p // block_size] * block_size + p % block_size
              for p in range(start, start + q)]
  return np.asarray(slots + [-1] * 5, np.int32)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_bounds_with_max_touched_blocks_equal_the_full_update(rng, impl):
  # The engine passes max_touched_blocks(tokens, rows, block_size): a bound of the distinct
  # blocks a ragged step's rows can touch. Packed to that many entries, the update is the
  # same as over every slot: mixed prefill chunks and decode rows, chunks that start and
  # end mid-block, one token per block, and a step that touches exactly the bound.
  from kernels_pallas.block_key_bounds import max_touched_blocks
  num_blocks, block_size = 64, 4
  pool = lib.make_pool(rng, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, jnp.float32)
  # The worst case last: rows of block_size + 2 tokens from offset block_size - 1 touch
  # 3 blocks each.
  cases = [([13, 1, 1, 7, 1, 0], None), ([1] * 9, None), ([2] * 6, None), ([5, 9], None),
           ([block_size * 6 + 2, 1], None), ([block_size + 2] * 4, block_size - 1)]
  for q_lens, start in cases:
    slots = _ragged_slots(rng, q_lens, num_blocks, block_size, start)
    bound = max_touched_blocks(len(slots), len(q_lens), block_size)
    touched = len({s // block_size for s in slots if s >= 0})
    assert touched <= bound < len(slots) + 1
    start = jnp.asarray(rng.standard_normal((num_blocks, 2, NUM_KV_HEADS, HEAD_DIM)),
                        jnp.float32)
    want = np.asarray(BOUNDS[impl](start.copy(), pool.k_pages, jnp.asarray(slots)))
    got = np.asarray(BOUNDS[impl](start.copy(), pool.k_pages, jnp.asarray(slots),
                                  max_touched=bound))
    np.testing.assert_array_equal(got, want)
    # Exactly as many entries as touched blocks still updates them all.
    exact = np.asarray(BOUNDS[impl](start.copy(), pool.k_pages, jnp.asarray(slots),
                                    max_touched=touched))
    np.testing.assert_array_equal(exact, want)
  assert touched == 12  # the worst case's 4 rows x 3 blocks, under its bound of 14

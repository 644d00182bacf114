"""The C++ hot-buffer resolve for XLA:CPU (kernels_pallas/cpu_resolve.cc) against the jnp
reference it replaces on CPU (`resolver.resolve`'s vmapped `_resolve_row`): every output
equal (tables, loads, the new state, counts) on random hot-buffer states (empty, full,
partly filled slots, recent and old evictions), selections with repeated blocks, rows
with nothing valid, and blocks resident, hot and missed in one row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.sparse import resolver
from kernels_pallas import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="the C++ CPU kernels are not built (no C++ compiler)")


def _case(rng, batch, k, num_slots, max_blocks, step):
  sel = rng.integers(0, max_blocks, size=(batch, k))
  if rng.random() < 0.5:  # repeated blocks: the second half mirrors the first
    half = k // 2
    sel[:, k - half:] = sel[:, :half][:, ::-1]
  valid = rng.random((batch, k)) < rng.uniform(0.3, 1.0)
  valid[0] = False  # a row with nothing selected
  slot_block = np.full((batch, num_slots), -1)
  for b in range(batch):  # distinct blocks in a random share of the slots
    filled = int(rng.integers(0, num_slots + 1))
    blocks = rng.choice(max_blocks, size=min(filled, max_blocks), replace=False)
    where = rng.choice(num_slots, size=blocks.size, replace=False)
    slot_block[b, where] = blocks
  last_used = np.where(slot_block >= 0, rng.integers(step - 40, step, size=slot_block.shape),
                       resolver.NEVER)
  last_used[:, : num_slots // 3] = step - 5  # equal keys: the lower slot goes first
  evicted_at = np.where(rng.random((batch, max_blocks)) < 0.5,
                        rng.integers(step - 20, step, size=(batch, max_blocks)), resolver.NEVER)
  resident = np.where(rng.random((batch, max_blocks)) < 0.3,
                      rng.integers(1, 1000, size=(batch, max_blocks)), 0)
  slot_device = 1000 + np.arange(batch * num_slots).reshape(batch, num_slots)
  host = rng.integers(1, 5000, size=(batch, max_blocks))
  state = resolver.HotBufferState(*(jnp.asarray(x, jnp.int32) for x in
                                    (slot_block, last_used, evicted_at)))
  return (jnp.asarray(sel, jnp.int32), jnp.asarray(valid), state,
          jnp.asarray(resident, jnp.int32), jnp.asarray(slot_device, jnp.int32),
          jnp.asarray(host, jnp.int32))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.sampled_from([1, 3, 8, 16]),
       extra_slots=st.sampled_from([0, 1, 8]), max_blocks=st.sampled_from([4, 20, 64]),
       window=st.sampled_from([0, 4, 100]))
def test_matches_the_jnp_resolve(seed, k, extra_slots, max_blocks, window):
  rng = np.random.default_rng(seed)
  step = 100
  sel, valid, state, resident, slot_device, host = _case(rng, 4, k, k + extra_slots,
                                                         max_blocks, step)
  kw = dict(num_device_blocks=2000, thrash_window_steps=window)
  ref = jax.jit(lambda *a: resolver.resolve(*a, **kw))(sel, valid, state, resident,
                                                        slot_device, host, step)
  got = jax.jit(lambda *a: resolver.resolve(*a, **kw, cpu_kernel=True))(
      sel, valid, state, resident, slot_device, host, step)
  for name, a, b in zip(("table", "host", "device", "slot_block", "last_used", "evicted_at",
                         "resident", "hot", "miss", "evict", "thrash"),
                        jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(b, a, err_msg=name)


def test_engine_sized_rows_and_a_second_step():
  # 8 rows, k = 128 of 4,096 blocks, 256 slots; the second step resolves against the
  # state the first left (hits where it loaded).
  rng = np.random.default_rng(5)
  sel, valid, state, resident, slot_device, host = _case(rng, 8, 128, 256, 4096, 1000)
  kw = dict(num_device_blocks=20000, thrash_window_steps=8)
  for step in (1000, 1001):
    ref = resolver.resolve(sel, valid, state, resident, slot_device, host, step, **kw)
    got = resolver.resolve(sel, valid, state, resident, slot_device, host, step, **kw,
                           cpu_kernel=True)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
      np.testing.assert_array_equal(b, a)
    state = got.state
  assert int(got.counts.hot_hits.sum()) > 0

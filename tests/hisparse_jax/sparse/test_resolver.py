"""Resolver: exact hit/miss/eviction/thrash counts, LRU order, no self-eviction, jit ==
no-jit, bit-exact host loads, and select -> resolve -> load -> attend end to end."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pool_helpers import read_blocks, write_blocks

import kernels_pallas
from hisparse_jax.kv_cache import transfer
from hisparse_jax.kv_cache.kv_pool import DEVICE, PINNED_HOST, KVCacheSpec, KVPool
from hisparse_jax.kv_cache.transfer import TransferEngine
from hisparse_jax.sparse import indexer, resolver
from hisparse_jax.sparse.config import HiSparseConfig
from hisparse_jax.sparse.resolver import NEVER, HotBufferState

NUM_DEVICE_BLOCKS = 16


@functools.cache  # one jitted program per window, shared by the examples of a test
def _jitted_resolve(thrash_window_steps):
  return jax.jit(_resolve_fn(thrash_window_steps))


def _resolve_fn(thrash_window_steps):
  return functools.partial(resolver.resolve, num_device_blocks=NUM_DEVICE_BLOCKS,
                           thrash_window_steps=thrash_window_steps)


class ScriptedAccessTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_scripted_pattern_counts_lru_and_thrash(self):
    # One sequence, 6 logical blocks, k = 2 selected per step, 3 hot slots on device
    # blocks 10, 11, 12. Logical block 0 is resident on device block 7; logical block i
    # lives in host block 100 + i. Thrash window: 4 steps.
    fn = self.variant(_resolve_fn(thrash_window_steps=4))
    resident = jnp.array([[7, 0, 0, 0, 0, 0]], jnp.int32)
    slot_device = jnp.array([[10, 11, 12]], jnp.int32)
    host = jnp.arange(100, 106, dtype=jnp.int32)[None]
    state = HotBufferState.create(batch=1, num_slots=3, max_blocks=6)

    def step(state, step_id, sel, valid=(True, True)):
      res = fn(jnp.array([sel], jnp.int32), jnp.array([valid]), state, resident, slot_device,
               host, step_id)
      counts = tuple(int(c[0]) for c in (res.counts.resident_hits, res.counts.hot_hits,
                                         res.counts.misses, res.counts.evictions,
                                         res.counts.thrash))
      loads = [(int(h), int(d)) for h, d in zip(res.load_host_ids, res.load_device_ids)
               if d < NUM_DEVICE_BLOCKS]
      return res.state, res.block_tables[0].tolist(), loads, counts

    # counts = (resident hits, hot hits, misses, evictions, thrash)
    # Step 0: blocks 1, 2 miss; empty slots are taken first, in slot order.
    state, table, loads, counts = step(state, 0, [1, 2])
    assert (table, loads, counts) == ([10, 11], [(101, 10), (102, 11)], (0, 0, 2, 0, 0))
    assert state.slot_block[0].tolist() == [1, 2, -1]
    assert state.slot_last_used[0].tolist() == [0, 0, NEVER]
    # Step 1: block 0 is resident (no copy, no slot touched), block 1 a hot hit in slot 0.
    state, table, loads, counts = step(state, 1, [0, 1])
    assert (table, loads, counts) == ([7, 10], [], (1, 1, 0, 0, 0))
    assert state.slot_last_used[0].tolist() == [1, 0, NEVER]
    # Step 2: blocks 3, 4 miss. Victims in LRU order: empty slot 2, then slot 1 (block 2,
    # last used at step 0) -- not slot 0 (block 1, used at step 1).
    state, table, loads, counts = step(state, 2, [3, 4])
    assert (table, loads, counts) == ([12, 11], [(103, 12), (104, 11)], (0, 0, 2, 1, 0))
    assert state.slot_block[0].tolist() == [1, 4, 3]
    assert state.evicted_at[0, 2] == 2
    # Step 3: block 3 hits slot 2; block 2 misses and goes to slot 0 (LRU, block 1). Block
    # 2 left the hot buffer at step 2, one step ago: thrash.
    state, table, loads, counts = step(state, 3, [2, 3])
    assert (table, loads, counts) == ([10, 12], [(102, 10)], (0, 1, 1, 1, 1))
    assert state.slot_block[0].tolist() == [2, 4, 3]
    assert state.slot_last_used[0].tolist() == [3, 2, 3]
    # Step 4: block 4 hits slot 1, which is the LRU slot -- but it is used by this step,
    # so block 1's miss evicts slot 0 (last used 3, tie with slot 2 broken by index).
    # Block 1 was evicted at step 3: thrash.
    state, table, loads, counts = step(state, 4, [1, 4])
    assert (table, loads, counts) == ([10, 11], [(101, 10)], (0, 1, 1, 1, 1))
    assert state.slot_block[0].tolist() == [1, 4, 3]
    # Step 10: block 2 (evicted at step 4, six steps ago: beyond the window, no thrash)
    # and block 5 miss: slot 2 (last used 3), then slot 0 (4; tie with slot 1 by index).
    state, table, loads, counts = step(state, 10, [2, 5])
    assert (table, loads, counts) == ([12, 10], [(102, 12), (105, 10)], (0, 0, 2, 2, 0))
    assert state.slot_block[0].tolist() == [5, 4, 2]
    # Step 11: a padded selection; padding resolves to the null block and loads nothing.
    state, table, loads, counts = step(state, 11, [5, -1], valid=(True, False))
    assert (table, loads, counts) == ([10, 0], [], (0, 1, 0, 0, 0))


def test_duplicate_selection_in_a_row_loads_once():
  # Per-KV-head selections flattened into one row select block 3 twice.
  res = _jitted_resolve(4)(jnp.array([[3, 1, 3, 1]], jnp.int32), jnp.ones((1, 4), bool),
                       HotBufferState.create(1, 4, 6), jnp.zeros((1, 6), jnp.int32),
                       jnp.array([[10, 11, 12, 13]], jnp.int32),
                       jnp.arange(6, dtype=jnp.int32)[None] + 1, 0)
  assert res.block_tables[0].tolist() == [10, 11, 10, 11]
  assert int(res.counts.misses[0]) == 2
  assert sorted(np.asarray(res.load_device_ids).tolist()) == [10, 11, 16, 16]


def test_too_few_slots_is_refused():
  with np.testing.assert_raises_regex(ValueError, "hot_buffer_tokens"):
    _resolve_fn(4)(jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3), bool),
                   HotBufferState.create(1, 2, 6), jnp.zeros((1, 6), jnp.int32),
                   jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 6), jnp.int32), 0)


class _ReferenceLRU:
  """Plain-Python model of one sequence's hot buffer, written from the docstring."""

  def __init__(self, num_slots, window):
    self.blocks = [-1] * num_slots
    self.last_used = [NEVER] * num_slots
    self.evicted_at, self.window = {}, window

  def step(self, step, selected, resident):
    counts = [0] * 5
    used, misses = set(), []
    for block in dict.fromkeys(selected):  # distinct, in order
      if block in resident:
        counts[0] += 1
      elif block in self.blocks:
        counts[1] += 1
        used.add(self.blocks.index(block))
      else:
        misses.append(block)
    free = sorted((i for i in range(len(self.blocks)) if i not in used),
                  key=lambda i: (NEVER if self.blocks[i] < 0 else self.last_used[i], i))
    for slot in used:
      self.last_used[slot] = step
    for block, slot in zip(misses, free):
      counts[2] += 1
      if self.blocks[slot] >= 0:
        counts[3] += 1
        self.evicted_at[self.blocks[slot]] = step
      counts[4] += step - self.evicted_at.get(block, NEVER) <= self.window
      self.blocks[slot], self.last_used[slot] = block, step
    return counts


@given(seed=st.integers(0, 2**31 - 1))
def test_random_scripts_match_reference_and_never_self_evict(seed):
  rng = np.random.default_rng(seed)
  batch, k, max_blocks, window = 2, 3, 8, 2
  fn = _jitted_resolve(window)
  slot_device_np = np.array([[1, 2, 3], [4, 5, 6]], np.int32)  # num_slots == k: no slack
  slot_device = jnp.asarray(slot_device_np)
  resident_np = np.where(rng.random((batch, max_blocks)) < 0.2,
                         np.arange(7, 7 + max_blocks), 0).astype(np.int32)
  refs = [_ReferenceLRU(k, window) for _ in range(batch)]
  state = HotBufferState.create(batch, k, max_blocks)
  for t in range(12):
    sel = np.stack([np.sort(rng.choice(max_blocks, k, replace=False)) for _ in range(batch)])
    valid = rng.random((batch, k)) < 0.9
    res = fn(jnp.asarray(sel, jnp.int32), jnp.asarray(valid), state, jnp.asarray(resident_np),
             slot_device, jnp.zeros((batch, max_blocks), jnp.int32), t)
    state = res.state
    counts, slot_block, tables = jax.device_get(
        ([getattr(res.counts, f) for f in ("resident_hits", "hot_hits", "misses", "evictions",
                                           "thrash")], state.slot_block, res.block_tables))
    for b in range(batch):
      resident = {i for i in range(max_blocks) if resident_np[b, i]}
      want = refs[b].step(t, sel[b][valid[b]].tolist(), resident)
      assert [int(c[b]) for c in counts] == want, (t, b)
      assert slot_block[b].tolist() == refs[b].blocks
      for j in np.flatnonzero(valid[b]):  # every selected block is where the table says
        block, device_id = sel[b, j], tables[b, j]
        if resident_np[b, block]:
          assert device_id == resident_np[b, block]
        else:
          slot = int(np.flatnonzero(slot_device_np[b] == device_id)[0])
          assert slot_block[b, slot] == block  # not evicted by this step


SPEC_FOR_HOP = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32",
                           block_size=4)


def _pools(spec, rng, num_host_blocks):
  """A device pool and a host pool whose usable blocks hold random data (host written
  through the TransferEngine); returns the pools and the host data."""
  device_pool = KVPool(spec, NUM_DEVICE_BLOCKS, DEVICE)
  host_pool = KVPool(spec, num_host_blocks, PINNED_HOST)
  engine = TransferEngine(device_pool, host_pool)
  shape = (num_host_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
  host_k = rng.standard_normal(shape).astype(np.float32)
  host_v = rng.standard_normal(shape).astype(np.float32)
  chunk = NUM_DEVICE_BLOCKS - 1
  for start in range(1, num_host_blocks, chunk):
    ids = np.arange(start, min(start + chunk, num_host_blocks))
    write_blocks(device_pool, 0, ids - start + 1, host_k[ids], host_v[ids])
    engine.swap_out(ids - start + 1, ids)
  engine.wait()
  return device_pool, host_pool, host_k, host_v


def _load_fn(device_pool, host_pool, one_memory=None):
  return functools.partial(resolver.load_blocks, device_sharding=device_pool.sharding,
                           host_sharding=host_pool.sharding, one_memory=one_memory)


# Both load mechanisms run on CPU: block copies (what CPU uses, one memory) and the
# host gather loop (what GPU uses, forced here).
LOAD_PATHS = pytest.mark.parametrize("one_memory", [True, False],
                                     ids=["block_copies", "host_gather"])


def test_cpu_takes_the_block_copies():
  assert transfer.hop_free(KVPool(SPEC_FOR_HOP, 2, DEVICE).sharding)


@LOAD_PATHS
def test_load_blocks_in_a_jit_is_bit_exact_and_drops_padding(rng, one_memory):
  spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
  device_pool, host_pool, host_k, host_v = _pools(spec, rng, num_host_blocks=24)
  before_k, before_v = (np.asarray(a) for a in read_blocks(device_pool, 0, range(16)))
  load = jax.jit(_load_fn(device_pool, host_pool, one_memory), donate_argnums=(1,))
  host_ids = jnp.array([23, 5, 17, 0, 0], jnp.int32)
  device_ids = jnp.array([3, 9, 14, 16, 99], jnp.int32)  # the last two: padding, dropped
  arrays, moved = load(host_pool.arrays(), device_pool.arrays(), host_ids, device_ids)
  device_pool.set_arrays(arrays)
  # 3 loads: copied one by one, or one trip of the host gather (a 5-entry list: all 5).
  assert int(moved) == (3 if one_memory else 5)
  k, v = (np.asarray(a) for a in read_blocks(device_pool, 0, range(16)))
  for h, d in ((23, 3), (5, 9), (17, 14)):
    np.testing.assert_array_equal(k[d].view(np.uint32), host_k[h].view(np.uint32))
    np.testing.assert_array_equal(v[d].view(np.uint32), host_v[h].view(np.uint32))
  untouched = [i for i in range(16) if i not in (3, 9, 14)]
  np.testing.assert_array_equal(k[untouched], before_k[untouched])
  np.testing.assert_array_equal(v[untouched], before_v[untouched])


def test_a_load_trip_moves_eight_blocks_or_a_shorter_list():
  assert resolver.load_chunk(128) == 8
  assert resolver.load_chunk(5) == 5
  assert resolver.load_chunk(0) == 1


def test_the_host_loads_mode_comes_from_the_env(monkeypatch):
  monkeypatch.delenv(resolver.HOST_LOADS_ENV, raising=False)
  assert resolver.host_loads_mode() == "loop"
  monkeypatch.setenv(resolver.HOST_LOADS_ENV, "fixed")
  assert resolver.host_loads_mode() == "fixed"
  monkeypatch.setenv(resolver.HOST_LOADS_ENV, "switch")
  with pytest.raises(ValueError, match="HISPARSE_JAX_HOST_LOADS must be 'loop' or 'fixed'"):
    resolver.host_loads_mode()


@pytest.mark.parametrize(("one_memory", "mode"), [(True, "loop"), (False, "loop"),
                                                  (False, "fixed")],
                         ids=["block_copies", "host_gather", "host_gather_fixed"])
def test_load_blocks_moves_the_loads_rounded_up_and_nothing_without_one(rng, one_memory,
                                                                        mode, monkeypatch):
  monkeypatch.setenv(resolver.HOST_LOADS_ENV, mode)
  spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
  device_pool, host_pool, host_k, host_v = _pools(spec, rng, num_host_blocks=40)
  load = jax.jit(_load_fn(device_pool, host_pool, one_memory), donate_argnums=(1,))
  num_device = device_pool.num_blocks
  # (the host gather: 8-block trips, as many as the loads need; "fixed": all 40 entries)
  for num_loads, want_trips in ((0, 0), (1, 8), (8, 8), (9, 16), (20, 24), (33, 40)):
    want_moved = num_loads if one_memory else want_trips if mode == "loop" else 40
    host_ids = np.zeros(40, np.int32)
    device_ids = np.full(40, num_device, np.int32)  # out of range: no load
    # Loads scattered among the entries (as a resolver's rows leave them).
    where = np.random.default_rng(num_loads).choice(40, num_loads, replace=False)
    host_ids[where] = 1 + np.arange(num_loads)
    device_ids[where] = 1 + np.arange(num_loads) % (num_device - 1)
    before = np.asarray(read_blocks(device_pool, 0, range(num_device))[0])
    arrays, moved = load(host_pool.arrays(), device_pool.arrays(), jnp.asarray(host_ids),
                         jnp.asarray(device_ids))
    device_pool.set_arrays(arrays)
    assert int(moved) == want_moved, num_loads
    k = np.asarray(read_blocks(device_pool, 0, range(num_device))[0])
    for h, d in zip(host_ids[where], device_ids[where]):
      if list(device_ids[where]).count(d) == 1:
        np.testing.assert_array_equal(k[d], host_k[h])
    if num_loads == 0:
      np.testing.assert_array_equal(k, before)


def _attend_selected(q, keys, values):
  """numpy attention of q [num_q_heads, d] over keys/values [tokens, num_kv_heads, d]."""
  group = q.shape[0] // keys.shape[1]
  out = np.zeros_like(q, dtype=np.float64)
  for h in range(q.shape[0]):
    s = keys[:, h // group] @ q[h] / np.sqrt(q.shape[1])
    p = np.exp(s - s.max())
    out[h] = (p / p.sum()) @ values[:, h // group]
  return out


def test_select_resolve_load_attend_in_one_jit_matches_host_tokens(rng):
  bs, num_kv_heads, head_dim, num_q_heads, max_blocks = 4, 2, 8, 4, 8
  spec = KVCacheSpec(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype="float32", block_size=bs)
  device_pool, host_pool, host_k, host_v = _pools(spec, rng, num_host_blocks=17)
  kv_lens = np.array([30, 21], np.int32)  # 8 and 6 blocks
  host_ids = 1 + np.arange(2)[:, None] * max_blocks + np.arange(max_blocks)[None]
  # Resident device copies: the sinks, the newest blocks and seq 0's block 3.
  resident = np.zeros((2, max_blocks), np.int32)
  resident[0, [0, 7, 3]] = [1, 2, 5]
  resident[1, [0, 5]] = [3, 4]
  rows, cols = np.nonzero(resident)
  write_blocks(device_pool, 0, resident[rows, cols], host_k[host_ids[rows, cols]],
                           host_v[host_ids[rows, cols]])
  slot_device = jnp.array([[6, 7, 8, 9], [10, 11, 12, 13]], jnp.int32)
  noise = rng.standard_normal((8, bs, num_kv_heads, head_dim)).astype(np.float32) * 50
  write_blocks(device_pool, 0, range(6, 14), noise, noise)  # stale slots: must be loaded
  keys = host_k[host_ids]  # [batch, max_blocks, bs, kv heads, d]
  valid_tok = (np.arange(max_blocks * bs) < kv_lens[:, None]).reshape(2, max_blocks, bs)
  bounds = np.stack([np.where(valid_tok[..., None, None], keys, np.inf).min(2),
                     np.where(valid_tok[..., None, None], keys, -np.inf).max(2)], axis=2)
  blocks = HiSparseConfig(top_k_tokens=16, hot_buffer_tokens=16, sink_tokens=4,
                          local_tokens=4).blocks(bs)

  def step(q, state, step_id, host_arrays, device_arrays):
    sel = indexer.select(q, jnp.asarray(bounds), jnp.asarray(kv_lens), blocks, "shared")
    res = resolver.resolve(sel.logical_ids, sel.valid, state, jnp.asarray(resident),
                           slot_device, jnp.asarray(host_ids, jnp.int32), step_id,
                           num_device_blocks=NUM_DEVICE_BLOCKS, thrash_window_steps=2)
    device_arrays, _ = _load_fn(device_pool, host_pool)(
        host_arrays, device_arrays, res.load_host_ids, res.load_device_ids)
    out = kernels_pallas.paged_attention_reference(q, *device_arrays, res.block_tables,
                                                   sel.kv_lens)
    return out, sel, res, device_arrays

  step = jax.jit(step, donate_argnums=(4,))
  state = HotBufferState.create(2, blocks.hot_buffer_blocks, max_blocks)
  q0 = rng.standard_normal((2, num_q_heads, head_dim))
  totals = np.zeros(5, int)
  for t in range(6):
    q = (q0 + 0.5 * rng.standard_normal(q0.shape)).astype(np.float32)
    out, sel, res, arrays = step(jnp.asarray(q), state, t, host_pool.arrays(),
                                 device_pool.arrays())
    device_pool.set_arrays(arrays)
    state = res.state
    counts = np.array([np.asarray(getattr(res.counts, f)) for f in (
        "resident_hits", "hot_hits", "misses", "evictions", "thrash")])  # [5, batch]
    np.testing.assert_array_equal(counts[:3].sum(0), sel.num_selected)
    totals += counts.sum(1)
    for b in range(2):
      ids = np.asarray(sel.logical_ids[b, :int(sel.num_selected[b])])
      assert ids[0] == 0 and ids[-1] == -(-kv_lens[b] // bs) - 1  # sink and newest
      toks = (ids[:, None] * bs + np.arange(bs)).reshape(-1)
      toks = toks[toks < kv_lens[b]]
      flat_k = keys[b].reshape(-1, num_kv_heads, head_dim)
      flat_v = host_v[host_ids[b]].reshape(-1, num_kv_heads, head_dim)
      np.testing.assert_allclose(out[b], _attend_selected(q[b], flat_k[toks], flat_v[toks]),
                                 rtol=1e-5, atol=1e-5)
  # The script went through every path: resident blocks, hot hits, host loads, evictions.
  assert totals[0] > 0 and totals[1] > 0 and totals[2] > 0 and totals[3] > 0, totals

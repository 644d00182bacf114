"""The zero-copy block copy (kernels_pallas/block_copy.py) against its jnp reference, in
interpret mode on this CPU, and lowered for cuda to one Triton call per array pair with
the destination aliased. (That XLA's GPU compiler leaves a pinned_host operand in host
memory with no copy is tests/hisparse_jax/engine/test_aot_h200.py's; its speed on a GPU is
`make gpu-bench`'s transfer part.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas.block_copy import chunk_elements, copy_blocks, copy_blocks_reference


def _pools(rng, src_blocks, dst_blocks, trailing, dtype):
  def one(n):
    if jnp.issubdtype(dtype, jnp.integer):
      return jnp.asarray(rng.integers(-128, 128, (n, *trailing)), dtype)
    return jnp.asarray(rng.standard_normal((n, *trailing)), dtype)
  return one(src_blocks), one(dst_blocks)


@pytest.mark.parametrize(("trailing", "dtype", "max_chunk"), [
    ((4, 2, 32), jnp.bfloat16, 4096),   # a KV block: [block_size, kv_heads, head_dim]
    ((4, 2, 32), jnp.int8, 64),          # 8-bit values, several chunks per block
    ((4, 2), jnp.float32, 4096),         # their per-token scales
    ((3, 5), jnp.float32, 4),            # 15 elements: chunk 1, every element a program
])
def test_the_listed_blocks_move_bit_for_bit_and_nothing_else(trailing, dtype, max_chunk):
  rng = np.random.default_rng(0)
  src, dst = _pools(rng, 12, 9, trailing, dtype)
  # Distinct destinations; -1 and 9 (past the end) are a bucketed list's padding.
  src_ids = jnp.asarray([3, 0, 11, 5, 7, 2], jnp.int32)
  dst_ids = jnp.asarray([8, 1, -1, 4, 9, 0], jnp.int32)
  (got,) = jax.jit(lambda s, d: copy_blocks((s,), (d,), src_ids, dst_ids,
                                            max_chunk=max_chunk))(src, dst)
  (want,) = copy_blocks_reference((src,), (dst,), src_ids, dst_ids)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
  expected = np.asarray(dst).copy()
  for s, d in ((3, 8), (0, 1), (5, 4), (2, 0)):
    expected[d] = np.asarray(src)[s]
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8), expected.view(np.uint8))


def test_several_array_pairs_share_one_id_list_and_an_empty_list_changes_nothing():
  rng = np.random.default_rng(1)
  (vs, vd), (ss, sd) = _pools(rng, 6, 6, (4, 32), jnp.int8), _pools(rng, 6, 6, (4,), jnp.float32)
  ids = jnp.asarray([5, 2], jnp.int32), jnp.asarray([0, 3], jnp.int32)
  got = copy_blocks((vs, ss), (vd, sd), *ids)
  for g, w in zip(got, copy_blocks_reference((vs, ss), (vd, sd), *ids), strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  empty = jnp.zeros((0,), jnp.int32)
  (same,) = copy_blocks((vs,), (vd,), empty, empty)
  np.testing.assert_array_equal(np.asarray(same), np.asarray(vd))


def test_chunks_are_the_largest_power_of_two_dividing_a_block():
  assert chunk_elements(4 * 2 * 32) == 256
  assert chunk_elements(16 * 8 * 128) == 4096   # capped at MAX_CHUNK
  assert chunk_elements(15) == 1 and chunk_elements(96, max_chunk=64) == 32
  with pytest.raises(ValueError, match="at least one element"):
    chunk_elements(0)


def test_mismatched_pairs_and_id_lists_are_refused():
  a, b = jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((4, 8), jnp.float32)
  ids = jnp.asarray([0], jnp.int32)
  with pytest.raises(ValueError, match="must pair up"):
    copy_blocks((a,), (a, a), ids, ids)
  with pytest.raises(ValueError, match=r"same on both sides, got bfloat16\[8\] and float32\[8\]"):
    copy_blocks((a,), (b,), ids, ids)
  with pytest.raises(ValueError, match="1-D of one length"):
    copy_blocks((a,), (a,), ids, jnp.asarray([0, 1], jnp.int32))


def test_it_lowers_for_cuda_to_one_triton_call_per_pair_writing_the_destination_in_place():
  s = jax.ShapeDtypeStruct
  args = ((s((64, 16, 2, 64), jnp.bfloat16), s((64, 16, 2), jnp.float32)),
          (s((32, 16, 2, 64), jnp.bfloat16), s((32, 16, 2), jnp.float32)),
          s((8,), jnp.int32), s((8,), jnp.int32))
  with kernels_pallas.backend.abstract_gpu():
    lowered = jax.jit(copy_blocks, donate_argnums=1).trace(*args).lower(
        lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert re.findall(r"custom_call @([\w$.]+)\(", text) == ["__gpu$xla.gpu.triton"] * 2
  assert len(re.findall(r'\bname = "block_copy"', text)) == 2
  assert text.count("output_operand_aliases") == 2  # the destination, updated in place

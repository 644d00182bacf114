"""The Mosaic GPU ragged kernel: run on CPU by jax's GPU interpreter against
ragged_paged_attention_reference (mixed prefill chunks and decode rows), and lowered for
cuda at the gpu-bench's full sizes (see test_mgpu_paged_attention for both set-ups). What
only a Hopper GPU can check: the PTX compile, the numbers there and the speed."""

from __future__ import annotations

import functools
import importlib.util
import types

import chex
import jax
import jax.numpy as jnp
import kernels_testlib as lib
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from test_mgpu_paged_attention import MGPU_CALL, TRITON_CALL, custom_calls, lower_for_cuda

from kernels_pallas.quant import QuantizedPages, quantize
from kernels_pallas.ragged_paged_attention import ragged_paged_attention_reference
from kernels_pallas.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu

NUM_BLOCKS = 64
S = jax.ShapeDtypeStruct
I32 = jnp.int32


def _seqs(block_size):
  """(q_len, kv_len): decode rows, a whole prefill, chunked prefills over 2+ tiles and 3+
  steps of 64 keys, an empty query."""
  bs = block_size
  return [(1, 1), (20, 20), (1, 4 * bs + 6), (3, bs + 1), (0, 5), (40, 150), (1, 150)]


def _case(rng, group, block_size, head_dim, dtype, seqs, pad_rows=2, num_kv_heads=2):
  q_lens, kv_lens = zip(*seqs)
  pool = lib.make_pool(rng, NUM_BLOCKS, block_size, num_kv_heads, head_dim, dtype)
  max_blocks = -(-max(kv_lens) // block_size) + 1
  tables = lib.make_tables(rng, kv_lens, block_size, max_blocks, NUM_BLOCKS)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = jnp.asarray(rng.standard_normal((cu[-1] + pad_rows, group * num_kv_heads, head_dim)),
                  dtype)
  return (q, pool.k_pages, pool.v_pages, jnp.asarray(tables), jnp.asarray(kv_lens, I32),
          jnp.asarray(cu)), cu


# (group, block_size, head_dim, dtype, tokens_per_step, attention kwargs): GQA 1 to 16 (64
# to 4 tokens per tile; 6: 10 tokens, 60 rows), head_dim 64/128, window and soft cap.
INTERPRET_GRID = (
    (4, 16, 64, jnp.bfloat16, 64, {}),
    (1, 8, 128, jnp.bfloat16, 64, {"sliding_window": 37}),
    (8, 32, 64, jnp.float16, 128, {"soft_cap": 5.0, "sm_scale": 0.2}),
    (6, 16, 64, jnp.bfloat16, 64, {"sliding_window": 70, "soft_cap": 3.0}),
    (16, 16, 128, jnp.bfloat16, 64, {}),
)


@pytest.mark.parametrize(("group", "block_size", "head_dim", "dtype", "tokens_per_step",
                          "attn_kw"), INTERPRET_GRID)
def test_interpreted_kernel_matches_reference(gpu_interpreter, rng, group, block_size,
                                              head_dim, dtype, tokens_per_step, attn_kw):
  args, cu = _case(rng, group, block_size, head_dim, dtype, _seqs(block_size))
  out = ragged_paged_attention_mgpu(*args, interpret=gpu_interpreter,
                                    tokens_per_step=tokens_per_step, **attn_kw)
  ref = ragged_paged_attention_reference(*args, **attn_kw)
  chex.assert_shape(out, args[0].shape)
  assert out.dtype == args[0].dtype
  assert lib.max_abs_err(out.astype(jnp.float32), ref.astype(jnp.float32)) <= 2e-2
  np.testing.assert_array_equal(np.asarray(out[cu[-1]:], np.float32), 0.0)  # padding rows
  assert not gpu_callbacks.get_races().races_found


def test_interpreted_prefill_equals_causal_softmax(gpu_interpreter, rng):
  """One chunk of 24 tokens at the end of 90 (independent numpy, causal mask)."""
  args, _ = _case(rng, 4, 16, 64, jnp.bfloat16, [(24, 90)], pad_rows=0, num_kv_heads=1)
  q, k_pages, v_pages, tables, *_ = args
  out = ragged_paged_attention_mgpu(*args, interpret=gpu_interpreter)
  k = lib.gather_tokens(np.asarray(k_pages, np.float32), np.asarray(tables)[0], 90)
  v = lib.gather_tokens(np.asarray(v_pages, np.float32), np.asarray(tables)[0], 90)
  qn = np.asarray(q, np.float32)
  for h in range(4):
    want = lib.naive_attention(qn[:, h:h + 1], k, v, mask=lib.causal_mask(24, 90))
    assert lib.max_abs_err(out[:, h:h + 1].astype(jnp.float32), want) <= 2e-2, h


def test_refuses_what_wgmma_and_tma_cannot_take(rng):
  args, _ = _case(rng, 4, 8, 64, jnp.bfloat16, [(2, 5), (1, 9)])
  q, k, v, tables, kv_lens, cu = args
  with pytest.raises(ValueError, match="bfloat16 or float16 KV, got float32"):
    ragged_paged_attention_mgpu(*(x.astype(jnp.float32) for x in (q, k, v)), tables,
                                kv_lens, cu)
  with pytest.raises(ValueError, match="head_dim a multiple of 32, got 48"):
    ragged_paged_attention_mgpu(q[..., :48], k[..., :48], v[..., :48], tables, kv_lens, cu)
  with pytest.raises(ValueError, match="exceed the WGMMA row tile 64"):
    ragged_paged_attention_mgpu(jnp.zeros((3, 130, 64), jnp.bfloat16), k, v, tables,
                                kv_lens, cu)
  with pytest.raises(ValueError, match="tokens_per_step must be a multiple of 64"):
    ragged_paged_attention_mgpu(*args, tokens_per_step=96)
  with pytest.raises(ValueError, match="InterpretGPUParams"):
    ragged_paged_attention_mgpu(*args, interpret=True)
  with pytest.raises(ValueError, match=r"\(3,\)"):  # the Triton kernel's shape checks
    ragged_paged_attention_mgpu(q, k, v, tables, kv_lens, cu[:2])
  with pytest.raises(ValueError, match="sliding_window"):
    ragged_paged_attention_mgpu(*args, sliding_window=0)
  pages = QuantizedPages(*quantize(k.astype(jnp.float32), "int8"), dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="got 8-bit pages"):
    ragged_paged_attention_mgpu(q, pages, pages, tables, kv_lens, cu)


def _bench_args(head_dim=128, group=4, block_size=16):
  """The gpu-bench "ragged" case at full size: chunks of 1,024 at 4,096 and 8,192, 30
  decode rows at 8,192; 8 KV heads."""
  q_lens = (1024, 1024) + (1,) * 30
  num_kv_heads = 8
  per_row = 8192 // block_size
  pages = S((len(q_lens) * per_row + 1, block_size, num_kv_heads, head_dim), jnp.bfloat16)
  return (S((sum(q_lens), group * num_kv_heads, head_dim), jnp.bfloat16), pages, pages,
          S((len(q_lens), per_row), I32), S((len(q_lens),), I32), S((len(q_lens) + 1,), I32))


@pytest.mark.parametrize(("kw", "head_dim"), [({}, 128), ({"sliding_window": 4096,
                                                          "soft_cap": 30.0}, 64),
                                              ({"tokens_per_step": 128}, 128)])
def test_bench_size_lowers_for_cuda_to_one_mosaic_gpu_call(kw, head_dim):
  text = lower_for_cuda(functools.partial(ragged_paged_attention_mgpu, **kw),
                        *_bench_args(head_dim))
  assert custom_calls(text) == {MGPU_CALL}
  assert text.count(f"custom_call @{MGPU_CALL}(") == 1
  assert TRITON_CALL not in text


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
                    reason="XLA's GPU compiler is not installed (jax[cuda13])")
def test_bench_size_compiles_for_an_h200_without_a_gpu():
  """The bench's mixed step through XLA's GPU compiler for sm_90a (the H200 target's
  compile-only client, as hisparse-jax compile does): the Mosaic GPU module included."""
  from hisparse_jax.engine import aot_compile  # noqa: PLC0415
  from hisparse_jax.engine.gpu_target import load_target  # noqa: PLC0415

  target = load_target("h200")
  assert target.sm == "sm_90"
  with target.kernel_context():
    lowered = jax.jit(ragged_paged_attention_mgpu).trace(*_bench_args()).lower(
        lowering_platforms=("cuda",))
  build = types.SimpleNamespace(target_devices=target.topology(1).devices)
  executable = aot_compile._compile_for_target(build, lowered)
  text = "\n".join(m.to_string() for m in executable.hlo_modules())
  assert "mosaic_gpu" in text

"""The matmul over packed weights (kernels_pallas/packed.py, cpu_matmul.cc): float64 numpy
products to float32 rounding for every row-block remainder (1-7 rows past the blocks of
8), tiles cut by N, leading dims and empty inputs; each output is the same whatever else
is in the batch (row-invariant); the einsum fallback agrees; and the model's `Linear`
and `compute_logits` take a packed kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import cpu_kernels, packed

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="the C++ CPU kernels are not built (no C++ compiler)")


def _rel_err(got, want):
  err = np.abs(np.asarray(got, np.float64) - want)
  return float(err.max(initial=0.0) / (np.abs(want).max(initial=0.0) + 1e-30))


@needs_kernels
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 7, 5), (8, 64, 48), (13, 100, 50),
                                   (29, 576, 192), (300, 33, 97), (0, 16, 48)])
def test_matches_numpy(rng, m, k, n):
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  want = x.astype(np.float64) @ w.astype(np.float64)
  pw = packed.pack(w)
  assert pw.shape == (k, n) and pw.panels.shape == (-(-n // packed.TILE), k, packed.TILE)
  np.testing.assert_array_equal(np.asarray(pw.unpack()), w)
  got = jax.jit(packed.matmul)(jnp.asarray(x), pw)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  if m:
    assert _rel_err(got, want) < 1e-5
    fallback = packed._einsum(jnp.asarray(x), pw.panels, n)
    assert _rel_err(fallback, want) < 1e-5


@needs_kernels
def test_rows_do_not_depend_on_the_batch(rng):
  """A row's output is bit-equal whether it is computed alone or among 1,000 rows (the
  register blocks of 8, 4, 2, 1 rows and the row chunks of a task all sum in k order)."""
  w = packed.pack_array(jnp.asarray(rng.standard_normal((96, 200)), jnp.float32))
  x = jnp.asarray(rng.standard_normal((1000, 96)), jnp.float32)
  f = jax.jit(packed.matmul)
  full = np.asarray(f(x, w))
  for lo, hi in ((0, 1), (5, 12), (997, 1000), (250, 520)):
    np.testing.assert_array_equal(np.asarray(f(x[lo:hi], w)), full[lo:hi])


@needs_kernels
def test_x_at_packed_weight_keeps_leading_dims(rng):
  w = rng.standard_normal((32, 70)).astype(np.float32)
  pw = packed.pack(w)
  x = rng.standard_normal((2, 3, 32)).astype(np.float32)
  got = jax.jit(lambda x, pw: x @ pw)(jnp.asarray(x), pw)
  assert got.shape == (2, 3, 70)
  assert _rel_err(got, x.astype(np.float64) @ w) < 1e-5
  assert pw[...] is pw
  with pytest.raises(ValueError, match="x has 31 features, the weight 32"):
    packed.matmul(jnp.zeros((1, 31)), pw)


def test_model_takes_packed_kernels(rng):
  """Linear and compute_logits (untied: the packed lm_head; tied: a packed head given)
  equal the unpacked model's to float32 rounding."""
  from flax import nnx  # noqa: PLC0415

  from models.config import ModelConfig  # noqa: PLC0415
  from models.llama import Linear, LlamaForCausalLM  # noqa: PLC0415

  for tied in (False, True):
    config = ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config, seed=1)
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    for _, node in nnx.iter_graph(copy):
      if isinstance(node, Linear):
        node.kernel.set_value(packed.pack_array(node.kernel[...]))
    head = packed.pack_array(copy.embed_tokens[...].T) if tied else None
    ids = jnp.asarray(rng.integers(0, 97, (2, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), ids.shape)
    want = np.asarray(model(ids, pos)[0])
    hidden, _ = jax.jit(lambda m, i, p: m.hidden_states(i, p))(copy, ids, pos)
    got = np.asarray(copy.compute_logits(hidden, head))
    assert np.abs(got - want).max() < 1e-4, tied

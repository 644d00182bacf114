"""The dense reference attention against a naive numpy loop, and the AttnFn contract."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_testlib import forward

from models.attention import DenseAttentionMetadata, dense_causal_attention
from models.config import ModelConfig
from models.llama import LlamaForCausalLM


def _naive(q, k, v, qpos, kpos, window, key_mask):
  b, s, hq, d = q.shape
  group = hq // k.shape[2]
  out = np.zeros_like(q)
  for bi in range(b):
    for i in range(s):
      for h in range(hq):
        ok = [j for j in range(k.shape[1]) if kpos[bi, j] <= qpos[bi, i]
              and (window is None or qpos[bi, i] - kpos[bi, j] < window)
              and (key_mask is None or key_mask[bi, j])]
        sc = np.array([q[bi, i, h] @ k[bi, j, h // group] for j in ok]) / np.sqrt(d)
        w = np.exp(sc - sc.max())
        w /= w.sum()
        out[bi, i, h] = sum(wj * v[bi, j, h // group] for wj, j in zip(w, ok))
  return out


class DenseAttentionTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_naive_with_gqa_window_and_padding(self):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 9, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 9, 2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 9, 2, 8)).astype(np.float32)
    pos = np.stack([np.arange(9), np.r_[0, 0, np.arange(7)]]).astype(np.int32)
    key_mask = np.ones((2, 9), bool)
    key_mask[1, :2] = False  # left padding of the second row
    for window in (None, 3):
      fn = self.variant(lambda q, k, v, p, m, w=window: dense_causal_attention(
          q, k, v, q_positions=p, k_positions=p, sliding_window=w, key_mask=m))
      out = np.asarray(fn(q, k, v, pos, key_mask))
      chex.assert_shape(out, (2, 9, 4, 8))
      ref = _naive(q, k, v, pos, pos, window, key_mask)
      np.testing.assert_allclose(out[0], ref[0], atol=1e-5)
      np.testing.assert_allclose(out[1, 2:], ref[1, 2:], atol=1e-5)


def test_bad_shapes_are_refused():
  q = jnp.zeros((1, 4, 3, 8))
  k = jnp.zeros((1, 4, 2, 8))
  p = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="bad attention shapes"):
    dense_causal_attention(q, k, k, q_positions=p, k_positions=p)


def _tiny_model():
  config = ModelConfig(model_type="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8)
  return LlamaForCausalLM(config), config


def test_attn_fn_contract_and_cache_threading():
  """attn_fn sees RoPE'd q/k with the documented shapes, once per layer, and whatever it
  returns as a layer's cache comes back in kv_caches; outputs equal the reference's."""
  model, config = _tiny_model()
  ids = jnp.asarray([[3, 9, 4, 1, 7]], jnp.int32)
  positions = jnp.arange(5, dtype=jnp.int32)[None]
  calls = []

  def attn_fn(q, k, v, *, layer_idx, kv_cache, metadata, config):
    chex.assert_shape(q, (1, 5, 4, 8))
    chex.assert_shape([k, v], (1, 5, 2, 8))
    calls.append(layer_idx)
    out = dense_causal_attention(q, k, v, q_positions=metadata, k_positions=metadata)
    return out, kv_cache + 10 * (layer_idx + 1)

  @jax.jit
  def run(model, ids, positions, caches):
    return model(ids, positions, attn_fn=attn_fn, kv_caches=caches, attn_metadata=positions)

  logits, caches = run(model, ids, positions, [jnp.int32(1), jnp.int32(2), jnp.int32(3)])
  assert calls == [0, 1, 2]
  assert [int(c) for c in caches] == [11, 22, 33]
  chex.assert_trees_all_close(logits, forward(model, ids, positions), atol=1e-6)


def test_batch_rows_are_independent_and_padding_is_masked():
  """A left-padded row with a key mask gives the unpadded row's logits at real tokens."""
  model, _ = _tiny_model()
  ids = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
  alone = forward(model, ids, jnp.arange(4, dtype=jnp.int32)[None])
  padded_ids = jnp.asarray([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]], jnp.int32)
  positions = jnp.asarray([[0, 0, 0, 1, 2, 3], list(range(6))], jnp.int32)
  mask = jnp.asarray([[False, False, True, True, True, True], [True] * 6])
  padded = forward(model, padded_ids, positions,
                   DenseAttentionMetadata(positions=positions, key_mask=mask))
  chex.assert_trees_all_close(padded[0, 2:], alone[0], atol=1e-5)
  mask_only = forward(model, padded_ids, positions, mask)
  chex.assert_trees_all_close(mask_only, padded, atol=0)
  full_row = forward(model, padded_ids[1:], positions[1:])
  chex.assert_trees_all_close(padded[1], full_row[0], atol=1e-5)


def test_hidden_states_and_chosen_positions():
  model, config = _tiny_model()
  ids = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
  pos = jnp.arange(4, dtype=jnp.int32)[None]
  hidden, _ = jax.jit(lambda m, i, p: m.hidden_states(i, p))(model, ids, pos)
  chex.assert_shape(hidden, (1, 4, config.hidden_size))
  logits = forward(model, ids, pos)
  assert logits.dtype == jnp.float32
  chex.assert_trees_all_close(model.compute_logits(hidden[:, -1]), logits[:, -1], atol=1e-5)

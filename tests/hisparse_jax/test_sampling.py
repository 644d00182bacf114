import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.sampling import SamplingParams, greedy, request_key, sample


def _keys(seeds, step=0):
  return jnp.stack([request_key(s, step) for s in seeds])


def _run(logits, temperature, top_p=1.0, top_k=0, seeds=None):
  b = logits.shape[0]
  seeds = seeds if seeds is not None else list(range(b))
  return np.asarray(sample(jnp.asarray(logits, jnp.float32),
                           jnp.full((b,), temperature, jnp.float32),
                           jnp.full((b,), top_p, jnp.float32),
                           jnp.full((b,), top_k, jnp.int32), _keys(seeds)))


def test_greedy_is_argmax(rng):
  logits = rng.normal(size=(5, 33))
  np.testing.assert_array_equal(_run(logits, 0.0), logits.argmax(-1))


def test_greedy_picks_the_first_largest_like_argmax(rng):


  logits = rng.normal(size=(6, 1031)).astype(np.float32)
  logits[1, [3, 700]] = 50.0  # ties: the first index
  logits[2, :] = 1.0
  logits[3, 9] = np.inf
  logits[4, [5, 8]] = np.nan  # argmax takes the first NaN
  np.testing.assert_array_equal(greedy(jnp.asarray(logits)), jnp.argmax(logits, axis=-1))


def test_top_k_one_is_greedy_at_any_temperature(rng):
  logits = rng.normal(size=(6, 40))
  np.testing.assert_array_equal(_run(logits, 5.0, top_k=1), logits.argmax(-1))


def test_top_p_keeps_only_the_nucleus():
  # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two tokens only.
  logits = np.log(np.array([[0.5, 0.3, 0.2]] * 400))
  drawn = _run(logits, 1.0, top_p=0.6, seeds=list(range(400)))
  assert set(drawn.tolist()) == {0, 1}
  # and the kept mass is renormalised: token 0 about 5/8 of the time.
  assert abs((drawn == 0).mean() - 0.625) < 0.08


def test_temperature_sampling_matches_distribution():
  p = np.array([0.1, 0.2, 0.7])
  drawn = _run(np.log(np.tile(p, (2000, 1))), 1.0, seeds=list(range(2000)))
  freq = np.bincount(drawn, minlength=3) / len(drawn)
  np.testing.assert_allclose(freq, p, atol=0.03)


def test_seeded_draws_are_reproducible_and_batch_independent(rng):
  logits = rng.normal(size=(4, 50)) * 3
  a = _run(logits, 1.0, seeds=[7, 8, 9, 10])
  b = _run(logits[2:3], 1.0, seeds=[9])
  assert a[2] == b[0]
  np.testing.assert_array_equal(a, _run(logits, 1.0, seeds=[7, 8, 9, 10]))


def test_mixed_rows_in_one_batch(rng):
  logits = rng.normal(size=(2, 20))
  out = np.asarray(sample(jnp.asarray(logits, jnp.float32), jnp.array([0.0, 1.0]),
                          jnp.array([1.0, 1.0]), jnp.array([0, 1], jnp.int32), _keys([1, 2])))
  chex.assert_shape(out, (2,))
  np.testing.assert_array_equal(out, logits.argmax(-1))


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", dict(temperature=-0.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("max_tokens", dict(max_tokens=0)),
])
def test_bad_params_name_the_field(field, kwargs):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**kwargs)


def test_params_normalise_stop_ids():
  sp = SamplingParams(stop_token_ids=[np.int64(3), 4])
  assert sp.stop_token_ids == (3, 4) and sp.greedy
  assert isinstance(jax.random.key_data(request_key(1, 2)), jax.Array)

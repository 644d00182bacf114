import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.engine.sampling import (
    SamplingParams,
    apply_penalties,
    greedy,
    mask_tokens,
    request_key,
    sample,
    token_logprobs,
)


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
    ("^n must be at least 1, got 0$", dict(n=0)),
    ("^prompt_logprobs must be >= 0 or None, got -1$", dict(prompt_logprobs=-1)),
])
def test_bad_params_name_the_field(field, kwargs):
  with pytest.raises(ValueError, match=field):
    SamplingParams(**kwargs)


def test_params_normalise_stop_ids():
  sp = SamplingParams(temperature=0.0, stop_token_ids=[np.int64(3), 4])
  assert sp.stop_token_ids == (3, 4) and sp.greedy
  assert isinstance(jax.random.key_data(request_key(1, 2)), jax.Array)


def _penalized_reference(logits, prompt, output, presence, frequency, repetition):
  """numpy: vLLM's apply_penalties for one row."""
  logits = logits.astype(np.float32).copy()
  counts = np.bincount(output, minlength=logits.shape[0]).astype(np.float32)
  seen = counts > 0
  in_prompt = np.zeros(logits.shape[0], bool)
  in_prompt[prompt] = True
  penalty = np.where(in_prompt | seen, np.float32(repetition), np.float32(1.0))
  logits *= np.where(logits > 0, np.float32(1.0) / penalty, penalty)
  return logits - np.float32(frequency) * counts - np.float32(presence) * seen


def test_penalties_match_vllms_formula(rng):
  vocab = 50
  logits = rng.normal(size=(3, vocab)).astype(np.float32) * 3
  prompts = [[1, 2, 2, 40], [7], [3, 4]]
  outputs = [[2, 5, 5, 5, 9], [], [4, 4, 49]]
  params = [(0.5, 0.25, 1.3), (1.0, 1.0, 0.7), (-0.5, 2.0, 1.0)]
  pad = lambda rows, n: np.array([r + [vocab + 3] * (n - len(r)) for r in rows], np.int32)
  got = apply_penalties(jnp.asarray(logits), jnp.asarray(pad(prompts, 4)),
                        jnp.asarray(pad(outputs, 6)), *(jnp.asarray(np.array(x, np.float32))
                                                        for x in zip(*params)))
  for i in range(3):
    want = _penalized_reference(logits[i], prompts[i], outputs[i], *params[i])
    np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-6, atol=1e-6)


def test_mask_tokens_only_on_active_rows(rng):
  logits = rng.normal(size=(2, 10)).astype(np.float32)
  ids = jnp.array([[2, 7, 10], [2, 7, 10]], jnp.int32)  # 10: padding, out of range
  out = np.asarray(mask_tokens(jnp.asarray(logits), ids, jnp.array([True, False])))
  assert np.isneginf(out[0, [2, 7]]).all() and np.isfinite(np.delete(out[0], [2, 7])).all()
  np.testing.assert_array_equal(out[1], logits[1])


def test_token_logprobs_are_log_softmax_with_ranks(rng):
  logits = rng.normal(size=(3, 30)).astype(np.float32)
  tokens = np.array([4, int(logits[1].argmax()), 29], np.int32)
  sampled, rank, top_ids, top_lp = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), 3)
  lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(sampled), lp[np.arange(3), tokens], atol=1e-5)
  np.testing.assert_array_equal(np.asarray(rank), (lp > lp[np.arange(3), tokens][:, None])
                                .sum(-1) + 1)
  assert int(rank[1]) == 1
  np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-lp, axis=-1)[:, :3])
  np.testing.assert_allclose(np.asarray(top_lp), np.sort(lp, axis=-1)[:, ::-1][:, :3],
                             atol=1e-5)


def test_min_p_drops_unlikely_tokens():
  # probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps tokens >= 0.125 (the first three)
  logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 600))
  drawn = np.asarray(sample(jnp.asarray(logits, jnp.float32), jnp.ones(600),
                            jnp.ones(600), jnp.zeros(600, jnp.int32),
                            _keys(list(range(600))), jnp.full(600, 0.25)))
  assert set(drawn.tolist()) == {0, 1, 2}
  np.testing.assert_allclose(np.bincount(drawn, minlength=3)[:3] / 600,
                             np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.06)


@pytest.mark.parametrize("kwargs,message", [
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
    (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens must be <= max_tokens=4, got 5"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
    (dict(logprobs=-1), "logprobs must be >= 0 or None, got -1"),
])
def test_new_fields_are_validated_by_name(kwargs, message):
  with pytest.raises(ValueError) as e:
    SamplingParams(**kwargs)
  assert str(e.value) == message

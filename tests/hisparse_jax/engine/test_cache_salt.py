"""vLLM's `cache_salt` (#53): a request's salt enters its first block's hash and its
first tier key, so equal prompts under different salts (or one salted, one not) share no
cached KV in any tier (prefix cache, disk, remote), equal salts share as before, and the
greedy tokens never change. Unsalted hashes and keys are pinned to their values before
salts existed (existing caches stay valid)."""

from __future__ import annotations

import pytest
from engine_fixtures import (
  BLOCK_SIZE,
  SIX_PROMPTS,
  assert_all_blocks_free,
  make_engine,
  random_prompts,
  run,
)

from hisparse_jax.engine.sampling import SamplingParams
from hisparse_jax.kv_cache import kv_hash
from hisparse_jax.kv_cache.tiers.keys import Namespace, chain_keys
from hisparse_jax.kv_cache.tiers.testing import RedisServer, RedisUnavailable

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
# 2 full blocks of 8, both hits when cached; 3 blocks with its outputs, so the prompt's
# cached blocks under three salts and a running request fit the 12-block device pool.
(PROMPT,) = random_prompts((20,), seed=53)
HIT = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is always computed


def _generate(engine, prompt=PROMPT, salt=None, params=GREEDY):
  rid = engine.add_request(prompt_token_ids=prompt, sampling_params=params, cache_salt=salt)
  return run(engine)[rid]


# --- hashes and keys ---------------------------------------------------------------


def test_unsalted_hashes_and_keys_are_unchanged():
  # Values of kv_hash.hash_full_blocks and tiers.keys.chain_keys before cache_salt.
  tokens = list(range(20))
  assert [hex(h) for h in kv_hash.hash_full_blocks(tokens, 8)] == [
      "0xeafb548c5c538b54ca7220242c5d2492", "0xa71b2cea93f32dbb99f457bfaa32379b"]
  assert kv_hash.hash_full_blocks(tokens, 8, cache_salt=None) == kv_hash.hash_full_blocks(
      tokens, 8)
  ns = Namespace("m", "float32", 8, "k/v 2x[8,2,8]", "tp0of1", 1024)
  assert [k.hex() for k in chain_keys(tokens, 8, ns)] == [
      "b4a166280d58452af913f3510c48fd5779593d0ca4b550714642a0bc0c590228",
      "6bbc543aa47bb1d68d5daad9db2fa7fd130845445adbc18c1a28dd96bfe8defe"]
  assert chain_keys(tokens, 8, ns, cache_salt=None) == chain_keys(tokens, 8, ns)


def test_the_salt_enters_the_first_block_and_the_chain_carries_it():
  tokens = list(range(32))
  ns = Namespace("m", "float32", 8, "k/v 2x[8,2,8]", "tp0of1", 1024)
  for salt_fn in (lambda s: kv_hash.hash_full_blocks(tokens, 8, cache_salt=s),
                  lambda s: chain_keys(tokens, 8, ns, cache_salt=s)):
    plain, a, a_again, b = salt_fn(None), salt_fn("a"), salt_fn("a"), salt_fn("b")
    assert a == a_again
    for i in range(4):  # every block differs: no salt's chain meets another's
      assert len({plain[i], a[i], b[i]}) == 3
    assert not set(a) & (set(plain) | set(b))
  # Only the first block mixes the salt in: later blocks chain from their parent.
  a = kv_hash.hash_full_blocks(tokens, 8, cache_salt="a")
  assert kv_hash.hash_full_blocks(tokens[8:], 8, None, a[0], cache_salt="b") == a[1:]
  assert kv_hash.hash_full_blocks(tokens[:8], 8, None, kv_hash.salted_root("a")) == a[:1]
  assert kv_hash.salted_root(None) is None
  # A salted root is a hash of its own domain, not any block's of the unsalted chain.
  assert kv_hash.salted_root("a") not in kv_hash.hash_full_blocks(tokens, 8)


# --- the engine's prefix cache -------------------------------------------------------


def test_prefix_cache_hits_only_within_one_salt():
  engine = make_engine()
  plain = _generate(engine)
  assert plain.num_cached_tokens == 0
  tokens = plain.outputs[0].token_ids
  # (salt, prompt tokens served from the cache): a new salt, or none after a salt, shares
  # nothing; a salt seen before (or no salt, seen first) hits every full block but the last.
  for salt, cached in (("a", 0), ("b", 0), ("a", HIT), (None, HIT), ("b", HIT),
                       ("a" * 1000, 0), ("é🔑", 0), ("é🔑", HIT),
                       ("\ud800", 0), ("\ud800", HIT)):  # (a lone surrogate, as JSON allows)
    out = _generate(engine, salt=salt)
    assert out.num_cached_tokens == cached, salt
    assert out.outputs[0].token_ids == tokens, salt
  assert_all_blocks_free(engine)


def test_blocks_filled_by_decoding_are_hashed_under_the_salt():
  # A prompt shorter than a block: its first block is filled (and hashed, from the
  # sequence's own state) as it decodes, then hit by a longer prompt of the same salt.
  engine = make_engine()
  (short,) = random_prompts((5,), seed=7)
  first = _generate(engine, short, salt="a", params=SamplingParams(
      temperature=0.0, max_tokens=6, ignore_eos=True))  # 10 of its 11 tokens computed
  longer = short + list(first.outputs[0].token_ids) + [1, 2]  # 13 tokens: 1 full block
  assert _generate(engine, longer, salt="b").num_cached_tokens == 0
  assert _generate(engine, longer).num_cached_tokens == 0
  assert _generate(engine, longer, salt="a").num_cached_tokens == BLOCK_SIZE
  assert_all_blocks_free(engine)


def test_salted_requests_under_preemption_and_parallel_sampling_keep_their_tokens():
  # The six prompts swap out and back on the small device pool (and fork with n=2):
  # run() checks the block invariants (a sequence's hashes are its salted chain) each step.
  reference = make_engine()
  expected = [_generate(reference, p).outputs[0].token_ids for p in SIX_PROMPTS]
  engine = make_engine()
  ids = [engine.add_request(prompt_token_ids=p, sampling_params=GREEDY, cache_salt=f"s{i % 2}")
         for i, p in enumerate(SIX_PROMPTS)]
  outs = run(engine)
  assert [outs[i].outputs[0].token_ids for i in ids] == expected
  pair = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=3, ignore_eos=True)
  forked = _generate(engine, SIX_PROMPTS[2], salt="s0", params=pair).outputs
  assert [c.token_ids for c in forked] == [
      c.token_ids for c in _generate(reference, SIX_PROMPTS[2], params=pair).outputs]
  assert_all_blocks_free(engine)


@pytest.mark.parametrize("salt", ["", 3, b"a", ["a"]])
def test_a_bad_salt_is_refused_naming_the_field(salt):
  engine = make_engine()
  with pytest.raises(ValueError, match="^cache_salt must be a non-empty string"):
    engine.add_request(prompt_token_ids=PROMPT, sampling_params=GREEDY, cache_salt=salt)
  assert not engine.has_unfinished_requests()


# --- the third tier: a restarted engine (disk), a second engine (remote) --------------


def _tier_metric(engine, name: str, tier: str) -> float:
  return engine.metrics().get(f'hisparse_kv_tier_{name}{{tier="{tier}"}}', 0.0)


@pytest.fixture
def tier_config(request, tmp_path):
  if request.param == "disk":
    yield "disk", {"disk_cache_dir": str(tmp_path / "kv")}
    return
  try:
    server = RedisServer(tmp_path)
  except RedisUnavailable as e:
    pytest.skip(str(e))
  yield "remote", {"remote_cache_url": server.url}
  server.stop()


@pytest.mark.parametrize("tier_config", ["disk", "remote"], indirect=True)
def test_the_third_tier_serves_the_same_salt_only(tier_config):
  kind, fields = tier_config
  first = make_engine(**fields)
  stored = _generate(first, salt="a")
  first.close()  # its stores finish
  tokens = stored.outputs[0].token_ids

  second = make_engine(**fields)  # a restarted engine (disk), another engine (remote)
  for salt in ("b", None):  # the tier holds nothing under these keys
    out = _generate(second, salt=salt)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == tokens, salt
  assert _tier_metric(second, "hit_tokens_total", kind) == 0
  assert _tier_metric(second, "loaded_blocks_total", kind) == 0
  out = _generate(second, salt="a")  # misses the device and host pools; the tier has it
  assert out.num_cached_tokens == HIT and out.outputs[0].token_ids == tokens
  assert _tier_metric(second, "hit_tokens_total", kind) == HIT
  assert _tier_metric(second, "loaded_blocks_total", kind) == HIT // BLOCK_SIZE
  second.close()

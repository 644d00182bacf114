"""Passkey prompts: the template's parts in order, the length asked (within one filler
sentence), the needle at its depth, the answer check."""

import pytest

from models import passkey


class _Words:
  """A tokenizer of whitespace-separated words (enough to count lengths)."""

  def encode(self, text, add_special_tokens=True):
    return [hash(w) % 1000 for w in text.split()]


@pytest.mark.parametrize("num_tokens", [60, 200, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 1.0])
def test_prompt_length_order_and_depth(num_tokens, depth):
  tok = _Words()
  p = passkey.make_passkey_prompt(tok, num_tokens, depth, "12345")
  filler_words = len(passkey.FILLER.split())
  assert num_tokens - filler_words < len(p.token_ids) <= num_tokens
  assert p.text.startswith(passkey.INTRO) and p.text.endswith(passkey.QUERY)
  before, needle, after = p.text.partition(passkey.NEEDLE.format(key="12345"))
  assert needle and before.count(passkey.FILLER) == round(p.num_filler * depth)
  assert after.count(passkey.FILLER) == p.num_filler - round(p.num_filler * depth)


def test_prompts_get_distinct_keys_and_the_answer_check():
  ps = passkey.make_passkey_prompts(_Words(), 300, [0.1, 0.5, 0.9], seed=1)
  assert [p.depth for p in ps] == [0.1, 0.5, 0.9]
  assert all(len(p.key) == 5 and p.key[0] != "0" for p in ps) and len({p.key for p in ps}) == 3
  assert passkey.is_right(" 67767. Remember it.", "67767")
  assert not passkey.is_right(" 6776", "67767") and passkey.answer_of("no digits") is None
  with pytest.raises(ValueError, match="depth must be in"):
    passkey.make_passkey_prompt(_Words(), 100, 1.5, "1")

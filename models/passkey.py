"""Passkey retrieval prompts (landmark attention's and Quest's template), for real models.

    intro  "There is an important info hidden inside a lot of irrelevant text. Find it and
           memorize them. I will quiz you about the important information there."
    filler "The grass is green. The sky is blue. The sun is yellow. Here we go. There and
           back again."  (repeated to the length asked)
    needle "The pass key is K. Remember it. K is the pass key."  (at the depth asked)
    query  "What is the pass key? The pass key is"

A prompt is built to a target length in tokens of a given tokenizer: the filler is
repeated around the needle so that the whole prompt is within a filler sentence of the
target, and the needle sits after `depth` of the filler (0.0: first, 1.0: last). The
answer is right when the first number in the generated text equals the key.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize them. I will quiz you about the important information there.")
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUERY = "What is the pass key? The pass key is"


@dataclasses.dataclass(frozen=True)
class PasskeyPrompt:
  """One prompt: its text, token ids (the tokenizer's encode, BOS as it adds it), the key
  and where the needle sits."""

  text: str
  token_ids: tuple[int, ...]
  key: str
  depth: float  # fraction of the filler before the needle
  num_filler: int  # filler sentences in all


def make_passkey_prompt(tokenizer, num_tokens: int, depth: float, key: str) -> PasskeyPrompt:
  """The prompt of about `num_tokens` tokens (at most, within one filler repetition) with
  `key` at `depth` in [0, 1]. `tokenizer`: anything with `encode(text) -> list[int]`."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1], got {depth}")

  def build(n: int) -> str:
    before = round(n * depth)
    parts = [INTRO, *[FILLER] * before, NEEDLE.format(key=key), *[FILLER] * (n - before),
             QUERY]
    return " ".join(parts)

  per_filler = len(tokenizer.encode(" " + FILLER, add_special_tokens=False))
  fixed = len(tokenizer.encode(build(0)))
  n = max(0, (num_tokens - fixed) // max(1, per_filler))
  while n > 0 and len(tokenizer.encode(build(n))) > num_tokens:
    n -= 1
  text = build(n)
  return PasskeyPrompt(text=text, token_ids=tuple(tokenizer.encode(text)), key=key,
                       depth=depth, num_filler=n)


def make_passkey_prompts(tokenizer, num_tokens: int, depths: Sequence[float], seed: int = 0,
                         num_digits: int = 5) -> list[PasskeyPrompt]:
  """One prompt per depth, each with its own random `num_digits`-digit key (no leading 0)."""
  rng = np.random.default_rng(seed)
  low, high = 10 ** (num_digits - 1), 10 ** num_digits
  return [make_passkey_prompt(tokenizer, num_tokens, d, str(int(rng.integers(low, high))))
          for d in depths]


def answer_of(text: str) -> str | None:
  """The first run of digits in a generated text (None: no number)."""
  match = re.search(r"\d+", text)
  return match.group(0) if match else None


def is_right(text: str, key: str) -> bool:
  return answer_of(text) == key

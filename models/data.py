"""The synthetic corpus of the default model: key-value retrieval and copying.

This module owns the vocabulary of `hisparse-tiny` and every generator of its text, so the
trainer, the evaluator and the engine demo agree on one format. Every answer is checkable.

Vocabulary (ids are fixed; `tokenizer.json` is built from `VOCAB`):
  specials  <pad> <bos> <eos> <unk> "\\n" "?" "|"
  words     NUM_WORDS two-syllable words ("kabe", "moti", ...): values and copy content
  keys      the same words with a colon ("kabe:", ...): keys and copy content

Retrieval text (one pair a line; keys unique within a prompt; the query ends on the key):
  kabe: moti
  fusa: lodu
  ...
  ? fusa:          -> expected answer "lodu"
Training sequences continue after "?" with more "key: value" lines that re-list pairs of the
context in random order; each of their values is supervised. Copy sequences are
`<bos> t1 ... tn | t1 ... tn \\n ...` (random n), copied tokens supervised. Copy content comes
from the same words and keys, so the induction circuit that copying forms is the one
retrieval reuses.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>", "\n", "?", "|")
PAD, BOS, EOS, UNK, NEWLINE, QUERY, COPY_SEP = SPECIALS
NUM_WORDS = 512
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _make_words() -> tuple[str, ...]:
  syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
  words = ["".join(p) for p in itertools.product(syllables, repeat=2)]
  order = np.random.default_rng(1234).permutation(len(words))[:NUM_WORDS]
  return tuple(words[i] for i in sorted(order))


WORDS: tuple[str, ...] = _make_words()
KEYS: tuple[str, ...] = tuple(w + ":" for w in WORDS)
VOCAB: tuple[str, ...] = SPECIALS + WORDS + KEYS
TOKEN_TO_ID: dict[str, int] = {t: i for i, t in enumerate(VOCAB)}
PAD_ID, BOS_ID, EOS_ID = TOKEN_TO_ID[PAD], TOKEN_TO_ID[BOS], TOKEN_TO_ID[EOS]
# The default model's chat template (tokenizer_config.json "chat_template"): BOS, then
# the messages' contents one per line, e.g. a system message with the `key: value`
# lines and a user message "? key:"; the model answers right after the question, so a
# generation prompt adds nothing.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, got ' + message['role']) }}"
    "{% endif %}{{ message['content'] }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% endfor %}")
NEWLINE_ID, QUERY_ID, COPY_SEP_ID = (TOKEN_TO_ID[NEWLINE], TOKEN_TO_ID[QUERY],
                                     TOKEN_TO_ID[COPY_SEP])
WORD_IDS = np.arange(len(SPECIALS), len(SPECIALS) + NUM_WORDS, dtype=np.int32)
KEY_IDS = WORD_IDS + NUM_WORDS
CONTENT_IDS = np.concatenate([WORD_IDS, KEY_IDS])
_TOKENS_PER_LINE = 3  # "key:" "value" "\n"


# A prompt the default model answers ("bare"), short enough for a command line: what
# `hisparse-jax demo` and the unknown-words warning of `generate` show.
EXAMPLE_PROMPT = "bafu: bapo\nbaki: bare\n? baki:"
EXAMPLE_ANSWER = "bare"


def max_pairs(context_len: int) -> int:
  """Most `key: value` lines whose prompt (<bos>, lines, "?", key) fits context_len tokens."""
  return min((context_len - 3) // _TOKENS_PER_LINE, NUM_WORDS)


@dataclasses.dataclass(frozen=True)
class RetrievalPrompt:
  """One retrieval query: `text` (no <bos>; the tokenizer adds it), its `answer` word, and
  `token_ids` (with <bos>); len(token_ids) <= the requested context length."""

  text: str
  answer: str
  token_ids: tuple[int, ...]
  num_pairs: int
  answer_line: int  # 0-based index of the queried line in the context


def make_retrieval_prompts(num_prompts: int, context_len: int, seed: int,
                           num_pairs: int | None = None) -> list[RetrievalPrompt]:
  """Fresh retrieval prompts that fill `context_len` tokens, with their expected answers.

  Keys are unique within a prompt and the queried line is uniform over the context, so the
  answer can sit anywhere from the first line to the last.
  """
  rng = np.random.default_rng(seed)
  num_pairs = max_pairs(context_len) if num_pairs is None else num_pairs
  if not 1 <= num_pairs <= max_pairs(context_len):
    raise ValueError(f"num_pairs={num_pairs} does not fit context_len={context_len}")
  prompts = []
  for _ in range(num_prompts):
    keys = rng.choice(NUM_WORDS, size=num_pairs, replace=False)
    values = rng.integers(0, NUM_WORDS, size=num_pairs)
    line = int(rng.integers(0, num_pairs))
    lines = [f"{KEYS[k]} {WORDS[v]}" for k, v in zip(keys, values)]
    text = "\n".join(lines) + f"\n{QUERY} {KEYS[keys[line]]}"
    ids = [BOS_ID]
    for k, v in zip(keys, values):
      ids += [int(KEY_IDS[k]), int(WORD_IDS[v]), NEWLINE_ID]
    ids += [QUERY_ID, int(KEY_IDS[keys[line]])]
    prompts.append(RetrievalPrompt(text=text, answer=WORDS[values[line]],
                                   token_ids=tuple(ids), num_pairs=num_pairs,
                                   answer_line=line))
  return prompts


def _padded_row(tokens: list[int], supervised: list[int], seq_len: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens cut or padded to [seq_len + 1], loss_mask [seq_len] True at the supervised
  input positions that fall inside the row)."""
  tokens = np.asarray(tokens[: seq_len + 1], np.int32)
  tokens = np.pad(tokens, (0, seq_len + 1 - len(tokens)), constant_values=PAD_ID)
  mask = np.zeros(seq_len, bool)
  supervised = np.asarray(supervised, np.int64)
  mask[supervised[supervised < seq_len]] = True
  return tokens, mask


def retrieval_sequence(rng: np.random.Generator, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [seq_len + 1], loss_mask bool [seq_len]) for one training sequence.

  loss_mask[t] says whether predicting tokens[t + 1] from tokens[: t + 1] is supervised: only
  the values of the query lines after "?".
  """
  total_lines = (seq_len - 1) // _TOKENS_PER_LINE
  lo = max(2, total_lines // 4)
  num_pairs = int(rng.integers(lo, min(total_lines - 1, NUM_WORDS) + 1))
  keys = rng.choice(NUM_WORDS, size=num_pairs, replace=False)
  values = rng.integers(0, NUM_WORDS, size=num_pairs)
  tokens = [BOS_ID]
  for k, v in zip(keys, values):
    tokens += [int(KEY_IDS[k]), int(WORD_IDS[v]), NEWLINE_ID]
  tokens.append(QUERY_ID)
  supervised = []
  num_queries = (seq_len + 1 - len(tokens)) // _TOKENS_PER_LINE + 1
  picks = rng.choice(num_pairs, size=min(num_queries, num_pairs), replace=False)
  for p in picks:
    supervised.append(len(tokens))  # predicting the value from the key position
    tokens += [int(KEY_IDS[keys[p]]), int(WORD_IDS[values[p]]), NEWLINE_ID]
  return _padded_row(tokens, supervised, seq_len)


def copy_sequence(rng: np.random.Generator, seq_len: int, num_content: int | None = None,
                  episode_len: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [seq_len + 1], loss_mask [seq_len]): `<bos>` then copy episodes
  `t1 .. tn | t1 .. tn \n` of random lengths n (so no fixed offset solves the task and the
  model must learn content-based induction), every copied token supervised.

  num_content: draw content from the first num_content words and keys only; None = all.
  episode_len: (lo, hi) bounds of n. A narrow range first lets a positional head narrow the
  candidates to a few, so matching by content gets a strong gradient; widening the range
  then leaves content matching alone. None = [seq_len // 16, seq_len // 2).
  """
  pool = CONTENT_IDS if num_content is None else np.concatenate(
      [WORD_IDS[: num_content // 2], KEY_IDS[: num_content - num_content // 2]])
  # Tokens are unique within a row (across episodes too): a repeated token would give the
  # induction head several equally good matches and blur the signal it learns from.
  fresh = rng.permutation(pool).astype(np.int32).tolist()
  tokens, supervised = [BOS_ID], []
  while len(tokens) < seq_len + 1 and len(fresh) >= 4:
    if episode_len is None:
      n = int(rng.integers(max(4, seq_len // 16), max(5, seq_len // 2)))
    else:
      n = int(rng.integers(episode_len[0], episode_len[1] + 1))
    n = min(n, len(fresh))
    content, fresh = fresh[:n], fresh[n:]
    tokens += content + [COPY_SEP_ID]
    # Inputs c1..c(n-1) of the copy predict c2..cn: pure induction. The first copied token
    # (predicted at "|") would need the episode start, a positional cue, so it is left out.
    supervised += range(len(tokens), len(tokens) + n - 1)
    tokens += content + [NEWLINE_ID]
  return _padded_row(tokens, supervised, seq_len)


def doubled_sequence(rng: np.random.Generator, seq_len: int, num_content: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [seq_len + 1], loss_mask [seq_len]): `<bos> x1 y1 x1 x2 y2 x2 ...`; at each y the
  model predicts the token before it. Solved only by a previous-token head with an identity
  OV circuit: the half of an induction circuit that has to exist before copying by content
  can be learned."""
  pool = CONTENT_IDS if num_content is None else np.concatenate(
      [WORD_IDS[: num_content // 2], KEY_IDS[: num_content - num_content // 2]])
  num_triples = seq_len // 3 + 1
  xy = rng.choice(pool, size=(num_triples, 2)).astype(np.int32)
  triples = np.stack([xy[:, 0], xy[:, 1], xy[:, 0]], axis=1).reshape(-1)
  tokens = np.concatenate([[BOS_ID], triples])[: seq_len + 1].astype(np.int32)
  mask = np.zeros(seq_len, bool)
  mask[2::3] = True  # input y at 3i + 2 predicts x at 3i + 3
  return tokens, mask


def offset_copy_sequence(rng: np.random.Generator, seq_len: int
                         ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [seq_len + 1], loss_mask [seq_len]): `<bos> junk t1 .. tn | t1 .. tn` with a
  random length n and a random amount of junk before it, so neither an absolute nor a
  relative position solves it: only matching by content (an induction head) does. Inputs
  t1..t(n-1) of the copy predict t2..tn. This is the copy task that formed induction in
  hisparse-tiny (after ~1,300 steps at 128 tokens, batch 32, lr 1e-3)."""
  n = int(rng.integers(8, (seq_len - 3) // 2))
  pre = int(rng.integers(0, seq_len - 2 * n - 2))
  junk = rng.choice(CONTENT_IDS, size=pre).astype(np.int32)
  content = rng.choice(CONTENT_IDS, size=n).astype(np.int32)
  tokens = np.concatenate([[BOS_ID], junk, content, [COPY_SEP_ID], content]).astype(np.int32)
  tokens = np.pad(tokens, (0, max(0, seq_len + 1 - len(tokens))),
                  constant_values=PAD_ID)[:seq_len + 1]
  mask = np.zeros(seq_len, bool)
  start = 1 + pre + n + 1
  mask[start:start + n - 1] = True
  return tokens, mask


def make_batch(rng: np.random.Generator, batch_size: int, seq_len: int,
               copy_fraction: float, num_content: int | None = None,
               doubled_fraction: float = 0.0, episode_len: tuple[int, int] | None = None,
               copy_kind: str = "episodes") -> dict[str, np.ndarray]:
  """A training batch: inputs/targets int32 [batch, seq_len], loss_mask, is_copy [batch].

  Rows are retrieval, copy or (a `doubled_fraction` of the copy rows) doubled sequences.
  """
  rows, masks, is_copy = [], [], []
  for _ in range(batch_size):
    copy = bool(rng.random() < copy_fraction)
    if copy and rng.random() < doubled_fraction:
      tokens, mask = doubled_sequence(rng, seq_len, num_content)
    elif copy and copy_kind == "offset":
      tokens, mask = offset_copy_sequence(rng, seq_len)
    elif copy:
      tokens, mask = copy_sequence(rng, seq_len, num_content, episode_len)
    else:
      tokens, mask = retrieval_sequence(rng, seq_len)
    rows.append(tokens)
    masks.append(mask)
    is_copy.append(copy)
  tokens = np.stack(rows)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.stack(masks),
          "is_copy": np.asarray(is_copy)}

"""Tokenizer round trips (ours and transformers' AutoTokenizer agree) and the synthetic corpus:
every retrieval prompt's expected answer is the value its text gives the queried key."""

import numpy as np
import pytest
import transformers

import models
from models import data
from models.tokenizer import Tokenizer, build_word_level_tokenizer, save_tokenizer_files


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok")
  tok = build_word_level_tokenizer(data.VOCAB, bos=data.BOS, eos=data.EOS, pad=data.PAD,
                                   unk=data.UNK)
  save_tokenizer_files(tok, path, bos=data.BOS, eos=data.EOS, pad=data.PAD, unk=data.UNK,
                       model_max_length=1024)
  (path / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": [2, 4]}')
  return path


def test_round_trip_and_special_ids(tok_dir):
  tok = Tokenizer.from_dir(tok_dir)
  assert tok.bos_token_id == data.BOS_ID and tok.eos_token_ids == (data.EOS_ID, 4)
  assert tok.vocab_size == len(data.VOCAB)
  prompt = data.make_retrieval_prompts(1, 64, seed=3)[0]
  ids = tok.encode(prompt.text)
  assert tuple(ids) == prompt.token_ids and ids[0] == data.BOS_ID
  assert tok.encode(tok.decode(ids)) == ids
  assert tok.encode("xyz: nope", add_special_tokens=False)[0] == data.TOKEN_TO_ID[data.UNK]
  assert tok.decode([tok.token_to_id(prompt.answer)]) == prompt.answer


def test_unknown_words_are_the_pieces_that_encode_to_unk(tok_dir):
  tok = Tokenizer.from_dir(tok_dir)
  assert tok.unk_token_id == data.TOKEN_TO_ID[data.UNK]
  assert tok.unknown_words("hello bafu: world\n? hello") == ["hello", "world", "hello"]
  assert tok.unknown_words(data.make_retrieval_prompts(1, 64, seed=3)[0].text) == []
  # A byte-level BPE encodes any text: it has no unk id and no unknown words.
  import tokenizers
  from tokenizers import models as tok_models
  from tokenizers import pre_tokenizers

  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  backend = tokenizers.Tokenizer(tok_models.BPE({c: i for i, c in enumerate(alphabet)}, []))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe = Tokenizer(backend, bos_token_id=None, eos_token_ids=[])
  assert bpe.unk_token_id is None and bpe.unknown_words("hello world") == []


def test_auto_tokenizer_loads_the_same_files(tok_dir):
  hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
  text = data.make_retrieval_prompts(1, 40, seed=4)[0].text
  assert hf(text)["input_ids"] == Tokenizer.from_dir(tok_dir).encode(text)
  assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 0)


def test_shipped_tokenizer_matches_vocabulary():
  tok = Tokenizer.from_dir(models.DEFAULT_MODEL_DIR)
  assert [tok.id_to_token(i) for i in range(len(data.VOCAB))] == list(data.VOCAB)
  assert tok.bos_token_id == data.BOS_ID and tok.eos_token_ids == (data.EOS_ID,)


@pytest.mark.parametrize("context_len", [64, 1024])
def test_retrieval_prompts_are_checkable(context_len):
  prompts = data.make_retrieval_prompts(20, context_len, seed=11)
  for p in prompts:
    assert len(p.token_ids) <= context_len and len(p.token_ids) > context_len - 3
    lines, query = p.text.rsplit("\n", 1)
    pairs = [line.split(" ") for line in lines.split("\n")]
    keys = [k for k, _ in pairs]
    assert len(set(keys)) == len(keys) == p.num_pairs
    assert query.startswith(f"{data.QUERY} ")
    assert dict(pairs)[query.split(" ")[1]] == p.answer == pairs[p.answer_line][1]
  assert len({p.text for p in prompts}) == 20
  assert data.make_retrieval_prompts(3, context_len, seed=11) == prompts[:3]


def test_training_sequences_supervise_the_right_tokens():
  rng = np.random.default_rng(0)
  tokens, mask = data.retrieval_sequence(rng, 256)
  assert tokens.shape == (257,) and mask.shape == (256,) and mask.sum() > 5
  query_start = int(np.nonzero(tokens == data.QUERY_ID)[0][0])
  context = {int(tokens[i]): int(tokens[i + 1]) for i in range(1, query_start, 3)}
  for t in np.nonzero(mask)[0]:
    assert t > query_start and context[int(tokens[t])] == int(tokens[t + 1])
  tokens, mask = data.copy_sequence(rng, 256, num_content=64)
  assert set(tokens[1:].tolist()) <= set(data.CONTENT_IDS[:32].tolist()) | set(
      data.KEY_IDS[:32].tolist()) | {data.COPY_SEP_ID, data.NEWLINE_ID, data.PAD_ID}
  for t in np.nonzero(mask)[0]:  # each supervised target follows an earlier copy of its input
    earlier = np.nonzero(tokens[:t] == tokens[t])[0]
    assert earlier.size and tokens[earlier[-1] + 1] == tokens[t + 1]
  tokens, mask = data.doubled_sequence(rng, 64)
  sup = np.nonzero(mask)[0]
  np.testing.assert_array_equal(tokens[sup - 1], tokens[sup + 1])  # the token before y
  assert mask.sum() == 21


def test_offset_copy_supervises_only_content_matched_tokens():
  rng = np.random.default_rng(0)
  starts = set()
  for _ in range(20):
    tokens, mask = data.offset_copy_sequence(rng, 128)
    assert tokens.shape == (129,) and mask.shape == (128,)
    sep = int(np.flatnonzero(tokens == data.COPY_SEP_ID)[0])
    supervised = np.flatnonzero(mask)
    n = len(supervised) + 1  # the first copied token is not supervised
    assert supervised[0] == sep + 1 and supervised[-1] == sep + n - 1
    # each supervised target is the token after the same content in the first copy
    np.testing.assert_array_equal(tokens[supervised + 1], tokens[sep - n + 1:sep])
    starts.add(sep - n)
  assert len(starts) > 10  # the copy starts at many offsets: position alone cannot solve it


def _streamed(tok, ids):
  """The text after each token of an incremental detokenization."""
  stream, text, out = tok.decode_stream(), "", []
  for t in ids:
    text += stream.step(t)
    out.append(text)
  return out


def test_decode_stream_equals_a_full_decode_for_every_prefix(tok_dir):
  tok = Tokenizer.from_dir(tok_dir)
  ids = tok.encode(data.make_retrieval_prompts(1, 80, seed=5)[0].text)
  ids = ids[:5] + [data.EOS_ID] + ids[5:]  # a special token in the middle is skipped
  assert _streamed(tok, ids) == [tok.decode(ids[:i + 1]) for i in range(len(ids))]


def test_decode_stream_holds_back_a_character_split_across_tokens():
  # A byte-level BPE with no merges: every non-ASCII character is several byte tokens.
  import tokenizers
  from tokenizers import decoders, pre_tokenizers
  from tokenizers import models as tok_models

  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  backend = tokenizers.Tokenizer(tok_models.BPE({c: i for i, c in enumerate(alphabet)}, []))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=[])
  text = "naïve 日本語 🙂 done"
  ids = tok.encode(text)
  assert tok.decode(ids) == text and len(ids) == len(text.encode())
  streamed = _streamed(tok, ids)
  split = 0
  for i, got in enumerate(streamed):
    full = tok.decode(ids[:i + 1])
    # An incomplete trailing character decodes as U+FFFD; the stream holds it back instead.
    split += full.endswith("\ufffd")
    assert got == full.rstrip("\ufffd"), (i, got, full)
  assert split >= 8 and streamed[-1] == text


def test_decode_stream_primed_with_the_prompt_reads_on_from_it(tok_dir):
  # vLLM's detokenizer starts in the prompt's context: the output's text is what a
  # decode of prompt + output adds to the prompt's (here, the first word's space).
  tok = Tokenizer.from_dir(tok_dir)
  ids = tok.encode(data.make_retrieval_prompts(1, 80, seed=5)[0].text)
  for cut in (1, 3, 30):
    prompt, out = ids[:cut], ids[cut:cut + 10]
    stream = tok.decode_stream(prompt_token_ids=prompt)
    text = "".join(stream.step(t) for t in out)
    assert tok.decode(prompt + out) == tok.decode(prompt) + text
    assert text.startswith(" ") == (cut > 1)  # after <bos> alone (skipped) no space

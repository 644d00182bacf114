"""The tokenizer a GGUF file's metadata describes, as a `tokenizers.Tokenizer`.

Byte-level BPE (`tokenizer.ggml.model` "gpt2": tokens, merges, the pre-tokenizer splits
`tokenizer.ggml.pre` names, as llama.cpp's llama-vocab.cpp splits text; control tokens as
special tokens), BOS/EOS/pad ids, `add_bos_token`, the chat template, and the end-of-turn
token the template writes among the EOS ids. Token ids equal llama.cpp's (where
transformers' GGUF tokenizer splits digits differently: tests/models). A tokenizer model
it cannot read (SentencePiece "llama", ...) is refused with `CheckpointError` naming the
file and the model. Read through `models/gguf_reader.py` (as the checkpoint's metadata);
`models.loader.load_tokenizer` and `models.gguf_checkpoint.load_pretrained` call it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from models.checkpoint import CheckpointError
from models.gguf_reader import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_USER_DEFINED,
    metadata_value,
    open_reader,
)
from models.tokenizer import Tokenizer

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, as llama.cpp's llama-vocab.cpp splits text
# (its regexes are the HF tokenizer.json ones of these model families). _GPT2_SPLIT is the
# one `pre_tokenizers.ByteLevel(use_regex=True)` holds.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's fallback for a BPE vocabulary that names no known pre-tokenizer ("default",
# or no tokenizer.ggml.pre at all: files older than the key).
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+",
                   r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                   r"\p{N}+", r"[0-9][0-9][0-9]")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# name -> (splits applied in turn: "digits" = each \p{N} char alone, else a regex; whether
# BPE takes a whole pre-token found in the vocabulary before merging (llama.cpp's
# ignore_merges); the add_bos default when the file has no tokenizer.ggml.add_bos_token).
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {}
for _names, _spec in [
    (("default",), (_DEFAULT_SPLITS, False, False)),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v1-en", "jina-v2-es",
      "jina-v2-de", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais"),
     ((_GPT2_SPLIT,), False, False)),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
     (("digits", _GPT2_SPLIT), False, False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), ((_LLAMA3_SPLIT,), True, True)),
    (("dbrx", "smaug-bpe"), ((_LLAMA3_SPLIT,), False, False)),
    (("qwen2", "stablelm2", "megrez", "deepseek-r1-qwen"), ((_QWEN2_SPLIT,), False, False)),
    (("tekken",), ((_TEKKEN_SPLIT,), True, True)),
]:
  for _name in _names:
    _PRE_TOKENIZERS[_name] = _spec
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))
# Tokens llama.cpp takes as end of turn (llama-vocab.cpp's end-of-generation list): those of
# them the chat template writes end a generation, as a chat model's generation_config says.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                       "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
                       "<end_of_utterance>", "<|return|>", "<|call|>")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """The tokenizer a GGUF file's metadata describes: byte-level BPE ("gpt2": tokens, merges,
  the pre-tokenizer `tokenizer.ggml.pre` names, control tokens as special tokens), BOS/EOS/pad
  ids, `add_bos_token`, the chat template; EOS ids include the end-of-turn token the chat
  template writes (e.g. `<|im_end|>`). Raises `CheckpointError` (a ValueError) naming the
  file and the problem."""
  path = os.fspath(path)
  return tokenizer_from_reader(open_reader(path), path)


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[dict[int, str], frozenset[str]]:
  """GPT-2's byte -> printable character map (the byte-level BPE spelling) and its values."""
  printable = (set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
               | set(range(ord("®"), ord("ÿ") + 1)))
  spelling, extra = {}, 0
  for b in range(256):
    if b in printable:
      spelling[b] = chr(b)
    else:
      spelling[b] = chr(256 + extra)
      extra += 1
  return spelling, frozenset(spelling.values())


def tokenizer_from_reader(reader, path: str) -> Tokenizer:
  """A `Tokenizer` from the vocabulary, merges, special ids and chat template of an open
  `gguf.GGUFReader` of the file `path`."""
  import tokenizers  # noqa: PLC0415
  from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors  # noqa: PLC0415
  from tokenizers.models import BPE  # noqa: PLC0415

  if "tokenizer.ggml.tokens" not in reader.fields:
    raise CheckpointError(f"{path} has no tokenizer (metadata key 'tokenizer.ggml.tokens' is "
                          "missing)")
  kind = metadata_value(reader, path, "tokenizer.ggml.model", None)
  if kind != "gpt2":
    what = {"llama": "SentencePiece ('llama')", None: "none given"}.get(kind, repr(kind))
    raise CheckpointError(f"{path}: tokenizer.ggml.model {what} is not supported; only "
                          "'gpt2' (byte-level BPE) tokenizers load from GGUF metadata")
  tokens = metadata_value(reader, path, "tokenizer.ggml.tokens")
  merges = metadata_value(reader, path, "tokenizer.ggml.merges", None)
  if merges is None:
    raise CheckpointError(f"{path}: byte-level BPE tokenizer without merges "
                          "(metadata key 'tokenizer.ggml.merges' is missing)")
  types = metadata_value(reader, path, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
  if len(types) != len(tokens):
    raise CheckpointError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                          f"{len(tokens)} tokens")
  pre = metadata_value(reader, path, "tokenizer.ggml.pre", "default")
  if pre not in _PRE_TOKENIZERS:
    raise CheckpointError(f"{path}: unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
                          f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}")
  splits, ignore_merges, add_bos_default = _PRE_TOKENIZERS[pre]

  # Every real token of a byte-level vocabulary is spelled in the byte alphabet; a token
  # spelled otherwise (a special token written in plain text) is re-spelled byte by byte,
  # as transformers' GGUF converter does, so the vocabulary keeps its size.
  spelling, alphabet = _byte_alphabet()
  vocab = {}
  for i, token in enumerate(tokens):
    spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())
    vocab.setdefault(spelled, i)
  pairs = []
  for merge in merges:
    pair = merge.split(" ")
    if len(pair) != 2:
      raise CheckpointError(f"{path}: tokenizer.ggml.merges entry {merge!r} is not two tokens "
                            "separated by a space")
    pairs.append((pair[0], pair[1]))
  try:
    backend = tokenizers.Tokenizer(BPE(vocab, pairs, dropout=None, continuing_subword_prefix="",
                                       end_of_word_suffix="", fuse_unk=False,
                                       ignore_merges=ignore_merges))
  except Exception as e:
    raise CheckpointError(f"{path}: the BPE vocabulary and merges do not build a tokenizer: "
                          f"{e}") from e
  # Each split cuts the pieces of the previous one, keeping both matches and the text
  # between them (llama.cpp's unicode_regex_split); the last, ByteLevel, respells bytes and
  # (for GPT-2's regex, which it holds) splits too.
  gpt2_last = splits[-1] == _GPT2_SPLIT
  steps = [pre_tokenizers.Digits(individual_digits=True) if split == "digits"
           else pre_tokenizers.Split(Regex(split), behavior="isolated")
           for split in (splits[:-1] if gpt2_last else splits)]
  steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_last))
  backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
  backend.decoder = decoders.ByteLevel()
  # Control tokens are special (matched whole in text, skipped when decoding); user-defined
  # ones are matched whole but decode as text (llama.cpp and transformers alike).
  control = [AddedToken(t, special=True, normalized=False)
             for t, kind_ in zip(tokens, types)
             if kind_ == TOKEN_TYPE_CONTROL and set(t) <= alphabet]
  user = [AddedToken(t, special=False, normalized=False)
          for t, kind_ in zip(tokens, types)
          if kind_ == TOKEN_TYPE_USER_DEFINED and t in vocab]
  if control:
    backend.add_special_tokens(control)
  if user:
    backend.add_tokens(user)

  def token_id(key: str) -> int | None:
    value = metadata_value(reader, path, f"tokenizer.ggml.{key}", None)
    if value is None:
      return None
    if not isinstance(value, int) or not 0 <= value < len(tokens):
      raise CheckpointError(f"{path}: tokenizer.ggml.{key}={value!r} is not a token id "
                            f"(vocabulary of {len(tokens)})")
    return value

  bos, eos = token_id("bos_token_id"), token_id("eos_token_id")
  pad, unk = token_id("padding_token_id"), token_id("unknown_token_id")
  add_bos = bool(metadata_value(reader, path, "tokenizer.ggml.add_bos_token", add_bos_default))
  add_eos = bool(metadata_value(reader, path, "tokenizer.ggml.add_eos_token", False))
  add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
  # transformers' TokenizersBackend.update_post_processor: BOS/EOS around each sequence.
  single = ([tokens[bos]] if add_bos else []) + ["$A"] + ([tokens[eos]] if add_eos else [])
  pair = single + ([f"{tokens[bos]}:1"] if add_bos else []) + ["$B:1"] + (
      [f"{tokens[eos]}:1"] if add_eos else [])
  specials = ([(tokens[bos], bos)] if add_bos else []) + ([(tokens[eos], eos)] if add_eos else [])
  try:
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=specials)
  except Exception as e:
    raise CheckpointError(f"{path}: cannot add BOS/EOS tokens {specials}: {e}") from e

  template = metadata_value(reader, path, "tokenizer.chat_template", None)
  template = template if isinstance(template, str) else None
  eos_ids = _end_of_generation_ids(tokens, types, template, eos,
                                   [token_id("eot_token_id"), token_id("eom_token_id")])
  special = {name: tokens[i] for name, i in
             (("bos_token", bos), ("eos_token", eos), ("pad_token", pad), ("unk_token", unk))
             if i is not None}
  return Tokenizer(backend, bos_token_id=bos, eos_token_ids=eos_ids, pad_token_id=pad,
                   chat_template=template, special_tokens=special)


def _end_of_generation_ids(tokens: Sequence[str], types: Sequence[int], template: str | None,
                           eos: int | None, extra: Sequence[int | None]) -> list[int]:
  """EOS first, then the file's end-of-turn/-message ids, then each control token the chat
  template writes that llama.cpp takes as an end of turn (`<|im_end|>`, `<|eot_id|>` ...)."""
  out = [i for i in (eos, *extra) if i is not None]
  if template:
    for i, (token, kind) in enumerate(zip(tokens, types)):
      if kind == TOKEN_TYPE_CONTROL and token in _END_OF_TURN_TOKENS and token in template:
        out.append(i)
  return list(dict.fromkeys(out))

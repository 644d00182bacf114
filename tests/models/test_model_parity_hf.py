"""Parity with Hugging Face transformers: logits at every position within 1e-4 (float32) and
16 identical greedy tokens, for tiny random Llama / Qwen2 / Mistral checkpoints and for the
shipped default model."""

import json
import os
import shutil

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from models_testlib import hf_greedy, hf_logits, hf_model, our_greedy, our_logits, save_tiny_hf

import models
from models import data
from models.eval_retrieval import greedy_generate
from models.loader import load_pretrained

CASES = {
    "llama_untied": ("llama", dict(tie_word_embeddings=False)),
    "llama3_rope_tied": ("llama", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama_mha_bias": ("llama", dict(num_key_value_heads=4, attention_bias=True,
                                     mlp_bias=True)),
    "qwen2_bias_mqa": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral_sliding_window": ("mistral", dict(sliding_window=7, head_dim=24)),
}
SEQ_LEN = 24
NUM_GREEDY = 16


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_checkpoint_matches_transformers(case, tmp_path, rng):
  kind, overrides = CASES[case]
  path = save_tiny_hf(tmp_path / case, kind, seed=len(case), **overrides)
  model, config, _ = load_pretrained(path)
  assert config.model_type == kind
  ids = rng.integers(0, config.vocab_size, size=(2, SEQ_LEN))
  hf = hf_model(path)
  ours, ref = our_logits(model, ids), hf_logits(hf, ids)
  chex.assert_shape(ours, (2, SEQ_LEN, config.vocab_size))
  assert ours.dtype == np.float32
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
  prompt = ids[:, : SEQ_LEN - NUM_GREEDY]
  np.testing.assert_array_equal(our_greedy(model, prompt, NUM_GREEDY),
                                hf_greedy(hf, prompt, NUM_GREEDY))


def test_sliding_window_changes_logits(tmp_path, rng):
  """The window is honoured: past it, logits differ from a full-attention model's."""
  path = save_tiny_hf(tmp_path / "m", "mistral", sliding_window=4)
  windowed, _, _ = load_pretrained(path)
  raw = json.loads((tmp_path / "m" / "config.json").read_text())
  raw["sliding_window"] = None
  (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
  full, _, _ = load_pretrained(path)
  ids = rng.integers(0, 97, size=(1, 12))
  a, b = our_logits(windowed, ids), our_logits(full, ids)
  np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-6)
  assert np.abs(a[:, 5:] - b[:, 5:]).min(axis=-1).max() > 0


def test_sharded_checkpoint_and_bfloat16(tmp_path, rng):
  path = save_tiny_hf(tmp_path / "single", "llama")
  hf = hf_model(path)
  hf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tmp_path / "single" / name, tmp_path / "sharded" / name)
  shards = sorted(os.listdir(tmp_path / "sharded"))
  assert "model.safetensors.index.json" in shards
  assert sum(s.endswith(".safetensors") for s in shards) > 2
  ids = rng.integers(0, 97, size=(1, 16))
  single, _, _ = load_pretrained(path)
  sharded, _, _ = load_pretrained(tmp_path / "sharded")
  np.testing.assert_array_equal(our_logits(single, ids), our_logits(sharded, ids))
  bf16, _, _ = load_pretrained(path, dtype="bfloat16")
  assert bf16.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
  assert bf16.embed_tokens[...].dtype == jnp.bfloat16
  ours = our_logits(bf16, ids)
  assert ours.dtype == np.float32
  np.testing.assert_allclose(ours, hf_logits(hf, ids), atol=0.1)


def test_default_checkpoint_matches_transformers():
  path = models.DEFAULT_MODEL_DIR
  model, config, tokenizer = load_pretrained()
  assert config.model_type == "llama" and config.num_key_value_heads < config.num_attention_heads
  prompt = data.make_retrieval_prompts(1, 160, seed=7)[0]
  ids = np.asarray([tokenizer.encode(prompt.text)])
  assert tuple(ids[0]) == prompt.token_ids
  hf = hf_model(path)
  np.testing.assert_allclose(our_logits(model, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)
  np.testing.assert_array_equal(greedy_generate(model, ids, NUM_GREEDY),
                                hf_greedy(hf, ids, NUM_GREEDY))

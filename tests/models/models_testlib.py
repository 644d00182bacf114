"""Helpers of the model tests: tiny random HF checkpoints and greedy decoding on both sides."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from models.llama import LlamaForCausalLM
from models.tokenizer import build_word_level_tokenizer, save_tokenizer_files

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def save_tiny_hf(out_dir: str | os.PathLike, kind: str, seed: int = 0, **overrides) -> str:
  """Saves a tiny randomly initialised HF model of `kind` (llama/qwen2/mistral) with
  save_pretrained; biases and norm weights are randomised so that every tensor matters."""
  config_cls, model_cls = {
      "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
      "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
  }[kind]
  config = config_cls(**{**TINY, **overrides})
  torch.manual_seed(seed)
  model = model_cls(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
  out_dir = os.fspath(out_dir)
  model.save_pretrained(out_dir)
  vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "\n"] + [f"w{i}" for i in range(92)]
  tok = build_word_level_tokenizer(vocab, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>")
  save_tokenizer_files(tok, out_dir, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
                       model_max_length=config.max_position_embeddings)
  return out_dir


def hf_model(path: str) -> transformers.PreTrainedModel:
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model: transformers.PreTrainedModel, ids: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()


def hf_greedy(model: transformers.PreTrainedModel, prompt: np.ndarray, num_tokens: int
              ) -> np.ndarray:
  """[batch, num_tokens] greedy tokens from transformers (KV-cached generate)."""
  with torch.no_grad():
    out = model.generate(torch.as_tensor(prompt, dtype=torch.long), do_sample=False,
                         max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                         pad_token_id=0, eos_token_id=None)
  return out[:, prompt.shape[1]:].numpy()


def positions_like(ids) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)


@jax.jit
def forward(model: LlamaForCausalLM, ids: jax.Array, positions: jax.Array,
            attn_metadata=None) -> jax.Array:
  """Jitted reference forward (one compile instead of many eager op compiles)."""
  return model(ids, positions, attn_metadata=attn_metadata)[0]


def our_logits(model: LlamaForCausalLM, ids: np.ndarray) -> np.ndarray:
  ids = jnp.asarray(ids, jnp.int32)
  return np.asarray(forward(model, ids, positions_like(ids)))


def our_greedy(model: LlamaForCausalLM, prompt: np.ndarray, num_tokens: int) -> np.ndarray:
  """Greedy tokens from our model: full forward over a fixed [batch, prompt + num_tokens]
  buffer (causal, so the unfilled tail is irrelevant); one compile for all steps."""
  batch, seq = prompt.shape
  buf = np.zeros((batch, seq + num_tokens), np.int32)
  buf[:, :seq] = prompt
  pos = positions_like(buf)
  for i in range(num_tokens):
    logits = forward(model, jnp.asarray(buf), pos)
    buf[:, seq + i] = np.asarray(jnp.argmax(logits[:, seq + i - 1], axis=-1))
  return buf[:, seq:]

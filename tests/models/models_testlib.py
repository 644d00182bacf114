"""Helpers of the model tests: tiny random HF checkpoints and greedy decoding on both sides
(ours: full recompute, or `cached_greedy` with a dense KV cache for real-sized models)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from models.attention import dense_causal_attention
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheMetadata:
  """Dense KV-cache attention metadata: the step's query positions [batch, seq], the cache
  slot its first token goes to, and every slot's position and validity [batch, cache_len]."""

  positions: jax.Array
  start: jax.Array
  slot_positions: jax.Array
  slot_valid: jax.Array


def kv_cache_attn_fn(q, k, v, *, layer_idx, kv_cache, metadata, config):
  """`AttnFn` over a dense per-layer cache (k, v) [batch, cache_len, kv_heads, head_dim]:
  writes this step's k/v at `metadata.start`, attends causally by position (slots not yet
  written hold later positions, so the causal mask hides them)."""
  del layer_idx
  k_cache, v_cache = kv_cache
  k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype),
                                                metadata.start, axis=1)
  v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype),
                                                metadata.start, axis=1)
  out = dense_causal_attention(q, k_cache, v_cache, q_positions=metadata.positions,
                               k_positions=metadata.slot_positions,
                               sliding_window=config.sliding_window,
                               key_mask=metadata.slot_valid)
  return out, (k_cache, v_cache)


@jax.jit
def _cached_step(model, ids, metadata, caches):
  hidden, caches = model.hidden_states(ids, metadata.positions, attn_fn=kv_cache_attn_fn,
                                       kv_caches=caches, attn_metadata=metadata)
  return jnp.argmax(model.compute_logits(hidden[:, -1]), axis=-1).astype(jnp.int32), caches


def cached_greedy(model: LlamaForCausalLM, prompts, num_tokens: int) -> np.ndarray:
  """Greedy tokens [batch, num_tokens] of prompts of any lengths (lists of ids), batched
  with left padding and a dense KV cache: one prefill, then one token per step (two
  compiles in all)."""
  config = model.config
  batch, longest = len(prompts), max(len(p) for p in prompts)
  total = longest + num_tokens
  ids = np.zeros((batch, longest), np.int32)
  pad = np.asarray([longest - len(p) for p in prompts])
  for i, p in enumerate(prompts):
    ids[i, pad[i]:] = p
  slot_positions = jnp.asarray(np.arange(total)[None] - pad[:, None], jnp.int32)
  slot_valid = slot_positions >= 0
  dtype = model.embed_tokens[...].dtype
  shape = (batch, total, config.num_key_value_heads, config.head_dim)
  caches = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            for _ in range(config.num_hidden_layers)]
  meta = CacheMetadata(slot_positions[:, :longest], jnp.int32(0), slot_positions, slot_valid)
  token, caches = _cached_step(model, jnp.asarray(ids), meta, caches)
  out = [token]
  for i in range(1, num_tokens):
    at = longest + i - 1
    meta = CacheMetadata(slot_positions[:, at:at + 1], jnp.int32(at), slot_positions,
                         slot_valid)
    token, caches = _cached_step(model, token[:, None], meta, caches)
    out.append(token)
  return np.asarray(jnp.stack(out, axis=1))

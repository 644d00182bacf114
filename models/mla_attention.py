"""The attention interface between a DSA decoder (MLA + lightning indexer) and whoever owns
its caches: `models/attention.py`'s contract for DeepSeek Sparse Attention models.

A DSA layer (`models/deepseek_v32.py`) owns no cache. For every layer it computes, per
token, the MLA attention inputs in their absorbed (MQA) form and the lightning indexer's
inputs, and calls an `MLAAttnFn`:

    out, new_cache, topk = attn_fn(step, layer_idx=i, kv_cache=kv_caches[i] or None,
                                   metadata=attn_metadata, config=config, prev_topk=topk)

    step.q        [batch, seq, heads, kv_lora_rank + rope]  q_nope @ W_UK per head (the
                  absorbed query), then the roped q_pe
    step.kv       [batch, seq, kv_lora_rank + rope]  the cache entry of each token: the
                  normalized kv latent, then the roped shared key (DeepSeek: 512 + 64 = 576)
    step.index_q  [batch, seq, index_heads, index_dim]  roped indexer queries (None in a
                  layer without an indexer: GLM-MoE-DSA's "shared" layers)
    step.index_k  [batch, seq, index_dim]  the indexer key of each token (LayerNorm, rope)
    step.index_w  float32 [batch, seq, index_heads]  weights_proj(x) * index_heads**-0.5
    out           [batch, seq, heads, kv_lora_rank]  softmax(scale * q . kv) . latent over
                  the selected keys (the caller multiplies by W_UV and o_proj)
    topk          int32 [batch, seq, k]  the key positions each query attended (negative:
                  none), what a following "shared" layer reuses (`prev_topk`)

Absorption is exact: q_nope . (W_UK latent) = (q_nope W_UK^T) . latent, and the value
W_UV latent is applied after the weighted sum, so the cache holds one latent + one rope
key per token, shared by every head (FlashMLA's layout). The index score of key t for
query s is sum_h w[s, h] * relu(q[s, h] . k[t] * index_dim**-0.5), as transformers'
DeepseekV32Indexer computes it (in this order); a query attends its top `index_topk`
allowed keys (all of them when it has fewer).

This module owns the contract and the full-sequence reference (`reference_mla_attn_fn`,
no cache: what the model runs when called without an `attn_fn`); the engine's paged,
tiered implementation is `hisparse_jax.sparse.dsa_attention`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from models.attention import DenseAttentionMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAStep:
  """One layer's attention inputs for the current tokens (shapes in the module doc)."""

  q: jax.Array
  kv: jax.Array
  index_q: jax.Array | None
  index_k: jax.Array | None
  index_w: jax.Array | None


class MLAAttnFn(Protocol):
  """Signature of the per-layer DSA attention callback (see the module docstring)."""

  def __call__(self, step: MLAStep, *, layer_idx: int, kv_cache: Any, metadata: Any,
               config: Any, prev_topk: jax.Array | None
               ) -> tuple[jax.Array, Any, jax.Array]:
    ...


def index_scores(index_q: jax.Array, index_k: jax.Array, index_w: jax.Array) -> jax.Array:
  """float32 [..., keys]: the lightning indexer's score of every key for each query.
  index_q [..., heads, dim], index_k [..., keys, dim] (broadcast over the leading axes),
  index_w float32 [..., heads]; transformers' order: relu(q . k * dim**-0.5), then the
  weighted sum over heads."""
  dim = index_q.shape[-1]
  scores = jnp.einsum("...hd,...td->...ht", index_q.astype(jnp.float32),
                      index_k.astype(jnp.float32))
  scores = jax.nn.relu(scores * dim ** -0.5)
  return jnp.einsum("...h,...ht->...t", index_w, scores)


def mla_attention(q: jax.Array, kv: jax.Array, allowed: jax.Array, *, scale: float,
                  kv_lora_rank: int) -> jax.Array:
  """Absorbed MLA over explicit keys: q [..., heads, width], kv [..., keys, width],
  allowed bool [..., keys] -> [..., heads, kv_lora_rank] (float32 softmax; zeros where a
  query allows no key). The value of a key is its first kv_lora_rank dims."""
  logits = jnp.einsum("...hd,...td->...ht", q.astype(jnp.float32), kv.astype(jnp.float32))
  logits = jnp.where(allowed[..., None, :], logits * scale, -jnp.inf)
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  p = jnp.where(allowed[..., None, :], jnp.exp(logits - top), 0.0)
  denom = p.sum(-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("...ht,...td->...hd", p.astype(kv.dtype), kv[..., :kv_lora_rank],
                   preferred_element_type=jnp.float32)
  return out.astype(q.dtype)


def reference_mla_attn_fn(step: MLAStep, *, layer_idx: int, kv_cache: Any,
                          metadata: DenseAttentionMetadata, config: Any,
                          prev_topk: jax.Array | None) -> tuple[jax.Array, Any, jax.Array]:
  """`MLAAttnFn` over the current tokens only (no cache): each query's top index_topk
  causally allowed keys (the indexer's, or `prev_topk` in a layer without one), then
  absorbed MLA over them."""
  del layer_idx
  if kv_cache is not None:
    raise ValueError("reference_mla_attn_fn keeps no cache; pass kv_caches=None")
  positions = metadata.positions
  allowed = positions[:, None, :] <= positions[:, :, None]  # [b, s(query), t(key)]
  if metadata.key_mask is not None:
    allowed &= metadata.key_mask[:, None, :].astype(bool)
  seq = positions.shape[1]
  if step.index_q is not None:
    scores = index_scores(step.index_q, step.index_k[:, None], step.index_w)  # [b, s, t]
    scores = jnp.where(allowed, scores, -jnp.inf)
    topk = jax.lax.top_k(scores, min(config.index_topk, seq))[1].astype(jnp.int32)
  elif prev_topk is None:
    raise ValueError("a layer without an indexer needs the previous layer's top-k")
  else:
    topk = prev_topk
  selected = jnp.zeros(allowed.shape, bool).at[
      jnp.arange(allowed.shape[0])[:, None, None], jnp.arange(seq)[None, :, None],
      jnp.maximum(topk, 0)].set(topk >= 0)
  out = mla_attention(step.q, step.kv[:, None], allowed & selected,
                      scale=config.softmax_scale, kv_lora_rank=config.kv_lora_rank)
  return out, None, topk

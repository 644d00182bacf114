"""The attention interface between the decoder and whoever owns the KV cache.

The decoder (`models/llama.py`) owns no KV cache. For every layer it computes q, k, v (RoPE
already applied to q and k) and calls an `AttnFn`:

    out, new_kv_cache = attn_fn(q, k, v, layer_idx=i, kv_cache=kv_caches[i] or None,
                                metadata=attn_metadata, config=config)

    q:   [batch, seq, num_q_heads, head_dim]
    k/v: [batch, seq, num_kv_heads, head_dim]
    out: [batch, seq, num_q_heads, head_dim]

The engine fills this with paged dense or sparse attention (batch=1, seq=all scheduled tokens,
ragged). This module owns the plain reference: `dense_causal_attention` and the `AttnFn` that
wraps it (`reference_attn_fn`), used when the model is called without an `attn_fn`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

_MASKED = -1e30


class AttnFn(Protocol):
  """Signature of the per-layer attention callback (see the module docstring)."""

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, *, layer_idx: int,
               kv_cache: Any, metadata: Any, config: Any) -> tuple[jax.Array, Any]:
    ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseAttentionMetadata:
  """Metadata of the reference attention: token positions and an optional key padding mask.

  positions: int32 [batch, seq]; query i sees key j iff positions[j] <= positions[i] (and
    positions[i] - positions[j] < sliding_window when the config has one).
  key_mask:  bool [batch, seq] or None; False marks padding keys nobody may attend to.
  """

  positions: jax.Array
  key_mask: jax.Array | None = None


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                           q_positions: jax.Array, k_positions: jax.Array,
                           sliding_window: int | None = None,
                           key_mask: jax.Array | None = None) -> jax.Array:
  """Softmax attention with a causal (optionally sliding-window) mask built from positions.

  Args:
    q: [batch, q_len, num_q_heads, head_dim]
    k, v: [batch, kv_len, num_kv_heads, head_dim]; num_q_heads % num_kv_heads == 0 (GQA).
    q_positions: int32 [batch, q_len]; k_positions: int32 [batch, kv_len].
    sliding_window: query p sees key k iff 0 <= p - k < sliding_window (None = unbounded).
    key_mask: bool [batch, kv_len] or None; False keys are never attended.

  Returns:
    [batch, q_len, num_q_heads, head_dim] in q's dtype. A query that sees no key at all (only
    a padding query can) averages all values; callers ignore such rows.
  """
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  if num_q_heads % num_kv_heads or k.shape != v.shape or k.shape[0] != batch:
    raise ValueError(f"bad attention shapes q={q.shape} k={k.shape} v={v.shape}")
  group = num_q_heads // num_kv_heads
  delta = q_positions[:, :, None] - k_positions[:, None, :]  # [b, q, k]
  allowed = delta >= 0
  if sliding_window is not None:
    allowed &= delta < sliding_window
  if key_mask is not None:
    allowed &= key_mask[:, None, :]
  # An additive bias (not -inf) keeps softmax NaN-free; XLA:CPU runs this form fastest.
  bias = jnp.where(allowed, 0.0, _MASKED)[:, None, None, :, :]  # [b, 1, 1, q, k]
  # Split q heads into (kv head, group member) so k/v are never repeated in memory.
  qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k,
                      preferred_element_type=jnp.float32)  # [b, kvh, g, q, k]
  scores = scores * (1.0 / jnp.sqrt(jnp.float32(head_dim))) + bias
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_q_heads, head_dim).astype(q.dtype)


def reference_attn_fn(q: jax.Array, k: jax.Array, v: jax.Array, *, layer_idx: int,
                      kv_cache: Any, metadata: DenseAttentionMetadata,
                      config: Any) -> tuple[jax.Array, Any]:
  """`AttnFn` over the current tokens only (no cache): dense causal attention."""
  del layer_idx
  if kv_cache is not None:
    raise ValueError("reference_attn_fn keeps no KV cache; pass kv_caches=None")
  out = dense_causal_attention(
      q, k, v, q_positions=metadata.positions, k_positions=metadata.positions,
      sliding_window=config.sliding_window, key_mask=metadata.key_mask)
  return out, None

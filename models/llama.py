"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral) in Flax NNX.

The model owns parameters only, never a KV cache: every layer hands its q, k, v to an
`AttnFn` (see `models/attention.py`), which the engine fills with paged dense or sparse
attention. Parameter names mirror Hugging Face's module tree (`model.layers.{i}.self_attn.
q_proj` ...), with every projection stored as `kernel` [in_features, out_features], the
transpose of torch's `weight`; `models/loader.py` owns the mapping.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import AttnFn, DenseAttentionMetadata, reference_attn_fn
from models.config import ModelConfig

_INIT_STD = 0.02


class ParamInit:
  """Draws initial parameter values: normal(0, std) from a numpy Generator (no XLA compile
  per shape, which matters on CPU), or zeros when seed is None (for `nnx.eval_shape`, where
  the loader only needs shapes and no memory should be touched)."""

  def __init__(self, seed: int | None, dtype: Any):
    self.rng = None if seed is None else np.random.default_rng(seed)
    self.dtype = dtype

  def normal(self, shape: tuple[int, ...], std: float = _INIT_STD) -> jax.Array:
    if self.rng is None:
      return jnp.zeros(shape, self.dtype)
    return jnp.asarray(self.rng.standard_normal(shape, np.float32) * std, self.dtype)

  def constant(self, shape: tuple[int, ...], value: float) -> jax.Array:
    return jnp.full(shape, value, self.dtype)


class Linear(nnx.Module):
  """y = x @ kernel (+ bias); kernel [in_features, out_features], or an object that
  multiplies as that matrix (`x @ kernel`: the engine's packed CPU weights,
  kernels_pallas.packed.PackedWeight)."""

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool, init: ParamInit,
               std: float = _INIT_STD):
    self.kernel = nnx.Param(init.normal((in_features, out_features), std))
    self.bias = nnx.Param(init.constant((out_features,), 0.0)) if use_bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.kernel[...]
    y = (jnp.einsum("...i,io->...o", x, kernel) if isinstance(kernel, jax.Array)
         else x @ kernel)
    if self.bias is not None:
      y = y + self.bias[...]
    return y


class RMSNorm(nnx.Module):
  """Hugging Face's LlamaRMSNorm: normalise in float32, cast back, then scale by weight."""

  def __init__(self, dim: int, eps: float, init: ParamInit):
    self.weight = nnx.Param(init.constant((dim,), 1.0))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
  """Inverse frequencies [head_dim // 2] in float32, with llama3 scaling when configured."""
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq
  factor = scaling["factor"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_len = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate-half RoPE (HF layout). x [batch, seq, heads, head_dim]; positions [batch, seq]."""
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, s, d/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [b, s, 1, d]
  cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


class Attention(nnx.Module):
  """Projections + RoPE around an `AttnFn`; q/k/v biases for Qwen2 or attention_bias."""

  def __init__(self, config: ModelConfig, init: ParamInit):
    d, h = config.hidden_size, config.head_dim
    qkv_bias = config.attention_bias
    o_bias = config.attention_bias and config.model_type != "qwen2"
    self.q_proj = Linear(d, config.num_attention_heads * h, use_bias=qkv_bias, init=init)
    self.k_proj = Linear(d, config.num_key_value_heads * h, use_bias=qkv_bias, init=init)
    self.v_proj = Linear(d, config.num_key_value_heads * h, use_bias=qkv_bias, init=init)
    out_std = _INIT_STD / math.sqrt(2 * config.num_hidden_layers)
    self.o_proj = Linear(config.num_attention_heads * h, d, use_bias=o_bias, init=init,
                         std=out_std)

  def __call__(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, *,
               layer_idx: int, attn_fn: AttnFn, kv_cache: Any, metadata: Any,
               config: ModelConfig) -> tuple[jax.Array, Any]:
    batch, seq, _ = x.shape
    h = config.head_dim
    q = self.q_proj(x).reshape(batch, seq, config.num_attention_heads, h)
    k = self.k_proj(x).reshape(batch, seq, config.num_key_value_heads, h)
    v = self.v_proj(x).reshape(batch, seq, config.num_key_value_heads, h)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    out, kv_cache = attn_fn(q, k, v, layer_idx=layer_idx, kv_cache=kv_cache,
                            metadata=metadata, config=config)
    return self.o_proj(out.reshape(batch, seq, config.num_attention_heads * h)), kv_cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: ModelConfig, init: ParamInit):
    d, f, b = config.hidden_size, config.intermediate_size, config.mlp_bias
    self.gate_proj = Linear(d, f, use_bias=b, init=init)
    self.up_proj = Linear(d, f, use_bias=b, init=init)
    self.down_proj = Linear(f, d, use_bias=b, init=init,
                            std=_INIT_STD / math.sqrt(2 * config.num_hidden_layers))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: ModelConfig, init: ParamInit):
    self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, init)
    self.self_attn = Attention(config, init)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, init)
    self.mlp = MLP(config, init)

  def __call__(self, x, positions, inv_freq, **attn_kwargs):
    attn_out, kv_cache = self.self_attn(self.input_layernorm(x), positions, inv_freq,
                                        **attn_kwargs)
    x = x + attn_out
    return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LlamaForCausalLM(nnx.Module):
  """Decoder-only LM. Invariants: no KV cache inside; logits are float32; parameters share
  one dtype (float32 or bfloat16); with tie_word_embeddings there is no lm_head and the
  output projection is embed_tokens.embedding transposed.
  """

  def __init__(self, config: ModelConfig, *, dtype: Any = jnp.float32, seed: int | None = 0):
    """seed: numpy seed of the random init; None gives zeros (for `nnx.eval_shape`)."""
    init = ParamInit(seed, dtype)
    self.config = config
    self.embed_tokens = nnx.Param(init.normal((config.vocab_size, config.hidden_size)))
    self.layers = nnx.List([DecoderLayer(config, init)
                            for _ in range(config.num_hidden_layers)])
    self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, init)
    self.lm_head = (None if config.tie_word_embeddings else
                    Linear(config.hidden_size, config.vocab_size, use_bias=False, init=init))

  def hidden_states(self, input_ids: jax.Array, positions: jax.Array, *,
                    attn_fn: AttnFn | None = None, kv_caches: Any = None,
                    attn_metadata: Any = None) -> tuple[jax.Array, list[Any]]:
    """Final-norm hidden states [batch, seq, hidden] and the per-layer KV caches.

    attn_fn None selects the dense causal reference; then attn_metadata may be None, a
    `DenseAttentionMetadata`, or a bool key mask [batch, seq] (False = padding).
    """
    config = self.config
    if input_ids.ndim != 2 or positions.shape != input_ids.shape:
      raise ValueError(f"input_ids {input_ids.shape} and positions {positions.shape} must "
                       "both be [batch, seq]")
    if attn_fn is None:
      attn_fn = reference_attn_fn
      if not isinstance(attn_metadata, DenseAttentionMetadata):
        attn_metadata = DenseAttentionMetadata(positions=positions, key_mask=attn_metadata)
    inv_freq = rope_inv_freq(config)
    x = self.embed_tokens[...][input_ids]  # [b, s, d]
    new_caches = []
    for i, layer in enumerate(self.layers):
      x, cache = layer(x, positions, inv_freq, layer_idx=i, attn_fn=attn_fn,
                       kv_cache=kv_caches[i] if kv_caches else None,
                       metadata=attn_metadata, config=config)
      new_caches.append(cache)
    return self.norm(x), new_caches

  def compute_logits(self, hidden: jax.Array, head: Any = None) -> jax.Array:
    """float32 logits [..., vocab] for hidden states [..., hidden] (any leading shape).
    head: the output projection to multiply by instead of the model's own (an object that
    multiplies as the [hidden, vocab] matrix, `hidden @ head`: the engine's packed copy)."""
    if head is not None:
      return (hidden @ head).astype(jnp.float32)
    if self.lm_head is None:
      kernel = self.embed_tokens[...].T
    else:
      kernel = self.lm_head.kernel[...]
      if not isinstance(kernel, jax.Array):  # (a packed kernel, as Linear takes)
        return (hidden @ kernel).astype(jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden, kernel, preferred_element_type=jnp.float32)

  def __call__(self, input_ids: jax.Array, positions: jax.Array, *,
               attn_fn: AttnFn | None = None, kv_caches: Any = None,
               attn_metadata: Any = None) -> tuple[jax.Array, list[Any]]:
    """logits float32 [batch, seq, vocab] and the per-layer KV caches attn_fn returned."""
    hidden, kv_caches = self.hidden_states(input_ids, positions, attn_fn=attn_fn,
                                           kv_caches=kv_caches, attn_metadata=attn_metadata)
    return self.compute_logits(hidden), kv_caches


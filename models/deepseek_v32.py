"""DeepSeek-V3.2 (transformers' `deepseek_v32`, DeepseekV32ForCausalLM) and GLM-MoE-DSA
(`glm_moe_dsa`, GlmMoeDsaForCausalLM: GLM-5) in Flax NNX.

MLA attention (low-rank q and compressed kv, interleaved RoPE on a separate rope slice)
with DeepSeek Sparse Attention (DSA): a lightning indexer scores every earlier key per
query and only its top `index_topk` keys are attended. MLP: dense SwiGLU in the first
layers (`mlp_layer_types` "dense"), then MoE (sigmoid router with a score-correction bias,
group-limited top-k routing, shared experts). GLM-MoE-DSA differs in two things only:
its indexer rotates with interleaved RoPE (DeepSeek-V3.2's with half-split), and layers
whose `indexer_types` entry is "shared" have no indexer and reuse the previous layer's
top-k selection (cross-layer sharing).

This is the full-sequence reference: no KV cache (paged MLA caches, the engine's indexer
and the sparse MLA kernel come later), every routed expert is computed for every token
(the combine weights zero the unselected ones). It follows transformers 5.24's eager
implementation step for step, dtypes included: the router and `indexer.weights_proj`
stay float32 whatever the model's dtype (HF's `_keep_in_fp32_modules`), indexer scores
are float32.

Parameter names mirror HF's module tree (`model.layers.{i}.self_attn.kv_b_proj` ->
`layers[i].self_attn.kv_b_proj.kernel`, [in, out]); routed experts are stacked per layer
(`mlp.experts.gate_proj` [E, hidden, moe_intermediate], `down_proj` [E, moe_intermediate,
hidden]). The config is models/deepseek_v32_config.py (`DeepseekV32Config`, re-exported
here with the model types); `models.deepseek_v32_checkpoint.load_pretrained` reads both
checkpoint layouts (per-expert tensors, as the released checkpoints and transformers'
save_pretrained write them, or transformers' fused `experts.gate_up_proj` /
`experts.down_proj`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import DenseAttentionMetadata
from models.deepseek_v32_config import (  # the config's public names, also public here
    GLM_MODEL_TYPE,
    MODEL_TYPE,
    SUPPORTED_MODEL_TYPES,
    DeepseekV32Config,
    YarnRope,
)
from models.llama import Linear, ParamInit, RMSNorm
from models.mla_attention import MLAAttnFn, MLAStep, reference_mla_attn_fn

__all__ = ["GLM_MODEL_TYPE", "MODEL_TYPE", "SUPPORTED_MODEL_TYPES", "Attention",
           "DecoderLayer", "DeepseekV32Config", "DeepseekV32ForCausalLM",
           "GlmMoeDsaForCausalLM", "Indexer", "LayerNorm", "MLP", "MoE", "Router",
           "YarnRope", "indexer_topk", "rope_cos_sin", "rope_half", "rope_interleave"]

# HF's DeepseekV32RMSNorm default: q_a_layernorm / kv_a_layernorm ignore rms_norm_eps.
_LORA_NORM_EPS = 1e-6
_INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm: nn.LayerNorm(index_head_dim, eps=1e-6)


# ----------------------------------------------------------------------------- RoPE


def rope_cos_sin(positions: jax.Array, config: DeepseekV32Config, dtype: Any
                 ) -> tuple[jax.Array, jax.Array]:
  """HF's rotary embedding over the qk_rope_head_dim dims: cos, sin [batch, seq, dim] of
  cat(freqs, freqs) (YaRN: its frequencies, both times its cos_sin_scale), in `dtype`."""
  dim, theta, yarn = config.qk_rope_head_dim, config.rope_theta, config.rope_yarn
  if yarn is None:
    inv_freq, scale = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)), 1.0
  else:
    inv_freq, scale = yarn.inv_freq(dim, theta), yarn.cos_sin_scale
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def rope_interleave(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """HF's `apply_rotary_pos_emb_interleave` on x [b, s, h, d]: the pairs (x0, x1), (x2, x3)
  ... rotate by one frequency each; the output is de-interleaved ([evens', odds'])."""
  half = cos.shape[-1] // 2
  cos, sin = cos[:, :, None, :half], sin[:, :, None, :half]
  x1, x2 = x[..., 0::2], x[..., 1::2]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """HF's `apply_rotary_pos_emb` (rotate-half) on x [b, s, h, d]."""
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


# ----------------------------------------------------------------------------- modules


class LayerNorm(nnx.Module):
  """torch.nn.LayerNorm (weight and bias), statistics in float32."""

  def __init__(self, dim: int, eps: float, init: ParamInit):
    self.weight = nnx.Param(init.constant((dim,), 1.0))
    self.bias = nnx.Param(init.constant((dim,), 0.0))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.weight[...].astype(jnp.float32)
            + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Indexer(nnx.Module):
  """DSA's lightning indexer (HF `DeepseekV32Indexer`): per query, a score for every key,
  sum_h w[h] * relu(q[h] . k) * head_dim**-0.5, w = weights_proj(x) * n_heads**-0.5;
  q from the attention's q-LoRA residual, one key per token (wk -> LayerNorm), both with
  RoPE on their first qk_rope_head_dim dims: half-split (DeepSeek-V3.2) or interleaved
  (GLM-MoE-DSA's `GlmMoeDsaIndexer`)."""

  def __init__(self, config: DeepseekV32Config, init: ParamInit):
    h, d = config.index_n_heads, config.index_head_dim
    self.wq_b = Linear(config.q_lora_rank, h * d, use_bias=False, init=init)
    self.wk = Linear(config.hidden_size, d, use_bias=False, init=init)
    self.k_norm = LayerNorm(d, _INDEXER_NORM_EPS, init)
    self.weights_proj = Linear(config.hidden_size, h, use_bias=False, init=_float32(init))

  def project(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array,
              config: DeepseekV32Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(queries [b, s, h, d], keys [b, s, d], head weights float32 [b, s, h]): the roped
    indexer queries and keys, and weights_proj(x) * h**-0.5 (HF's order of operations)."""
    b, s, _ = x.shape
    h, d, r = config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
    q = self.wq_b(q_resid).reshape(b, s, h, d)
    k = self.k_norm(self.wk(x))[:, :, None, :]  # [b, s, 1, d]
    rope = rope_interleave if config.indexer_rope_interleaved else rope_half
    q = jnp.concatenate([rope(q[..., :r], cos, sin), q[..., r:]], axis=-1)
    k = jnp.concatenate([rope(k[..., :r], cos, sin), k[..., r:]], axis=-1)[:, :, 0]
    weights = self.weights_proj(x.astype(jnp.float32)).astype(jnp.float32) * h ** -0.5
    return q, k, weights

  def scores(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array,
             allowed: jax.Array, config: DeepseekV32Config) -> jax.Array:
    """float32 index scores [b, s, t]; -inf where `allowed` [b, s, t] is False."""
    q, k, weights = self.project(x, q_resid, cos, sin, config)
    d = config.index_head_dim
    scores = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), k.astype(jnp.float32))
    scores = jax.nn.relu(scores * d ** -0.5)
    index_scores = jnp.einsum("bsh,bsht->bst", weights, scores)
    return jnp.where(allowed, index_scores, -jnp.inf)


def _float32(init: ParamInit) -> ParamInit:
  """`init`'s random stream drawing float32 parameters (those HF keeps in float32)."""
  out = ParamInit(None, jnp.float32)
  out.rng = init.rng
  return out


def indexer_topk(index_scores: jax.Array, index_topk: int) -> jax.Array:
  """int32 [b, s, min(index_topk, t)]: the keys of the top index scores per query, as HF's
  `index_scores.topk(...)`. Where a query has fewer allowed keys than that, the rest are
  disallowed (-inf) keys in no particular order (HF's too); they stay masked."""
  k = min(index_topk, index_scores.shape[-1])
  return jax.lax.top_k(index_scores, k)[1].astype(jnp.int32)


class Attention(nnx.Module):
  """MLA with DSA (HF `DeepseekV32Attention`, eager path): keys and values expanded per
  head from the kv latent (kv_b_proj), a shared rope key; the indexer's top-k keys of each
  query are the only ones it attends (within the causal mask). A "shared" layer
  (GLM-MoE-DSA) has no indexer: it attends the previous layer's selection."""

  def __init__(self, config: DeepseekV32Config, layer_idx: int, init: ParamInit):
    d, n, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
    self.q_a_proj = Linear(d, config.q_lora_rank, use_bias=bias, init=init)
    self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LORA_NORM_EPS, init)
    self.q_b_proj = Linear(config.q_lora_rank, n * config.qk_head_dim, use_bias=False,
                           init=init)
    self.kv_a_proj_with_mqa = Linear(d, config.kv_lora_rank + config.qk_rope_head_dim,
                                     use_bias=bias, init=init)
    self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, _LORA_NORM_EPS, init)
    self.kv_b_proj = Linear(config.kv_lora_rank,
                            n * (config.qk_nope_head_dim + config.v_head_dim),
                            use_bias=False, init=init)
    self.o_proj = Linear(n * config.v_head_dim, d, use_bias=bias, init=init)
    self.indexer = (Indexer(config, init) if config.indexer_types[layer_idx] == "full"
                    else None)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, allowed: jax.Array,
               config: DeepseekV32Config, prev_topk: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """(output [b, s, hidden], top-k key indices [b, s, k]); allowed [b, s, t] bool is the
    causal (and padding) mask; prev_topk: the previous layer's selection (what a layer
    without an indexer attends)."""
    b, s, _ = x.shape
    n = config.num_attention_heads
    nope, rope, vd = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    q_resid = self.q_a_layernorm(self.q_a_proj(x))
    q = self.q_b_proj(q_resid).reshape(b, s, n, config.qk_head_dim)
    q_pass, q_rot = q[..., :nope], q[..., nope:]
    kv = self.kv_a_proj_with_mqa(x)
    latent = self.kv_a_layernorm(kv[..., :config.kv_lora_rank])
    k_rot = kv[..., config.kv_lora_rank:][:, :, None, :]  # [b, s, 1, rope]
    q_rot, k_rot = rope_interleave(q_rot, cos, sin), rope_interleave(k_rot, cos, sin)
    q = jnp.concatenate([q_pass, q_rot], axis=-1)
    kv = self.kv_b_proj(latent).reshape(b, s, n, nope + vd)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rot, (b, s, n, rope))], axis=-1)
    v = kv[..., nope:]

    if self.indexer is not None:
      topk = indexer_topk(self.indexer.scores(x, q_resid, cos, sin, allowed, config),
                          config.index_topk)
    elif prev_topk is None:
      raise ValueError("a shared-indexer layer needs the previous layer's top-k")
    else:
      topk = prev_topk
    selected = jnp.zeros((b, s, s), bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], topk].set(True)
    mask = allowed & selected  # [b, s, t]

    logits = jnp.einsum("bshd,bthd->bhst", q, k) * config.softmax_scale
    logits = jnp.where(mask[:, None], logits.astype(jnp.float32), -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, n * vd)
    return self.o_proj(out), topk

  def paged(self, x: jax.Array, cos: jax.Array, sin: jax.Array, *, layer_idx: int,
            attn_fn: MLAAttnFn, kv_cache: Any, metadata: Any, config: DeepseekV32Config,
            prev_topk: jax.Array | None) -> tuple[jax.Array, Any, jax.Array]:
    """The same attention in its absorbed (MQA) form over a cache `attn_fn` owns
    (models/mla_attention.py): (output [b, s, hidden], the new cache, top-k key
    positions [b, s, k]). kv_b_proj's key half multiplies the queries (W_UK) and its value
    half the attended latents (W_UV), so the cache holds one latent + rope key a token."""
    b, s, _ = x.shape
    n, rank = config.num_attention_heads, config.kv_lora_rank
    nope, vd = config.qk_nope_head_dim, config.v_head_dim
    q_resid = self.q_a_layernorm(self.q_a_proj(x))
    q = self.q_b_proj(q_resid).reshape(b, s, n, config.qk_head_dim)
    kv = self.kv_a_proj_with_mqa(x)
    latent = self.kv_a_layernorm(kv[..., :rank])
    k_rot = rope_interleave(kv[..., rank:][:, :, None, :], cos, sin)[:, :, 0]
    q_rot = rope_interleave(q[..., nope:], cos, sin)
    w = self.kv_b_proj.kernel[...].reshape(rank, n, nope + vd)  # [latent, head, nope + v]
    q_latent = jnp.einsum("bsnd,lnd->bsnl", q[..., :nope], w[..., :nope])
    index = (self.indexer.project(x, q_resid, cos, sin, config) if self.indexer is not None
             else (None, None, None))
    step = MLAStep(q=jnp.concatenate([q_latent, q_rot], axis=-1),
                   kv=jnp.concatenate([latent, k_rot], axis=-1),
                   index_q=index[0], index_k=index[1], index_w=index[2])
    out, kv_cache, topk = attn_fn(step, layer_idx=layer_idx, kv_cache=kv_cache,
                                  metadata=metadata, config=config, prev_topk=prev_topk)
    out = jnp.einsum("bsnl,lnv->bsnv", out.astype(w.dtype), w[..., nope:])
    return self.o_proj(out.reshape(b, s, n * vd)), kv_cache, topk


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)) (dense layers and the shared experts)."""

  def __init__(self, hidden: int, intermediate: int, init: ParamInit):
    self.gate_proj = Linear(hidden, intermediate, use_bias=False, init=init)
    self.up_proj = Linear(hidden, intermediate, use_bias=False, init=init)
    self.down_proj = Linear(intermediate, hidden, use_bias=False, init=init)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nnx.Module):
  """HF `DeepseekV32TopkRouter`, in float32: sigmoid scores; the choice adds
  e_score_correction_bias, keeps the topk_group groups whose top-2 corrected scores sum
  highest, then the top num_experts_per_tok experts within them; the weights are the
  uncorrected scores of those experts (normalised if norm_topk_prob) times
  routed_scaling_factor."""

  def __init__(self, config: DeepseekV32Config, init: ParamInit):
    f32 = _float32(init)
    self.weight = nnx.Param(f32.normal((config.n_routed_experts, config.hidden_size)))
    self.e_score_correction_bias = nnx.Param(f32.constant((config.n_routed_experts,), 0.0))

  def __call__(self, x: jax.Array, config: DeepseekV32Config
               ) -> tuple[jax.Array, jax.Array]:
    """(weights float32 [tokens, k], expert ids int32 [tokens, k]) for x [tokens, hidden]."""
    e, g = config.n_routed_experts, config.n_group
    logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), self.weight[...])
    scores = jax.nn.sigmoid(logits)
    choice = scores + self.e_score_correction_bias[...]
    group_scores = jax.lax.top_k(choice.reshape(-1, g, e // g), 2)[0].sum(-1)  # [t, g]
    group_idx = jax.lax.top_k(group_scores, config.topk_group)[1]
    group_mask = jnp.zeros_like(group_scores, bool).at[
        jnp.arange(group_scores.shape[0])[:, None], group_idx].set(True)
    score_mask = jnp.repeat(group_mask, e // g, axis=-1)
    choice = jnp.where(score_mask, choice, -jnp.inf)
    idx = jax.lax.top_k(choice, config.num_experts_per_tok)[1]
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if config.norm_topk_prob:
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * config.routed_scaling_factor, idx.astype(jnp.int32)


class Experts(nnx.Module):
  """The routed experts' SwiGLU weights stacked: gate_proj / up_proj [E, hidden, inter],
  down_proj [E, inter, hidden] (kernel layout, x @ W)."""

  def __init__(self, config: DeepseekV32Config, init: ParamInit):
    e, d, f = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    self.gate_proj = nnx.Param(init.normal((e, d, f)))
    self.up_proj = nnx.Param(init.normal((e, d, f)))
    self.down_proj = nnx.Param(init.normal((e, f, d)))

  def __call__(self, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
    """sum_k weights[:, k] * expert[idx[:, k]](x) for x [tokens, hidden]: every expert on
    every token (a reference, not a dispatch), the unselected ones weighted 0."""
    combine = jnp.zeros((x.shape[0], self.gate_proj.shape[0]), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], idx].add(weights)  # [t, E]
    gate = jnp.einsum("td,edf->tef", x, self.gate_proj[...])
    up = jnp.einsum("td,edf->tef", x, self.up_proj[...])
    out = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, self.down_proj[...])
    return jnp.einsum("ted,te->td", out, combine.astype(out.dtype))


class MoE(nnx.Module):
  """HF `DeepseekV32MoE`: routed experts + shared experts (one MLP of
  n_shared_experts * moe_intermediate_size)."""

  def __init__(self, config: DeepseekV32Config, init: ParamInit):
    self.gate = Router(config, init)
    self.experts = Experts(config, init)
    self.shared_experts = (MLP(config.hidden_size,
                               config.moe_intermediate_size * config.n_shared_experts, init)
                           if config.n_shared_experts else None)

  def __call__(self, x: jax.Array, config: DeepseekV32Config) -> jax.Array:
    flat = x.reshape(-1, x.shape[-1])
    weights, idx = self.gate(flat, config)
    out = self.experts(flat, weights, idx).reshape(x.shape)
    if self.shared_experts is not None:
      out = out + self.shared_experts(x)
    return out


class DecoderLayer(nnx.Module):
  """x + attn(norm(x)), then x + mlp(norm(x)); the MLP dense or MoE by mlp_layer_types."""

  def __init__(self, config: DeepseekV32Config, layer_idx: int, init: ParamInit):
    d = config.hidden_size
    self.input_layernorm = RMSNorm(d, config.rms_norm_eps, init)
    self.self_attn = Attention(config, layer_idx, init)
    self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps, init)
    self.is_moe = config.mlp_layer_types[layer_idx] == "sparse"
    self.mlp = MoE(config, init) if self.is_moe else MLP(d, config.intermediate_size, init)

  def __call__(self, x, cos, sin, allowed, config, prev_topk=None):
    attn, topk = self.self_attn(self.input_layernorm(x), cos, sin, allowed, config, prev_topk)
    return self._mlp(x + attn, config), topk

  def paged(self, x, cos, sin, *, config, **attn_kwargs):
    """`__call__` with the attention over an `MLAAttnFn`'s cache: (x, cache, top-k)."""
    attn, kv_cache, topk = self.self_attn.paged(self.input_layernorm(x), cos, sin,
                                                config=config, **attn_kwargs)
    return self._mlp(x + attn, config), kv_cache, topk

  def _mlp(self, x, config):
    h = self.post_attention_layernorm(x)
    return x + (self.mlp(h, config) if self.is_moe else self.mlp(h))


class DeepseekV32ForCausalLM(nnx.Module):
  """Decoder-only LM; float32 logits; parameters in one dtype except the router and
  indexer.weights_proj (float32)."""

  def __init__(self, config: DeepseekV32Config, *, dtype: Any = jnp.float32,
               seed: int | None = 0):
    """seed: numpy seed of the random init; None gives zeros (for `nnx.eval_shape`)."""
    init = ParamInit(seed, dtype)
    self.config = config
    self.embed_tokens = nnx.Param(init.normal((config.vocab_size, config.hidden_size)))
    self.layers = nnx.List([DecoderLayer(config, i, init)
                            for i in range(config.num_hidden_layers)])
    self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, init)
    self.lm_head = (None if config.tie_word_embeddings else
                    Linear(config.hidden_size, config.vocab_size, use_bias=False, init=init))

  def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None, *,
               key_mask: jax.Array | None = None, return_topk: bool = False
               ) -> jax.Array | tuple[jax.Array, list[jax.Array]]:
    """float32 logits [batch, seq, vocab] of a full sequence (causal by `positions`, default
    0..seq-1; key_mask [batch, seq] False = padding, never attended nor selected); with
    return_topk also each layer's indexer top-k key indices [batch, seq, k] (see
    `indexer_topk`: entries beyond a query's allowed keys are meaningless)."""
    config = self.config
    b, s = input_ids.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    allowed = positions[:, None, :] <= positions[:, :, None]  # [b, s(query), t(key)]
    if key_mask is not None:
      allowed = allowed & key_mask[:, None, :].astype(bool)
    x = self.embed_tokens[...][input_ids]
    cos, sin = rope_cos_sin(positions, config, x.dtype)
    topks = []
    for layer in self.layers:
      x, topk = layer(x, cos, sin, allowed, config, topks[-1] if topks else None)
      topks.append(topk)
    x = self.norm(x)
    kernel = self.embed_tokens[...].T if self.lm_head is None else self.lm_head.kernel[...]
    logits = jnp.einsum("...d,dv->...v", x, kernel, preferred_element_type=jnp.float32)
    return (logits, topks) if return_topk else logits


  def hidden_states(self, input_ids: jax.Array, positions: jax.Array, *,
                    attn_fn: MLAAttnFn | None = None, kv_caches: Any = None,
                    attn_metadata: Any = None) -> tuple[jax.Array, list[Any]]:
    """Final-norm hidden states [batch, seq, hidden] and each layer's new cache, every
    layer's attention through `attn_fn` (models/mla_attention.py; the engine's paged DSA
    attention), each layer handed the previous layer's top-k (what a "shared" layer
    attends). attn_fn None: `reference_mla_attn_fn` over these tokens alone, with
    attn_metadata None, a `DenseAttentionMetadata` or a bool key mask [batch, seq]. The
    layout of llama.LlamaForCausalLM.hidden_states, so the engine's step runs either."""
    config = self.config
    if input_ids.ndim != 2 or positions.shape != input_ids.shape:
      raise ValueError(f"input_ids {input_ids.shape} and positions {positions.shape} must "
                       "both be [batch, seq]")
    if attn_fn is None:
      attn_fn = reference_mla_attn_fn
      if not isinstance(attn_metadata, DenseAttentionMetadata):
        attn_metadata = DenseAttentionMetadata(positions=positions, key_mask=attn_metadata)
    x = self.embed_tokens[...][input_ids]
    cos, sin = rope_cos_sin(positions, config, x.dtype)
    new_caches, topk = [], None
    for i, layer in enumerate(self.layers):
      x, cache, topk = layer.paged(x, cos, sin, config=config, layer_idx=i, attn_fn=attn_fn,
                                   kv_cache=kv_caches[i] if kv_caches else None,
                                   metadata=attn_metadata, prev_topk=topk)
      new_caches.append(cache)
    return self.norm(x), new_caches

  def compute_logits(self, hidden: jax.Array, head: Any = None) -> jax.Array:
    """float32 logits [..., vocab] of hidden states [..., hidden] (`head`: an output
    projection to use instead of the model's own, as llama's)."""
    if head is None:
      head = self.embed_tokens[...].T if self.lm_head is None else self.lm_head.kernel[...]
    return jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)


GlmMoeDsaForCausalLM = DeepseekV32ForCausalLM  # one module; config.model_type tells them apart

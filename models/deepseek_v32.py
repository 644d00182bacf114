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
hidden]); `load_pretrained` reads both checkpoint layouts (per-expert tensors, as the
released checkpoints and transformers' save_pretrained write them, or transformers'
fused `experts.gate_up_proj` / `experts.down_proj`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from models.attention import DenseAttentionMetadata
from models.config import ConfigError, eos_token_ids
from models.llama import Linear, ParamInit, RMSNorm
from models.loader import CheckpointError, _get_variable, _tensor_files, read_config_json
from models.mla_attention import MLAAttnFn, MLAStep, reference_mla_attn_fn

MODEL_TYPE = "deepseek_v32"
GLM_MODEL_TYPE = "glm_moe_dsa"
SUPPORTED_MODEL_TYPES = (MODEL_TYPE, GLM_MODEL_TYPE)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# HF's DeepseekV32RMSNorm default: q_a_layernorm / kv_a_layernorm ignore rms_norm_eps.
_LORA_NORM_EPS = 1e-6
_INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm: nn.LayerNorm(index_head_dim, eps=1e-6)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "n_routed_experts",
                  "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                  "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
                  "index_topk", "index_head_dim", "index_n_heads", "max_position_embeddings")


# transformers' DeepseekV32Config defaults (what it reads for a field config.json lacks).
_HF_DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6,
    bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False,
    attention_bias=False, index_topk=2048, index_head_dim=128, index_n_heads=64,
    first_k_dense_replace=3)
# transformers' GlmMoeDsaConfig's (a DeepseekV32Config with other defaults).
_GLM_DEFAULTS = dict(
    _HF_DEFAULTS, vocab_size=154880, hidden_size=6144, intermediate_size=12288,
    num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048, v_head_dim=256,
    qk_nope_head_dim=192, n_group=1, topk_group=1, max_position_embeddings=202752,
    rms_norm_eps=1e-5, index_n_heads=32)


def _get_mscale(scale: float, mscale: float = 1.0) -> float:
  """HF's yarn `get_mscale`."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnRope:
  """YaRN rope scaling as transformers' `_compute_yarn_parameters` reads it (the released
  DeepSeek-V3.2 checkpoint: factor 40, original_max_position_embeddings 4096, mscale and
  mscale_all_dim 1.0)."""

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True

  @property
  def cos_sin_scale(self) -> float:
    """The factor HF multiplies cos and sin by (its `attention_scaling`)."""
    if self.attention_factor is not None:
      return self.attention_factor
    if self.mscale and self.mscale_all_dim:
      return _get_mscale(self.factor, self.mscale) / _get_mscale(self.factor, self.mscale_all_dim)
    return _get_mscale(self.factor)

  def inv_freq(self, dim: int, theta: float) -> jax.Array:
    """float32 [dim // 2]: interpolated (/ factor) low frequencies, extrapolated high ones,
    a linear ramp between the correction range's dims (as HF computes them)."""
    def correction_dim(rotations: float) -> float:
      return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
              / (2 * math.log(theta)))
    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return (interpolation * (1 - extrapolation_factor)
            + extrapolation * extrapolation_factor)


@dataclasses.dataclass(frozen=True)
class DeepseekV32Config:
  """Architecture of a DeepSeek-V3.2 decoder (HF `DeepseekV32Config`'s fields we use).

  Invariants (checked in `__post_init__`): sizes are positive ints; n_routed_experts is a
  multiple of n_group, each group holds >= 2 experts (the group score sums its top 2);
  topk_group <= n_group; num_experts_per_tok <= the experts of topk_group groups;
  qk_rope_head_dim is even and <= index_head_dim; mlp_layer_types has one "dense" /
  "sparse" entry per layer; indexer_types one "full" / "shared" entry per layer, the first
  "full" (deepseek_v32: all "full"); rope_yarn None (the default RoPE) or YaRN.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  moe_intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  n_shared_experts: int
  n_routed_experts: int
  routed_scaling_factor: float
  kv_lora_rank: int
  q_lora_rank: int
  qk_rope_head_dim: int
  v_head_dim: int
  qk_nope_head_dim: int
  n_group: int
  topk_group: int
  num_experts_per_tok: int
  norm_topk_prob: bool
  index_topk: int
  index_head_dim: int
  index_n_heads: int
  mlp_layer_types: tuple[str, ...]
  indexer_types: tuple[str, ...] | None = None  # None: every layer "full"
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_yarn: YarnRope | None = None
  max_position_embeddings: int = 163840
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  model_type: str = MODEL_TYPE

  def __post_init__(self):
    for name in _POSITIVE_INTS:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if (not isinstance(self.n_shared_experts, int) or isinstance(self.n_shared_experts, bool)
        or self.n_shared_experts < 0):
      raise ConfigError(f"n_shared_experts must be a non-negative int, "
                        f"got {self.n_shared_experts!r}")
    if self.n_routed_experts % self.n_group:
      raise ConfigError(f"n_routed_experts={self.n_routed_experts} is not a multiple of "
                        f"n_group={self.n_group}")
    if self.n_routed_experts // self.n_group < 2:
      raise ConfigError(f"n_group={self.n_group} leaves fewer than 2 experts per group "
                        "(a group's score is the sum of its top 2)")
    if self.topk_group > self.n_group:
      raise ConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
    if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
      raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts "
                        f"of topk_group={self.topk_group} groups")
    if self.qk_rope_head_dim % 2:
      raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
    if self.qk_rope_head_dim > self.index_head_dim:
      raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} exceeds "
                        f"index_head_dim={self.index_head_dim}")
    if not (isinstance(self.rms_norm_eps, float) and self.rms_norm_eps > 0):
      raise ConfigError(f"rms_norm_eps must be a positive float, got {self.rms_norm_eps!r}")
    if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
      raise ConfigError(f"rope_theta must be positive and finite, got {self.rope_theta!r}")
    if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
      raise ConfigError(f"routed_scaling_factor must be positive and finite, "
                        f"got {self.routed_scaling_factor!r}")
    types = tuple(self.mlp_layer_types)
    if len(types) != self.num_hidden_layers or any(t not in ("dense", "sparse") for t in types):
      raise ConfigError(f"mlp_layer_types must hold num_hidden_layers={self.num_hidden_layers} "
                        f"entries of 'dense' / 'sparse', got {list(types)!r}")
    object.__setattr__(self, "mlp_layer_types", types)
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(f"model_type must be one of {', '.join(SUPPORTED_MODEL_TYPES)}, "
                        f"got {self.model_type!r}")
    indexers = (("full",) * self.num_hidden_layers if self.indexer_types is None
                else tuple(self.indexer_types))
    if (len(indexers) != self.num_hidden_layers
        or any(t not in ("full", "shared") for t in indexers) or indexers[0] != "full"):
      raise ConfigError(f"indexer_types must hold num_hidden_layers={self.num_hidden_layers} "
                        f"entries of 'full' / 'shared', the first 'full', got {list(indexers)!r}")
    if self.model_type == MODEL_TYPE and "shared" in indexers:
      raise ConfigError(f"indexer_types with 'shared' layers is {GLM_MODEL_TYPE} only")
    object.__setattr__(self, "indexer_types", indexers)
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def indexer_rope_interleaved(self) -> bool:
    """GLM-MoE-DSA's indexer: interleaved RoPE; DeepSeek-V3.2's: half-split."""
    return self.model_type == GLM_MODEL_TYPE

  @property
  def softmax_scale(self) -> float:
    """HF's `DeepseekV32Attention.scaling` (`yarn_apply_mscale`): qk_head_dim ** -0.5, with
    YaRN and a non-zero mscale_all_dim times get_mscale(factor, mscale_all_dim) ** 2."""
    scale = self.qk_head_dim ** -0.5
    yarn = self.rope_yarn
    if yarn is not None and yarn.mscale_all_dim:
      scale *= _get_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    return eos_token_ids(self.eos_token_id)

  @classmethod
  def from_hf_dict(cls, raw: Mapping[str, Any]) -> DeepseekV32Config:
    """Builds a config from a parsed HF `config.json`; missing fields take transformers'
    DeepseekV32Config defaults (as transformers does); `ConfigError` names the first field
    that cannot describe a model we support."""
    model_type = raw.get("model_type", MODEL_TYPE)
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(f"model_type must be one of {', '.join(SUPPORTED_MODEL_TYPES)}, "
                        f"got {model_type!r}")
    defaults = _GLM_DEFAULTS if model_type == GLM_MODEL_TYPE else _HF_DEFAULTS
    if raw.get("hidden_act", "silu") != "silu":
      raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if raw.get("mlp_bias", False):
      raise ConfigError("mlp_bias=true is not supported (transformers ignores it too)")

    def get(name: str) -> Any:
      value = raw.get(name)
      return defaults[name] if value is None else value

    num_heads = get("num_attention_heads")
    num_kv = raw.get("num_key_value_heads")
    if num_kv is not None and num_kv != num_heads:
      # HF's expand_kv makes num_attention_heads key heads; repeat_kv would then repeat
      # them again (a shape error in transformers itself).
      raise ConfigError(f"num_key_value_heads={num_kv} must equal num_attention_heads="
                        f"{num_heads} (MLA expands keys per query head)")
    num_layers = get("num_hidden_layers")
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is None:
      first_dense = get("first_k_dense_replace")
      if not isinstance(first_dense, int) or isinstance(first_dense, bool) or first_dense < 0:
        raise ConfigError(f"first_k_dense_replace must be a non-negative int, "
                          f"got {first_dense!r}")
      if isinstance(num_layers, int):
        n_dense = min(first_dense, num_layers)
        mlp_types = ["dense"] * n_dense + ["sparse"] * (num_layers - n_dense)
      else:
        mlp_types = []
    elif not isinstance(mlp_types, (list, tuple)):
      raise ConfigError(f"mlp_layer_types must be a list, got {mlp_types!r}")
    if raw.get("moe_layer_freq", 1) != 1:
      raise ConfigError(f"moe_layer_freq={raw['moe_layer_freq']} is not supported (only 1)")
    indexer_types = (_glm_indexer_types(raw, num_layers) if model_type == GLM_MODEL_TYPE
                     else None)
    rope_theta, rope_yarn = _read_rope(raw, get("max_position_embeddings"))
    floats = {}
    for name in ("routed_scaling_factor", "rms_norm_eps"):
      value = get(name)
      if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, got {value!r}")
      floats[name] = float(value)
    return cls(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        moe_intermediate_size=get("moe_intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        n_shared_experts=get("n_shared_experts"),
        n_routed_experts=raw.get("num_experts") or get("n_routed_experts"),
        routed_scaling_factor=floats["routed_scaling_factor"],
        kv_lora_rank=get("kv_lora_rank"),
        q_lora_rank=get("q_lora_rank"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        n_group=get("n_group"),
        topk_group=get("topk_group"),
        num_experts_per_tok=get("num_experts_per_tok"),
        norm_topk_prob=bool(get("norm_topk_prob")),
        index_topk=get("index_topk"),
        index_head_dim=get("index_head_dim"),
        index_n_heads=get("index_n_heads"),
        mlp_layer_types=tuple(mlp_types),
        indexer_types=indexer_types,
        rms_norm_eps=floats["rms_norm_eps"],
        rope_theta=rope_theta,
        rope_yarn=rope_yarn,
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        attention_bias=bool(get("attention_bias")),
        bos_token_id=get("bos_token_id"),
        eos_token_id=get("eos_token_id"),
        pad_token_id=get("pad_token_id"),
        model_type=model_type,
    )


def _glm_indexer_types(raw: Mapping[str, Any], num_layers: Any) -> tuple[str, ...]:
  """GlmMoeDsaConfig's indexer_types: the field, else `index_topk_pattern` ("FSSF..." or a
  list), else layer i is "full" iff max(i - index_skip_topk_offset + 1, 0) is a multiple of
  index_topk_freq (defaults 2 and 1: every layer full)."""
  types = raw.get("indexer_types")
  if types is None and raw.get("index_topk_pattern") is not None:
    pattern = raw["index_topk_pattern"]
    if isinstance(pattern, str):
      if any(c not in "FS" for c in pattern):
        raise ConfigError(f"index_topk_pattern must be a string of F / S, got {pattern!r}")
      types = [{"F": "full", "S": "shared"}[c] for c in pattern]
    else:
      types = pattern
  if types is None:
    freq, offset = raw.get("index_topk_freq", 1), raw.get("index_skip_topk_offset", 2)
    for name, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
      if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if not isinstance(num_layers, int):
      return ()
    freq = max(freq, 1)
    types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
             for i in range(num_layers)]
  if not isinstance(types, (list, tuple)):
    raise ConfigError(f"indexer_types must be a list, got {types!r}")
  return tuple(types)


def _read_rope(raw: Mapping[str, Any], max_positions: Any) -> tuple[float, YarnRope | None]:
  """(rope_theta, YaRN or None) from `rope_parameters` (transformers 5) or `rope_theta` +
  `rope_scaling` (the released checkpoints' layout); rope types other than "default" and
  "yarn" are refused, naming the field."""
  params = raw.get("rope_parameters")
  field = "rope_parameters"
  if params is None:
    params = dict(raw.get("rope_scaling") or {})
    field = "rope_scaling"
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
  if not isinstance(params, Mapping):
    raise ConfigError(f"{field} must be a JSON object, got {params!r}")
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in ("default", "yarn"):
    raise ConfigError(f"{field}.rope_type={rope_type!r} is not supported (only 'default' and "
                      "'yarn')")
  theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
  if not isinstance(theta, (int, float)) or isinstance(theta, bool):
    raise ConfigError(f"{field}.rope_theta must be a number, got {theta!r}")
  if rope_type == "default":
    return float(theta), None
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ConfigError(f"{field}.partial_rotary_factor="
                      f"{params['partial_rotary_factor']!r} is not supported (only 1.0)")

  def number(key: str, default: Any, *, positive: bool = False) -> Any:
    value = params.get(key)
    if value is None:
      return default
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
        or not math.isfinite(value) or (positive and value <= 0)):
      raise ConfigError(f"{field}.{key} must be a {'positive ' if positive else ''}number, "
                        f"got {value!r}")
    return float(value)

  if params.get("factor") is None:
    raise ConfigError(f"{field}.factor is missing (rope_type 'yarn')")
  original = params.get("original_max_position_embeddings", raw.get(
      "original_max_position_embeddings", max_positions))
  if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
    raise ConfigError(f"{field}.original_max_position_embeddings must be a positive int, "
                      f"got {original!r}")
  yarn = YarnRope(factor=number("factor", None, positive=True),
                  original_max_position_embeddings=original,
                  beta_fast=number("beta_fast", None) or 32.0,  # HF: `or 32`, `or 1`
                  beta_slow=number("beta_slow", None) or 1.0,
                  mscale=number("mscale", None), mscale_all_dim=number("mscale_all_dim", None),
                  attention_factor=number("attention_factor", None),
                  truncate=bool(params.get("truncate", True)))
  return float(theta), yarn


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


# ----------------------------------------------------------------------------- loading


def hf_param_map(config: DeepseekV32Config) -> dict[str, tuple[tuple[Any, ...], bool]]:
  """HF tensor name -> (our parameter path, transposed) for every tensor except the routed
  experts' (see `_expert_tensors`)."""
  out: dict[str, tuple[tuple[Any, ...], bool]] = {
      "model.embed_tokens.weight": (("embed_tokens",), False),
      "model.norm.weight": (("norm", "weight"), False),
  }
  if not config.tie_word_embeddings:
    out["lm_head.weight"] = (("lm_head", "kernel"), True)
  for i in range(config.num_hidden_layers):
    pre, at = f"model.layers.{i}.", ("layers", i)
    for norm in ("input_layernorm", "post_attention_layernorm"):
      out[f"{pre}{norm}.weight"] = ((*at, norm, "weight"), False)
    attn = (*at, "self_attn")
    has_indexer = config.indexer_types[i] == "full"
    projs = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    projs += ["indexer.wq_b", "indexer.wk", "indexer.weights_proj"] if has_indexer else []
    for proj in projs:
      path = (*attn, *proj.split("."))
      out[f"{pre}self_attn.{proj}.weight"] = ((*path, "kernel"), True)
      if config.attention_bias and proj in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
        out[f"{pre}self_attn.{proj}.bias"] = ((*path, "bias"), False)
    norms = ["q_a_layernorm.weight", "kv_a_layernorm.weight"]
    norms += ["indexer.k_norm.weight", "indexer.k_norm.bias"] if has_indexer else []
    for norm in norms:
      out[f"{pre}self_attn.{norm}"] = ((*attn, *norm.split(".")), False)
    mlp = (*at, "mlp")
    dense = config.mlp_layer_types[i] == "dense"
    mlps = [("mlp", mlp)] if dense else (
        [("mlp.shared_experts", (*mlp, "shared_experts"))] if config.n_shared_experts else [])
    for name, path in mlps:
      for proj in ("gate_proj", "up_proj", "down_proj"):
        out[f"{pre}{name}.{proj}.weight"] = ((*path, proj, "kernel"), True)
    if not dense:
      out[f"{pre}mlp.gate.weight"] = ((*mlp, "gate", "weight"), False)
      out[f"{pre}mlp.gate.e_score_correction_bias"] = (
          (*mlp, "gate", "e_score_correction_bias"), False)
  return out


def _expert_tensors(config: DeepseekV32Config, i: int, fused: bool) -> list[str]:
  pre = f"model.layers.{i}.mlp.experts."
  if fused:
    return [pre + "gate_up_proj", pre + "down_proj"]
  return [f"{pre}{j}.{p}.weight" for j in range(config.n_routed_experts)
          for p in ("gate_proj", "up_proj", "down_proj")]


def load_config(path: str | os.PathLike) -> DeepseekV32Config:
  """The config of the HF directory at `path`; `CheckpointError` names the file."""
  file, raw = read_config_json(path)
  try:
    return DeepseekV32Config.from_hf_dict(raw)
  except ConfigError as e:
    raise CheckpointError(f"{file}: {e}") from e


def _is_mtp(name: str, num_layers: int) -> bool:
  """Tensors of layers past num_hidden_layers: the released checkpoints' multi-token
  prediction layer (transformers ignores `model.layers.61.*` too)."""
  parts = name.split(".")
  return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
          and int(parts[2]) >= num_layers)


def load_pretrained(path: str | os.PathLike, dtype: str = "float32"
                    ) -> tuple[DeepseekV32ForCausalLM, DeepseekV32Config]:
  """(model, config) from an HF directory (config.json + safetensors, sharded or not).
  Routed experts are read per expert (`mlp.experts.{j}.gate_proj.weight` ...) or fused
  (`mlp.experts.gate_up_proj` [E, 2 * inter, hidden], `mlp.experts.down_proj` [E, hidden,
  inter]); a missing, unexpected or misshapen tensor is a `CheckpointError` naming it.
  Tensors of layers past num_hidden_layers (the released checkpoints' MTP layer) are
  skipped, as transformers skips them; FP8 block-quantized checkpoints (`weight_scale_inv`
  tensors) are refused as unexpected tensors (not dequantized here)."""
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
  path = os.fspath(path)
  config = load_config(path)
  jdtype = _DTYPES[dtype]
  expected = hf_param_map(config)
  name_to_file = _tensor_files(path)
  present = {n for n in name_to_file
             if not n.endswith("rotary_emb.inv_freq") and not _is_mtp(n, config.num_hidden_layers)}
  if config.tie_word_embeddings:
    present.discard("lm_head.weight")
  experts: dict[int, list[str]] = {}
  for i, kind in enumerate(config.mlp_layer_types):
    if kind == "sparse":
      experts[i] = _expert_tensors(config, i, fused=f"model.layers.{i}.mlp.experts.down_proj"
                                   in present)
  wanted = set(expected) | {n for names in experts.values() for n in names}
  missing = sorted(wanted - present)
  if missing:
    raise CheckpointError(f"missing tensor {missing[0]!r} in {path} "
                          f"({len(missing)} missing in all)")
  extra = sorted(present - wanted)
  if extra:
    raise CheckpointError(f"unexpected tensor {extra[0]!r} in {name_to_file[extra[0]]} "
                          f"({len(extra)} unexpected in all)")
  model = nnx.eval_shape(lambda: DeepseekV32ForCausalLM(config, dtype=jdtype, seed=None))
  handles: dict[str, Any] = {}

  def read(name: str, want: tuple[int, ...]) -> np.ndarray:
    file = name_to_file[name]
    if file not in handles:
      try:
        handles[file] = safe_open(file, framework="flax")
      except Exception as e:
        raise CheckpointError(f"{file} is truncated or corrupt: {e}") from e
    f = handles[file]
    shape = tuple(f.get_slice(name).get_shape())
    if shape != want:
      raise CheckpointError(f"tensor {name!r} in {file} has shape {shape}, expected {want}")
    try:
      return np.asarray(f.get_tensor(name))
    except Exception as e:
      raise CheckpointError(f"tensor {name!r} in {file} cannot be read (truncated or corrupt "
                            f"file): {e}") from e

  def put(param_path: tuple[Any, ...], value: np.ndarray) -> None:
    var = _get_variable(model, param_path)
    var.set_value(jnp.asarray(np.ascontiguousarray(value.astype(var.dtype, copy=False))))

  for name, (param_path, transposed) in expected.items():
    shape = tuple(_get_variable(model, param_path).shape)
    tensor = read(name, shape[::-1] if transposed else shape)
    put(param_path, tensor.T if transposed else tensor)
  e, d, f = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
  for i, names in experts.items():
    at = ("layers", i, "mlp", "experts")
    if len(names) == 2:  # fused: gate_up [E, 2f, d] (gate first), down [E, d, f]
      gate_up = read(names[0], (e, 2 * f, d))
      put((*at, "gate_proj"), gate_up[:, :f].transpose(0, 2, 1))
      put((*at, "up_proj"), gate_up[:, f:].transpose(0, 2, 1))
      put((*at, "down_proj"), read(names[1], (e, d, f)).transpose(0, 2, 1))
      continue
    shapes = {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
    for proj, shape in shapes.items():
      stacked = np.stack([read(f"model.layers.{i}.mlp.experts.{j}.{proj}.weight", shape).T
                          for j in range(e)])
      put((*at, proj), stacked)
  handles.clear()
  return model, config

"""The architecture of DSA models: DeepSeek-V3.2 (transformers' `deepseek_v32`) and
GLM-MoE-DSA (`glm_moe_dsa`, GLM-5), as a frozen, validated dataclass read from an HF
config.json.

Owns `DeepseekV32Config` (every field the model uses; its invariants checked in
`__post_init__`, each refusal a `ConfigError` naming the field), transformers' defaults
for both model types (a field config.json lacks reads as transformers reads it), GLM's
`indexer_types` ("full" / "shared" per layer, from the field or its older spellings) and
the rope: default or YaRN (`YarnRope`: HF's `_compute_yarn_parameters`, from
`rope_parameters` or the released checkpoints' `rope_scaling`). The modules that compute
with it are models/deepseek_v32.py; reading a checkpoint is
models/deepseek_v32_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ConfigError, eos_token_ids

MODEL_TYPE = "deepseek_v32"
GLM_MODEL_TYPE = "glm_moe_dsa"
SUPPORTED_MODEL_TYPES = (MODEL_TYPE, GLM_MODEL_TYPE)
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

"""`ModelConfig`: the frozen, validated description of a Llama-family decoder.

This module owns the translation between a Hugging Face `config.json` (Llama 2/3, Qwen2,
Mistral) and the one config type the model, loader and engine use. Both the legacy layout
(`rope_theta` + `rope_scaling`) and the transformers>=5 layout (`rope_parameters`) are read;
`to_hf_dict` writes both so that old and new transformers load what we save.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")
_REQUIRED_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "mistral": "MistralForCausalLM"}


def eos_token_ids(eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
  """A config's `eos_token_id` (HF allows None, an int or a list) as a tuple of ids."""
  if eos_token_id is None:
    return ()
  if isinstance(eos_token_id, int):
    return (eos_token_id,)
  return tuple(eos_token_id)


class ConfigError(ValueError):
  """A config.json that cannot describe a model we support (missing field, bad value)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Llama-family decoder.

  Invariants (checked in `__post_init__`):
    * num_attention_heads is a positive multiple of num_key_value_heads (MHA, GQA or MQA);
    * head_dim is even (RoPE rotates pairs);
    * rope_scaling is None or a dict with rope_type "llama3" and its four parameters;
    * sliding_window is None (full causal attention) or a positive window: query position p
      sees key positions k with 0 <= p - k < sliding_window (Hugging Face's convention).
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: Mapping[str, Any] | None = None
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  sliding_window: int | None = None
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(f"unknown model_type {self.model_type!r}; supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads={self.num_key_value_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
    if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
      raise ConfigError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} "
                        "must be positive")
    if self.rope_scaling is not None:
      rope_type = self.rope_scaling.get("rope_type")
      if rope_type != "llama3":
        raise ConfigError(f"unsupported rope type {rope_type!r}; supported: "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}")
      missing = [k for k in _LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
      if missing:
        raise ConfigError(f"rope_scaling of type llama3 lacks {missing}")
      # Freeze the mapping so the config stays hashable-by-value in spirit.
      object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
    if self.sliding_window is not None and (
        not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
      raise ConfigError(f"sliding_window must be None or a positive int, "
                        f"got {self.sliding_window!r}")
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  def __hash__(self):
    # rope_scaling is a dict; hash by the sorted items so configs can be static jit args.
    items = dataclasses.astuple(self)
    return hash(tuple(tuple(sorted(x.items())) if isinstance(x, dict) else x for x in items))

  @property
  def num_queries_per_kv(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """All end-of-sequence ids (HF allows an int or a list)."""
    return eos_token_ids(self.eos_token_id)

  def num_params(self) -> int:
    """Parameter count of the decoder this config describes."""
    d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
    q, kv = self.num_attention_heads * h, self.num_key_value_heads * h
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.attention_bias else 0)
    mlp = 3 * d * f + ((2 * f + d) if self.mlp_bias else 0)
    per_layer = attn + mlp + 2 * d
    embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return self.num_hidden_layers * per_layer + embed + d

  @classmethod
  def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
    """Builds a config from a parsed HF `config.json`; raises `ConfigError` when it can't."""
    missing = [k for k in _REQUIRED_FIELDS if k not in raw or raw[k] is None]
    if missing:
      raise ConfigError(f"config.json lacks required field(s) {missing}")
    model_type = raw["model_type"]
    if model_type not in SUPPORTED_MODEL_TYPES:
      raise ConfigError(f"unknown model_type {model_type!r}; supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if raw.get("hidden_act", "silu") != "silu":
      raise ConfigError(f"unsupported hidden_act {raw['hidden_act']!r} (only silu)")
    num_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
    rope_theta, rope_scaling = _read_rope(raw)
    if model_type == "qwen2":
      attention_bias = True  # Qwen2 always has q/k/v biases (and no o bias).
      if raw.get("use_sliding_window", False):
        raise ConfigError("qwen2 with use_sliding_window=true (per-layer windows) is not "
                          "supported")
      sliding_window = None
    else:
      attention_bias = bool(raw.get("attention_bias", False))
      sliding_window = raw.get("sliding_window") if model_type == "mistral" else None
    if model_type == "llama" and raw.get("mlp_bias", False):
      mlp_bias = True
    else:
      mlp_bias = False
    return cls(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        sliding_window=sliding_window,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )

  def to_hf_dict(self) -> dict[str, Any]:
    """The HF `config.json` content for this config (readable by transformers 4 and 5)."""
    rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
      rope_parameters = {**self.rope_scaling, "rope_theta": self.rope_theta}
    out = {
        "architectures": [_ARCHITECTURES[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
        "rope_parameters": rope_parameters,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                         else self.eos_token_id),
        "pad_token_id": self.pad_token_id,
        "torch_dtype": "float32",
    }
    if self.model_type == "llama":
      out["attention_bias"] = self.attention_bias
      out["mlp_bias"] = self.mlp_bias
    if self.model_type == "mistral":
      out["sliding_window"] = self.sliding_window
    if self.model_type == "qwen2":
      out["use_sliding_window"] = False
      out["sliding_window"] = None
    return out


def _read_rope(raw: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
  """(rope_theta, llama3 scaling dict or None) from either HF layout; refuses other types."""
  params = raw.get("rope_parameters")
  if params is None:
    params = dict(raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
  params = dict(params)
  rope_type = params.get("rope_type", params.get("type", "default"))
  theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
  if not math.isfinite(theta):
    raise ConfigError(f"rope_theta={theta} is not finite")
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ConfigError(f"unsupported rope type {rope_type!r}; supported: "
                      f"{', '.join(SUPPORTED_ROPE_TYPES)}")
  scaling = {"rope_type": "llama3"}
  for key in _LLAMA3_ROPE_KEYS:
    if key not in params:
      raise ConfigError(f"rope scaling of type llama3 lacks {key!r}")
    scaling[key] = params[key]
  return theta, scaling

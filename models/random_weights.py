"""Random Llama weights made where the model runs: nothing read, nothing copied from host.

`random_llama(config, dtype)` builds a `LlamaForCausalLM` whose parameters are drawn by
`jax.random` inside jitted programs on the default device (an 8B-class model in bfloat16:
16 GB in seconds on a GPU, with no host copy first; `LlamaForCausalLM(config, seed=s)`
draws every tensor with numpy on the host and copies it over). The shapes come from
`nnx.eval_shape` (no memory touched); the values follow the model's own init: normal(0,
0.02), the residual projections (o_proj, down_proj) 0.02 / sqrt(2 x layers), norms ones,
biases zeros. `llama_8b_config()` is Llama-3.1-8B's architecture (what the GPU benches
serve with random weights).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.checkpoint import get_variable, hf_param_map
from models.config import ModelConfig
from models.llama import _INIT_STD, LlamaForCausalLM

# Llama-3.1-8B (meta-llama/Llama-3.1-8B config.json): GQA 32:8, head_dim 128, llama3 rope.
LLAMA_31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                   intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                   rope_theta=500000.0, max_position_embeddings=131072,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})


def llama_8b_config(**overrides: Any) -> ModelConfig:
  """Llama-3.1-8B's architecture (no special token ids: random weights have no
  tokenizer); `overrides` replace fields (fewer layers, a smaller vocabulary)."""
  return ModelConfig(**{**LLAMA_31_8B, **overrides})


@functools.cache
def _normal_program(shape: tuple[int, ...], dtype: Any, std: float):
  return jax.jit(lambda key: jax.random.normal(key, shape, dtype) * jnp.asarray(std, dtype))


def _std(path: tuple[Any, ...], num_layers: int) -> float | None:
  """The init std of the parameter at `path` (None: a norm weight or a bias)."""
  if path[-1] != "kernel" and path != ("embed_tokens",):
    return None
  if len(path) >= 2 and path[-2] in ("o_proj", "down_proj"):
    return _INIT_STD / math.sqrt(2 * num_layers)
  return _INIT_STD


def random_llama(config: ModelConfig, dtype: Any = jnp.bfloat16, seed: int = 0
                 ) -> LlamaForCausalLM:
  """A `LlamaForCausalLM` of `config` in `dtype` with random weights drawn on the default
  device (one small jitted program per distinct shape: the layers share them)."""
  model = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype, seed=None))
  params = hf_param_map(config)
  keys = jax.random.split(jax.random.key(seed), len(params))
  for key, (path, _) in zip(keys, params.values()):
    var = get_variable(model, path)
    shape = tuple(var.shape)
    std = _std(path, config.num_hidden_layers)
    if std is None:  # norms: ones; biases: zeros
      base = 1.0 if path[-1] == "weight" else 0.0
      var.set_value(jnp.full(shape, base, dtype))
    else:
      var.set_value(_normal_program(shape, jnp.dtype(dtype), std)(key))
  return model

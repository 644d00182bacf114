"""Tensor parallelism of the decoder: which parameter is split over the mesh axis, how.

Megatron's layout over one mesh axis `TP_AXIS` of `tp` devices:

    q_proj, k_proj, v_proj, gate_proj, up_proj   kernel [in, out]: out split (column)
    o_proj, down_proj                            kernel [in, out]: in split (row; XLA
                                                 adds the one all-reduce after each)
    embed_tokens, norms, lm_head                 replicated

So each device holds num_attention_heads / tp query heads and num_kv_heads / tp KV
heads, and attention never crosses devices. GQA with fewer KV heads than devices
(vLLM's rule): each KV head is repeated `kv_head_repeat(config, tp)` times, so every
device holds one copy of the KV head its query heads read; `tp_config` is the config of
that equivalent model (query head i reads repeated KV head i // (heads / (kv * r)) =
original KV head i // (heads / kv): floor divisions compose).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig

TP_AXIS = "tp"

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
  """ValueError naming `--tensor_parallel_size` when `tp` cannot split this model."""
  if not isinstance(tp, (int, np.integer)) or isinstance(tp, bool) or tp < 1:
    raise ValueError(f"--tensor_parallel_size must be a positive integer, got {tp!r}")
  heads, kv = config.num_attention_heads, config.num_key_value_heads
  if heads % tp:
    raise ValueError(f"--tensor_parallel_size={tp} does not divide the model's "
                     f"num_attention_heads={heads}")
  if kv % tp and tp % kv:
    raise ValueError(f"--tensor_parallel_size={tp} and the model's num_key_value_heads={kv}: "
                     "one must divide the other (KV heads are split, or repeated when "
                     "fewer than the devices)")
  if config.intermediate_size % tp:
    raise ValueError(f"--tensor_parallel_size={tp} does not divide the model's "
                     f"intermediate_size={config.intermediate_size}")


def kv_head_repeat(config: ModelConfig, tp: int) -> int:
  """How many copies of each KV head the `tp` devices hold together (1: split)."""
  kv = config.num_key_value_heads
  return tp // kv if tp > kv else 1


def tp_config(config: ModelConfig, tp: int) -> ModelConfig:
  """The config of the model as loaded over `tp` devices (KV heads repeated if fewer)."""
  check_tensor_parallel(config, tp)
  r = kv_head_repeat(config, tp)
  if r == 1:
    return config
  return dataclasses.replace(config, num_key_value_heads=config.num_key_value_heads * r)


def repeat_kv_heads(tensor: np.ndarray, where: str, head_dim: int, repeat: int,
                    transposed: bool) -> np.ndarray:
  """A k_proj / v_proj tensor (`where` names the parameter's path) with each KV head's
  rows (HF weight [out, in]: out axis 0; our kernel [in, out]: axis 1; bias [out])
  repeated `repeat` times in place; any other tensor as it is."""
  if repeat == 1 or not any(name in where for name in ("k_proj", "v_proj")):
    return tensor
  axis = 0 if (transposed or tensor.ndim == 1) else 1
  shape = tensor.shape
  heads = shape[axis] // head_dim
  split = shape[:axis] + (heads, head_dim) + shape[axis + 1:]
  out = np.repeat(tensor.reshape(split), repeat, axis=axis)
  return out.reshape(shape[:axis] + (heads * repeat * head_dim,) + shape[axis + 1:])


def param_spec(path: tuple) -> P:
  """PartitionSpec of the parameter at `path` (names as in models/llama.py)."""
  names = [p for p in path if isinstance(p, str)]
  if len(names) >= 2 and names[-2] in _COLUMN:
    return P(None, TP_AXIS) if names[-1] == "kernel" else P(TP_AXIS)
  if len(names) >= 2 and names[-2] in _ROW and names[-1] == "kernel":
    return P(TP_AXIS, None)
  return P()

"""Reading a DSA model's HF checkpoint (models/deepseek_v32.py's model, its
models/deepseek_v32_config.py config): config.json -> `DeepseekV32Config`, HF tensor
names -> our parameters (`hf_param_map`, the routed experts apart: per-expert tensors or
transformers' fused ones, stacked per layer), `load_pretrained`.

`models.loader` dispatches a directory whose config.json names model_type deepseek_v32 or
glm_moe_dsa here; this module imports what every format shares from models/checkpoint.py,
never the loader. Every failure is a `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from models.checkpoint import DTYPES, CheckpointError, get_variable, read_config_json, tensor_files
from models.config import ConfigError
from models.deepseek_v32 import DeepseekV32ForCausalLM
from models.deepseek_v32_config import DeepseekV32Config


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
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  path = os.fspath(path)
  config = load_config(path)
  jdtype = DTYPES[dtype]
  expected = hf_param_map(config)
  name_to_file = tensor_files(path)
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
    var = get_variable(model, param_path)
    var.set_value(jnp.asarray(np.ascontiguousarray(value.astype(var.dtype, copy=False))))

  for name, (param_path, transposed) in expected.items():
    shape = tuple(get_variable(model, param_path).shape)
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

"""What every checkpoint format shares: the error, the HF layout's file names and tensor names,
and the load target both formats fill.

`models.loader` dispatches a path to its format (an HF directory here and in the loader, a
GGUF file in `models/gguf_checkpoint.py`, a DSA model in `models/deepseek_v32_checkpoint.py`);
each of those imports this module and none imports the loader, so the formats stay
independent of one another and of the dispatcher.

Owns: `CheckpointError` (every loading failure, a ValueError naming the file and, where
there is one, the tensor), config.json reading, the safetensors index (`tensor_files`),
the llama family's HF tensor name -> NNX parameter map (`hf_param_map`: HF's torch layout
[out, in], ours [in, out]) and `LoadTarget` (the abstract model a checkpoint's tensors go
into, one at a time, optionally straight into their tensor-parallel shards).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from models import sharding
from models.config import ModelConfig
from models.llama import LlamaForCausalLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # what a model loads as


class CheckpointError(ValueError):
  """A checkpoint we cannot load; the message names the file (and tensor)."""


def read_config_json(path: str | os.PathLike) -> tuple[str, dict]:
  """(path of, contents of) the HF directory's config.json; `CheckpointError` names the
  file when it is missing, not JSON or not a JSON object."""
  file = os.path.join(os.fspath(path), CONFIG_FILE)
  if not os.path.isfile(file):
    raise CheckpointError(f"missing file {file}")
  try:
    with open(file) as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{file} is not valid JSON: {e}") from e
  if not isinstance(raw, dict):
    raise CheckpointError(f"{file} does not hold a JSON object")
  return file, raw


def hf_param_map(config: ModelConfig) -> dict[str, tuple[tuple[Any, ...], bool]]:
  """HF tensor name -> (path of our parameter, whether the tensor is transposed)."""
  out: dict[str, tuple[tuple[Any, ...], bool]] = {
      "model.embed_tokens.weight": (("embed_tokens",), False),
      "model.norm.weight": (("norm", "weight"), False),
  }
  if not config.tie_word_embeddings:
    out["lm_head.weight"] = (("lm_head", "kernel"), True)
  o_bias = config.attention_bias and config.model_type != "qwen2"
  for i in range(config.num_hidden_layers):
    pre = f"model.layers.{i}."
    for norm in ("input_layernorm", "post_attention_layernorm"):
      out[f"{pre}{norm}.weight"] = (("layers", i, norm, "weight"), False)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      out[f"{pre}self_attn.{proj}.weight"] = (("layers", i, "self_attn", proj, "kernel"), True)
      if config.attention_bias and (proj != "o_proj" or o_bias):
        out[f"{pre}self_attn.{proj}.bias"] = (("layers", i, "self_attn", proj, "bias"), False)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      out[f"{pre}mlp.{proj}.weight"] = (("layers", i, "mlp", proj, "kernel"), True)
      if config.mlp_bias:
        out[f"{pre}mlp.{proj}.bias"] = (("layers", i, "mlp", proj, "bias"), False)
  return out


def get_variable(model: nnx.Module, path: tuple[Any, ...]) -> nnx.Variable:
  """The variable at a parameter path (`hf_param_map`'s: attribute names, list indices)."""
  node: Any = model
  for part in path:
    node = node[part] if isinstance(part, int) else getattr(node, part)
  return node


def tensor_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file holding it (single file or sharded index)."""
  single = os.path.join(path, WEIGHTS_FILE)
  index = os.path.join(path, WEIGHTS_INDEX_FILE)
  if os.path.isfile(single):
    files = [single]
  elif os.path.isfile(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
    for name, shard in weight_map.items():
      if not os.path.isfile(os.path.join(path, shard)):
        raise CheckpointError(f"missing file {os.path.join(path, shard)} (shard of tensor "
                              f"{name!r} named by {index})")
    files = sorted({os.path.join(path, s) for s in weight_map.values()})
  else:
    raise CheckpointError(f"missing file {single} (or {index})")
  name_to_file: dict[str, str] = {}
  for file in files:
    try:
      with safe_open(file, framework="flax") as f:
        for name in f.keys():
          name_to_file[name] = file
    except Exception as e:  # safetensors raises its own error types on bad headers
      raise CheckpointError(f"{file} is truncated or corrupt: {e}") from e
  return name_to_file


class LoadTarget:
  """Where a checkpoint's tensors go, one at a time: the abstract model of `config` (shapes
  only, no memory) whose variables each `set` fills. With a mesh, tensor parallelism over
  its `models.sharding.TP_AXIS` axis: each tensor goes from host memory straight into its
  shards (`models.sharding.param_spec`; no device holds a full copy of a split parameter)
  and `config` / `model` are `models.sharding.tp_config`'s (KV heads repeated when fewer
  than the devices). Both checkpoint formats (HF directory, GGUF file) load through it."""

  def __init__(self, config: ModelConfig, dtype: str, mesh: jax.sharding.Mesh | None):
    if dtype not in DTYPES:
      raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    self.dtype = DTYPES[dtype]
    self.mesh = mesh
    self.source_config = config
    self.shapes_model = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=self.dtype,
                                                                seed=None))
    self.model = self.shapes_model  # the model whose variables get the values
    self.config = config
    self.repeat = 1
    self.host = None
    if mesh is not None:
      tp = int(mesh.shape[sharding.TP_AXIS])
      tp_cfg = sharding.tp_config(config, tp)
      self.repeat = sharding.kv_head_repeat(config, tp)
      if self.repeat > 1:
        self.model = nnx.eval_shape(lambda: LlamaForCausalLM(tp_cfg, dtype=self.dtype,
                                                             seed=None))
      self.config = tp_cfg
      self.host = jax.local_devices(backend="cpu")[0]  # tensors read into host memory

  def checkpoint_shape(self, param_path: tuple[Any, ...], transposed: bool) -> tuple[int, ...]:
    """The shape the checkpoint's tensor for `param_path` must have (HF layout)."""
    var = get_variable(self.shapes_model, param_path)
    return tuple(var.shape[::-1] if transposed else var.shape)

  def set(self, param_path: tuple[Any, ...], transposed: bool, tensor: Any) -> None:
    """Fills `param_path` from a checkpoint tensor (HF layout; numpy or jax array). A numpy
    tensor is cast and transposed on the host (no XLA op compiled per shape) and copied
    to the device once."""
    if self.mesh is None:
      if isinstance(tensor, np.ndarray):
        tensor = tensor.astype(self.dtype, copy=False)
        tensor = jnp.asarray(np.ascontiguousarray(tensor.T if transposed else tensor))
        get_variable(self.model, param_path).set_value(tensor)
        return
      tensor = jnp.asarray(tensor).astype(self.dtype)
      get_variable(self.model, param_path).set_value(tensor.T if transposed else tensor)
      return
    tensor = np.asarray(tensor).astype(self.dtype)
    tensor = sharding.repeat_kv_heads(tensor, str(param_path[-2:]),
                                      self.source_config.head_dim, self.repeat, transposed)
    tensor = tensor.T if transposed else tensor
    spec = jax.sharding.NamedSharding(self.mesh, sharding.param_spec(param_path))
    get_variable(self.model, param_path).set_value(jax.device_put(tensor, spec))

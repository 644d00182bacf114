"""ONE loader for every checkpoint: the dispatcher (a path, a model preset's name or None ->
its format) and the Hugging Face-layout directory's own loading, saving and converting.

A path that is a file is a GGUF checkpoint (llama.cpp's format; `models/gguf_checkpoint.py`
owns it); a directory whose config.json names a DSA model type loads through
`models/deepseek_v32_checkpoint.py`; every other directory is a llama-family HF checkpoint
read here. Every public function takes any of them where it takes a path. This module is
the only one that imports the formats' modules; what they share (`CheckpointError`, the HF
tensor names, `LoadTarget`) is `models/checkpoint.py`, re-exported here. Every failure
raises `CheckpointError` (a ValueError) naming the file and, where there is one, the tensor.

Layout read: `config.json` + (`model.safetensors` | `model.safetensors.index.json` with its
shards) + `tokenizer.json` (+ optional `generation_config.json`, `tokenizer_config.json`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

import models
from models import sharding
from models.checkpoint import (  # CheckpointError, LoadTarget, hf_param_map: also public here
    CONFIG_FILE,
    DTYPES,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    LoadTarget,
    get_variable,
    hf_param_map,
    read_config_json,
    tensor_files,
)
from models.config import ConfigError, ModelConfig
from models.llama import LlamaForCausalLM
from models.tokenizer import Tokenizer

_SAVE_DTYPES = {**DTYPES, "float16": jnp.float16}
# Buffers some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _resolve(path: str | os.PathLike | None) -> str:
  """A checkpoint directory, a GGUF file or a model preset's name (configs/models.py:
  `hisparse-tiny`, `smollm2-135m-instruct`) -> the path to read; None: the default model."""
  path = models.DEFAULT_MODEL_DIR if path is None else os.fspath(path)
  if not (os.path.isdir(path) or os.path.isfile(path)):
    from configs.models import MODEL_PRESETS  # noqa: PLC0415 (configs imports models)

    if path in MODEL_PRESETS:
      try:
        return MODEL_PRESETS[path].resolve()
      except FileNotFoundError as e:  # its package is not installed
        raise CheckpointError(str(e)) from None
    what = "GGUF file" if path.lower().endswith(".gguf") else "checkpoint directory"
    raise CheckpointError(f"{what} {path} does not exist")
  return path


def _is_gguf_path(path: str) -> bool:
  """A resolved checkpoint path that is a file: a GGUF checkpoint (directories are HF)."""
  return os.path.isfile(path)


def load_config(path: str | os.PathLike | None = None) -> ModelConfig:
  """The `ModelConfig` of the checkpoint at `path` (None = the embedded default model)."""
  path = _resolve(path)
  if _is_gguf_path(path):
    from models import gguf_checkpoint  # noqa: PLC0415
    return gguf_checkpoint.load_config(path)
  file, raw = read_config_json(path)
  if _is_dsa(raw):
    from models import deepseek_v32_checkpoint  # noqa: PLC0415 (DSA support is loaded on use)
    return deepseek_v32_checkpoint.load_config(path)
  try:
    return ModelConfig.from_hf_dict(raw)
  except ConfigError as e:
    raise CheckpointError(f"{file}: {e}") from e


# DSA models (MLA + lightning indexer): their own config (models/deepseek_v32_config.py) and
# checkpoint reading (models/deepseek_v32_checkpoint.py).
DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")


def _is_dsa(raw: dict) -> bool:
  return raw.get("model_type") in DSA_MODEL_TYPES


def is_dsa_config(config: Any) -> bool:
  """Whether a loaded model config is a DSA model's (models.deepseek_v32)."""
  return getattr(config, "model_type", None) in DSA_MODEL_TYPES


def checkpoint_dtype(path: str | os.PathLike | None = None) -> str:
  """What `dtype="auto"` loads the checkpoint at `path` as: its config.json
  `torch_dtype` (or `dtype`), float32 or bfloat16; float16 checkpoints load as bfloat16
  (the engine computes in float32 or bfloat16, as vLLM's CPU backend does with float16);
  float32 where the field is absent. A GGUF file: `gguf_checkpoint.checkpoint_dtype`
  (float32 for float32 and quantized matrices, bfloat16 for float16/bfloat16 ones)."""
  path = _resolve(path)
  if _is_gguf_path(path):
    from models import gguf_checkpoint  # noqa: PLC0415
    return gguf_checkpoint.checkpoint_dtype(path)
  file = os.path.join(path, CONFIG_FILE)
  try:
    with open(file) as f:
      raw = json.load(f)
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{file} is not readable JSON: {e}") from e
  name = raw.get("torch_dtype", raw.get("dtype")) if isinstance(raw, dict) else None
  if name is None:
    return "float32"
  name = str(name).removeprefix("torch.")
  if name in ("float32", "bfloat16"):
    return name
  if name == "float16":
    return "bfloat16"
  raise CheckpointError(f"{file}: torch_dtype {name!r} is not a dtype this engine loads "
                        "(float32, bfloat16, float16)")


def load_pretrained(path: str | os.PathLike | None = None, dtype: str = "float32",
                    mesh: jax.sharding.Mesh | None = None
                    ) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer]:
  """(model, config, tokenizer) from a HF-layout directory or a GGUF file (None = the
  embedded default model). Both formats end in the same model.

  dtype: "float32" or "bfloat16"; every parameter is converted to it (GGUF tensors are
  dequantized to float32 first).
  mesh: tensor parallelism over its `models.sharding.TP_AXIS` axis: each tensor is read
  into host memory and put straight into its shards (`models.sharding.param_spec`; no
  device holds a full copy of a split parameter); the config returned is
  `models.sharding.tp_config` (KV heads repeated when fewer than the devices).

  A DSA checkpoint (config.json's model_type deepseek_v32 or glm_moe_dsa) loads through
  `models.deepseek_v32_checkpoint.load_pretrained`: (DeepseekV32ForCausalLM, DeepseekV32Config,
  tokenizer); no tensor parallelism.
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  path = _resolve(path)
  if _is_gguf_path(path):
    from models import gguf_checkpoint  # noqa: PLC0415 (GGUF support is loaded on use)
    return gguf_checkpoint.load_pretrained(path, dtype, mesh)
  config = load_config(path)
  if is_dsa_config(config):
    if mesh is not None:
      raise CheckpointError(f"{path}: DSA models ({config.model_type}) are not supported "
                            "with tensor parallelism (--tensor_parallel_size > 1)")
    from models import deepseek_v32_checkpoint  # noqa: PLC0415
    model, config = deepseek_v32_checkpoint.load_pretrained(path, dtype)
    return model, config, _load_tokenizer(path)
  expected = hf_param_map(config)
  name_to_file = tensor_files(path)
  present = {n for n in name_to_file if not n.endswith(_IGNORED_SUFFIXES)}
  if config.tie_word_embeddings:
    present.discard("lm_head.weight")  # some exporters write the tied copy; it is redundant
  missing = sorted(set(expected) - present)
  if missing:
    raise CheckpointError(f"missing tensor {missing[0]!r} in {path} "
                          f"({len(missing)} missing in all)")
  extra = sorted(present - set(expected))
  if extra:
    raise CheckpointError(f"unexpected tensor {extra[0]!r} in {name_to_file[extra[0]]} "
                          f"({len(extra)} unexpected in all)")
  target = LoadTarget(config, dtype, mesh)
  by_file: dict[str, list[str]] = {}
  for name in expected:
    by_file.setdefault(name_to_file[name], []).append(name)
  for file, names in by_file.items():
    try:
      handle = safe_open(file, framework="flax")
    except Exception as e:
      raise CheckpointError(f"{file} is truncated or corrupt: {e}") from e
    with handle as f:
      for name in names:
        param_path, transposed = expected[name]
        want = target.checkpoint_shape(param_path, transposed)
        shape = tuple(f.get_slice(name).get_shape())
        if shape != want:
          raise CheckpointError(f"tensor {name!r} in {file} has shape {shape}, expected {want}")
        try:
          if target.host is None:
            tensor = f.get_tensor(name)
          else:
            with jax.default_device(target.host):
              tensor = f.get_tensor(name)
        except Exception as e:
          raise CheckpointError(f"tensor {name!r} in {file} cannot be read (truncated or "
                                f"corrupt file): {e}") from e
        target.set(param_path, transposed, tensor)
  return target.model, target.config, _load_tokenizer(path)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
  """The tokenizer of the checkpoint at `path` (None = the embedded default model); a GGUF
  file's from its metadata (`models.gguf_tokenizer.load_tokenizer`)."""
  return _load_tokenizer(_resolve(path))


def _load_tokenizer(path: str) -> Tokenizer:
  try:
    if _is_gguf_path(path):
      from models import gguf_tokenizer  # noqa: PLC0415 (GGUF support is loaded on use)
      return gguf_tokenizer.load_tokenizer(path)
    return Tokenizer.from_dir(path)
  except CheckpointError:
    raise
  except (FileNotFoundError, ValueError) as e:
    raise CheckpointError(str(e)) from e


def save_pretrained(model: LlamaForCausalLM, out_dir: str | os.PathLike, *,
                    dtype: str = "float32",
                    generation_config: dict[str, Any] | None = None,
                    tokenizer: Tokenizer | None = None) -> None:
  """Writes config.json, model.safetensors (and generation_config.json) in HF layout, as
  transformers and vLLM read them: the weights in `dtype` (float32, bfloat16, float16;
  `torch_dtype` names it), the tied output projection not written (config.json's
  `tie_word_embeddings` says so).

  tokenizer: also writes tokenizer.json + tokenizer_config.json (`save_tokenizer_files`:
  BOS/EOS/pad tokens, chat template) and, unless `generation_config` is given, a
  generation_config.json with its BOS / pad ids and every EOS id (end-of-turn tokens
  included: a chat model stops on them)."""
  from safetensors.flax import save_file  # noqa: PLC0415 (only writers need it)

  from models.tokenizer import save_tokenizer_files  # noqa: PLC0415
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype must be one of {sorted(_SAVE_DTYPES)}, got {dtype!r}")
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  config = model.config
  tensors = {}
  for name, (param_path, transposed) in hf_param_map(config).items():
    value = get_variable(model, param_path)[...]
    value = value.T if transposed else value
    tensors[name] = jnp.asarray(jax.device_get(value)).astype(_SAVE_DTYPES[dtype])
  save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
  hf = config.to_hf_dict()
  hf["torch_dtype"] = hf["dtype"] = dtype  # transformers 4 reads the first, 5 the second
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(hf, f, indent=2)
    f.write("\n")
  if tokenizer is not None:
    save_tokenizer_files(tokenizer, out_dir, model_max_length=config.max_position_embeddings)
    if generation_config is None:
      eos = list(tokenizer.eos_token_ids)
      generation_config = {"bos_token_id": tokenizer.bos_token_id,
                           "eos_token_id": eos[0] if len(eos) == 1 else eos,
                           "pad_token_id": tokenizer.pad_token_id}
      generation_config = {k: v for k, v in generation_config.items() if v not in (None, [])}
  if generation_config is not None:
    with open(os.path.join(out_dir, GENERATION_CONFIG_FILE), "w") as f:
      json.dump(generation_config, f, indent=2)
      f.write("\n")


def convert(path: str | os.PathLike | None, out_dir: str | os.PathLike, *,
            dtype: str = "auto") -> tuple[ModelConfig, str]:
  """Writes the checkpoint at `path` (an HF directory, a GGUF file or a model preset's name;
  None = the default model) as an HF-layout directory `out_dir` that this project,
  transformers and vLLM load: `save_pretrained` of the model as loaded (GGUF tensors
  dequantized, Q/K in HF's layout) with its tokenizer. dtype: "auto" (the checkpoint's,
  `checkpoint_dtype`), float32, bfloat16 or float16. The files are written into a new
  directory beside `out_dir`, renamed to it when complete (`out_dir` must not exist, or
  be empty). Returns (config, dtype written)."""
  out_dir = os.path.abspath(os.fspath(out_dir))
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
    raise ValueError(f"{out_dir} exists and is not an empty directory")
  path = _resolve(path)
  if not _is_gguf_path(path) and is_dsa_config(config := load_config(path)):
    raise CheckpointError(f"{path} is a DSA model ({config.model_type}), already in HF "
                          "layout; convert writes llama-family models (from GGUF files or "
                          "HF directories)")
  if dtype == "auto":
    dtype = checkpoint_dtype(path)
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype must be auto or one of {sorted(_SAVE_DTYPES)}, got {dtype!r}")
  model, config, tokenizer = load_pretrained(path, dtype="float32" if dtype == "float16"
                                             else dtype)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
  try:
    save_pretrained(model, staging, dtype=dtype, tokenizer=tokenizer)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # as os.makedirs would (mkdtemp: 0o700)
    for name in os.listdir(staging):  # (safetensors writes 0o600)
      os.chmod(os.path.join(staging, name), 0o666 & ~umask)
    os.replace(staging, out_dir)  # an empty out_dir is replaced; a non-empty one refuses
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return config, dtype


def param_count(model: nnx.Module) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def shard_model(model: LlamaForCausalLM, mesh: jax.sharding.Mesh) -> LlamaForCausalLM:
  """An in-memory model put into its shards over `mesh` (as `load_pretrained(mesh=)` loads
  one; its config is `models.sharding.tp_config`). Each parameter is read back to host
  memory first, so the source model's full copy is where it already was (tests and
  embedders that build a model themselves; checkpoints load straight into shards)."""
  config = model.config
  tp = int(mesh.shape[sharding.TP_AXIS])
  tp_cfg = sharding.tp_config(config, tp)
  repeat = sharding.kv_head_repeat(config, tp)
  dtype = model.embed_tokens[...].dtype
  placed = nnx.eval_shape(lambda: LlamaForCausalLM(tp_cfg, dtype=dtype, seed=None))
  for param_path, _ in hf_param_map(config).values():
    value = np.asarray(jax.device_get(get_variable(model, param_path)[...]))
    value = sharding.repeat_kv_heads(value, str(param_path[-2:]), config.head_dim, repeat,
                                     transposed=False)
    spec = jax.sharding.NamedSharding(mesh, sharding.param_spec(param_path))
    get_variable(placed, param_path).set_value(jax.device_put(value, spec))
  return placed

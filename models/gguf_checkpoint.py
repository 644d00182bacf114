"""GGUF checkpoints (llama.cpp's single-file format) of Llama, Qwen2 and Mistral models.

This module owns everything GGUF: metadata -> `ModelConfig`, GGUF tensor names
(`blk.3.attn_q.weight`) -> Hugging Face names (`model.layers.3.self_attn.q_proj.weight`, whose
mapping to our parameters `models/checkpoint.py` owns), dequantization to float32, the
undoing of llama.cpp's Q/K permutation (the file's reader: gguf_reader.py; the tokenizer the
metadata describes: gguf_tokenizer.py). Files are read only through llama.cpp's own `gguf`
package (`gguf.GGUFReader`, `gguf.quants.dequantize`):
every tensor type it dequantizes loads, one tensor at a time. Every failure raises
`CheckpointError` naming the file and what is wrong with it.

Callers use `models.loader` (`load_pretrained`, `load_config`, `checkpoint_dtype`,
`load_tokenizer` take a `.gguf` file where they take an HF directory).

The module is not called `gguf.py`: run as a script from inside `models/`, such a file
would shadow the `gguf` package it reads with.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import numpy as np

from models.checkpoint import DTYPES, CheckpointError, LoadTarget, hf_param_map
from models.config import ConfigError, ModelConfig
from models.gguf_reader import MISSING, metadata_value, open_reader
from models.gguf_tokenizer import tokenizer_from_reader

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")

# GGUF tensor name -> HF tensor name ({i}: the layer). `models.checkpoint.hf_param_map` maps the
# HF names on to our parameters, so both formats end in the same model.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors some converters write that carry no parameters (the rotary inverse frequencies).
_IGNORED_SUFFIXES = (".attn_rot_embd",)
# llama.cpp's form of Llama 3.1-style rope scaling: one divisor per rotary frequency (read
# into the config's rope_scaling, not a parameter).
ROPE_FREQS = "rope_freqs.weight"


def gguf_tensor_names(config: ModelConfig) -> dict[str, str]:
  """GGUF tensor name -> HF tensor name, for every tensor a GGUF of `config` holds."""
  inverse = {}
  for i in range(config.num_hidden_layers):
    for short, long in _LAYER_TENSORS.items():
      for kind in ("weight", "bias"):
        inverse[f"model.layers.{i}.{long}.{kind}"] = f"blk.{i}.{short}.{kind}"
  inverse.update({v: k for k, v in _GLOBAL_TENSORS.items()})
  return {inverse[hf]: hf for hf in hf_param_map(config)}


# ----------------------------------------------------------------------------- reading


@functools.lru_cache(maxsize=8)
def _summary(path: str, mtime_ns: int, size: int) -> tuple[ModelConfig, str]:
  """(config, "auto" dtype) of a file, cached by identity: `checkpoint_dtype`, `load_config`
  and `load_pretrained` each read the file's metadata, which takes seconds for a large
  vocabulary."""
  del mtime_ns, size
  reader = open_reader(path)
  return _config(reader, path), _auto_dtype(reader, path)


def _cached_summary(path: str) -> tuple[ModelConfig, str]:
  path = os.fspath(path)
  try:
    st = os.stat(path)
  except OSError as e:
    raise CheckpointError(f"GGUF file {path} does not exist") from e
  return _summary(os.path.realpath(path), st.st_mtime_ns, st.st_size)


def load_config(path: str | os.PathLike) -> ModelConfig:
  """The `ModelConfig` the GGUF file at `path` describes (its architecture's metadata)."""
  return _cached_summary(path)[0]


def checkpoint_dtype(path: str | os.PathLike) -> str:
  """What `dtype="auto"` loads the GGUF at `path` as: float32 when its matrices are float32
  or quantized (dequantized values are exact in float32, not in bfloat16), bfloat16 when
  they are all float16 or bfloat16 (float16 as for safetensors checkpoints)."""
  return _cached_summary(path)[1]


def _auto_dtype(reader, path: str) -> str:
  import gguf  # noqa: PLC0415

  half = {gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
  types = {t.tensor_type for t in reader.tensors if len(t.shape) >= 2}
  return "bfloat16" if types and types <= half else "float32"


def _config(reader, path: str) -> ModelConfig:
  """The HF config.json fields the metadata gives, through `ModelConfig.from_hf_dict`."""
  arch = metadata_value(reader, path, "general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(f"{path}: unknown architecture {arch!r} (general.architecture); "
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

  def key(name: str, default: Any = MISSING) -> Any:
    value = metadata_value(reader, path, f"{arch}.{name}", default)
    if isinstance(value, list):  # per-layer values (some architectures): one value only
      if len(set(value)) != 1:
        raise CheckpointError(f"{path}: metadata key {arch}.{name} varies per layer "
                              f"({value[:4]}...); not supported")
      value = value[0]
    return value

  names = {t.name for t in reader.tensors}
  hidden, heads = key("embedding_length"), key("attention.head_count")
  head_dim = key("attention.key_length", None)
  if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
    head_dim = hidden // heads
  value_dim = key("attention.value_length", head_dim)
  if value_dim != head_dim:
    raise CheckpointError(f"{path}: {arch}.attention.value_length={value_dim} differs from "
                          f"the key length {head_dim}; not supported")
  rope_dim = key("rope.dimension_count", head_dim)
  if rope_dim != head_dim:
    raise CheckpointError(f"{path}: {arch}.rope.dimension_count={rope_dim} rotates part of "
                          f"each head (head_dim {head_dim}); partial rotary is not supported")
  scaling = key("rope.scaling.type", "none")
  if scaling == "linear" and key("rope.scaling.factor", 1.0) == 1.0:
    scaling = "none"  # a factor of 1 scales nothing
  if scaling != "none":
    raise CheckpointError(f"{path}: unsupported rope type {scaling!r} "
                          f"({arch}.rope.scaling.type); supported: none, and llama3 as "
                          f"{ROPE_FREQS}")
  theta = key("rope.freq_base", 10000.0)
  rope_scaling = None
  freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
  if freqs is not None:
    rope_scaling = _llama3_scaling(_dequantized(freqs, path), float(theta), head_dim,
                                   key("rope.scaling.original_context_length", None), path)
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  vocab_size = key("vocab_size", None)
  if vocab_size is None:
    if tokens is None:
      raise CheckpointError(f"{path} has no tokenizer (metadata key 'tokenizer.ggml.tokens' "
                            f"is missing) and no {arch}.vocab_size")
    vocab_size = len(tokens.data)
  raw = {
      "model_type": arch,
      "vocab_size": vocab_size,
      "hidden_size": hidden,
      "intermediate_size": key("feed_forward_length"),
      "num_hidden_layers": key("block_count"),
      "num_attention_heads": heads,
      "num_key_value_heads": key("attention.head_count_kv", heads),
      "head_dim": head_dim,
      "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
      "rope_theta": theta,
      "rope_scaling": rope_scaling,
      "max_position_embeddings": key("context_length"),
      # llama.cpp writes the output projection only when it is not the embedding matrix.
      "tie_word_embeddings": "output.weight" not in names,
      "attention_bias": "blk.0.attn_q.bias" in names,
      "mlp_bias": "blk.0.ffn_gate.bias" in names,
      "sliding_window": key("attention.sliding_window", None),
      "bos_token_id": metadata_value(reader, path, "tokenizer.ggml.bos_token_id", None),
      "eos_token_id": metadata_value(reader, path, "tokenizer.ggml.eos_token_id", None),
      "pad_token_id": metadata_value(reader, path, "tokenizer.ggml.padding_token_id", None),
  }
  try:
    return ModelConfig.from_hf_dict(raw)
  except ConfigError as e:
    raise CheckpointError(f"{path}: {e}") from e
  except (TypeError, ValueError) as e:  # a metadata value of the wrong type
    raise CheckpointError(f"{path}: metadata describes no valid model: {e}") from e


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
  """The `rope_freqs.weight` llama.cpp's converter writes for HF llama3 rope scaling: per
  rotary frequency, the divisor of its inverse frequency (float32 [head_dim // 2])."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  factor = scaling["factor"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  old = scaling["original_max_position_embeddings"]
  out = []
  for freq in inv_freq:
    wavelen = 2 * np.pi / freq
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


def _llama3_scaling(factors: np.ndarray, theta: float, head_dim: int,
                    original_context: int | None, path: str) -> dict[str, Any] | None:
  """The HF llama3 rope_scaling that gives llama.cpp's per-frequency divisors `factors`.

  Factors are 1 at high frequencies, `factor` at low ones and, in between, 1 / f is affine
  in the inverse frequency: 1/f = 1/factor + s (1 - 1/factor), s = (old / (2 pi) inv_freq
  - low) / (high - low). Its slope and intercept fix old, low and high up to one degree
  of freedom, fixed by the file's original context length or else by low = 1 (Llama 3.x's
  value); any choice gives the same frequencies. The result is checked by recomputing the
  factors from it."""
  where = f"{path}: {ROPE_FREQS}"
  if factors.shape != (head_dim // 2,):
    raise CheckpointError(f"{where} has shape {factors.shape}, expected ({head_dim // 2},)")
  f = factors.astype(np.float64)
  if np.allclose(f, 1.0, rtol=0, atol=1e-6):
    return None
  factor = float(f.max())
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  medium = (f > 1 + 1e-5) & (f < factor * (1 - 1e-5))
  scaling = None
  if medium.sum() >= 2 and factor > 1:
    s = (1 / f[medium] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_freq[medium], s, 1)
    if slope > 0 and intercept < 0:
      if original_context is None:
        width = -1.0 / intercept  # low = 1
        original_context = int(round(2 * np.pi * slope * width))
      width = original_context / (2 * np.pi * slope)
      low = -intercept * width

      def snap(x: float) -> float:
        r = round(x, 4)
        return r if abs(r - x) <= 1e-5 * max(1.0, abs(x)) else x

      scaling = {"rope_type": "llama3", "factor": snap(factor), "low_freq_factor": snap(low),
                 "high_freq_factor": snap(low + width),
                 "original_max_position_embeddings": int(original_context)}
  if scaling is None or not np.allclose(
      llama3_rope_factors(theta, head_dim, scaling), factors, rtol=1e-5, atol=0):
    raise CheckpointError(f"{where} (per-frequency rope factors {factors.round(4).tolist()}) "
                          "is not llama3 rope scaling this loader can express")
  return scaling


# ----------------------------------------------------------------------------- tensors


@functools.cache
def _can_dequantize(qtype) -> bool:
  """Whether `gguf.quants.dequantize` handles tensor type `qtype` (tried on one zero block)."""
  import gguf  # noqa: PLC0415

  if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
    return True
  if qtype in (gguf.GGMLQuantizationType.I8, gguf.GGMLQuantizationType.I16,
               gguf.GGMLQuantizationType.I32, gguf.GGMLQuantizationType.I64):
    return False  # integers, not weights
  try:
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
  except Exception:
    return False
  return True


def _type_name(qtype) -> str:
  return getattr(qtype, "name", str(qtype))


def unpermute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes the permutation llama.cpp's converter applies to the Q and K projections (weight
  [heads * head_dim, ...] or bias) of llama models, so their rows are in HF's rotate-half
  layout again (transformers' `LlamaTensorProcessor._reverse_permute_weights`).

  The converter's `permute` reshapes rows to (heads, 2, head_dim // 2) and swaps the last
  two axes; this reshapes to (heads, head_dim // 2, 2) and swaps them back."""
  dim = weights.shape[0] // num_heads // 2
  w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
  return w.swapaxes(2, 1).reshape(weights.shape)


def permute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
  """llama.cpp's converter's `permute` (the inverse of `unpermute_qk`; for writing files)."""
  w = weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
  return w.swapaxes(1, 2).reshape(weights.shape)


def _dequantized(tensor, path: str) -> np.ndarray:
  """The float32 values of a GGUF tensor, numpy order (HF layout: [out, in] for matrices)."""
  import gguf  # noqa: PLC0415

  try:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # F32 dequantizes to a view of the file's memory map: copied, so no parameter is
    # backed by the file.
    f32 = tensor.tensor_type == gguf.GGMLQuantizationType.F32
    values = np.array(values, np.float32, copy=True if f32 else None)
    return values.reshape(tuple(int(d) for d in tensor.shape[::-1]))
  except Exception as e:
    raise CheckpointError(f"tensor {tensor.name!r} in {path} (type "
                          f"{_type_name(tensor.tensor_type)}) cannot be dequantized: {e}") from e


def _read_tensor(tensor, config: ModelConfig, path: str) -> np.ndarray:
  """The float32 values of a GGUF tensor in HF layout, Q/K un-permuted."""
  values = _dequantized(tensor, path)
  # transformers undoes the permutation for files of architecture llama only (its
  # TENSOR_PROCESSORS); llama.cpp writes mistral models as llama, and qwen2 (NeoX rope)
  # is never permuted.
  if config.model_type == "llama":
    if ".attn_q." in tensor.name:
      values = unpermute_qk(values, config.num_attention_heads)
    elif ".attn_k." in tensor.name:
      values = unpermute_qk(values, config.num_key_value_heads)
  return values


def _checked_tensors(reader, target: LoadTarget, path: str) -> list[tuple[Any, str]]:
  """(GGUF tensor, HF name) for every tensor the model needs, after checking names, shapes
  and types of them all (before any is read)."""
  config = target.source_config
  expected = gguf_tensor_names(config)
  by_name = {}
  for t in reader.tensors:
    if t.name.endswith(_IGNORED_SUFFIXES) or t.name == ROPE_FREQS:  # ROPE_FREQS: config
      continue
    by_name[t.name] = t
  missing = sorted(set(expected) - set(by_name))
  if missing:
    raise CheckpointError(f"missing tensor {missing[0]!r} in {path} "
                          f"({len(missing)} missing in all)")
  extra = sorted(set(by_name) - set(expected))
  if extra:
    raise CheckpointError(f"unexpected tensor {extra[0]!r} in {path} "
                          f"({len(extra)} unexpected in all)")
  hf_map = hf_param_map(config)
  out = []
  for name, t in by_name.items():
    hf = expected[name]
    shape = tuple(int(d) for d in t.shape[::-1])
    want = target.checkpoint_shape(*hf_map[hf])
    if shape != want:
      raise CheckpointError(f"tensor {name!r} in {path} has shape {shape} (HF layout), "
                            f"expected {want}")
    if not _can_dequantize(t.tensor_type):
      raise CheckpointError(f"tensor {name!r} in {path} has type "
                            f"{_type_name(t.tensor_type)}, which gguf.quants cannot "
                            "dequantize (unsupported tensor type)")
    out.append((t, hf))
  return out


def load_pretrained(path: str | os.PathLike, dtype: str = "float32",
                    mesh: jax.sharding.Mesh | None = None):
  """(model, config, tokenizer) from a GGUF file; see `models.loader.load_pretrained`."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  path = os.fspath(path)
  reader = open_reader(path)
  config = _config(reader, path)
  target = LoadTarget(config, dtype, mesh)
  tensors = _checked_tensors(reader, target, path)
  tokenizer = tokenizer_from_reader(reader, path)  # before any tensor is read: fails fast
  hf_map = hf_param_map(config)
  for tensor, hf in tensors:
    param_path, transposed = hf_map[hf]
    target.set(param_path, transposed, _read_tensor(tensor, config, path))
  return target.model, target.config, tokenizer

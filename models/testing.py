"""Small random checkpoints for tests and examples (no training, no download).

`save_random_checkpoint` writes a random Llama over the default model's vocabulary in HF
layout (config.json, model.safetensors, tokenizer.json, ...), loadable by
`models.loader.load_pretrained` and by transformers. `save_gguf` writes a model as a GGUF
file the way llama.cpp's converter does (with a byte-level BPE from `byte_level_tokenizer`).
"""

from __future__ import annotations

import os
from typing import Any

from models import data
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.loader import save_pretrained
from models.tokenizer import build_word_level_tokenizer, save_tokenizer_files


def tiny_random_config(max_position_embeddings: int = 512) -> ModelConfig:
  """2 layers x 1 KV head x 16 dims (256 KV bytes per float32 token), default vocabulary."""
  return ModelConfig(model_type="llama", vocab_size=len(data.VOCAB), hidden_size=32,
                     intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16,
                     max_position_embeddings=max_position_embeddings,
                     bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID,
                     pad_token_id=data.PAD_ID)


def save_random_checkpoint(out_dir: str | os.PathLike, *, seed: int = 0,
                           config: ModelConfig | None = None) -> str:
  """Writes a random model (`config`, default `tiny_random_config()`) and the default
  model's tokenizer to `out_dir`; returns the directory as a string."""
  config = config if config is not None else tiny_random_config()
  save_pretrained(LlamaForCausalLM(config, seed=seed), out_dir)
  tok = build_word_level_tokenizer(data.VOCAB, bos=data.BOS, eos=data.EOS, pad=data.PAD,
                                   unk=data.UNK)
  save_tokenizer_files(tok, out_dir, bos=data.BOS, eos=data.EOS, pad=data.PAD, unk=data.UNK,
                       model_max_length=config.max_position_embeddings,
                       chat_template=data.CHAT_TEMPLATE)
  return str(out_dir)


# ----------------------------------------------------------------------------- GGUF files

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_BPE_CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 2024 and we'll see 1,234.56 more!",
    "Small models learn fast: keys, values, copies; retrieval at 512, 1024 and 2048 tokens.",
    "  Whitespace   runs\tand\ttabs\nnew lines\n\nhéllo wörld naïve café",
)


def random_model(config: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
  """A random model whose norm weights and biases are random too (not ones and zeros), so
  that every tensor a checkpoint holds changes the logits."""
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from models.checkpoint import get_variable, hf_param_map  # noqa: PLC0415

  model = LlamaForCausalLM(config, seed=seed)
  rng = np.random.default_rng(seed + 1)
  for name, (path, _) in hf_param_map(config).items():
    var = get_variable(model, path)
    if len(var.shape) == 1:
      base = 1.0 if name.endswith("norm.weight") else 0.0
      var.set_value(jnp.asarray(base + 0.1 * rng.standard_normal(var.shape), var.dtype))
  return model


def byte_level_tokenizer(vocab_size: int = 320,
                         specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>",
                                                      "<|im_end|>")):
  """A GPT-2-style byte-level BPE (`tokenizers.Tokenizer`) of `vocab_size` tokens trained on
  a few sentences, the special tokens first (ids 0, 1, ...)."""
  import tokenizers  # noqa: PLC0415
  from tokenizers import decoders, pre_tokenizers, trainers  # noqa: PLC0415
  from tokenizers.models import BPE  # noqa: PLC0415

  tok = tokenizers.Tokenizer(BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                min_frequency=1, show_progress=False)
  tok.train_from_iterator(list(_BPE_CORPUS) * 4 + list(data.WORDS), trainer)
  if tok.get_vocab_size() != vocab_size:
    raise ValueError(f"the corpus gives {tok.get_vocab_size()} tokens, not {vocab_size}")
  return tok


def gguf_contents(model: LlamaForCausalLM, tokenizer, *, tensor_type: Any = None,
                  pre: str = "gpt-2", chat_template: str | None = CHATML_TEMPLATE,
                  bos_token: str | None = "<|im_start|>", eos_token: str | None = "<|im_end|>",
                  pad_token: str | None = "<|endoftext|>", add_bos_token: bool = False
                  ) -> tuple[str, dict[str, Any], dict[str, Any]]:
  """(architecture, metadata, tensors) of the GGUF file llama.cpp's converter writes for
  `model` (HF tensors renamed, Q/K of llama models permuted for its rope layout, float32
  norms, llama3 rope scaling as `rope_freqs.weight`) with the byte-level BPE `tokenizer`
  (added special tokens: control type).

  tensor_type: the `gguf.GGMLQuantizationType` of the matrices (None: F32), or a function
  of the GGUF tensor name giving one; quantized with `gguf.quants.quantize`. Tensors map
  names to float arrays or (raw bytes, type): edit either dict before `write_gguf`."""
  import json  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from gguf import GGMLQuantizationType as Q  # noqa: PLC0415
  from gguf.quants import quantize  # noqa: PLC0415

  from models.checkpoint import get_variable, hf_param_map  # noqa: PLC0415
  from models.gguf_checkpoint import (  # noqa: PLC0415
      ROPE_FREQS,
      gguf_tensor_names,
      llama3_rope_factors,
      permute_qk,
  )

  config = model.config
  arch = config.model_type
  vocab = tokenizer.get_vocab(with_added_tokens=True)
  tokens = sorted(vocab, key=vocab.get)
  if [vocab[t] for t in tokens] != list(range(len(tokens))):
    raise ValueError("tokenizer ids are not 0..n-1")
  special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
  merges = json.loads(tokenizer.to_str())["model"]["merges"]
  meta: dict[str, Any] = {
      "general.name": f"random {arch}",
      f"{arch}.context_length": config.max_position_embeddings,
      f"{arch}.embedding_length": config.hidden_size,
      f"{arch}.block_count": config.num_hidden_layers,
      f"{arch}.feed_forward_length": config.intermediate_size,
      f"{arch}.attention.head_count": config.num_attention_heads,
      f"{arch}.attention.head_count_kv": config.num_key_value_heads,
      f"{arch}.rope.freq_base": config.rope_theta,
      f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
      "tokenizer.ggml.model": "gpt2",
      "tokenizer.ggml.pre": pre,
      "tokenizer.ggml.tokens": tokens,
      "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
      "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in merges],
      "tokenizer.ggml.add_bos_token": add_bos_token,
  }
  if config.head_dim != config.hidden_size // config.num_attention_heads:
    meta[f"{arch}.attention.key_length"] = config.head_dim
    meta[f"{arch}.attention.value_length"] = config.head_dim
  if arch == "llama":
    meta[f"{arch}.rope.dimension_count"] = config.head_dim
  if arch == "mistral" and config.sliding_window is not None:
    meta[f"{arch}.attention.sliding_window"] = config.sliding_window
  for key, token in (("bos", bos_token), ("eos", eos_token), ("padding", pad_token)):
    if token is not None:
      meta[f"tokenizer.ggml.{key}_token_id"] = vocab[token]
  if chat_template is not None:
    meta["tokenizer.chat_template"] = chat_template

  hf_map = hf_param_map(config)
  tensors: dict[str, Any] = {}
  if config.rope_scaling is not None:  # llama3: the converter's per-frequency factors
    tensors[ROPE_FREQS] = llama3_rope_factors(config.rope_theta, config.head_dim,
                                              config.rope_scaling)
  for gguf_name, hf_name in gguf_tensor_names(config).items():
    path, transposed = hf_map[hf_name]
    value = np.asarray(jax.device_get(get_variable(model, path)[...]), np.float32)
    value = value.T if transposed else value
    if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
      heads = (config.num_attention_heads if ".attn_q." in gguf_name
               else config.num_key_value_heads)
      value = permute_qk(value, heads)
    qtype = tensor_type(gguf_name) if callable(tensor_type) else tensor_type
    if value.ndim == 1 or qtype in (None, Q.F32):
      tensors[gguf_name] = np.ascontiguousarray(value)
    elif qtype == Q.F16:
      tensors[gguf_name] = value.astype(np.float16)
    else:
      tensors[gguf_name] = (quantize(np.ascontiguousarray(value), qtype), qtype)
  return arch, meta, tensors


def write_gguf(path: str | os.PathLike, arch: str, metadata: dict[str, Any],
               tensors: dict[str, Any]) -> str:
  """Writes a GGUF file with `gguf.GGUFWriter`: `general.architecture` = arch, metadata
  (bool, int as uint32, float as float32, str, and lists of str / int as int32 / float),
  tensors (float32/float16/int arrays as they are, (raw bytes, type) as that type)."""
  import gguf  # noqa: PLC0415

  T = gguf.GGUFValueType
  path = os.fspath(path)
  writer = gguf.GGUFWriter(path, arch)
  for key, value in metadata.items():
    if isinstance(value, (list, tuple)):
      first = value[0]
      sub = (T.STRING if isinstance(first, str) else T.FLOAT32 if isinstance(first, float)
             else T.INT32)
      writer.add_key_value(key, list(value), T.ARRAY, sub_type=sub)
    else:
      vtype = (T.BOOL if isinstance(value, bool) else T.UINT32 if isinstance(value, int)
               else T.FLOAT32 if isinstance(value, float) else T.STRING)
      writer.add_key_value(key, value, vtype)
  for name, tensor in tensors.items():
    if isinstance(tensor, tuple):
      writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
    else:
      writer.add_tensor(name, tensor)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def save_gguf(model: LlamaForCausalLM, path: str | os.PathLike, tokenizer, **kwargs) -> str:
  """`write_gguf(path, *gguf_contents(model, tokenizer, **kwargs))`."""
  return write_gguf(path, *gguf_contents(model, tokenizer, **kwargs))


# ----------------------------------------------------------------------------- DSA models

# A tiny DeepSeek-V3.2 as transformers' DeepseekV32Config reads it: a dense first layer,
# then MoE layers; index_topk 8 (shorter than the tests' prompts, so the indexer's sparsity
# is active in prefill and decode); 16 index heads, not 4: a key whose q.k is negative in
# every head scores exactly 0 (ReLU), and with 4 heads such zeros tie at the top-k edge
# often enough for torch's and XLA's top-k to break the tie differently (both right).
# initializer_range 0.3: logits far enough apart that greedy ties cannot flip.
DSA_TINY_HF_CONFIG = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, kv_lora_rank=32,
    q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, index_topk=8,
    index_head_dim=32, index_n_heads=16, first_k_dense_replace=1, initializer_range=0.3,
    max_position_embeddings=256, routed_scaling_factor=2.5, bos_token_id=0, eos_token_id=1)
# Each kind's changes to it: GLM-MoE-DSA with layers 1 and 3 sharing the previous layer's
# selection (no indexer of their own).
DSA_KIND_OVERRIDES = {
    "deepseek_v32": {},
    "glm_moe_dsa": dict(num_hidden_layers=4, n_group=1, topk_group=1, rms_norm_eps=1e-5,
                        indexer_types=["full", "shared", "full", "shared"]),
}


def save_random_dsa(out_dir: str | os.PathLike, kind: str = "deepseek_v32", *,
                    with_tokenizer: bool = False, **overrides):
  """Saves a random transformers DSA model of `kind` ("deepseek_v32" or "glm_moe_dsa"):
  `DSA_TINY_HF_CONFIG` with the kind's and `overrides`' changes, eager attention, its norms,
  biases and the router's score-correction bias randomised so every tensor matters. With
  `with_tokenizer`, over the default model's vocabulary with its tokenizer files (what the
  CLI and `LLM` need). Returns the transformers model (eval mode), the reference of the
  parity tests. Needs torch and transformers (the `parity` extra)."""
  import torch  # noqa: PLC0415 (tests only)
  import transformers  # noqa: PLC0415

  classes = {"deepseek_v32": (transformers.DeepseekV32Config,
                              transformers.DeepseekV32ForCausalLM),
             "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM)}
  fields = {**DSA_TINY_HF_CONFIG, **DSA_KIND_OVERRIDES[kind], **overrides}
  if with_tokenizer:
    fields.update(vocab_size=len(data.VOCAB), bos_token_id=data.BOS_ID,
                  eos_token_id=data.EOS_ID, pad_token_id=data.PAD_ID)
  config_cls, model_cls = classes[kind]
  config = config_cls(**fields, attn_implementation="eager")
  torch.manual_seed(0)
  hf = model_cls(config).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name:
        p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    for name, b in hf.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(torch.randn_like(b) * 0.1)
  hf.save_pretrained(out_dir)
  if with_tokenizer:
    tok = build_word_level_tokenizer(data.VOCAB, bos=data.BOS, eos=data.EOS, pad=data.PAD,
                                     unk=data.UNK)
    save_tokenizer_files(tok, out_dir, bos=data.BOS, eos=data.EOS, pad=data.PAD,
                         unk=data.UNK, model_max_length=fields["max_position_embeddings"],
                         chat_template=data.CHAT_TEMPLATE)
  return hf

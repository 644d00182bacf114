"""Small random checkpoints for tests and examples (no training, no download).

`save_random_checkpoint` writes a random Llama over the default model's vocabulary in HF
layout (config.json, model.safetensors, tokenizer.json, ...), loadable by
`models.loader.load_pretrained` and by transformers.
"""

from __future__ import annotations

import os

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

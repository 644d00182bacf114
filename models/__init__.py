"""Flax NNX model families, HF checkpoint loading, tokenizer, the embedded default model.

Public API:
  DEFAULT_MODEL_DIR                    the shipped `hisparse-tiny` checkpoint (HF layout)
  ModelConfig                          models.config: frozen, validated architecture
  LlamaForCausalLM                     models.llama: the decoder; owns no KV cache, attention
                                       goes through an `AttnFn` (models.attention)
  load_pretrained, load_config         models.loader: HF directory or GGUF file -> (model,
                                       config, tokenizer); GGUF via models.gguf_checkpoint
  CheckpointError                      models.checkpoint (also models.loader): every loading
                                       failure (a ValueError)
  Tokenizer                            models.tokenizer: `tokenizers` wrapper + BOS/EOS ids
                                       (`from_dir`; a GGUF file's: models.loader.load_tokenizer)
  make_retrieval_prompts               models.data: retrieval prompts with expected answers
"""

import os

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hisparse_tiny")

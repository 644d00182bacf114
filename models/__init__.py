"""Flax NNX model families, HF checkpoint loading, tokenizer, the embedded default model."""

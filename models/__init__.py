"""Flax NNX model families, Hugging Face checkpoint loading, tokenizer, and the embedded default model."""
